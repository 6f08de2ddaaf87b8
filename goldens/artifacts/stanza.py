"""The `http_archive` stanza of a golden archive: render it, find it in MODULE.bazel, rewrite it.

MODULE.bazel is Starlark, whose syntax Python's `ast` parses, so the stanzas are found in the
syntax tree: a call in a comment or a string is no call, and a file that does not parse is an
error naming its line. Rewrites touch only what must change: an existing stanza keeps its bytes
except the sha256 and url string literals; a new stanza goes after the last `http_archive(...)`.
Edits are spliced at the positions `ast` reports, which count UTF-8 bytes within a line, so
they are applied to the encoded file. MODULE.bazel is replaced atomically (temp file + rename),
so a crash never leaves it half written.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

from goldens.cli_files import write_atomically

REPO_RULE_LINE = (
    'http_archive = use_repo_rule("@bazel_tools//tools/build_defs/repo:http.bzl", "http_archive")'
)


class StanzaError(ValueError):
    """MODULE.bazel does not have the shape a rewrite needs."""


@dataclass(frozen=True)
class GoldenPin:
    """One pinned golden archive: the repository name, its sha256 and canonical URL."""

    name: str
    sha256: str
    url: str


def render(pin: GoldenPin) -> str:
    """The seed's stanza, byte for byte; no trailing newline."""
    return (
        "http_archive(\n"
        f'    name = "{pin.name}",\n'
        '    build_file_content = """\n'
        "filegroup(\n"
        f'    name = "{pin.name}",\n'
        '    srcs = glob(["**"]),\n'
        '    visibility = ["//visibility:public"],\n'
        ")\n"
        '""",\n'
        f'    sha256 = "{pin.sha256}",\n'
        f"    url = {_quote(pin.url)},\n"
        ")"
    )


def parse(module_text: str) -> dict[str, GoldenPin]:
    """Every `http_archive(...)` call with a name, sha256 and url (or urls) in the file."""
    pins: dict[str, GoldenPin] = {}
    for call in _Module(module_text).stanzas():
        name = _string(_keyword(call, "name"))
        if name is None:
            continue
        if name in pins:
            raise StanzaError(f"MODULE.bazel has two http_archive stanzas named {name!r}")
        pins[name] = GoldenPin(name, _string(_keyword(call, "sha256")) or "", _url(call) or "")
    return pins


def set_pin(module_text: str, pin: GoldenPin) -> str:
    """MODULE.bazel text with NAME's stanza pinned to `pin`; every other byte unchanged."""
    module = _Module(module_text)
    matches = [call for call in module.stanzas() if _string(_keyword(call, "name")) == pin.name]
    if len(matches) > 1:
        raise StanzaError(f"MODULE.bazel has two http_archive stanzas named {pin.name!r}")
    if not matches:
        return _insert(module, render(pin))
    call = matches[0]
    sha256, url = _keyword(call, "sha256"), _keyword(call, "url")
    if _string(sha256) is None or _string(url) is None:
        return module.splice([(module.span(call), render(pin))])
    return module.splice(
        [(module.span(sha256), _quote(pin.sha256)), (module.span(url), _quote(pin.url))]
    )


def update_module_file(path: Path, pin: GoldenPin) -> bool:
    """Rewrites NAME's stanza in the file at `path`; False when it already says this."""
    text = path.read_text(encoding="utf-8")
    updated = set_pin(text, pin)
    if updated == text:
        return False
    write_atomically(path, updated)
    return True


class _Module:
    """MODULE.bazel's syntax tree, and its text as UTF-8 bytes to splice edits into."""

    def __init__(self, text: str) -> None:
        try:
            self.tree = ast.parse(text)
        except SyntaxError as error:
            raise StanzaError(f"MODULE.bazel line {error.lineno}: {error.msg}") from error
        self.text = text
        self.data = text.encode("utf-8")
        # `ast` breaks lines where bytes.splitlines does: at \n, \r\n and a lone \r.
        self._line_starts = [0]
        for line in self.data.splitlines(keepends=True):
            self._line_starts.append(self._line_starts[-1] + len(line))

    def stanzas(self) -> list[ast.Call]:
        """The top-level `http_archive(...)` statements, in file order."""
        return [
            statement.value
            for statement in self.tree.body
            if isinstance(statement, ast.Expr) and _calls(statement.value, "http_archive")
        ]

    def repo_rule(self) -> ast.stmt | None:
        """The `http_archive = use_repo_rule(...)` statement, if the file declares it."""
        for statement in self.tree.body:
            if (
                isinstance(statement, ast.Assign)
                and [_name(target) for target in statement.targets] == ["http_archive"]
                and _calls(statement.value, "use_repo_rule")
            ):
                return statement
        return None

    def span(self, node: ast.expr | ast.stmt) -> tuple[int, int]:
        """The node's source as a [start, end) range of byte offsets."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        start = self._line_starts[node.lineno - 1] + node.col_offset
        return start, self._line_starts[node.end_lineno - 1] + node.end_col_offset

    def splice(self, edits: list[tuple[tuple[int, int], str]]) -> str:
        """The text with each byte range replaced; the ranges must not overlap."""
        data = self.data
        for (start, end), replacement in sorted(edits, reverse=True):
            data = data[:start] + replacement.encode("utf-8") + data[end:]
        return data.decode("utf-8")


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _calls(node: ast.expr, function: str) -> bool:
    return isinstance(node, ast.Call) and _name(node.func) == function


def _keyword(call: ast.Call, keyword: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _string(node: ast.expr | None) -> str | None:
    """The node's value when it is one plain string literal, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _url(call: ast.Call) -> str | None:
    """`url`, else the first of `urls` when that is a list literal."""
    urls = _keyword(call, "urls")
    first = urls.elts[0] if isinstance(urls, ast.List) and urls.elts else None
    return _string(_keyword(call, "url")) or _string(first)


def _insert(module: _Module, stanza: str) -> str:
    """`stanza` after the last stanza, else after the repo rule, declared first if need be."""
    stanzas = module.stanzas()
    anchor = stanzas[-1] if stanzas else module.repo_rule()
    if anchor is None:
        text = module.text
        if text and not text.endswith("\n"):
            text += "\n"
        return text + ("\n" if text else "") + REPO_RULE_LINE + "\n\n" + stanza + "\n"
    end = module.span(anchor)[1]
    last = end == len(module.data)
    return module.splice([((end, end), "\n\n" + stanza + ("\n" if last else ""))])


def _quote(value: str) -> str:
    if any(c in value for c in '"\\\n'):
        raise StanzaError(f"{value!r} cannot go into MODULE.bazel as a plain string")
    return f'"{value}"'
