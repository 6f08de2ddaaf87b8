"""Paths under `bazel run` and atomic writes, as every tool in the repository uses them."""

import os

import pytest

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
