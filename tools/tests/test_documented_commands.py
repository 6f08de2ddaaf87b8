"""Every command the documents name runs: a newcomer pastes them as written.

The `bazel run` targets of README.md, docs/, the testdata README and the store's README each
start with --help from this test's runfiles (the binaries are its data, built as `bazel run`
builds them) and must exit 0 with a usage line. In that same process, before the --help, the
target's own argparse parser parses every `bazel run //LABEL -- ARGS` line the documents give
for it (a sitecustomize module this test writes hooks the first parse_args call; nothing else of
the tool runs), and each must parse. `python3 -m tools.MODULE ARGS` and
`tools/upload-public-bazel-artifact.sh ARGS` lines are parsed the same way in this process. A
document that names a target this test does not know fails it: add the target to
`_DOCUMENTED_COMMANDS` in tools/BUILD.bazel. Every label a `bazel test` line names is declared
in its package's BUILD file. The documents' publish recipe (`D=...` and
`tools/upload-public-bazel-artifact.sh NAME next ...`) runs as written, with bash, in a scratch
copy of the repository's store, MODULE.bazel and distdir fragment, on the files its section's
regenerate commands write: the archive it publishes must hold the pinned archive's files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goldens import schema
from goldens.artifacts import archive, stanza
from goldens.artifacts.store import ref_from_url

DOCUMENTS = [
    Path("README.md"),
    *sorted(Path("docs").glob("*.md")),
    Path("max_tests/integration/architectures/llama3/testdata/README.md"),
    Path("artifacts/README.md"),
]


def _documents() -> list[Path]:
    """The documents that are here (test_every_document_is_here names a missing one)."""
    return [document for document in DOCUMENTS if document.is_file()]


LABEL = r"//[A-Za-z0-9_/.-]*(?::[A-Za-z0-9_.-]+)?"
# `bazel run //LABEL` or `./bazelw run //LABEL`, as the documents write them.
RUN_TARGET = re.compile(rf"(?:bazel|bazelw) run ({LABEL})")
# A command whose flags are parsed: its program (a run label, a module or the upload script),
# then the rest of the line.
COMMAND = re.compile(
    rf"(?:(?:bazel|bazelw) run (?P<label>{LABEL})(?P<run_args>.*)"
    r"|python3? -m (?P<module>tools(?:\.\w+)+)(?=\s|$)(?P<module_args>.*)"
    r"|(?P<script>tools/upload-public-bazel-artifact\.sh)(?P<script_args>.*))"
)
TEST_LINE = re.compile(rf"(?:bazel|bazelw) test((?:\s+{LABEL}(?:\.\.\.)?)+)")
SCRIPT_MODULE = "tools.artifacts.upload_artifact"  # what the upload script runs
# A shell operator ends a command (`; done`, `| tail`, `> file`, `&& ...`).
OPERATORS = {";", "|", "||", "&", "&&", ">", ">>", "<", "(", ")"}


def _code(document: Path) -> list[str]:
    """The shell text of a document: each line of its code blocks (continuation lines joined)
    and each code span outside them."""
    found: list[str] = []
    prose: list[str] = []
    fenced, pending = False, ""
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
            continue
        if not pending and line.lstrip().startswith("#"):
            continue  # a comment line, whatever it quotes
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        found.append(pending)
        pending = ""
    found += re.findall(r"`([^`]+)`", "\n".join(prose))
    return [" ".join(text.split()) for text in found]


def _argv(rest: str) -> list[str] | None:
    """The words of a command's arguments up to the first shell operator or comment; None for
    a line whose words come from the shell (`$(...)`: the recipe test runs those)."""
    if "$(" in rest:
        return None
    lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word in OPERATORS:
            break
        words.append(word)
    return words


def _documented_command_lines() -> list[tuple[str, str, list[str]]]:
    """(document, program, argv) of every documented command line with arguments: program is
    a `bazel run` label (its arguments after `--`) or a `tools.` module."""
    lines = []
    for document in _documents():
        for text in _code(document):
            match = COMMAND.search(text)
            if match is None:
                continue
            if match["label"]:
                rest = match["run_args"]
                if not rest.startswith(" -- "):
                    continue  # no arguments, or Bazel's own flags only
                program, argv = _canonical(match["label"]), _argv(rest[len(" -- ") :])
            elif match["module"]:
                program, argv = match["module"], _argv(match["module_args"])
            else:
                program, argv = SCRIPT_MODULE, _argv(match["script_args"])
            if argv:
                lines.append((str(document), program, argv))
    return lines


def test_every_document_is_here() -> None:
    missing = [str(document) for document in DOCUMENTS if not document.is_file()]
    assert not missing, f"{missing}: not here; under Bazel, add them to this test's data"


def _commands() -> dict[str, str]:
    """label -> the binary's runfiles path, from $DOCUMENTED_COMMANDS (tools/BUILD.bazel)."""
    pairs = (item.split("=", 1) for item in os.environ.get("DOCUMENTED_COMMANDS", "").split())
    return dict(pairs)


