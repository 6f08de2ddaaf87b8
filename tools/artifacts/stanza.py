"""The `http_archive` stanza of a golden archive: render it, find it in MODULE.bazel, rewrite it.

Rewrites touch only what must change: an existing stanza keeps its bytes except the sha256 and
url string literals; a new stanza goes after the last `http_archive(...)`. MODULE.bazel is
replaced atomically (temp file + rename), so a crash never leaves it half written.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tools.cli_files import write_atomically

REPO_RULE_LINE = (
    'http_archive = use_repo_rule("@bazel_tools//tools/build_defs/repo:http.bzl", "http_archive")'
)
_REPO_RULE_DECLARED = re.compile(r"^http_archive\s*=\s*use_repo_rule\(", re.MULTILINE)


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
    for call in _calls(module_text):
        name = call.string("name")
        if name is None:
            continue
        if name in pins:
            raise StanzaError(f"MODULE.bazel has two http_archive stanzas named {name!r}")
        url = call.string("url")
        if url is None and "urls" in call.args:
            urls = _literal(module_text, call.args["urls"])
            url = urls[0] if isinstance(urls, list) and urls else None
        pins[name] = GoldenPin(name, call.string("sha256") or "", url or "")
    return pins


def set_pin(module_text: str, pin: GoldenPin) -> str:
    """MODULE.bazel text with NAME's stanza pinned to `pin`; every other byte unchanged."""
    matches = [call for call in _calls(module_text) if call.string("name") == pin.name]
    if len(matches) > 1:
        raise StanzaError(f"MODULE.bazel has two http_archive stanzas named {pin.name!r}")
    if matches:
        call = matches[0]
        if call.string("sha256") is not None and call.string("url") is not None:
            edits = sorted(
                [(call.args["sha256"], _quote(pin.sha256)), (call.args["url"], _quote(pin.url))],
                reverse=True,
            )
            for (start, end), literal in edits:
                module_text = module_text[:start] + literal + module_text[end:]
            return module_text
        return module_text[: call.start] + render(pin) + module_text[call.end :]
    return _insert(module_text, render(pin))


def update_module_file(path: Path, pin: GoldenPin) -> bool:
    """Rewrites NAME's stanza in the file at `path`; False when it already says this."""
    text = path.read_text(encoding="utf-8")
    updated = set_pin(text, pin)
    if updated == text:
        return False
    write_atomically(path, updated)
    return True


def _insert(module_text: str, stanza: str) -> str:
    calls = list(_calls(module_text))
    if calls:
        anchor = calls[-1].end
    else:
        declared = _REPO_RULE_DECLARED.search(module_text)
        if declared is None:
            if module_text and not module_text.endswith("\n"):
                module_text += "\n"
            module_text += ("\n" if module_text else "") + REPO_RULE_LINE + "\n"
            declared = _REPO_RULE_DECLARED.search(module_text)
            assert declared is not None
        anchor = _statement_end(module_text, declared.start())
    tail = module_text[anchor:]
    return module_text[:anchor] + "\n\n" + stanza + ("" if tail else "\n") + tail


def _quote(value: str) -> str:
    if any(c in value for c in '"\\\n'):
        raise StanzaError(f"{value!r} cannot go into MODULE.bazel as a plain string")
    return f'"{value}"'


def _literal(text: str, span: tuple[int, int]) -> object:
    try:
        return ast.literal_eval(text[span[0] : span[1]])
    except (ValueError, SyntaxError):
        return None


# --- a lexer just big enough for MODULE.bazel: strings, comments, brackets, names ---------

_TOKEN = re.compile(
    r"""
    (?P<comment>\#[^\n]*)
  | (?P<string>(?:[rRbB]{1,2})?(?:'''|\"\"\"|'|\"))
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>[()\[\]{},=])
  | (?P<other>\S)
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Token:
    kind: str
    start: int
    end: int
    text: str


def _tokens(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        assert match is not None  # the `other` and `space` groups match any character
        kind = match.lastgroup or "other"
        if kind == "string":
            end = _string_end(text, match.start(), match.end(), match.group("string"))
            tokens.append(_Token("string", match.start(), end, text[match.start() : end]))
            pos = end
            continue
        if kind not in {"comment", "space"}:
            tokens.append(_Token(kind, match.start(), match.end(), match.group()))
        pos = match.end()
    return tokens


def _string_end(text: str, start: int, body: int, opener: str) -> int:
    quote = opener.lstrip("rRbB")
    pos = body
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
            continue
        if text.startswith(quote, pos):
            return pos + len(quote)
        if len(quote) == 1 and text[pos] == "\n":
            break
        pos += 1
    line = text.count("\n", 0, start) + 1
    raise StanzaError(f"MODULE.bazel line {line}: unterminated string")


@dataclass
class _Call:
    start: int
    end: int
    args: dict[str, tuple[int, int]]  # keyword -> span of its value
    text: str

    def string(self, keyword: str) -> str | None:
        """The keyword's value when it is one plain string literal, else None."""
        span = self.args.get(keyword)
        if span is None:
            return None
        value = self.text[span[0] : span[1]]
        if not value.startswith(("'", '"')):
            return None
        literal = _literal(self.text, span)
        return literal if isinstance(literal, str) else None


def _calls(text: str, function: str = "http_archive") -> list[_Call]:
    """Top-level calls of `function`, with their keyword argument value spans."""
    tokens = _tokens(text)
    calls: list[_Call] = []
    depth = 0
    i = 0
    while i < len(tokens):
        token = tokens[i]
        is_call = (
            depth == 0
            and token.kind == "name"
            and token.text == function
            and i + 1 < len(tokens)
            and tokens[i + 1].text == "("
        )
        if not is_call:
            depth += _depth_change(token)
            if depth < 0:
                raise StanzaError(
                    f"MODULE.bazel: unbalanced {token.text!r} at offset {token.start}"
                )
            i += 1
            continue
        call, i = _read_call(text, tokens, i)
        calls.append(call)
    return calls


def _depth_change(token: _Token) -> int:
    if token.kind != "op":
        return 0
    return 1 if token.text in "([{" else -1 if token.text in ")]}" else 0


def _read_call(text: str, tokens: list[_Token], i: int) -> tuple[_Call, int]:
    start = tokens[i].start
    depth = 0
    args: dict[str, tuple[int, int]] = {}
    argument: list[_Token] = []
    j = i + 1
    while j < len(tokens):
        token = tokens[j]
        depth += _depth_change(token)
        if depth == 0:  # the closing parenthesis
            _keyword(argument, args)
            return _Call(start, token.end, args, text), j + 1
        if depth == 1 and token.text in {",", "("} and token.kind == "op":
            if token.text == ",":
                _keyword(argument, args)
                argument = []
        else:
            argument.append(token)
        j += 1
    line = text.count("\n", 0, start) + 1
    raise StanzaError(f"MODULE.bazel line {line}: http_archive( is never closed")


def _keyword(argument: list[_Token], args: dict[str, tuple[int, int]]) -> None:
    if len(argument) >= 3 and argument[0].kind == "name" and argument[1].text == "=":
        args[argument[0].text] = (argument[2].start, argument[-1].end)


def _statement_end(text: str, start: int) -> int:
    """End of the (possibly multi-line) statement beginning at `start`, before its newline."""
    depth = 0
    for token in _tokens(text[start:]):
        depth += _depth_change(token)
        if depth == 0 and token.text == ")":
            return start + token.end
    return len(text)
