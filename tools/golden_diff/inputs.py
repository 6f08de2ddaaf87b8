"""The inputs golden_diff compares: six spellings of a set of NAME's golden files.

A version of NAME in the store, a sha256 (stored or pinned), 'pinned' (MODULE.bazel's pin), a
folder of golden JSON files, a .tar.gz archive, or nothing (the testdata folder the tools write
into). Each resolves to a `GoldenSet` (goldens/diff.py); anything unreadable is an
`InputError` naming the input and what to do.
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from goldens import locate
from goldens.artifacts import archive, stanza
from goldens.artifacts.extract import download_pinned, extract_pinned
from goldens.artifacts.stanza import GoldenPin
from goldens.artifacts.store import (
    SHA256_PATTERN,
    ArchiveRef,
    LocalStore,
    Store,
    StoreError,
    ref_from_url,
)
from goldens.artifacts.store_options import CheckFailed
from goldens.cli_files import repo_root, user_path
from goldens.diff import OWN_NAME, TORCH_NAME, GoldenSet, UnreadableGolden, belongs_to, parse_golden

T = TypeVar("T")


# variants.TESTDATA_REL; that module imports torch, which a diff does not need.
TESTDATA = Path("max_tests/integration/architectures/llama3/testdata")


REGENERATE = {
    OWN_NAME: "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- "
    "--encoding=all --model=all",
    TORCH_NAME: "./bazelw run //max_tests/integration/architectures/llama3/testdata:"
    "run_torch_llama -- --model=all --verbose",
}


INPUT_HELP = (
    "a version of NAME in the store, a sha256 (stored or pinned), 'pinned', a folder of golden "
    "JSON files, a .tar.gz archive, or a failing golden test's outputs.zip (or its extracted "
    "folder: its runs over the pinned files); write ./2 for a folder named 2"
)


class InputError(ValueError):
    """An input cannot be read as a set of NAME's goldens: exit 2."""