def _documented_targets() -> dict[str, list[str]]:
    """label -> the documents naming it with `bazel run`."""
    found: dict[str, list[str]] = {}
    for document in _documents():
        for label in RUN_TARGET.findall(document.read_text(encoding="utf-8")):
            found.setdefault(_canonical(label), []).append(str(document))
    return found


def _canonical(label: str) -> str:
    """//tools/bench -> //tools/bench:bench, as Bazel reads a label without a target name."""
    return label if ":" in label else f"{label}:{label.rsplit('/', 1)[-1]}"


needs_bazel = pytest.mark.skipif(
    "DOCUMENTED_COMMANDS" not in os.environ,
    reason="runs under Bazel: ./bazelw test //tools:documented_commands_test",
)


@needs_bazel
def test_every_documented_run_target_is_one_this_test_runs() -> None:
    known = {_canonical(label) for label in _commands()}
    documented = _documented_targets()
    assert documented, f"no `bazel run //...` found in {[str(d) for d in DOCUMENTS]}"
    missing = {label: docs for label, docs in documented.items() if label not in known}
    assert not missing, (
        f"documented but not run by this test: {missing}; add each label to "
        "_DOCUMENTED_COMMANDS in tools/BUILD.bazel (or fix the document)"
    )


# Imported at start-up by each Python the binary runs (PYTHONPATH; the launcher's too, which
# passes the variables on): while $DOCUMENTED_ARGVS is set, the first parse_args call parses
# each of those argument lists with the tool's own parser, writes the verdicts to
# $DOCUMENTED_VERDICTS (unless a process wrote them first), and goes on with the call (--help:
# the usage, exit 0).
SITECUSTOMIZE = """
import os

if os.environ.get("DOCUMENTED_ARGVS"):
    import argparse, contextlib, io, json

    _argvs = json.loads(os.environ["DOCUMENTED_ARGVS"])
    _verdicts = os.environ["DOCUMENTED_VERDICTS"]
    _parse_args = argparse.ArgumentParser.parse_args

    def _parse_documented(self, args=None, namespace=None):
        argparse.ArgumentParser.parse_args = _parse_args
        verdicts = []
        for argv in _argvs:
            said = io.StringIO()
            try:
                with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                    _parse_args(self, argv)
                verdicts.append(None)
            except SystemExit as exit:
                verdicts.append(None if exit.code == 0 else said.getvalue().strip()[-600:])
        if not os.path.exists(_verdicts):
            with open(_verdicts, "w") as out:
                json.dump(verdicts, out)
        return _parse_args(self, args, namespace)

    argparse.ArgumentParser.parse_args = _parse_documented
"""


def _flag_lines(program: str) -> list[tuple[str, list[str]]]:
    """(document, argv) of the documented command lines of one program."""
    return [(doc, argv) for doc, prog, argv in _documented_command_lines() if prog == program]


