"""Where golden files are read from.

1. Under Bazel: the pinned archives' runfiles. The test's BUILD sets TEST_LLAMA_GOLDENS and
   TORCH_LLAMA_GOLDENS to `$(rootpaths @test_llama_golden//:test_llama_golden)` (and torch's).
2. Outside Bazel (plain pytest, GPU machines): the archive MODULE.bazel pins, taken from the
   repository's local store (artifacts/) and extracted to a cache folder.
3. The testdata folder, where evaluate_llama and run_torch_llama write fresh goldens.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from pathlib import Path

from tools.artifacts import stanza

REPO_ROOT = Path(__file__).resolve().parents[2]
ARCHIVES = {
    "own": ("test_llama_golden", "TEST_LLAMA_GOLDENS"),
    "torch": ("torch_llama_golden", "TORCH_LLAMA_GOLDENS"),
}
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-goldens" / "pinned"


@dataclasses.dataclass(frozen=True)
class Source:
    folder: Path
    description: str


def _runfiles_source(env: str) -> Source | None:
    value = os.environ.get(env)
    if not value:
        return None
    files = [Path(p) for p in value.split()]
    folders = {p.parent for p in files}
    if len(folders) != 1:
        raise ValueError(f"${env} lists files in several folders: {sorted(folders)}")
    return Source(folders.pop().resolve(), f"Bazel runfiles (${env})")


def _store_source(name: str, repo_root: Path) -> Source | None:
    module = repo_root / "MODULE.bazel"
    if not module.is_file():
        return None
    pin = stanza.parse(module.read_text(encoding="utf-8")).get(name)
    if pin is None:
        return None
    sha = pin.sha256
    archives = sorted((repo_root / "artifacts" / name).glob(f"*/{sha}/{name}.tar.gz"))
    if not archives:
        return None
    target = CACHE / sha
    if not target.is_dir():
        tmp = CACHE / f".{sha}.{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, target)
    return Source(target, f"pinned archive {archives[0].relative_to(repo_root)}")


def golden_sources(reference: str, testdata: Path, repo_root: Path = REPO_ROOT) -> list[Source]:
    """Folders to look in for `reference` ("own" or "torch") goldens, in order."""
    name, env = ARCHIVES[reference]
    runfiles = _runfiles_source(env)
    if runfiles is not None:
        return [runfiles]  # under Bazel only what the test depends on counts
    sources = [s for s in (_store_source(name, repo_root),) if s is not None]
    sources.append(Source(testdata, f"testdata folder {testdata}"))
    return sources


def find_golden(reference: str, file_name: str, testdata: Path) -> tuple[Path | None, list[Source]]:
    """The first `file_name` among the sources, and the sources searched."""
    sources = golden_sources(reference, testdata)
    for source in sources:
        path = source.folder / file_name
        if path.is_file():
            return path, sources
    return None, sources
