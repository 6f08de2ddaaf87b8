"""llama_server's version pin: what `llama-server --version` says, and a clear message when it
is not the pinned llama.cpp; the pin equal to the one tools/llama_cpp/install.sh installs.
Starting and stopping, against a fake llama-server (a Python script): the golden numerics'
arguments, its own process group, stopped on exit and on a failed start, no process left."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from goldens.engines import llama_server
from goldens.engines.base import EngineError
from testing.processes import exited

INSTALL = Path(os.environ.get("LLAMA_CPP_INSTALL", "tools/llama_cpp/install.sh"))


def _fake(tmp_path: Path, printed: str) -> str:
    """A llama-server that prints `printed` for --version (on stderr, as llama.cpp does)."""
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\necho '{printed}' >&2\n")
    path.chmod(0o755)
    return str(path)


def test_the_pinned_version_passes_and_another_is_named_with_the_fix(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    release, build = re.fullmatch(r"(\S+) \(build (\d+)\)", llama_server.PINNED_VERSION).groups()
    pinned = _fake(tmp_path / "a", f"version: {release} (build {build}, commit Debian)")
    assert llama_server.version(pinned) == llama_server.PINNED_VERSION
    assert llama_server.pin_mismatch(pinned) is None
    (tmp_path / "b").mkdir()
    other = _fake(tmp_path / "b", "version: 0.8.1 (build 12001, commit Debian)")
    message = llama_server.pin_mismatch(other)
    assert "is llama.cpp 0.8.1 (build 12001)" in message
    assert f"measured with {llama_server.PINNED_VERSION}" in message
    assert "tools/llama_cpp/install.sh" in message


def test_a_binary_without_a_version_line_is_an_error_naming_it(tmp_path) -> None:
    path = _fake(tmp_path, "usage: llama-server [options]")
    with pytest.raises(EngineError, match="printed no 'version: X \\(build N\\)'"):
        llama_server.version(path)


def test_the_pin_is_the_release_install_sh_installs() -> None:
    text = INSTALL.read_text()
    (debian,) = re.findall(r'^LLAMA_CPP_DEBIAN="([^"]+)"', text, re.MULTILINE)
    upstream = re.fullmatch(r"(?:\d+:)?([\d.]+)\+dfsg-\d+", debian).group(1)
    assert llama_server.PINNED_VERSION.startswith(f"{upstream} (build ")
    for package in ("llama.cpp-tools", "llama.cpp-tools-extra", "libllama0", "libggml0"):
        assert f'"{package}=$' in text, package


def test_the_same_release_with_another_build_is_a_mismatch(tmp_path) -> None:
    """The pin is the release and its build number (PINNED_VERSION's comment: "its release and
    build number"): another build of the pinned release is named as a mismatch. Planted,
    caught here: the pin compared by release only."""
    release, build = re.fullmatch(r"(\S+) \(build (\d+)\)", llama_server.PINNED_VERSION).groups()
    other = _fake(tmp_path, f"version: {release} (build {int(build) + 1}, commit Debian)")
    message = llama_server.pin_mismatch(other)
    assert message is not None
    assert f"is llama.cpp {release} (build {int(build) + 1})" in message


FAKE_SERVER = """\
import http.server, json, os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_LLAMA_RECORD"], "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "argv": args}) + "\\n")
print("fake llama-server starting", flush=True)
mode = os.environ["FAKE_LLAMA_MODE"]
if mode == "crash":
    print("fake llama-server: failed to load model", flush=True)
    sys.exit(1)
if mode == "hang":
    time.sleep(60)
    sys.exit(0)
if mode == "deaf":  # ignores SIGTERM, and so does the child it leaves in its group
    import signal, subprocess
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["FAKE_LLAMA_RECORD"], "a") as f:
        f.write(json.dumps({"pid": child.pid, "argv": ["child"]}) + "\\n")

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """A fake llama-server (a Python script: `FAKE_LLAMA_MODE` ready, hang or crash) that
    records each launch's pid and arguments; every process it started is killed afterwards,
    whatever the code under test did."""
    script = tmp_path / "fake_llama_server.py"
    script.write_text(FAKE_SERVER)
    path = tmp_path / "llama-server"  # exec: the pid Popen sees is the Python process's
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    path.chmod(0o755)
    record = tmp_path / "launches.jsonl"
    monkeypatch.setenv(llama_server.BINARY_ENV, str(path))
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def launches() -> list[dict]:
        if not record.exists():
            return []
        return [json.loads(line) for line in record.read_text().splitlines()]

    yield gguf, launches
    for launch in launches():
        with contextlib.suppress(ProcessLookupError):
            os.kill(launch["pid"], signal.SIGKILL)


def test_a_server_runs_with_the_golden_numerics_and_is_stopped_on_exit(
    fake_server, monkeypatch
) -> None:
    """The module docstring: the server runs on 127.0.0.1 at `url`'s port with one thread, one
    slot, no flash attention and a float32 KV cache, in a process group of its own, and is
    stopped on leaving the block, its log removed. Planted, each caught here: flash attention
    "auto", the process group dropped (killpg fails), the log file left behind."""
    gguf, launches = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "ready")
    with llama_server.LlamaServer(gguf, startup_s=10) as server:
        pid, log = server.pid, Path(server._log.name)
        assert server.url == f"http://127.0.0.1:{server.port}/v1"
        assert os.getpgid(pid) == pid  # a process group of its own
        (launch,) = launches()
        argv = launch["argv"]
        pairs = dict(itertools.pairwise(argv))
        assert pairs["--model"] == str(gguf)
        assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", str(server.port))
        assert pairs["--threads"] == pairs["--threads-batch"] == pairs["--parallel"] == "1"
        assert pairs["--flash-attn"] == "off"
        assert pairs["--cache-type-k"] == pairs["--cache-type-v"] == "f32"
    assert server.pid is None and exited(pid)
    assert not log.exists()
    assert "fake llama-server starting" in server.log_tail()


def test_a_server_never_ready_is_stopped_and_started_once(fake_server, monkeypatch) -> None:
    """A server that runs but never answers /health is an EngineError naming the wait and its
    log's tail, started once (not a port clash: no second try) and stopped before the error
    (the docstring: stopped "also when the block raises"). Planted, each caught here: stop()
    left out on failure, the loop retrying a running server (two processes leaked)."""
    gguf, launches = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
    server = llama_server.LlamaServer(gguf, startup_s=0.5)
    with pytest.raises(EngineError, match=r"did not become ready within 0\.5 s") as error:
        server.start()
    assert "fake llama-server starting" in str(error.value)
    assert len(launches()) == 1
    assert server.pid is None
    assert all(exited(launch["pid"]) for launch in launches())


def test_a_server_that_ignores_sigterm_is_killed_with_its_group(fake_server, monkeypatch) -> None:
    """The module docstring: SIGTERM, then SIGKILL to the group after STOP_GRACE_S. A server
    (and a child in its group) that ignore SIGTERM are killed once the grace runs out, and
    stop() returns. Planted, each caught here: the escalation dropped (the server left
    running), SIGKILL to the server alone (its child left running)."""
    gguf, launches = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "deaf")
    monkeypatch.setattr(llama_server, "STOP_GRACE_S", 0.3)
    with llama_server.LlamaServer(gguf, startup_s=10) as server:
        process = server.process
    assert process.returncode == -signal.SIGKILL
    pids = [launch["pid"] for launch in launches()]
    assert len(pids) == 2  # the server and its child
    deadline = time.monotonic() + 5
    while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)  # the child is reaped by init once its parent is gone
    assert all(exited(pid) for pid in pids)


def test_a_server_that_exits_fails_at_once_with_its_log(fake_server, monkeypatch) -> None:
    """A server that exits at start (a bad file) fails the start as soon as it exits, not
    after `startup_s`, with its log's last lines in the error; an exit is taken for a port
    clash and tried 3 times. Planted, caught here: the wait not looking whether the process
    is still running (then each try waits the whole startup_s)."""
    gguf, launches = fake_server
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    start = time.monotonic()
    with pytest.raises(EngineError, match="failed to load model"):
        llama_server.LlamaServer(gguf, startup_s=4).start()
    assert time.monotonic() - start < 3
    assert len(launches()) == 3