@needs_bazel
@pytest.mark.parametrize("label", sorted(_commands()) or ["(none)"])
def test_a_documented_command_starts_shows_its_help_and_parses_its_documented_flags(
    label: str, tmp_path: Path
) -> None:
    binary = _commands()[label]
    lines = _flag_lines(label)
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    verdicts = tmp_path / "verdicts.json"
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "DOCUMENTED_ARGVS": json.dumps([argv for _, argv in lines]),
        "DOCUMENTED_VERDICTS": str(verdicts),
    }
    done = subprocess.run(
        [binary, "--help"], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{label} --help exited {done.returncode}:\n{output[-3000:]}"
    assert "usage:" in output.lower(), f"{label} --help printed no usage line:\n{output[-2000:]}"
    root = _checkout()
    problems = [] if root is None else _help_example_problems(done.stdout, root)
    assert not problems, f"{label} --help's examples:\n" + "\n".join(problems)
    if not lines:
        return
    assert verdicts.is_file(), f"{label}: its parser was never asked to parse (no parse_args)"
    refused = [
        f"{doc}: {label} -- {shlex.join(argv)}\n  {verdict}"
        for (doc, argv), verdict in zip(lines, json.loads(verdicts.read_text()), strict=True)
        if verdict is not None
    ]
    assert not refused, "documented flags its parser refuses:\n" + "\n".join(refused)


def _help_examples(help_text: str) -> list[tuple[str, list[str], list[str]]]:
    """(label, argv, physical lines) of each `bazel run //LABEL -- ARGS` command a --help
    text shows, its backslash-continued lines joined."""
    examples, pending = [], []
    for line in help_text.splitlines():
        if pending or RUN_TARGET.search(line):
            pending.append(line.strip())
            if line.rstrip().endswith("\\"):
                continue
            match = COMMAND.search(" ".join(part.rstrip("\\") for part in pending))
            if match and match["label"]:
                rest = match["run_args"].strip()
                argv = _argv(rest[len("-- ") :]) if rest.startswith("-- ") else []
                examples.append((_canonical(match["label"]), argv or [], pending))
            pending = []
    return examples


def _help_example_problems(help_text: str, root: Path) -> list[str]:
    """Why a --help example would fail pasted as written in a fresh clone's root: a line
    broken inside quotes (the shell keeps that backslash in the argument), a path under ~ (a
    fresh machine has no such file), or a relative .gguf path the checkout lacks (`bazel run`
    reads it against the folder it is run from)."""
    problems = []
    for label, argv, lines in _help_examples(help_text):
        for line in lines[:-1]:
            try:
                shlex.split(line.rstrip("\\"))
            except ValueError:
                problems.append(f"{label}: a line break inside quotes: {line}")
        for word in argv:
            value = word.split("=", 1)[-1]
            if value.startswith("~"):
                problems.append(f"{label}: {word} names a file under ~, absent on a fresh machine")
            elif (
                value.endswith(".gguf")
                and "$" not in value
                and not Path(value).is_absolute()
                and not (root / value).is_file()
            ):
                problems.append(f"{label}: {word} is not a file of the checkout")
    return problems


# The tools whose --help shows `bazel run` examples: label -> module, parser factory.
HELP_EXAMPLE_TOOLS = {
    "//pipelines/llama3:generate": ("pipelines.llama3.generate", "_parser"),
    "//pipelines/llama3:serve": ("pipelines.llama3.server", "_parser"),
    "//tools/gen_tiny_model:gen_tiny_model": (
        "tools.gen_tiny_model.gen_tiny_model",
        "build_parser",
    ),
    "//tools/gen_tiny_model:write_hf_config": (
        "tools.gen_tiny_model.write_hf_config",
        "build_parser",
    ),
}
# The aliases the examples may name instead (tools/BUILD.bazel).
ALIASES = {"//tools:gen_tiny_model": "//tools/gen_tiny_model:gen_tiny_model"}


@pytest.mark.parametrize("label", sorted(HELP_EXAMPLE_TOOLS))
def test_help_examples_name_their_own_tool_parse_and_run_in_a_fresh_clone(label: str) -> None:
    """Each example in a --help runs as pasted in the checkout's root: the tool's own label
    (write_hf_config showed gen_tiny_model's), flags its parser takes, and files the checkout
    has (generate and serve named a SmolLM2 file under ~ that a fresh machine lacks). The
    Bazel target depends on these tools, so it runs there too."""
    module_name, factory = HELP_EXAMPLE_TOOLS[label]
    module = importlib.import_module(module_name)
    parser = getattr(module, factory)()
    help_text = parser.format_help()
    examples = _help_examples(help_text)
    assert examples, f"{label} --help shows no `bazel run` example:\n{help_text}"
    root = _checkout() or Path.cwd()
    problems = _help_example_problems(help_text, root)
    for shown, argv, _ in examples:
        if ALIASES.get(shown, shown) != label:
            problems.append(f"{label} --help shows {shown}'s example")
        try:  # run from the checkout's root, where the shell makes $PWD that folder
            parser.parse_args([word.replace("$PWD", str(root)) for word in argv])
        except SystemExit:
            problems.append(f"{label}: its parser refuses {shlex.join(argv)}")
    assert not problems, "\n".join(problems)


class _Parsed(Exception):
    """Raised by the patched parse_args once the tool's parser took the arguments."""


@pytest.mark.parametrize(
    "module", sorted({p for _, p, _ in _documented_command_lines() if not p.startswith("//")})
)
def test_a_documented_module_command_parses_its_flags(module: str, monkeypatch, capsys) -> None:
    """`python3 -m tools.X ARGS` and the upload script's lines, parsed by the module's parser
    in this process (the module is this test's dependency); nothing of the tool runs."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    refused = []
    for document, argv in _flag_lines(module):
        monkeypatch.setattr(sys, "argv", [module, *argv])
        try:
            runpy.run_module(module, run_name="__main__")
            refused.append(f"{document}: {shlex.join(argv)}: parse_args was never called")
        except _Parsed:
            pass
        except SystemExit as exit:
            if exit.code != 0:
                said = capsys.readouterr().err.strip()[-600:]
                refused.append(f"{document}: python3 -m {module} {shlex.join(argv)}\n  {said}")
    assert not refused, "documented flags its parser refuses:\n" + "\n".join(refused)


def test_the_documents_name_commands_whose_flags_are_checked() -> None:
    programs = {program for _, program, _ in _documented_command_lines()}
    for expected in (
        "//max_tests/integration/architectures/llama3:evaluate_llama",
        "//tools:golden_check",
        SCRIPT_MODULE,
    ):
        assert expected in programs, f"no documented command line of {expected} found"


def _checkout() -> Path | None:
    """The source checkout: the documents' runfiles are links into it under Bazel."""
    root = Path("README.md").resolve().parent
    return root if (root / "MODULE.bazel").is_file() else None


def _declared(root: Path, label: str) -> bool:
    package, _, name = _canonical(label)[2:].partition(":")
    for build in ("BUILD.bazel", "BUILD"):
        path = root / package / build
        if path.is_file():
            return re.search(rf'\bname = "{re.escape(name)}"', path.read_text()) is not None
    return False


def test_every_label_a_documented_bazel_test_line_names_is_declared() -> None:
    root = _checkout()
    if root is None:
        pytest.skip("the checkout's BUILD files are not reachable from here")
    labels = {
        (str(document), label)
        for document in _documents()
        for text in _code(document)
        for found in TEST_LINE.findall(text)
        for label in found.split()
        if not label.endswith("...")
    }
    assert labels, "no `bazel test //LABEL` found in the documents"
    undeclared = sorted(f"{doc}: {label}" for doc, label in labels if not _declared(root, label))
    assert not undeclared, "documented test targets no BUILD file declares:\n" + "\n".join(
        undeclared
    )


EVALUATE = "//max_tests/integration/architectures/llama3:evaluate_llama"
RUN_TORCH = "//max_tests/integration/architectures/llama3/testdata:run_torch_llama"


def _recipes() -> list[tuple[str, list[str], list[tuple[str, list[str]]]]]:
    """(document, lines, regenerate) of each publish recipe: a `D=` line and the upload lines
    after it, and the evaluate_llama and run_torch_llama command lines of its section (from
    the `## ` heading above it to the `D=` line), which write the files it publishes."""
    recipes = []
    for document in _documents():
        lines = [line.strip() for line in document.read_text(encoding="utf-8").splitlines()]
        section = 0
        for i, line in enumerate(lines):
            if line.startswith("## "):
                section = i
            if line.startswith("D="):
                uploads = [
                    u for u in lines[i + 1 : i + 4] if u.startswith("tools/upload-public-bazel")
                ]
                if uploads:
                    regenerate = [
                        (_canonical(match[1]), _argv(match[2]) or [])
                        for text in lines[section:i]
                        if (match := re.search(rf"(?:bazel|bazelw) run ({LABEL}) --(.*)", text))
                        and _canonical(match[1]) in (EVALUATE, RUN_TORCH)
                    ]
                    recipes.append((str(document), [line, *uploads], regenerate))
    return recipes


def _selection(argv: list[str]) -> argparse.Namespace:
    """The flags of evaluate_llama and run_torch_llama that decide which files they write into
    the testdata folder, with their defaults (their own parsers check these lines' flags)."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--model", "all"), ("--encoding", "all"), ("--mode", "eager")):
        parser.add_argument(flag, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output-dir")
    return parser.parse_known_args(argv)[0]


def _written_by(regenerate: list[tuple[str, list[str]]], provenance: dict) -> bool:
    """Whether one of the commands writes a golden of this provenance into the testdata folder:
    evaluate_llama's eager and ggml modes, run_torch_llama's, on the CPU ("all")."""
    for label, argv in regenerate:
        chosen = _selection(argv)
        if chosen.output_dir is not None or chosen.device != "cpu":
            continue
        if chosen.model not in ("all", provenance["model"]):
            continue
        if chosen.encoding not in ("all", provenance["encoding"]):
            continue
        if label == RUN_TORCH:
            producer = schema.PRODUCERS["torch"]
        else:
            producer = {"eager": schema.PRODUCERS["own"], "ggml": schema.PRODUCERS["ggml"]}.get(
                chosen.mode
            )
        if provenance["producer"] == producer and provenance["hardware"] == "all":
            return True
    return False


def test_the_documents_have_a_publish_recipe_that_says_next() -> None:
    recipes = _recipes()
    assert recipes, "no publish recipe (D=... then tools/upload-public-bazel-artifact.sh)"
    for document, lines, regenerate in recipes:
        for line in lines[1:]:
            assert re.search(r"_golden next ", line), f"{document}: {line!r} names a version"
        assert regenerate, (
            f"{document}: no evaluate_llama or run_torch_llama line before {lines[0]}"
        )


def _recipe_runs() -> list[tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]]:
    """Each distinct recipe with its section's regenerate commands (the documents share one)."""
    return sorted(
        {
            (tuple(lines), tuple(sorted((label, tuple(argv)) for label, argv in regenerate)))
            for _, lines, regenerate in _recipes()
        }
    )


@needs_bazel
@pytest.mark.parametrize("recipe", _recipe_runs() or [((), ())])
def test_the_publish_recipe_runs_as_written_in_a_scratch_store(
    recipe: tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]], tmp_path: Path
) -> None:
    """The recipe publishes each archive as the next version and pins it; the engine's golden
    changed, so test_llama_golden gets a new version, torch_llama_golden (unchanged) none.
    The testdata folder holds the pinned files the section's regenerate commands write (and
    no others, as after a fresh checkout): the archive published must hold every file of the
    pinned one, so a recipe that leaves a mode's goldens out fails."""
    commands, regenerate = recipe[0], [(label, list(argv)) for label, argv in recipe[1]]
    repo = _scratch_repository(tmp_path / "repo")
    testdata = repo / commands[0].removeprefix("D=")
    pins = stanza.parse((repo / "MODULE.bazel").read_text())
    pinned_names = {}
    for name in ("test_llama_golden", "torch_llama_golden"):
        pin = pins[name]
        members = archive.unpack_members((repo / _store_path(pin.url)).read_bytes())
        pinned_names[name] = sorted(members)
        for member, data in members.items():
            if _written_by(regenerate, json.loads(data)["provenance"]):
                (testdata / member).write_bytes(data)
    changed = sorted(testdata.glob("tinyllama_float32_*_golden.json"))[0]
    body = json.loads(changed.read_text())
    body["provenance"]["torch_version"] += "+recipe-test"
    changed.write_text(json.dumps(body, indent=1) + "\n")

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(commands)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    after = stanza.parse((repo / "MODULE.bazel").read_text())
    own_before, own_after = pins["test_llama_golden"], after["test_llama_golden"]
    assert own_after.sha256 != own_before.sha256
    version = ref_from_url(own_before.url).version
    assert ref_from_url(own_after.url).version == version + 1
    published = archive.unpack_members((repo / _store_path(own_after.url)).read_bytes())
    assert sorted(published) == pinned_names["test_llama_golden"], (
        "the recipe published other files than the pinned archive holds: missing "
        f"{sorted(set(pinned_names['test_llama_golden']) - set(published))}, new "
        f"{sorted(set(published) - set(pinned_names['test_llama_golden']))}; regenerate "
        f"commands: {regenerate}"
    )
    assert after["torch_llama_golden"] == pins["torch_llama_golden"]
    assert "nothing to publish" in done.stderr
    distdir = (repo / "third_party" / "golden_distdir.bazelrc").read_text()
    assert own_after.sha256 in distdir


