"""GPU gating for every test under max_tests, and the device those tests run on.

Tests marked `gpu` take the `device` fixture: the device under test, chosen by GPU_TEST_DEVICE
(`cuda` when unset, `cuda:N`, or `cpu`). Their assertions compare the device with a float64 CPU
reference or with goldens, so the same code holds on the CPU: with GPU_TEST_DEVICE=cpu the `gpu`
tests run there, and CI (which has no GPU) exercises the GPU test code on every run instead of
letting it rot until someone borrows a GPU. Bazel's `*_on_cpu` twins of the GPU targets set it.

On CUDA, where there is no CUDA device the `gpu` tests are skipped with the reason, so
`python -m pytest max_tests` never fails for lack of a GPU, except under Bazel's `--config=gpu`,
which sets GPU_TESTS_REQUIRED=1: asking for GPU tests on a machine without a GPU is then a clear
failure, not a silent skip.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

GPU_REQUIRED_ENV = "GPU_TESTS_REQUIRED"
DEVICE_ENV = "GPU_TEST_DEVICE"
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def _device_under_test() -> str:
    """GPU_TEST_DEVICE, checked: a typo must not quietly test the wrong device."""
    name = os.environ.get(DEVICE_ENV, "cuda")
    if not _DEVICE_PATTERN.fullmatch(name):
        raise pytest.UsageError(f"${DEVICE_ENV} is {name!r}; expected cpu, cuda or cuda:N")
    return name


def _cuda_problem(name: str) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    index = torch.device(name).index or 0
    if index >= torch.cuda.device_count():
        return f"no CUDA device {index} (${DEVICE_ENV}={name}; {torch.cuda.device_count()} found)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    _device_under_test()


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> str | None:
    """Says in the log where the `gpu` tests ran, so a CPU run cannot pass for a GPU one."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return None
    name = _device_under_test()
    source = f"${DEVICE_ENV}={os.environ[DEVICE_ENV]}" if DEVICE_ENV in os.environ else "default"
    return f"device under test of the gpu tests: {name} ({source})"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    name = _device_under_test()
    if name == "cpu":
        return
    problem = _cuda_problem(name)
    if problem is None:
        return
    if os.environ.get(GPU_REQUIRED_ENV) == "1":
        pytest.fail(f"{problem}; this test needs a GPU (--config=gpu sets ${GPU_REQUIRED_ENV}=1)")
    pytest.skip(problem)


@pytest.fixture
def device() -> Iterator[torch.device]:
    """The device under test, with TF32 off for the test.

    TF32 rounds the inputs of CUDA float32 matmuls to 10 mantissa bits (Ampere and later);
    the float32 tolerances and the goldens' `cuda` entries assume IEEE float32, as on the CPU,
    which ignores the flag.
    """
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield torch.device(_device_under_test())
    torch.backends.cuda.matmul.allow_tf32 = before
