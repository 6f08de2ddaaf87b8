"""GPU gating for every test under max_tests.

Tests marked `gpu` need a CUDA device. Where there is none they are skipped with the reason,
so `python -m pytest max_tests` never fails for lack of a GPU, except under Bazel's
`--config=gpu`, which sets GPU_TESTS_REQUIRED=1: asking for GPU tests on a machine without a
GPU is then a clear failure, not a silent skip.
"""

from __future__ import annotations

import os

import pytest

GPU_REQUIRED_ENV = "GPU_TESTS_REQUIRED"


def _cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    problem = _cuda_problem()
    if problem is None:
        return
    if os.environ.get(GPU_REQUIRED_ENV) == "1":
        pytest.fail(f"{problem}; this test needs a GPU (--config=gpu sets ${GPU_REQUIRED_ENV}=1)")
    pytest.skip(problem)