def _scratch_repository(root: Path) -> Path:
    """What the upload script needs of a checkout: itself, the Python packages it runs, the
    store, MODULE.bazel and the distdir fragment (copies: the recipe writes to them)."""
    for folder in ("goldens", "tools/artifacts"):
        shutil.copytree(
            folder,
            root / folder,
            ignore=shutil.ignore_patterns("test_*", "__pycache__", "BUILD.bazel"),
        )
    shutil.copytree("artifacts", root / "artifacts")
    (root / "tools").mkdir(exist_ok=True)
    for file in ("tools/upload-public-bazel-artifact.sh", "MODULE.bazel"):
        shutil.copy(file, root / file)
    (root / "third_party").mkdir()
    shutil.copy("third_party/golden_distdir.bazelrc", root / "third_party")
    (root / "max_tests/integration/architectures/llama3/testdata").mkdir(parents=True)
    return root


def _store_path(url: str) -> Path:
    """artifacts/NAME/VERSION/SHA/NAME.tar.gz of a pinned local-store URL."""
    return Path("artifacts", *url.split("/artifacts/", 1)[1].split("/"))


def test_the_readers_of_documents_and_help_texts_on_made_up_inputs(tmp_path: Path) -> None:
    """This file's own readers, on text whose answer is known, so that a reader that finds
    nothing cannot pass for documents that are fine. Plants each FAILED here (a sweep had them
    pass the lanes above): a fence indented under a list item not read; an operator not
    ending the argument words; a BUILD file taken to declare every name; a `~` path other
    than ~/.cache let through; a line break inside quotes on a help example's first line
    missed."""
    document = tmp_path / "doc.md"
    document.write_text(
        "1. Run:\n\n   ```sh\n   ./bazelw run //a:b -- --x 1 \\\n     --y 2\n   ```\n"
        "Prose with `./bazelw test //c:d`.\n"
    )
    assert _code(document) == ["./bazelw run //a:b -- --x 1 --y 2", "./bazelw test //c:d"]
    assert _argv("--a 1 | tail -3") == ["--a", "1"]
    assert _argv("--a 1; done") == ["--a", "1"]
    assert _argv("--a $(ls)") is None
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "BUILD.bazel").write_text('py_binary(\n    name = "other",\n)\n')
    assert _declared(tmp_path, "//pkg:other")
    assert not _declared(tmp_path, "//pkg:absent")
    assert not _declared(tmp_path, "//nowhere:other")
    help_text = (
        "  bazel run //pkg:tool -- --model ~/models/m.gguf\n"
        '  bazel run //pkg:tool -- --prompt "two \\\n'
        '      words" --model testdata/absent.gguf\n'
    )
    problems = _help_example_problems(help_text, tmp_path)
    assert problems == [
        "//pkg:tool: ~/models/m.gguf names a file under ~, absent on a fresh machine",
        '//pkg:tool: a line break inside quotes: bazel run //pkg:tool -- --prompt "two \\',
        "//pkg:tool: testdata/absent.gguf is not a file of the checkout",
    ]
