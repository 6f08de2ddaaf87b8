"""How the repository's command-line tools and tests find and write files, and report usage.

- `repo_root`: the repository a command acts on. Under `bazel run` that is the workspace Bazel
  was called in (BUILD_WORKSPACE_DIRECTORY); elsewhere (plain Python, pytest, `bazel test`)
  it is the checkout holding this file, found by resolving the runfiles symlinks.
- `user_path`: a path the user typed means their working directory. Under `bazel run` the
  process starts in the runfiles tree, and Bazel says where the user was in
  BUILD_WORKING_DIRECTORY.
- `output_directory` / `output_file`: a folder the user named for outputs is created (parents
  included) when missing; a path that exists as a file, or a folder this process cannot create
  files in, is an error naming the flag, found before the command's work, never after it.
- `OneLineParser`: a usage error is one line naming the problem (argparse would print the
  whole usage block first), exit 2; the full usage is one --help away.
- `atomic_path` / `write_atomically`: an output appears whole or not at all. Data goes to a
  temporary file beside the target, then one rename replaces it; on any failure the temporary
  file is removed and an existing target is left untouched. A write that fails (no permission,
  a full disk) is a `WriteError`, a PathError the tools report in one line with exit 2: their
  exit 1 is a verdict (a token flipped, a regression, a golden differs), not a failed write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def repo_root() -> Path:
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if workspace:
        return Path(workspace)
    return Path(__file__).resolve().parents[1]


def user_path(path: str | os.PathLike) -> Path:
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return Path(base, os.path.expanduser(path))


class PathError(ValueError):
    """A path the user gave cannot be used; the message names the flag, the path and the fix."""


class WriteError(PathError, OSError):
    """An output could not be written. Also an OSError, so code that handles a failed write
    as an OSError (the artifact store's StoreError) keeps doing so."""


def output_directory(path: Path, flag: str) -> Path:
    """`path`, created with its parents when missing, as the folder a command writes into."""
    return _writable_folder(path, flag, path)


def _writable_folder(folder: Path, flag: str, given: Path) -> Path:
    """`folder` created when missing and checked writable; errors show `flag`=`given`."""
    if folder.exists() and not folder.is_dir():
        raise PathError(
            f"{flag}={given} exists and is not a directory; name a folder to write into"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent is a file, no permission, read-only file system
        reason = f"{error.strerror}: {error.filename}" if error.filename else str(error)
        raise PathError(
            f"{flag}={given} cannot be created ({reason}); name a folder you can write"
        ) from error
    reason = None
    if not os.access(folder, os.W_OK | os.X_OK):  # also false on a read-only file system
        reason = "no write permission, or a read-only file system"
    else:  # root passes os.access on /sys, where creating a file still fails: create one
        try:  # (nameless, gone when closed) as the atomic write will
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            reason = error.strerror or str(error)
    if reason is not None:
        raise PathError(
            f"{flag}={given}: cannot create files in {folder} ({reason}); name a folder you "
            "can write"
        )
    return folder


def at_least(least: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number of at least `least` (--threads=0 would otherwise
    reach torch.set_num_threads and stop in a traceback)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: give at least {least}")
        return value

    parse.__name__ = f"whole number >= {least}"
    return parse


def output_file(path: Path, flag: str) -> Path:
    """`path` as a file a command writes: not a folder; its folder created when missing and
    one this process can create the file in (the atomic write renames a file created there)."""
    if path.is_dir():
        raise PathError(f"{flag}={path} is a directory; name the file to write")
    _writable_folder(path.parent, flag, path)
    return path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to; renamed over `path` on success.

    The result keeps an existing file's mode, else gets 0644 (mkstemp's 0600 would not do).
    An OSError while creating, writing or renaming the temporary file is a WriteError naming
    `path`; any other failure propagates as it is. Either way the temporary file is removed.
    """
    try:
        fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise _write_error(path, error) from error
    os.close(fd)
    temp = Path(temp_name)
    try:
        yield temp
        os.chmod(temp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(temp, path)
    except WriteError:
        temp.unlink(missing_ok=True)
        raise
    except OSError as error:
        temp.unlink(missing_ok=True)
        raise _write_error(path, error) from error
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _write_error(path: Path, error: OSError) -> WriteError:
    reason = error.strerror or str(error)
    return WriteError(
        f"cannot write {path} ({reason}); free space or grant write permission in "
        f"{path.parent}, or name another path"
    )


def write_atomically(path: Path, content: str | bytes, fsync: bool = False) -> None:
    """Replace `path` with `content` (str is written as UTF-8) in one rename.

    `fsync` flushes the data to disk before the rename, for files that must survive a crash.
    """
    data = content.encode("utf-8") if isinstance(content, str) else content
    with atomic_path(path) as temp, open(temp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
