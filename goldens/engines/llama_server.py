"""Start llama.cpp's `llama-server` on a free loopback port for one checkpoint, and stop it.

    with LlamaServer(gguf) as server:
        engine = LlamaCppEngine(server.url)

The server runs with the numerics the goldens compare best with (`GOLDEN_ARGS`): one thread,
one slot, no flash attention and float32 KV cache (llama.cpp's defaults, flash attention and
an f16 cache, move log-probabilities by 6e-3 to 3e-2 on the float32 tiny file, against 5e-5
with these). It is started in a process group of its own and stopped on exit from the block
(SIGTERM, then SIGKILL to the group after `STOP_GRACE_S`), also when the block raises; its
output goes to a log file whose tail is in any error. Debian's package `llama.cpp-tools`
provides the binary (tools/llama_cpp/install.sh, which installs `PINNED_VERSION`);
`LLAMA_SERVER` names another one. `version()` is what the binary says it is; `pin_mismatch()`
says when that is not the version the llama.cpp lane's figures were measured with.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from goldens.engines.base import EngineError

BINARY_ENV = "LLAMA_SERVER"
GOLDEN_ARGS = (
    "--threads", "1", "--threads-batch", "1", "--parallel", "1", "--ctx-size", "16384",
    "--flash-attn", "off", "--cache-type-k", "f32", "--cache-type-v", "f32",
    "--no-warmup", "--no-webui",
)  # fmt: skip


def binary() -> str:
    """The llama-server to run: $LLAMA_SERVER, else the one on the PATH."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EngineError(f"${BINARY_ENV}={explicit} is not an executable file")
        return explicit
    found = shutil.which("llama-server")
    if found is None:
        raise EngineError(
            "llama-server is not installed: run tools/llama_cpp/install.sh (Debian's "
            f"llama.cpp-tools), or set ${BINARY_ENV} to a llama-server binary"
        )
    return found


# The llama.cpp every llama.cpp figure and tolerance entry of this project was measured with:
# what `llama-server --version` prints (its release and build number). tools/llama_cpp/
# install.sh installs Debian's package of it (tools/llama_cpp/test_install.py keeps the two
# pins together).
PINNED_VERSION = "0.7.0 (build 11669)"
_VERSION = re.compile(r"version: (\S+) \(build (\d+)")


@functools.lru_cache(maxsize=8)
def version(path: str | None = None) -> str:
    """`llama-server --version` as "RELEASE (build N)" (of `path`, else `binary()`)."""
    path = path or binary()
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EngineError(f"{path} --version failed: {error}") from None
    match = _VERSION.search(done.stdout + done.stderr)
    if match is None:
        tail = (done.stdout + done.stderr).strip()[-300:]
        raise EngineError(f"{path} --version printed no 'version: X (build N)': {tail!r}")
    return f"{match.group(1)} (build {match.group(2)})"


def pin_mismatch(path: str | None = None) -> str | None:
    """None when the llama-server to run is PINNED_VERSION, else what to do about it."""
    path = path or binary()
    found = version(path)
    if found == PINNED_VERSION:
        return None
    return (
        f"{path} is llama.cpp {found}; the llama.cpp lane's entries were measured with "
        f"{PINNED_VERSION} (goldens/engines/llama_server.py PINNED_VERSION): run "
        "tools/llama_cpp/install.sh, which installs it, or measure the entries again with "
        "this version and move the pin"
    )


STOP_GRACE_S = 5.0  # from SIGTERM to SIGKILL


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process serving `gguf` on 127.0.0.1 (`url`: its OpenAI base URL)."""

    def __init__(
        self, gguf: str | os.PathLike, extra_args: tuple[str, ...] = (), startup_s: float = 60.0
    ) -> None:
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise EngineError(f"{self.gguf}: no such checkpoint for llama-server")
        self.extra_args = tuple(extra_args)
        self.startup_s = startup_s
        self.process: subprocess.Popen | None = None
        self.port = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        command = [binary(), "--model", str(self.gguf), *GOLDEN_ARGS, *self.extra_args]
        # The log lives as long as the server; stop() closes and removes it.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="llama-server-", suffix=".log", delete=False
        )
        # A port taken between free_port and the server's bind fails the start: try again.
        for _ in range(3):
            self.port = free_port()
            self.process = subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            if self._wait_ready():
                return
            if self.process.poll() is None:
                break  # running but never ready: not a port clash
        log = self.log_tail()
        self.stop()
        raise EngineError(
            f"llama-server did not become ready within {self.startup_s:g} s on "
            f"{self.gguf.name}; its log ends:\n{log}"
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_s
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(health, timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._log is not None:
            self._log.close()
            self._last_log = self.log_tail()
            os.unlink(self._log.name)
            self._log = None

    def log_tail(self, lines: int = 20) -> str:
        if self._log is None:
            return getattr(self, "_last_log", "")
        text = Path(self._log.name).read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid
