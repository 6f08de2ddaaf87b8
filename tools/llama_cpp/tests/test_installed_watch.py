"""Bazel refetches the installed llama.cpp's fingerprint when a file it names changes.

The llama.cpp lanes' verdicts are cached under `@llama_cpp_installed//:fingerprint`
(tools/llama_cpp/installed.bzl); they are sound only if Bazel writes a new fingerprint when a
tool changes, appears or goes away. This runs a real Bazel (Debian's, on PATH) in a scratch
workspace with its own output base and server, a fake `llama-server` first on its PATH and a
scratch folder of ggml backends, and reads the fingerprint after each change. Under `bazel
test` only as //tools/llama_cpp:installed_watch_test (unsandboxed, local: NESTED_BAZEL_OK),
about 5 s:
    ./bazelw test //tools/llama_cpp:installed_watch_test
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from testing import nested_bazel

RULE = Path(
    os.environ.get("LLAMA_CPP_INSTALLED_BZL", nested_bazel.REPO / "tools/llama_cpp/installed.bzl")
)

pytestmark = nested_bazel.marks("//tools/llama_cpp:installed_watch_test")

MODULE = """\
llama_cpp_installed = use_repo_rule("//:installed.bzl", "llama_cpp_installed")

llama_cpp_installed(name = "llama_cpp_installed", backends = "{backends}")
"""
BUILD = """\
genrule(
    name = "copy",
    srcs = ["@llama_cpp_installed//:fingerprint"],
    outs = ["fingerprint.txt"],
    cmd = "cp $< $@",
)
"""


def _server_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith("tool llama-server: ")]
    return line.removeprefix("tool llama-server: ")


def _digest_line(path: Path) -> str:
    return f"file {hashlib.sha256(path.read_bytes()).hexdigest()} {path}"


def test_a_tool_or_backend_changed_added_or_removed_writes_a_new_fingerprint(
    tmp_path: Path,
) -> None:
    fake_bin, output_base, backends = tmp_path / "bin", tmp_path / "ob", tmp_path / "backends0"
    for folder in (fake_bin, backends):
        folder.mkdir()
    module = MODULE.format(backends=backends)
    workspace = nested_bazel.workspace(tmp_path / "ws", "fingerprint_check", module, BUILD)
    shutil.copy(RULE, workspace / "installed.bzl")
    env = os.environ | {"PATH": f"{fake_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("LLAMA_SERVER", None)
    startup = ["bazel", f"--output_base={output_base}", "--max_idle_secs=60"]

    def fingerprint() -> str:
        built = subprocess.run(
            [*startup, "build", "//:copy"], cwd=workspace, env=env, capture_output=True,
            text=True, timeout=300, check=False,
        )  # fmt: skip
        assert built.returncode == 0, built.stderr[-3000:]
        return (workspace / "bazel-bin" / "fingerprint.txt").read_text()

    fake, backend = fake_bin / "llama-server", backends / "libggml-cpu-x64.so"
    try:
        fake.write_text("#!/bin/sh\necho 1\n")
        fake.chmod(0o755)
        backend.write_bytes(b"backend 1")
        first = fingerprint()
        assert _server_line(first) == str(fake)
        assert _digest_line(fake) in first and _digest_line(backend) in first

        fake.write_text("#!/bin/sh\necho 2\n")  # upgraded in place
        assert _digest_line(fake) in fingerprint()

        backend.write_bytes(b"backend 2")  # a backend upgraded in place
        assert _digest_line(backend) in fingerprint()

        added = backends / "libggml-cpu-zen4.so"  # a backend added
        added.write_bytes(b"zen4")
        assert _digest_line(added) in fingerprint()

        added.unlink()  # ... and removed
        assert str(added) not in fingerprint()

        installed = fake_bin / "llama-perplexity"  # a tool installed ahead of the PATH's
        installed.write_text("#!/bin/sh\n")
        installed.chmod(0o755)
        assert f"tool llama-perplexity: {installed}" in fingerprint()

        fake.unlink()  # the tool removed: the next one on the PATH, or none
        last = fingerprint()
        assert _server_line(last) != str(fake)
        assert str(fake) not in last
    finally:
        subprocess.run([*startup, "shutdown"], cwd=workspace, env=env, capture_output=True,
                       timeout=120, check=False)  # fmt: skip
