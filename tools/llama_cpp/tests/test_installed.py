"""The installed llama.cpp's fingerprint (tools/llama_cpp/installed.bzl) names what the
llama.cpp lanes run: the tools the tests find on their own PATH, with the sha256 of each, of
every llama.cpp or ggml library each loads, and of every CPU backend ggml can load; and this
machine's CPU. Those lanes' verdicts are cached under it, so a file it missed could change
under a cached verdict. On a machine without llama.cpp every tool is "absent"."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from goldens.engines import llama_server
from goldens.engines.base import EngineError

FINGERPRINT = Path(os.environ["LLAMA_CPP_FINGERPRINT"])
TOOLS = ("llama-server", "llama-perplexity", "llama-quantize", "llama-bench", "llama-batched-bench")
BACKENDS = Path("/usr/lib/x86_64-linux-gnu/ggml/backends0")


def _fingerprint() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    tools, files, cpu = {}, {}, {}
    for line in FINGERPRINT.read_text().splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "tool":
            name, _, where = rest.partition(": ")
            tools[name] = where
        elif kind == "file":
            digest, _, path = rest.partition(" ")
            files[path] = digest
        elif kind == "cpu":
            key, _, value = rest.partition(": ")
            cpu[key] = value
        else:
            raise AssertionError(f"{FINGERPRINT}: unknown line {line!r}")
    return tools, files, cpu


def _found(tool: str) -> str | None:
    """The tool the lanes run: llama-server as the llama.cpp lane looks it up
    (`llama_server.binary`: $LLAMA_SERVER first), the others on the PATH."""
    if tool == "llama-server":
        try:
            found = llama_server.binary()
        except EngineError:
            found = None
    else:
        found = shutil.which(tool)
    return os.path.realpath(found) if found else None


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        path = rest.split(" (")[0].strip()
        if arrow and ("llama" in name or "ggml" in name) and path.startswith("/"):
            found.append(path)
    return found


def test_each_tool_is_the_one_the_tests_find_with_its_sha256() -> None:
    tools, files, _ = _fingerprint()
    assert sorted(tools) == sorted(TOOLS)
    for tool in TOOLS:
        found = _found(tool)
        if found is None:
            assert tools[tool] == "absent", f"{tool}: not on this test's PATH, fingerprinted"
            continue
        assert tools[tool] == found, (
            f"{tool}: the tests run {found}, the fingerprint names {tools[tool]}"
        )
        assert files.get(found) == _sha256(found), f"{found}: sha256"


def test_every_library_a_tool_loads_and_every_cpu_backend_has_its_sha256() -> None:
    _, files, _ = _fingerprint()
    expected = [lib for tool in TOOLS if (found := _found(tool)) for lib in _libraries(found)]
    expected += sorted(str(p) for p in BACKENDS.glob("*.so")) if BACKENDS.is_dir() else []
    for path in expected:
        assert files.get(path) == _sha256(path), f"{path}: not fingerprinted with its sha256"


def test_the_cpu_is_this_machines() -> None:
    _, _, cpu = _fingerprint()
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    assert cpu["model"] == info.get("model name", "unknown")
    assert cpu["flags"] == " ".join(sorted(info.get("flags", "unknown").split()))
