"""Background processes recorded by pid files: start, check, stop.

Each process runs in its own session (so its children, such as a worker's running action,
share its process group), writes to STATE/logs/NAME.log, and is recorded in
STATE/pids/NAME.pid. A pid counts as ours only while /proc/PID/cmdline still names the program
we started, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def pid_file(state: Path, name: str) -> Path:
    return state / "pids" / f"{name}.pid"


def log_file(state: Path, name: str) -> Path:
    return state / "logs" / f"{name}.log"


def own_env(**extra: str) -> dict[str, str]:
    """This process's environment for the stack's programs, less PYTHONPATH: BuildGrid, its
    migrations and pip run in their own virtual environment, where the caller's PYTHONPATH
    (another interpreter's site-packages) would shadow its packages."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, **extra}


def spawn(state: Path, name: str, cmd: list[str], program: str | None = None) -> subprocess.Popen:
    """Starts `cmd` in the background, logging to its log file; records it and returns it.

    `program` is the name the process runs as (default: cmd[0]'s), the one after a wrapper that
    execs it (setpriv).
    """
    log = log_file(state, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_file(state, name).parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=own_env(),
        )
    pid_file(state, name).write_text(f"{proc.pid} {program or Path(cmd[0]).name}\n")
    return proc


def _recorded(state: Path, name: str) -> tuple[int, str] | None:
    try:
        pid, program = pid_file(state, name).read_text().split()
        return int(pid), program
    except (OSError, ValueError):
        return None


def _is_running(pid: int, program: str) -> bool:
    """True while `pid` is a live (not zombie) process started as `program` (argv[0]'s name).

    setpriv execs the program it wraps; a script (bgd) runs as `python3.13 .../bgd ...`.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines()):
        return False
    return any(Path(arg.decode(errors="replace")).name == program for arg in cmdline[:2])


def running_pid(state: Path, name: str) -> int | None:
    """The pid of the recorded process `name` while it runs, else None."""
    recorded = _recorded(state, name)
    if recorded and _is_running(*recorded):
        return recorded[0]
    return None


def recorded_names(state: Path) -> list[str]:
    return sorted(p.stem for p in (state / "pids").glob("*.pid"))


def stop(state: Path, name: str, first_signal: int = signal.SIGTERM, grace_s: float = 15.0) -> bool:
    """Stops the recorded process `name` and its process group; True if it was running.

    The first signal goes to the process itself (PostgreSQL's postmaster shuts its backends
    down on SIGINT), then after `grace_s` SIGKILL goes to the whole group.
    """
    recorded = _recorded(state, name)
    was_running = bool(recorded and _is_running(*recorded))
    if recorded and was_running:
        pid, program = recorded
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first_signal)
        deadline = time.monotonic() + grace_s
        while _is_running(pid, program) and time.monotonic() < deadline:
            time.sleep(0.1)
        _kill_group(pid)
    pid_file(state, name).unlink(missing_ok=True)
    return was_running


def _kill_group(pgid: int) -> None:
    """SIGKILLs what is left of the session started for a process (its pgid is its pid)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port` (TIME_WAIT leftovers do not count, as for one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_answers(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for(check, timeout_s: float, still_alive) -> bool:
    """Polls `check()` until it is true (True), `still_alive()` is false or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        if not still_alive():
            return bool(check())
        time.sleep(0.1)
    return False


MOUNTS = Path("/proc/self/mounts")


def _unescape_mount_path(field: str) -> str:
    """A path as /proc/self/mounts spells it: space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), field)


def mounts_under(folder: Path, mounts: str) -> list[tuple[str, str]]:
    """(mount point, file system type) of each mount at or below `folder` in a
    /proc/self/mounts text, deepest first (so a mount inside another is undone first)."""
    root = str(folder)
    found = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount_path(fields[1])
        if point == root or point.startswith(root.rstrip("/") + "/"):
            found.append((point, fields[2]))
    return sorted(found, key=lambda mount: mount[0].count("/"), reverse=True)


def unmount_under(folder: Path) -> tuple[list[str], list[str]]:
    """Detaches every mount at or below `folder`: (unmounted, left with the reason why).

    A worker staging an action's inputs through FUSE mounts them below the state folder; a
    worker killed mid-action leaves the mount behind with no process to answer it ("Transport
    endpoint is not connected"), and nothing below it can be listed or deleted. A lazy
    unmount (`fusermount -u -z`, `umount -l` for other types) detaches it even then.
    """
    try:
        text = MOUNTS.read_text()
    except OSError:
        return [], []
    done, left = [], []
    for point, fs_type in mounts_under(folder, text):
        if fs_type.startswith("fuse"):
            cmd = ["fusermount3" if shutil.which("fusermount3") else "fusermount", "-u", "-z"]
        else:
            cmd = ["umount", "-l"]
        try:
            result = subprocess.run(
                [*cmd, point], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            left.append(f"{point} ({' '.join(cmd)}: {error})")
            continue
        if result.returncode == 0:
            done.append(point)
        else:
            why = (result.stderr or result.stdout).strip().splitlines()
            left.append(f"{point} ({' '.join(cmd)}: {why[-1] if why else result.returncode})")
    return done, left
