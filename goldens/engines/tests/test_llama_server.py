"""llama_server's version pin: what `llama-server --version` says, and a clear message when it
is not the pinned llama.cpp; the pin equal to the one tools/llama_cpp/install.sh installs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from goldens.engines import llama_server
from goldens.engines.base import EngineError

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
