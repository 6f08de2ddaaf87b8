import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from goldens.artifacts import archive, extract
from goldens.artifacts.extract import ChecksumMismatch, extract_pinned

MEMBERS = {
    "llama3_1_float32_cpu_golden.json": b'{"tokens": [791, 6864]}\n',
    "llama3_1_q4_k_cpu_golden.json": b'{"logits": [0.5, -1.25]}\n',
    "torch_llama3_1_bfloat16_cpu_golden.json": b"{}\n",
}
DATA = archive.pack_members(MEMBERS)
SHA = archive.sha256_hex(DATA)


@pytest.fixture
def archive_path(tmp_path: Path) -> Path:
    path = tmp_path / "artifacts" / "test_llama_golden" / "1" / SHA / "test_llama_golden.tar.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(DATA)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "llama-goldens" / "pinned"


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_extraction_gives_the_archive_files_with_their_bytes(
    archive_path: Path, cache: Path
) -> None:
    folder = extract_pinned(archive_path, SHA, cache)
    assert folder == cache / SHA
    assert _contents(folder) == MEMBERS
    assert _entries(cache) == [SHA]  # no temporary folder is left beside it


def test_a_second_call_reuses_the_folder_without_reading_the_archive(
    archive_path: Path, cache: Path
) -> None:
    folder = extract_pinned(archive_path, SHA, cache)
    inode = folder.stat().st_ino
    (folder / "sentinel").write_bytes(b"still here")
    archive_path.unlink()
    again = extract_pinned(archive_path, SHA, cache)
    assert again == folder
    assert again.stat().st_ino == inode
    assert (again / "sentinel").read_bytes() == b"still here"
    assert _entries(cache) == [SHA]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: d[:100] + bytes([d[100] ^ 0xFF]) + d[101:], id="byte-flipped"),
        pytest.param(lambda d: d[: len(d) // 2], id="truncated"),
    ],
)
def test_an_archive_that_differs_from_its_pin_is_refused_and_leaves_nothing(
    archive_path: Path, cache: Path, damage
) -> None:
    damaged = damage(DATA)
    archive_path.write_bytes(damaged)
    with pytest.raises(ChecksumMismatch) as raised:
        extract_pinned(archive_path, SHA, cache)
    message = str(raised.value)
    assert str(archive_path) in message
    assert f"has sha256 {archive.sha256_hex(damaged)}" in message
    assert f"pinned sha256 is {SHA}" in message
    assert f"git checkout -- {archive_path}" in message
    assert "python3 -m tools.artifacts.upload_artifact verify" in message
    assert _entries(cache) == []


def test_an_intact_archive_pinned_to_another_sha_is_refused(
    archive_path: Path, cache: Path
) -> None:
    other = archive.sha256_hex(archive.pack_members({"a_golden.json": b"other\n"}))
    with pytest.raises(
        ChecksumMismatch, match=f"has sha256 {SHA}, but the pinned sha256 is {other}"
    ):
        extract_pinned(archive_path, other, cache)
    assert _entries(cache) == []


def test_pinned_bytes_that_are_no_archive_are_refused_and_leave_nothing(
    tmp_path: Path, cache: Path
) -> None:
    path = tmp_path / "test_llama_golden.tar.gz"
    path.write_bytes(b"not a tar.gz")
    with pytest.raises(archive.ArchiveError, match=f"{path} matches its pinned sha256 but is no"):
        extract_pinned(path, archive.sha256_hex(b"not a tar.gz"), cache)
    assert _entries(cache) == []


@pytest.mark.parametrize("sha", ["", "..", SHA.upper(), SHA[:-1]])
def test_a_pin_that_is_no_sha256_is_refused_before_touching_the_cache(
    archive_path: Path, cache: Path, sha: str
) -> None:
    cache.mkdir(parents=True)
    with pytest.raises(ValueError, match="is not 64 lowercase hex digits; fix the http_archive"):
        extract_pinned(archive_path, sha, cache)
    assert _entries(cache) == []


def test_a_failure_while_writing_removes_the_temporary_folder(
    archive_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write_bytes = Path.write_bytes
    written: list[Path] = []

    def disk_fills_up(self: Path, data: bytes) -> int:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        written.append(self)
        return real_write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", disk_fills_up)
    with pytest.raises(OSError, match="No space left on device"):
        extract_pinned(archive_path, SHA, cache)
    assert written  # one member was written into the temporary folder before the failure
    assert _entries(cache) == []


def test_a_rename_failure_other_than_a_lost_race_is_raised(
    archive_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(src: str, dst: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", dst)

    monkeypatch.setattr(extract.os, "rename", refuse)
    with pytest.raises(PermissionError):
        extract_pinned(archive_path, SHA, cache)
    assert _entries(cache) == []


def test_the_loser_of_a_race_uses_the_winners_folder(
    archive_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_rename = os.rename
    renamed: list[Path] = []
    winner: list[tuple[Path, int]] = []
    failures: list[int] = []

    def another_process_finishes_first(src: str, dst: str) -> None:
        renamed.append(Path(src))
        if len(renamed) == 1:
            # A complete extraction lands between this one's extraction and its rename.
            folder = extract_pinned(archive_path, SHA, cache)
            winner.append((folder, folder.stat().st_ino))
        try:
            real_rename(src, dst)
        except OSError as error:
            failures.append(error.errno)
            raise

    monkeypatch.setattr(extract.os, "rename", another_process_finishes_first)
    folder = extract_pinned(archive_path, SHA, cache)
    assert len(renamed) == 2 and renamed[0] != renamed[1]
    assert failures in ([errno.ENOTEMPTY], [errno.EEXIST])  # the outer rename lost
    assert folder == winner[0][0] == cache / SHA
    assert folder.stat().st_ino == winner[0][1]
    assert _contents(folder) == MEMBERS
    assert _entries(cache) == [SHA]


def test_concurrent_threads_all_get_one_complete_folder(archive_path: Path, cache: Path) -> None:
    count = 8
    start = threading.Barrier(count)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        start.wait()
        try:
            results.append(extract_pinned(archive_path, SHA, cache))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert results == [cache / SHA] * count
    assert _contents(cache / SHA) == MEMBERS
    assert _entries(cache) == [SHA]


_CHILD = """
import sys, time
from pathlib import Path
from goldens.artifacts.extract import extract_pinned
archive_path, sha, cache, ready, go = sys.argv[1:]
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.001)
print(extract_pinned(Path(archive_path), sha, Path(cache)))
"""


def test_concurrent_processes_all_get_one_complete_folder(
    archive_path: Path, cache: Path, tmp_path: Path
) -> None:
    count = 6
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    children = []
    for i in range(count):
        ready = tmp_path / f"ready{i}"
        args = [str(archive_path), SHA, str(cache), str(ready), str(go)]
        command = [sys.executable, "-c", _CHILD, *args]
        children.append(
            (ready, subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
        )
    try:
        # Start them together, once each has imported the module, so their extractions overlap.
        deadline = time.monotonic() + 60
        while not all(ready.exists() for ready, _ in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        outputs = [child.communicate(timeout=60)[0] for _, child in children]
    finally:
        for _, child in children:
            if child.poll() is None:
                child.kill()
    assert [child.returncode for _, child in children] == [0] * count
    assert [Path(out.strip()) for out in outputs] == [cache / SHA] * count
    assert _contents(cache / SHA) == MEMBERS
    assert _entries(cache) == [SHA]
