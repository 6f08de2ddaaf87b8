"""Fixtures of the benches' command-line tests: a `bazel run` user's folder, and a load that
only records what it was asked to load."""

from __future__ import annotations

import pytest
import torch

from pipelines.llama3 import Llama3Engine


class Loaded(Exception):
    """Raised instead of loading a checkpoint: the command line was accepted."""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A `bazel run` user's folder holding rel.gguf (empty) and trunc.gguf (a GGUF cut inside its
    metadata); torch's thread count is left as it is."""
    (tmp_path / "rel.gguf").write_bytes(b"")
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    return tmp_path


@pytest.fixture
def no_load(monkeypatch) -> type[Loaded]:
    """Llama3Engine.from_gguf raises Loaded(path): a test reads the path a command would load."""

    def loaded(path, **kwargs):
        raise Loaded(path)

    monkeypatch.setattr(Llama3Engine, "from_gguf", loaded)
    return Loaded
