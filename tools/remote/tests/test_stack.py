"""stack.py without a stack: flags, state folders, the rendered config, pid bookkeeping.

Nothing here starts BuildGrid, buildbox or PostgreSQL (tools/remote/e2e.sh does, in CI);
a `sleep` stands in for a recorded process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from testing.processes import exited
from tools.remote import deps, processes, stack


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = stack.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["start", "--workers=x"], "--workers: invalid int value: 'x'"),
        (["start", "--workers=-1"], "--workers=-1 is not in 0..64"),
        (["start", "--port=80"], "--port=80 is not a port in 1024..65535"),
        (["start", "--port=9000", "--pg-port=9000"], "--port and --pg-port are both 9000"),
        (["start", "--workers=0"], "leaves no worker to run actions"),
        (["restart"], "invalid choice: 'restart'"),
        (["start", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, message):
    code, out = run(capsys, *argv)
    assert code == 2
    assert message in out
    assert len(out.strip().splitlines()) == 1


def test_a_state_folder_that_is_a_file_exits_2(capsys, tmp_path):
    state = tmp_path / "state"
    state.write_text("")
    code, out = run(capsys, "start", f"--state={state}")
    assert code == 2
    assert f"--state={state} exists and is not a directory" in out


def test_stop_and_status_without_a_state_folder(capsys, tmp_path):
    assert run(capsys, "stop", f"--state={tmp_path / 'none'}") == (
        0,
        f"stack: not running (no state folder {tmp_path / 'none'})\n",
    )
    code, out = run(capsys, "status", f"--state={tmp_path / 'none'}")
    assert code == 1
    assert "not running" in out


def test_the_config_has_every_placeholder_filled(tmp_path):
    text = stack._render_config(
        tmp_path, 8980, "postgresql+psycopg://bgd:pw@127.0.0.1:1/postgres"
    ).read_text()
    assert "@" not in text.replace("bgd:pw@127", "")
    assert "!execution" in text and "resources:gpu-memory" in text
    assert "maximum-concurrent-rpcs: 2000" in text
    assert 'address: "127.0.0.1:8980"' in text
    assert (tmp_path / "buildgrid.yml").stat().st_mode & 0o077 == 0


def test_a_cache_only_config_has_no_scheduler(tmp_path):
    text = stack._render_config(tmp_path, 8980, None).read_text()
    for absent in ("!execution", "!sql-scheduler", "!sql-connection", "execution:begin"):
        assert absent not in text
    assert "!action-cache" in text and "!cas" in text


@pytest.fixture(autouse=True)
def no_real_start(monkeypatch):
    """A test that reaches a real start fails instead of starting BuildGrid and PostgreSQL."""

    def refuse(state, args):
        raise AssertionError("a unit test tried to start the stack")

    monkeypatch.setattr(stack, "_start", refuse)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 5
    while not cmdline.read_bytes().startswith(b"sleep") and time.monotonic() < deadline:
        time.sleep(0.01)  # until the child has exec'd `sleep`
    yield proc
    proc.kill()
    proc.wait()


def record(state, name, pid, program):
    processes.pid_file(state, name).parent.mkdir(parents=True, exist_ok=True)
    processes.pid_file(state, name).write_text(f"{pid} {program}\n")


def test_a_recycled_pid_is_never_signalled(tmp_path, sleeper):
    record(tmp_path, "buildgrid", sleeper.pid, "bgd")  # the pid now runs `sleep`, not bgd
    assert processes.running_pid(tmp_path, "buildgrid") is None
    assert processes.stop(tmp_path, "buildgrid") is False
    assert sleeper.poll() is None
    assert not processes.pid_file(tmp_path, "buildgrid").exists()


def test_stop_ends_a_recorded_process(tmp_path, sleeper):
    record(tmp_path, "worker-1", sleeper.pid, "sleep")
    assert processes.running_pid(tmp_path, "worker-1") == sleeper.pid
    assert processes.stop(tmp_path, "worker-1", grace_s=5) is True
    sleeper.wait(timeout=5)


def test_a_second_start_reports_the_running_stack(capsys, tmp_path, sleeper):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        record(tmp_path, "buildgrid", sleeper.pid, "sleep")
        recorded = {
            "port": port,
            "pg_port": None,
            "cache_only": True,
            "workers": [],
            "started": ["buildgrid"],
        }
        (tmp_path / "stack.json").write_text(json.dumps(recorded))
        code, out = run(capsys, "start", f"--state={tmp_path}")
        assert code == 0
        assert out.startswith(f"stack: already running (1 processes); state folder {tmp_path}")
        assert f"--remote_cache=grpc://127.0.0.1:{port}" in out
        code, out = run(capsys, "status", f"--state={tmp_path}")
        assert code == 0
        assert f"BuildGrid answers on 127.0.0.1:{port}" in out
        assert run(capsys, "stop", f"--state={tmp_path}")[0] == 0
    time.sleep(0.1)
    assert sleeper.poll() is not None
    assert not (tmp_path / "stack.json").exists()


def test_stop_kills_what_is_left_of_the_process_group(tmp_path):
    """stop ends the recorded process and its process group (a worker's running action): a
    child left behind when its parent died of the first signal gets SIGKILL (planted: no
    SIGKILL to the group, the child ran on)."""
    proc = processes.spawn(tmp_path, "worker-1", ["sh", "-c", "sleep 60 & echo $!; wait"])
    log = processes.log_file(tmp_path, "worker-1")
    deadline = time.monotonic() + 5
    while len(log.read_text().splitlines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(log.read_text().splitlines()[1])
    try:
        assert processes.running_pid(tmp_path, "worker-1") == proc.pid
        assert processes.stop(tmp_path, "worker-1", grace_s=5) is True
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while not exited(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exited(child), f"the group's child {child} outlived stop"
        assert not processes.pid_file(tmp_path, "worker-1").exists()
    finally:
        if not exited(child):
            os.kill(child, signal.SIGKILL)


def test_a_script_run_by_its_interpreter_counts_as_running(tmp_path):
    """bgd is a script: it runs as `python3.13 .../bgd ...`, so the program's name may be the
    second word of the command line (processes._is_running; planted: argv[0] alone, and a
    running BuildGrid read as stopped)."""
    script = tmp_path / "bgd"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 5
        while str(script).encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        record(tmp_path, "buildgrid", proc.pid, "bgd")
        assert processes.running_pid(tmp_path, "buildgrid") == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_port_in_time_wait_is_free_and_a_listening_one_is_not():
    """port_is_free: a port a server listens on is taken; one whose server closed, with a
    connection of its left in TIME_WAIT, is free, since a server (which sets SO_REUSEADDR)
    could listen on it again (planted: the probe without SO_REUSEADDR, and a restart right
    after a stop refused as "port taken")."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert processes.port_is_free(port) is False
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        assert processes.port_answers(port) is True
        served.close()  # the server closes first: its side waits in TIME_WAIT
        client.close()
    assert processes.port_answers(port) is False
    assert processes.port_is_free(port) is True


def test_wait_for_polls_while_the_process_lives_and_stops_when_it_dies():
    """wait_for polls `check` until it is true while `still_alive` holds, and gives up at once
    when the process has died (planted: the still_alive test inverted, giving up on a live
    process whose server is not up yet on the first poll)."""
    calls = []

    def ready_on_third_poll() -> bool:
        calls.append(1)
        return len(calls) >= 3

    assert processes.wait_for(ready_on_third_poll, 10, lambda: True) is True
    assert len(calls) == 3
    began = time.monotonic()
    assert processes.wait_for(lambda: False, 30, lambda: False) is False
    assert time.monotonic() - began < 5


def test_a_missing_program_that_cannot_be_installed_says_how_to(monkeypatch):
    """Off Debian (or not root) a missing program is a MissingDependency whose message is the
    command that installs it: buildbox from the unstable suite, postgresql from stable
    (deps.py's docstring; planted: the hint without `-t unstable`)."""
    monkeypatch.setattr(deps.shutil, "which", lambda name: None)
    monkeypatch.setattr(deps, "_can_install", lambda: "this machine is not Debian")
    with pytest.raises(deps.MissingDependency) as buildbox:
        deps.buildbox(Path("/nonexistent/install.log"))
    assert str(buildbox.value) == (
        "missing buildbox and cannot install it (this machine is not Debian); on Debian, as "
        "root: apt-get install -t unstable --no-install-recommends buildbox (with the unstable "
        "suite in apt's sources, pinned low; see bazelw)"
    )
    monkeypatch.setattr(deps, "_postgres_bin_dir", lambda: None)
    with pytest.raises(deps.MissingDependency) as postgres:
        deps.postgres(Path("/nonexistent/install.log"))
    assert str(postgres.value) == (
        "missing postgresql and cannot install it (this machine is not Debian); on Debian, as "
        "root: apt-get install --no-install-recommends postgresql"
    )


def test_a_dependency_that_cannot_be_installed_exits_2(capsys, tmp_path, monkeypatch):
    """`start` exits 2 (bad input, not 1 for a failed start) when a program is missing and
    cannot be installed, with the one line that says how to install it (stack.py's
    docstring; planted: exit 1)."""

    def missing(state, args):
        raise deps.MissingDependency("missing buildbox and cannot install it (not root)")

    monkeypatch.setattr(stack, "_start", missing)
    code, out = run(capsys, "start", f"--state={tmp_path}")
    assert (code, out) == (2, "stack: missing buildbox and cannot install it (not root)\n")
    assert not (tmp_path / "stack.json").exists()


_REAL_START = stack._start  # before no_real_start replaces it


def test_a_taken_port_exits_1_naming_the_port_and_its_option(capsys, tmp_path, monkeypatch):
    """`start` on a port something else listens on: exit 1, one line naming the port, what
    wanted it and the option that moves it, before any process is started; nothing recorded
    (stack.py's docstring, README "Scaling out"). The real _start runs, its dependencies and
    spawns stubbed. Planted: the port check dropped (BuildGrid then failed to bind, a later
    and vaguer failure)."""
    monkeypatch.setattr(stack, "_start", _REAL_START)
    monkeypatch.setattr(stack.deps, "buildbox", lambda log: {})
    monkeypatch.setattr(stack.deps, "postgres", lambda log: Path("/nonexistent/pg/bin"))
    monkeypatch.setattr(stack.deps, "buildgrid", lambda venv, log: Path("/nonexistent/bgd"))
    started = []
    monkeypatch.setattr(stack.processes, "spawn", lambda *a, **k: started.append(a))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code, out = run(capsys, "start", f"--state={tmp_path}", f"--port={port}")
    assert (code, out) == (
        1,
        f"stack: port {port} (BuildGrid) on 127.0.0.1 is taken; choose another with --port\n",
    )
    assert started == []
    assert not (tmp_path / "stack.json").exists()


def test_stop_ends_every_recorded_process_and_deletes_the_database_keeping_the_logs(
    capsys, tmp_path
):
    """`stop` stops every recorded process, those stack.json lists and any other with a pid
    file, deletes PostgreSQL's data folder (named in postgres.dir, created fresh by each
    start), postgres.dir, casd.sock and stack.json, and keeps the logs (stack.py's
    docstring). Planted: the rmtree of the data folder dropped (the cluster and its password
    left behind)."""
    state = tmp_path / "state"
    state.mkdir()
    pg_dir = tmp_path / "llama-goldens-pg-x"
    (pg_dir / "data").mkdir(parents=True)
    (pg_dir / "data" / "PG_VERSION").write_text("17\n")
    (state / "postgres.dir").write_text(f"{pg_dir}\n")
    (state / "casd.sock").write_text("")
    started = ["postgres", "buildgrid"]
    recorded = {"port": 1, "pg_port": 2, "cache_only": False, "workers": [], "started": started}
    (state / "stack.json").write_text(json.dumps(recorded))
    names = ["postgres", "buildgrid", "worker-1"]  # worker-1: a pid file only
    procs = {name: processes.spawn(state, name, ["sleep", "60"]) for name in names}
    try:
        for proc in procs.values():
            cmdline = Path(f"/proc/{proc.pid}/cmdline")
            deadline = time.monotonic() + 5
            while not cmdline.read_bytes().startswith(b"sleep") and time.monotonic() < deadline:
                time.sleep(0.01)  # until the child has exec'd `sleep`
        assert [n for n in names if processes.running_pid(state, n)] == names
        assert run(capsys, "stop", f"--state={state}") == (
            0,
            f"stack: stopped 3 processes; state folder {state}\n",
        )
        for proc in procs.values():
            proc.wait(timeout=5)
        assert not pg_dir.exists()
        remaining = sorted(p.relative_to(state).as_posix() for p in state.rglob("*"))
        assert remaining == ["lock", "logs", *(f"logs/{n}.log" for n in sorted(names)), "pids"]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_mounts_under_a_folder_are_read_as_the_kernel_escapes_them_deepest_first():
    """/proc/self/mounts spells a space in a path as \040 and a backslash as \134; a mount
    inside another is detached first; a sibling folder sharing the name's prefix is not
    below the folder. Planted: a prefix test without the separator (state-other counted)."""
    mounts = "\n".join(
        [
            "/dev/vda / ext4 rw 0 0",
            "tmpfs /s tmpfs rw 0 0",
            "/dev/fuse /s/state/cache/a\\040b/mnt fuse rw,user_id=0 0 0",
            "tmpfs /s/state tmpfs rw 0 0",
            "/dev/fuse /s/state/x\\134040 fuse.buildbox rw 0 0",
            "/dev/fuse /s/state-other/mnt fuse rw 0 0",
        ]
    )
    assert processes.mounts_under(Path("/s/state"), mounts) == [
        ("/s/state/cache/a b/mnt", "fuse"),
        ("/s/state/x\\040", "fuse.buildbox"),
        ("/s/state", "tmpfs"),
    ]


def _stale_fuse_mount(point: Path) -> None:
    """A mount as a worker killed mid-action leaves it: buildbox-fuse mounts, is SIGKILLed,
    and the mount stays attached with nothing to answer it."""
    if not (Path("/dev/fuse").exists() and shutil.which("buildbox-fuse")):
        pytest.skip("needs /dev/fuse and buildbox-fuse (tools/remote/stack.sh start installs it)")
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855/0"
    cas = point.parent / "cas"
    cas.mkdir()
    fuse = subprocess.Popen(
        ["buildbox-fuse", f"--local={cas}", f"--input-digest-value={empty}", str(point)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not processes.mounts_under(
        point, processes.MOUNTS.read_text()
    ):
        time.sleep(0.05)
    fuse.kill()
    fuse.wait()


def _tmpfs_mount(point: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "none", str(point)], check=False, timeout=30)


@pytest.mark.parametrize("mount", [_stale_fuse_mount, _tmpfs_mount], ids=["fuse", "tmpfs"])
def test_stop_detaches_what_a_killed_worker_left_mounted_below_the_state(capsys, tmp_path, mount):
    """A worker killed mid-action leaves its FUSE staging mounted below the state folder, where
    nothing can list or delete it (seen after a disk-full CI run). `stop` detaches it and says
    so. Planted: `_stop` without its unmount_under call (the mount stays; rmtree fails)."""
    state = tmp_path / "state"
    point = state / "casd-cache" / "staging dir" / "mnt"
    point.mkdir(parents=True)
    mount(point)
    mounted = [p for p, _ in processes.mounts_under(state, processes.MOUNTS.read_text())]
    if mounted != [str(point)]:
        pytest.skip(f"this process cannot mount below {tmp_path} (mounts there: {mounted})")
    try:
        assert run(capsys, "stop", f"--state={state}") == (
            0,
            f"stack: stopped 0 processes, detached 1 stale mount; state folder {state}\n",
        )
        assert processes.mounts_under(state, processes.MOUNTS.read_text()) == []
        shutil.rmtree(state)
    finally:
        processes.unmount_under(state)


def test_a_mount_stop_cannot_detach_is_named_and_exits_1(capsys, tmp_path, monkeypatch):
    """A mount point the unmount refuses (here: one the mounts file lists that is not
    mounted) is named with the command to run, and `stop` exits 1. Planted: the refusal
    dropped (exit 0, the mount not named)."""
    state = tmp_path / "state"
    point = state / "mnt"
    point.mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/fuse {point} fuse rw 0 0\n")
    monkeypatch.setattr(processes, "MOUNTS", mounts)
    code, out = run(capsys, "stop", f"--state={state}")
    assert code == 1
    assert f"stack: stopped 0 processes; state folder {state}\n" in out
    assert f"stack: could not detach {point} (fusermount" in out
    assert "as root: umount -l PATH" in out


def test_the_gpu_property_is_registered_with_the_scheduler(tmp_path):
    """docs/environment.md:58-60: every platform property an action carries must be listed in
    the scheduler's match-property-keys, or Execute fails with "Unregistered platform
    property"; the key the GPU worker advertises (and GPU tests ask for) is the one listed
    (planted: the `- resources:gpu-memory` entry dropped, which the comment above it still
    names, so a plain substring check passes)."""
    lines = stack._render_config(tmp_path, 8980, "postgresql+psycopg://u:p@h:1/d").read_text()
    lines = lines.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "match-property-keys:")
    keys = []
    for line in lines[start + 1 :]:
        if not line.strip().startswith("- "):
            break
        keys.append(line.strip()[2:])
    assert keys == [stack.GPU_PROPERTY.split("=")[0]] == ["resources:gpu-memory"]


class _Running:
    """A spawned process that stays up: poll() is None."""

    def poll(self):
        return None


def test_workers_run_through_casd_with_fuse_staging(tmp_path, monkeypatch):
    """docs/environment.md:64-67: Bazel talks to BuildGrid only; casd is the workers' local
    CAS (a proxy of BuildGrid's), each worker's runner stages inputs through FUSE where
    /dev/fuse and buildbox-fuse exist (else copy-or-link), N CPU workers plus, with
    --gpu-worker, one advertising resources:gpu-memory=2. The real _start runs with its
    programs, PostgreSQL and spawns stubbed (planted: the workers' --cas-remote pointed at
    BuildGrid; the staging choice inverted; one worker too few; the GPU worker's --platform
    dropped)."""
    monkeypatch.setattr(stack, "_start", _REAL_START)
    programs = {p: f"/bb/{p}" for p in deps.BUILDBOX_PROGRAMS}
    monkeypatch.setattr(stack.deps, "buildbox", lambda log: programs)
    monkeypatch.setattr(stack.deps, "postgres", lambda log: Path("/pg/bin"))
    monkeypatch.setattr(stack.deps, "buildgrid", lambda venv, log: Path("/venv/bin/bgd"))
    monkeypatch.setattr(stack.processes, "port_is_free", lambda port: True)
    monkeypatch.setattr(stack, "_start_postgres", lambda *a: ("postgresql+psycopg://x", "/pg"))
    monkeypatch.setattr(stack.processes, "wait_for", lambda check, timeout, alive: True)
    monkeypatch.setattr(stack.time, "sleep", lambda seconds: None)
    spawned = {}

    def spawn(state, name, cmd, program=None):
        spawned[name] = cmd
        return _Running()

    monkeypatch.setattr(stack.processes, "spawn", spawn)
    for fuse_program, staging in (
        ("/bb/buildbox-fuse", "fuse" if Path("/dev/fuse").exists() else "copy-or-link"),
        (None, "copy-or-link"),
    ):
        monkeypatch.setattr(stack.shutil, "which", lambda name, found=fuse_program: found)
        spawned.clear()
        args = stack._parser().parse_args(
            ["start", "--workers=2", "--gpu-worker", "--port=9100", "--pg-port=9101"]
        )
        started = stack._start(tmp_path, args)
        sock = tmp_path / "casd.sock"
        assert list(spawned) == ["buildgrid", "casd", "worker-1", "worker-2", "worker-gpu"]
        assert spawned["buildgrid"] == [
            "/venv/bin/bgd",
            "server",
            "start",
            f"{tmp_path}/buildgrid.yml",
        ]
        assert spawned["casd"] == [
            "/bb/buildbox-casd",
            "--cas-remote=grpc://127.0.0.1:9100",
            f"--bind=unix:{sock}",
            "--log-level=warning",
            str(tmp_path / "casd-cache"),
        ]
        worker = [
            "/bb/buildbox-worker",
            "--bots-remote=grpc://127.0.0.1:9100",
            f"--cas-remote=unix:{sock}",
            "--buildbox-run=/bb/buildbox-run-hosttools",
            f"--runner-arg=--staging-mode={staging}",
        ]
        assert spawned["worker-1"] == [*worker, "worker-1"]
        assert spawned["worker-gpu"] == [*worker, "--platform=resources:gpu-memory=2", "worker-gpu"]
        assert started["workers"] == ["worker-1", "worker-2", "worker-gpu (resources:gpu-memory=2)"]


def test_postgres_runs_as_the_postgres_user_under_root_with_a_psycopg_url(tmp_path, monkeypatch):
    """docs/environment.md:55-56,68-70: PostgreSQL refuses root, so as root the stack runs
    initdb and postgres as `postgres` through setpriv, the cluster in a folder of /tmp (root's
    home is not reachable by that user); not as root, in the state folder with no prefix.
    BuildGrid gets a `postgresql+psycopg://` URL and `bgd migrate apply URL` creates the schema.
    Programs stubbed (planted: the URL as `postgresql://`; the setpriv prefix dropped; the
    cluster under the state folder as root)."""
    runs, spawns, chowned = [], [], []

    def fake_run(cmd, **kwargs):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    def fake_spawn(state, name, cmd, program=None):
        spawns.append((name, cmd, program))
        return _Running()

    monkeypatch.setattr(stack.subprocess, "run", fake_run)
    monkeypatch.setattr(stack.processes, "spawn", fake_spawn)
    monkeypatch.setattr(stack.processes, "wait_for", lambda check, t, alive: check() and alive())
    monkeypatch.setattr(stack.shutil, "chown", lambda path, user, group: chowned.append(path))
    setpriv = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
    bgd = Path("/venv/bin/bgd")
    for uid in (0, 1000):
        runs.clear()
        spawns.clear()
        state = tmp_path / f"state-{uid}"
        (state / "logs").mkdir(parents=True)
        monkeypatch.setattr(stack.os, "geteuid", lambda uid=uid: uid)
        url, pg_dir = stack._start_postgres(state, 9101, Path("/pg/bin"), bgd)
        try:
            assert re.fullmatch(
                r"postgresql\+psycopg://bgd:[0-9a-f]{32}@127\.0\.0\.1:9101/postgres", url
            )
            assert (state / "postgres.dir").read_text() == f"{pg_dir}\n"
            prefix = setpriv if uid == 0 else []
            if uid == 0:
                assert pg_dir.parent == Path(tempfile.gettempdir())
                assert pg_dir.name.startswith("llama-goldens-pg-")
                assert chowned == [pg_dir, pg_dir / "pwfile"]
            else:
                assert pg_dir == state / "postgres"
            initdb, ready, migrate = runs
            assert initdb[: len(prefix) + 1] == [*prefix, "/pg/bin/initdb"]
            assert ready[:2] == ["/pg/bin/pg_isready", "-q"]
            assert migrate == [str(bgd), "migrate", "apply", url]
            ((name, cmd, program),) = spawns
            assert (name, program) == ("postgres", "postgres")
            assert cmd[: len(prefix) + 1] == [*prefix, "/pg/bin/postgres"]
            assert "listen_addresses=127.0.0.1" in cmd
            assert not (pg_dir / "pwfile").exists()
        finally:
            if uid == 0:
                shutil.rmtree(pg_dir)


def test_buildbox_installs_from_unstable_and_postgresql_from_stable(tmp_path, monkeypatch):
    """docs/environment.md:61-63,68: buildbox is installed like Bazel, from the unstable suite
    (`-t unstable --no-install-recommends`) through the same private source file bazelw
    writes, reusing the machine's mirror, after an `apt-get -f install` where the first try
    fails; postgresql from stable, with no -t (planted: `-t unstable` dropped from the install;
    --no-install-recommends dropped)."""
    assert (deps.UNSTABLE_SOURCE.name, deps.UNSTABLE_PIN.name) == (
        "bazelw-unstable.sources",
        "bazelw-unstable",
    )
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.test/debian\nSuites: bookworm\n"
    )
    monkeypatch.setattr(deps, "APT_ROOT", apt)
    monkeypatch.setattr(deps, "UNSTABLE_SOURCE", apt / "sources.list.d" / "bazelw-unstable.sources")
    monkeypatch.setattr(deps, "UNSTABLE_PIN", apt / "preferences.d" / "bazelw-unstable")
    monkeypatch.setattr(deps, "_can_install", lambda: None)
    calls = []

    def run_logged(cmd, log):
        calls.append(cmd)
        if cmd[-1] == "buildbox" and len(calls) == 2:  # the first try stops at a conflict
            raise deps.MissingDependency("conflict")

    monkeypatch.setattr(deps, "_run_logged", run_logged)
    log = tmp_path / "install.log"
    deps._apt_install(["buildbox"], unstable=True, log=log)
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *deps.DPKG_OPTS]
    assert calls == [
        ["apt-get", "update", "-qq"],
        [*install, "-t", "unstable", "buildbox"],
        ["apt-get", "-f", "install", "-y", "-qq", *deps.DPKG_OPTS, "-t", "unstable"],
        [*install, "-t", "unstable", "buildbox"],
    ]
    source = deps.UNSTABLE_SOURCE.read_text()
    assert "URIs: http://mirror.test/debian\nSuites: unstable\n" in source
    assert "Pin: release a=unstable\nPin-Priority: 100\n" in deps.UNSTABLE_PIN.read_text()
    calls.clear()
    deps._apt_install(["postgresql"], unstable=False, log=log)
    assert calls == [["apt-get", "update", "-qq"], [*install, "postgresql"]]


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="needs an interpreter older than 3.13")
def test_buildgrid_gets_a_python_of_at_least_3_13(tmp_path, monkeypatch):
    """docs/environment.md:52-54: BuildGrid 0.9.1 needs Python >= 3.13: a python3.13 on PATH
    (Debian unstable's) is found, and an interpreter older than 3.13 is refused whatever its
    name (planted: the candidates from python3.20 down to 3.14 only, Debian's python3.13
    missed; the probe's bound lowered to 3.11)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    (bin_dir / "python3.13").symlink_to(sys.executable)  # this test's Python, older than 3.13
    assert deps._python_313() is None
    (bin_dir / "python3.13").unlink()
    (bin_dir / "python3.13").write_text("#!/bin/sh\nexit 0\n")  # passes the version probe
    (bin_dir / "python3.13").chmod(0o755)
    assert deps._python_313() == str(bin_dir / "python3.13")
