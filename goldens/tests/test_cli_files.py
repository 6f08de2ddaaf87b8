"""Paths under `bazel run` and atomic writes, as every tool in the repository uses them."""

import os
from pathlib import Path

import pytest

from goldens import cli_files
from goldens.cli_files import (
    PathError,
    atomic_path,
    output_directory,
    repo_root,
    user_path,
    write_atomically,
)


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


def test_output_directory_is_created_with_its_parents(tmp_path):
    target = tmp_path / "a" / "b" / "goldens"
    assert output_directory(target, "--output-dir") == target
    assert target.is_dir()
    assert output_directory(target, "--output-dir") == target  # an existing folder is fine


@pytest.mark.parametrize("inside", [False, True])
def test_output_directory_that_is_a_file_is_refused_and_left_alone(tmp_path, inside):
    existing = tmp_path / "goldens.json"
    existing.write_text("keep me")
    target = existing / "sub" if inside else existing
    with pytest.raises(PathError, match=r"^--output-dir=.*goldens\.json.* name a folder"):
        output_directory(target, "--output-dir")
    assert existing.read_text() == "keep me"


def test_repo_root_is_the_bazel_run_workspace_else_this_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    assert (repo_root() / "MODULE.bazel").is_file()
    assert (repo_root() / "goldens" / "cli_files.py").is_file()
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(tmp_path))
    assert repo_root() == tmp_path


@pytest.mark.parametrize("failing", ["mkstemp", "replace"])
def test_a_write_the_system_refuses_is_a_path_error_and_leaves_no_temporary(
    tmp_path, monkeypatch, failing
):
    """A refused write is a PathError (the tools' exit 2), still an OSError for the store."""
    target = tmp_path / "record.json"
    target.write_text("old")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    owner = cli_files.tempfile if failing == "mkstemp" else cli_files.os
    monkeypatch.setattr(owner, failing, refuse)
    with pytest.raises(PathError) as caught:
        write_atomically(target, "new")
    assert str(caught.value) == (
        f"cannot write {target} (Permission denied); free space or grant write permission in "
        f"{tmp_path}, or name another path"
    )
    assert isinstance(caught.value, OSError)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


@pytest.mark.parametrize("check", ["output_directory", "output_file"])
def test_a_folder_this_process_cannot_write_is_refused_naming_the_flag(
    tmp_path, monkeypatch, check
):
    """Tests run as root here, so a chmod would not refuse: os.access says no instead."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        cli_files.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
    )
    given = locked if check == "output_directory" else locked / "report.html"
    with pytest.raises(PathError) as caught:
        getattr(cli_files, check)(given, "--out")
    assert str(caught.value) == (
        f"--out={given}: cannot create files in {locked} (no write permission, or a read-only "
        "file system); name a folder you can write"
    )
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("check", ["output_directory", "output_file"])
def test_a_folder_where_no_file_can_be_created_is_refused_naming_the_flag(
    tmp_path, monkeypatch, check
):
    """os.access says yes to root on a read-only file system (/sys), where creating a file
    still fails: the check creates one, as the atomic write will (refused here)."""
    given = tmp_path if check == "output_directory" else tmp_path / "report.html"

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli_files.tempfile, "TemporaryFile", refused)
    with pytest.raises(PathError) as caught:
        getattr(cli_files, check)(given, "--out")
    assert str(caught.value) == (
        f"--out={given}: cannot create files in {tmp_path} (Permission denied); name a folder "
        "you can write"
    )
