"""Extract a pinned golden archive into a content-addressed cache folder, safely in parallel.

`extract_pinned(archive_path, sha256, cache_root)` gives `cache_root/SHA256` holding the
archive's files. The folder only ever appears through one rename of a complete extraction, so
an existing one is whole and is reused as is. Several processes may extract the same archive at
once: each works in its own temporary folder beside the target, the first rename wins, and the
others drop their copy and use the winner's, which is identical because the name is the
archive's sha256. `read_pinned(archive_path, sha256)` gives the files in memory, checked the
same way, for a command that only reads them.
"""

import errno
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from goldens.artifacts import archive
from goldens.artifacts.stanza import GoldenPin
from goldens.artifacts.store import SHA256_PATTERN, Store, local_only, ref_from_url
from goldens.artifacts.store_options import CheckFailed


class ChecksumMismatch(archive.ArchiveError):
    """The archive's bytes are not the ones pinned: it was damaged or replaced."""


def extract_pinned(archive_path: Path, sha256: str, cache_root: Path) -> Path:
    """`cache_root/sha256` with the files of the archive at `archive_path`, checked first."""
    if not SHA256_PATTERN.fullmatch(sha256):
        # The sha names the cache folder; anything else could point outside it or at its root.
        raise ValueError(
            f"pinned sha256 {sha256!r} for {archive_path} is not 64 lowercase hex digits; "
            "fix the http_archive stanza's sha256 in MODULE.bazel"
        )
    target = cache_root / sha256
    if target.is_dir():
        return target
    members = read_pinned(archive_path, sha256)
    cache_root.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=cache_root, prefix=f".{sha256}."))
    try:
        for name, content in members.items():
            (temp / name).write_bytes(content)
        try:
            os.rename(temp, target)
        except OSError as error:
            # Another process renamed its complete copy first; it has the same content.
            lost_race = error.errno in (errno.ENOTEMPTY, errno.EEXIST) and target.is_dir()
            if not lost_race:
                raise
    finally:
        # After a successful rename `temp` no longer exists; otherwise it is ours to remove.
        shutil.rmtree(temp, ignore_errors=True)
    return target


def read_pinned(archive_path: Path, sha256: str) -> dict[str, bytes]:
    """The files of the archive at `archive_path`, once its bytes are checked to be `sha256`'s.

    ChecksumMismatch when they are not; ArchiveError when they are but hold no golden archive.
    """
    data = archive_path.read_bytes()
    actual = archive.sha256_hex(data)
    if actual != sha256:
        raise ChecksumMismatch(
            f"checksum mismatch: {archive_path} has sha256 {actual}, but the pinned sha256 is "
            f"{sha256}; the file is damaged or was replaced. Restore it with "
            f"`git checkout -- {archive_path}` and check the whole store with "
            "`python3 -m tools.artifacts.upload_artifact verify`"
        )
    # unpack_members is what `upload_artifact fetch` uses: it refuses anything but flat regular
    # files, so each member name is safe to join to a folder (stricter than filter="data").
    try:
        return archive.unpack_members(data)
    except archive.ArchiveError as error:
        raise archive.ArchiveError(
            f"{archive_path} matches its pinned sha256 but is no golden archive ({error}); "
            "pin an archive made by `python3 -m tools.artifacts.upload_artifact upload`"
        ) from error


def download_pinned(store: Store, pin: GoldenPin) -> bytes:
    """The pinned archive's bytes from the store, else from its URL; sha256 checked."""
    ref = ref_from_url(pin.url)
    data = store.read(ref) if ref is not None else None
    source = store.description
    if data is None:
        if not _fetchable(pin.url):
            where = ref.relative_path if ref else pin.url
            raise CheckFailed(f"{pin.name}: {where} is not in the {store.description}")
        print(f"downloading {pin.url}", file=sys.stderr)
        try:
            with urllib.request.urlopen(pin.url, timeout=30) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as error:
            raise CheckFailed(f"{pin.name}: cannot download {pin.url}: {error}") from error
        source = pin.url
    actual = archive.sha256_hex(data)
    if actual != pin.sha256:
        raise CheckFailed(
            f"{pin.name}: checksum mismatch: {source} gave sha256 {actual}, "
            f"MODULE.bazel pins {pin.sha256}"
        )
    return data


def _fetchable(url: str) -> bool:
    return urllib.parse.urlparse(url).scheme in {"http", "https"} and not local_only(url)
