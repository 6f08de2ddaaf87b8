import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from goldens.artifacts import archive

GOLDENS = {
    "b_golden.json": b'{"logits": [0.5, -1.25]}\n',
    "a_golden.json": b'{"tokens": [791, 6864]}\n',
    "c_golden.json": b"{}\n",
}


def _write(folder: Path, order: list[str], mtime: int, umask: int) -> list[Path]:
    folder.mkdir()
    previous = os.umask(umask)
    try:
        for name in order:
            (folder / name).write_bytes(GOLDENS[name])
            os.utime(folder / name, (mtime, mtime))
    finally:
        os.umask(previous)
    return [folder / name for name in order]


def test_same_files_give_one_sha256_across_mtime_umask_and_order(tmp_path: Path) -> None:
    first = _write(tmp_path / "one", ["a_golden.json", "b_golden.json", "c_golden.json"], 1, 0o022)
    second = _write(
        tmp_path / "two", ["c_golden.json", "a_golden.json", "b_golden.json"], 1_700_000_000, 0o077
    )
    assert (first[0].stat().st_mode & 0o777) != (second[1].stat().st_mode & 0o777)
    assert archive.pack_files(first) == archive.pack_files(list(reversed(second)))


def test_pinned_digests_of_a_known_archive_never_drift() -> None:
    # If these change, every published sha256 changes with them. The tar digest depends only
    # on this code; the tar.gz digest also on zlib's deflate, which has been stable for years.
    data = archive.pack_members({"x_golden.json": b'{"x": 1}\n'})
    tar_digest = archive.sha256_hex(archive.uncompressed_tar(data))
    assert tar_digest == "561bde524f451dfd687ddc5f395597f9d9a7b564dbb5fd86830c668a5361851e"
    assert archive.sha256_hex(data) == (
        "a6dd15b965c3d4cf0786681be84cbe2a8f7787eefeecb2015e3097ef985fdf93"
    )


def test_gzip_header_has_no_time_and_no_file_name() -> None:
    data = archive.pack_members(GOLDENS)
    assert data[:3] == b"\x1f\x8b\x08"
    flags, mtime = data[3], int.from_bytes(data[4:8], "little")
    assert flags & 0x08 == 0, "FNAME flag set: the header carries a file name"
    assert mtime == 0


def test_members_are_sorted_flat_and_normalized() -> None:
    data = archive.pack_members(GOLDENS)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == sorted(GOLDENS)
    for info in infos:
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (
            0,
            0,
            0,
            "",
            "",
            0o644,
        )
        assert info.isfile()


def test_unpack_gives_back_the_members() -> None:
    assert archive.unpack_members(archive.pack_members(GOLDENS)) == GOLDENS


def test_two_files_with_one_basename_are_refused(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "g.json").write_text("1")
    (tmp_path / "y" / "g.json").write_text("2")
    with pytest.raises(archive.ArchiveError, match="distinct name"):
        archive.read_members([tmp_path / "x" / "g.json", tmp_path / "y" / "g.json"])


def test_empty_file_list_is_refused() -> None:
    with pytest.raises(archive.ArchiveError, match="at least one"):
        archive.pack_files([])


def test_member_with_a_path_is_refused_on_unpack() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(archive.ArchiveError, match="plain file name"):
        archive.unpack_members(buffer.getvalue())


def test_garbage_is_not_an_archive() -> None:
    with pytest.raises(archive.ArchiveError):
        archive.unpack_members(b"not gzip at all")


@pytest.mark.parametrize("name", ["sub/a_golden.json", "../a_golden.json", "..", "a\\b.json", ""])
def test_a_member_name_with_a_path_is_refused_on_pack(name: str) -> None:
    """An archive is flat: pack_members (which golden_update calls with names from a pending
    folder or an outputs.zip, not only basenames) refuses a name that is no plain file name
    rather than publish an archive its own unpack refuses. Catches dropping the name check
    from pack_members."""
    with pytest.raises(archive.ArchiveError, match="must be a plain file name"):
        archive.pack_members({**GOLDENS, name: b"{}\n"})


@pytest.mark.parametrize(
    "kind",
    [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE],
    ids=["symlink", "hardlink", "folder"],
)
def test_a_member_that_is_no_regular_file_is_refused_on_unpack(kind: bytes) -> None:
    """Only flat regular files come out of an archive (extract joins each name to a folder): a
    symlink, hard link or folder member is an ArchiveError naming it, not a KeyError or an
    assert from tarfile. Catches dropping the isfile() check in unpack_members."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = GOLDENS["a_golden.json"]
        info = tarfile.TarInfo("a_golden.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("b_golden.json")
        link.type = kind
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(archive.ArchiveError, match=r"'b_golden\.json' is not a regular file"):
        archive.unpack_members(buffer.getvalue())
