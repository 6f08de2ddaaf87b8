"""Paths under `bazel run` and atomic writes, as every tool in the repository uses them."""

import os

import pytest

from tools.cli_files import atomic_path, user_path, write_atomically


def test_user_path_means_the_directory_bazel_run_was_called_from(monkeypatch, tmp_path):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert user_path("sub/model.gguf") == tmp_path / "sub" / "model.gguf"
    assert user_path("/abs/model.gguf").as_posix() == "/abs/model.gguf"
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY")
    assert user_path("x") == user_path(os.path.join(os.getcwd(), "x"))


def test_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "golden.json"
    write_atomically(target, "first\n")
    write_atomically(target, b"second\n", fsync=True)
    assert target.read_text() == "second\n"
    assert target.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["golden.json"]


def test_existing_mode_is_kept(tmp_path):
    target = tmp_path / "MODULE.bazel"
    target.write_text("old")
    target.chmod(0o600)
    write_atomically(target, "new")
    assert target.stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as temp:
        temp.write_bytes(b"half")
        raise RuntimeError("writer crashed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
