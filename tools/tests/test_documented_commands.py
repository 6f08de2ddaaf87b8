"""Every command the documents name runs: a newcomer pastes them as written.

The `bazel run` targets of README.md, docs/ and the testdata README each start with --help from
this test's runfiles (the binaries are its data, built as `bazel run` builds them) and must
exit 0 with a usage line. A document that names a target this test does not know fails it:
add the target to `_DOCUMENTED_COMMANDS` in tools/BUILD.bazel. The documents' publish recipe
(`D=...` and `tools/upload-public-bazel-artifact.sh NAME next ...`) runs as written, with bash,
in a scratch copy of the repository's store, MODULE.bazel and distdir fragment.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from goldens.artifacts import archive, stanza
from goldens.artifacts.store import ref_from_url

DOCUMENTS = [
    Path("README.md"),
    *sorted(Path("docs").glob("*.md")),
    Path("max_tests/integration/architectures/llama3/testdata/README.md"),
]
# `bazel run //LABEL` or `./bazelw run //LABEL`, as the documents write them.
RUN_TARGET = re.compile(r"(?:bazel|bazelw) run (//[A-Za-z0-9_/.-]*(?::[A-Za-z0-9_.-]+)?)")


def _commands() -> dict[str, str]:
    """label -> the binary's runfiles path, from $DOCUMENTED_COMMANDS (tools/BUILD.bazel)."""
    pairs = (item.split("=", 1) for item in os.environ.get("DOCUMENTED_COMMANDS", "").split())
    return dict(pairs)


def _documented_targets() -> dict[str, list[str]]:
    """label -> the documents naming it with `bazel run`."""
    found: dict[str, list[str]] = {}
    for document in DOCUMENTS:
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


@needs_bazel
@pytest.mark.parametrize("label", sorted(_commands()) or ["(none)"])
def test_a_documented_command_starts_and_shows_its_help(label: str) -> None:
    binary = _commands()[label]
    done = subprocess.run(
        [binary, "--help"], capture_output=True, text=True, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{label} --help exited {done.returncode}:\n{output[-3000:]}"
    assert "usage:" in output.lower(), f"{label} --help printed no usage line:\n{output[-2000:]}"


def _recipes() -> list[tuple[str, list[str]]]:
    """(document, lines) of each publish recipe: a `D=` line and the upload lines after it."""
    recipes = []
    for document in DOCUMENTS:
        lines = [line.strip() for line in document.read_text(encoding="utf-8").splitlines()]
        for i, line in enumerate(lines):
            if line.startswith("D="):
                uploads = [
                    u for u in lines[i + 1 : i + 4] if u.startswith("tools/upload-public-bazel")
                ]
                if uploads:
                    recipes.append((str(document), [line, *uploads]))
    return recipes


def test_the_documents_have_a_publish_recipe_that_says_next() -> None:
    recipes = _recipes()
    assert recipes, "no publish recipe (D=... then tools/upload-public-bazel-artifact.sh)"
    for document, lines in recipes:
        for line in lines[1:]:
            assert re.search(r"_golden next ", line), f"{document}: {line!r} names a version"


@needs_bazel
@pytest.mark.parametrize("recipe", sorted({tuple(lines) for _, lines in _recipes()}) or [()])
def test_the_publish_recipe_runs_as_written_in_a_scratch_store(
    recipe: tuple[str, ...], tmp_path: Path
) -> None:
    """The recipe publishes each archive as the next version and pins it; the engine's golden
    changed, so test_llama_golden gets a new version, torch_llama_golden (unchanged) none."""
    repo = _scratch_repository(tmp_path / "repo")
    testdata = repo / recipe[0].removeprefix("D=")
    pins = stanza.parse((repo / "MODULE.bazel").read_text())
    for name in ("test_llama_golden", "torch_llama_golden"):
        pin = pins[name]
        members = archive.unpack_members((repo / _store_path(pin.url)).read_bytes())
        for member, data in members.items():
            (testdata / member).write_bytes(data)
    changed = sorted(testdata.glob("tinyllama_float32_*_golden.json"))[0]
    body = json.loads(changed.read_text())
    body["provenance"]["torch_version"] += "+recipe-test"
    changed.write_text(json.dumps(body, indent=1) + "\n")

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(recipe)],
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
