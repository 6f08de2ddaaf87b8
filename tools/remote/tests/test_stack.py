"""stack.py without a stack: flags, state folders, the rendered config, pid bookkeeping.

Nothing here starts BuildGrid, buildbox or PostgreSQL (tools/remote/e2e.sh does, in CI);
a `sleep` stands in for a recorded process.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tools.remote import processes, stack


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
