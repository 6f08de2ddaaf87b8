"""Publishing policy: immutable NAME/VERSION objects, versions that only go up, read-back."""

import sys
from dataclasses import dataclass

from goldens.artifacts import archive
from goldens.artifacts.store import ArchiveRef, PublishRefused, Store, StoreError, version_taken


@dataclass(frozen=True)
class PublishResult:
    ref: ArchiveRef
    url: str
    published: bool  # False: these bytes were already there, nothing was written


def publish(store: Store, name: str, version: int, data: bytes) -> PublishResult:
    """Puts `data` at NAME/VERSION/SHA256/NAME.tar.gz unless that would rewrite history.

    Identical bytes already at NAME/VERSION are a no-op. Different content under an existing
    NAME/VERSION, or a VERSION below the newest one published, is refused; the store's write
    refuses it too, atomically, so of two publishers racing for one version only one wins.
    What was written is read back and checked; on a mismatch it is deleted, so nothing
    half-published stays.
    """
    ref = ArchiveRef(name, version, archive.sha256_hex(data))
    existing = store.digests(name, version)
    if ref.sha256 in existing:
        _progress(f"{ref.relative_path} is already in the {store.description}; nothing to do")
        return PublishResult(ref, store.url(ref), published=False)
    if existing:
        same = _same_content(store, ArchiveRef(name, version, existing[0]), data)
        if same is not None:
            # Another zlib compressed the same members differently; keep the published bytes.
            _progress(f"{same.relative_path} holds the same files; nothing to do")
            return PublishResult(same, store.url(same), published=False)
        raise version_taken(store, name, version, existing[0])
    newest = max(store.versions(name), default=0)
    if version < newest:
        raise PublishRefused(
            f"{name} version {version} is below the newest published version {newest} in the "
            f"{store.description}; publish version {newest + 1} instead"
        )
    store.write(ref, data)
    stored = store.read(ref)
    if stored is None or archive.sha256_hex(stored) != ref.sha256:
        store.delete(ref)
        got = "nothing" if stored is None else f"sha256 {archive.sha256_hex(stored)}"
        raise StoreError(
            f"read-back of {ref.relative_path} from the {store.description} gave {got}, "
            f"expected sha256 {ref.sha256}; the object was deleted, publish again"
        )
    _progress(f"published {ref.relative_path} to the {store.description} (read back, sha256 ok)")
    return PublishResult(ref, store.url(ref), published=True)


def _same_content(store: Store, published: ArchiveRef, data: bytes) -> ArchiveRef | None:
    stored = store.read(published)
    if stored is None or archive.sha256_hex(stored) != published.sha256:
        return None
    try:
        if archive.uncompressed_tar(stored) == archive.uncompressed_tar(data):
            return published
    except archive.ArchiveError:
        return None
    return None


def _progress(message: str) -> None:
    print(message, file=sys.stderr)