def golden_set(
    name: str, members: dict[str, bytes], description: str, where: str, partial: bool = False
) -> GoldenSet:
    selected = {member: data for member, data in members.items() if belongs_to(name, member)}
    if not selected:
        pattern = "torch_*_golden.json" if name == TORCH_NAME else "*_golden.json except torch_*"
        raise InputError(
            f"{where} holds no {name} golden files ({pattern}); compute them with "
            f"{REGENERATE[name]}, or name another input"
        )
    try:
        files = {m: parse_golden(selected[m], f"{where}: {m}") for m in sorted(selected)}
    except UnreadableGolden as error:
        raise InputError(str(error)) from None
    return GoldenSet(description, files, partial)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What an input spelling is resolved against: NAME, its store and MODULE.bazel."""

    name: str
    store: Store
    module_file: Path

    def pin(self) -> GoldenPin | None:
        if not self.module_file.is_file():
            return None
        return stanza.parse(self.module_file.read_text(encoding="utf-8")).get(self.name)

    # The store is listed through these, so an unreachable one (an S3 endpoint, credentials)
    # is bad input naming the flag being resolved, like any other store failure.
    def versions(self, flag: str) -> list[int]:
        return checked(flag, lambda: self.store.versions(self.name))

    def digests(self, version: int, flag: str) -> list[str]:
        return checked(flag, lambda: self.store.digests(self.name, version))

    def stored_versions(self, flag: str) -> str:
        return ", ".join(str(v) for v in self.versions(flag)) or "none"


def load_input(inputs: Inputs, spec: str | None, flag: str) -> GoldenSet:
    """One side of the diff; `spec` None means the testdata folder."""
    if spec is None:
        return load_folder(inputs, repo_root() / TESTDATA, flag)
    if spec == "pinned":
        return load_pinned(inputs, flag)
    if SHA256_PATTERN.fullmatch(spec):
        return load_sha256(inputs, spec, flag)
    if spec.isascii() and spec.isdigit():
        return load_version(inputs, int(spec), flag)
    path = user_path(spec)
    if path.is_dir():
        return load_folder(inputs, path, flag)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        return load_archive_file(inputs, path, flag)
    if path.is_file() and path.name.endswith(".zip"):
        return load_test_outputs(inputs, path, flag)
    raise InputError(
        f"{flag}={spec} (resolved to {path}) is none of: {INPUT_HELP}; "
        f"versions of {inputs.name} in the {inputs.store.description}: "
        f"{inputs.stored_versions(flag)}"
    )


def load_folder(inputs: Inputs, path: Path, flag: str) -> GoldenSet:
    members = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    if any(_is_test_report(m) for m in members):  # an extracted outputs.zip
        where = f"{flag}: test outputs {path}"
        return golden_set(inputs.name, members, f"test outputs {path}", where, partial=True)
    return golden_set(inputs.name, members, f"folder {path}", f"{flag}: folder {path}")


def load_test_outputs(inputs: Inputs, path: Path, flag: str) -> GoldenSet:
    """A failing golden test's outputs.zip (bazel-testlogs/PACKAGE/TARGET/test.outputs/, a
    sharded test's under TARGET/shard_N_of_M/): the eager runs it wrote beside its HTML
    reports, as golden files, over the pinned ones."""
    where = f"{flag}: test outputs {path}"
    try:
        with zipfile.ZipFile(path) as outputs:
            members = {
                info.filename: outputs.read(info)
                for info in outputs.infolist()
                if not info.is_dir() and "/" not in info.filename
            }
    except (zipfile.BadZipFile, OSError) as error:
        raise InputError(f"{where}: {error}; give a test's outputs.zip") from None
    if not any(_is_test_report(m) for m in members):
        raise InputError(f"{where} holds no golden_report_*.html: not the outputs of a golden test")
    return golden_set(inputs.name, members, f"test outputs {path}", where, partial=True)


def _is_test_report(member: str) -> bool:
    return member.startswith("golden_report_") and member.endswith(".html")


def load_archive_file(inputs: Inputs, path: Path, flag: str) -> GoldenSet:
    where = f"{flag}: archive {path}"
    try:
        members = archive.unpack_members(path.read_bytes())
    except archive.ArchiveError as error:
        raise InputError(f"{where}: {error}; give a golden archive (NAME.tar.gz)") from None
    return golden_set(inputs.name, members, f"archive {path}", where)


def load_pinned(inputs: Inputs, flag: str) -> GoldenSet:
    pin = inputs.pin()
    if pin is None or not SHA256_PATTERN.fullmatch(pin.sha256):
        raise InputError(
            f"{flag}: {inputs.name} is not pinned in {inputs.module_file}; give a version "
            f"({inputs.stored_versions(flag)}), a sha256, a folder or an archive instead"
        )
    pinned = ref_from_url(pin.url)
    if pinned is not None and pin.sha256 in inputs.digests(pinned.version, flag):
        return load_stored(inputs, ArchiveRef(inputs.name, pinned.version, pin.sha256), flag)
    return load_sha256(inputs, pin.sha256, flag)


def load_version(inputs: Inputs, version: int, flag: str) -> GoldenSet:
    digests = inputs.digests(version, flag)
    if digests:
        return load_stored(inputs, ArchiveRef(inputs.name, version, digests[0]), flag)
    pin = inputs.pin()
    pinned = ref_from_url(pin.url) if pin is not None else None
    if pin is not None and pinned is not None and pinned.version == version:
        return load_sha256(inputs, pin.sha256, flag)
    raise InputError(
        f"{flag}={version}: version {version} of {inputs.name} is not in the "
        f"{inputs.store.description} (versions there: {inputs.stored_versions(flag)}); give one "
        "of those, or pick the store with --artifacts-dir or --bucket"
    )


def load_sha256(inputs: Inputs, sha256: str, flag: str) -> GoldenSet:
    """The archive with this sha256: from the store when it holds it, else fetched by the pin."""
    for version in inputs.versions(flag):
        if sha256 in inputs.digests(version, flag):
            return load_stored(inputs, ArchiveRef(inputs.name, version, sha256), flag)
    pin = inputs.pin()
    if pin is None or pin.sha256 != sha256:
        raise InputError(
            f"{flag}={sha256}: this sha256 of {inputs.name} is neither pinned in "
            f"{inputs.module_file} nor in the {inputs.store.description}; give a stored "
            f"version ({inputs.stored_versions(flag)}) or its sha256"
        )
    pinned = ref_from_url(pin.url)
    label = inputs.name if pinned is None else f"{inputs.name} version {pinned.version}"
    where = f"{flag}: pinned {inputs.name} (sha256 {sha256})"
    members = fetch_members(inputs.store, pin, where)
    return golden_set(inputs.name, members, f"{label} (sha256 {sha256}), fetched", where)


def load_stored(inputs: Inputs, ref: ArchiveRef, flag: str) -> GoldenSet:
    """An archive the store holds, its sha256 checked on the way."""
    description = f"{ref.name} version {ref.version} (sha256 {ref.sha256})"
    where = f"{flag}: {description}"
    store = inputs.store
    if isinstance(store, LocalStore):
        # Into the cache the tests extract pinned archives to (locate.py): reused, not redone.
        cache = locate.cache_root()
        folder = checked(where, lambda: extract_pinned(store.path(ref), ref.sha256, cache))
        members = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    else:
        members = fetch_members(store, GoldenPin(ref.name, ref.sha256, store.url(ref)), where)
    return golden_set(inputs.name, members, description, where)


def fetch_members(store: Store, pin: GoldenPin, where: str) -> dict[str, bytes]:
    """The pinned archive's files, fetched and checked as `upload_artifact fetch` does."""
    return checked(where, lambda: archive.unpack_members(download_pinned(store, pin)))


def checked(where: str, action: Callable[[], T]) -> T:
    """`action()`, with a store or checksum failure reported as bad input naming `where`."""
    try:
        return action()
    except (CheckFailed, StoreError, archive.ArchiveError, OSError) as error:
        raise InputError(f"{where}: {error}") from None
