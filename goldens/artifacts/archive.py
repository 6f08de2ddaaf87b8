"""Reproducible golden archives: the same files give the same tar.gz bytes on any machine.

An archive is flat (members are file basenames), so the http_archive filegroup sees the
goldens at its root. Everything that varies between checkouts is normalized: entry order,
mtime, owner, mode, and the gzip header's time and file name.
"""

import gzip
import hashlib
import io
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

# zlib's level 9 is what `gzip -9` writes; changing it changes every sha256, so it is fixed.
COMPRESS_LEVEL = 9
MEMBER_MODE = 0o644


class ArchiveError(ValueError):
    """A file list or an archive that cannot be a golden archive."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_members(files: Iterable[Path]) -> dict[str, bytes]:
    """Reads files into {basename: bytes}; two files with one basename would collide."""
    members: dict[str, bytes] = {}
    for path in files:
        if not path.is_file():
            raise ArchiveError(f"{path}: not a file (give paths of existing golden files)")
        if path.name in members:
            raise ArchiveError(
                f"{path}: a second file named {path.name!r}; archive members are basenames, "
                "so give each file a distinct name"
            )
        members[path.name] = path.read_bytes()
    if not members:
        raise ArchiveError("no files given: name at least one golden file to archive")
    return members


def pack_members(members: Mapping[str, bytes]) -> bytes:
    """Packs {basename: bytes} into deterministic tar.gz bytes."""
    if not members:
        raise ArchiveError("no files given: name at least one golden file to archive")
    tar_buffer = io.BytesIO()
    with tarfile.open(fileobj=tar_buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            _check_member_name(name)
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = MEMBER_MODE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    gz_buffer = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of the temp name and the clock.
    with gzip.GzipFile(
        filename="", mode="wb", fileobj=gz_buffer, mtime=0, compresslevel=COMPRESS_LEVEL
    ) as gz:
        gz.write(tar_buffer.getvalue())
    return gz_buffer.getvalue()


def pack_files(files: Iterable[Path]) -> bytes:
    return pack_members(read_members(files))


def unpack_members(archive: bytes) -> dict[str, bytes]:
    """Reads a golden archive back into {basename: bytes}, refusing anything but flat files."""
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            for info in tar:
                if not info.isfile():
                    raise ArchiveError(f"archive member {info.name!r} is not a regular file")
                _check_member_name(info.name)
                extracted = tar.extractfile(info)
                assert extracted is not None  # regular files always have a payload
                members[info.name] = extracted.read()
    except (tarfile.TarError, OSError, EOFError) as error:
        raise ArchiveError(f"not a readable tar.gz archive: {error}") from error
    return members


def uncompressed_tar(archive: bytes) -> bytes:
    """The tar stream inside a tar.gz: equal for equal content whatever zlib compressed it."""
    try:
        return gzip.decompress(archive)
    except (OSError, EOFError) as error:
        raise ArchiveError(f"not a readable gzip stream: {error}") from error


def _check_member_name(name: str) -> None:
    # Members land in a folder on extraction; a path in a name could escape it.
    if not name or name in {".", ".."} or "/" in name or "\\" in name or "\0" in name:
        raise ArchiveError(f"archive member {name!r} must be a plain file name")
