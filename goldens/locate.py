"""Where golden files are read from.

1. Under Bazel: the pinned archives' runfiles. The test's BUILD sets TEST_LLAMA_GOLDENS and
   TORCH_LLAMA_GOLDENS to `$(rootpaths @test_llama_golden//:test_llama_golden)` (and torch's).
2. Outside Bazel (plain pytest, GPU machines): the archive MODULE.bazel pins, taken from the
   repository's local store (artifacts/NAME/VERSION/SHA256/NAME.tar.gz), checked against the
   pinned sha256 and extracted to $XDG_CACHE_HOME/llama-goldens/pinned/SHA256 (default
   ~/.cache/...) by goldens.artifacts.extract, which is safe when several processes do it at once.
   A damaged archive raises an error naming it rather than falling through to the next source,
   and so does a pinned archive the local store does not hold (PinnedArchiveMissing).
3. The testdata folder, where evaluate_llama and run_torch_llama write fresh goldens.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from goldens.artifacts import stanza
from goldens.artifacts.extract import extract_pinned
from goldens.artifacts.store import SHA256_PATTERN, local_only, ref_from_url
from goldens.cli_files import repo_root as checkout_root

ARCHIVES = {
    "own": ("test_llama_golden", "TEST_LLAMA_GOLDENS"),
    "torch": ("torch_llama_golden", "TORCH_LLAMA_GOLDENS"),
    "ggml": ("test_llama_golden", "TEST_LLAMA_GOLDENS"),  # the engine's archive: its ggml mode
}


class PinnedArchiveMissing(FileNotFoundError):
    """MODULE.bazel pins an archive that the local store does not hold."""


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


def cache_root() -> Path:
    """Where pinned archives are extracted, read from the environment at each call."""
    # The XDG spec says to ignore a relative XDG_CACHE_HOME, and an empty one means unset.
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "llama-goldens" / "pinned"


def _store_source(name: str, env: str, repo_root: Path) -> Source | None:
    module = repo_root / "MODULE.bazel"
    if not module.is_file():
        return None
    pin = stanza.parse(module.read_text(encoding="utf-8")).get(name)
    if pin is None or not SHA256_PATTERN.fullmatch(pin.sha256):
        return None
    archive = _pinned_archive(repo_root / "artifacts", name, pin.sha256, pin.url)
    if archive is None:
        # An error, not a fall-through to the testdata folder: that folder holds whatever was
        # last computed into it, so the tests would compare against goldens nobody pinned and
        # say nothing. The docs promise the pinned archive first and never this fallback; the
        # testdata folder serves the names MODULE.bazel does not pin.
        raise PinnedArchiveMissing(_missing(pin, env, repo_root / "artifacts"))
    target = extract_pinned(archive, pin.sha256, cache_root())
    return Source(
        target, f"pinned archive {archive.relative_to(repo_root)} (extracted to {target})"
    )


def _missing(pin: stanza.GoldenPin, env: str, store: Path) -> str:
    """Why the pinned archive is not read, and the command that brings it back."""
    problem = (
        f"{pin.name}: MODULE.bazel pins {pin.url} (sha256 {pin.sha256}), which the local store "
        f"{store} does not hold"
    )
    if local_only(pin.url):  # only the store ever had it: it was deleted there
        return (
            f"{problem}; restore it: git checkout -- {store / pin.name}, then check the store: "
            "python3 -m tools.artifacts.upload_artifact verify"
        )
    return (
        f"{problem}; run the test under Bazel, which downloads it, or fetch it: python3 -m "
        f"tools.artifacts.upload_artifact fetch {pin.name} --output-dir=DIR, then set "
        f'{env}="$(echo DIR/*)"'
    )


def _pinned_archive(store: Path, name: str, sha: str, url: str) -> Path | None:
    """The local store's archive with the pinned sha: the pinned URL's version, else the newest.

    Versions holding the same sha hold the same bytes, so the choice only has to be stable.
    """
    ref = ref_from_url(url)
    if ref is not None and ref.name == name and ref.sha256 == sha:
        pinned = store / ref.relative_path
        if pinned.is_file():
            return pinned
    versions = [
        path
        for path in (store / name).glob(f"*/{sha}/{name}.tar.gz")
        if path.parent.parent.name.isdigit()
    ]
    return max(versions, key=lambda path: int(path.parent.parent.name), default=None)


def golden_sources(reference: str, testdata: Path, repo_root: Path | None = None) -> list[Source]:
    """Folders to look in for `reference` ("own" or "torch") goldens, in order."""
    name, env = ARCHIVES[reference]
    runfiles = _runfiles_source(env)
    if runfiles is not None:
        return [runfiles]  # under Bazel only what the test depends on counts
    store = _store_source(name, env, repo_root or checkout_root())
    sources = [store] if store is not None else []
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
