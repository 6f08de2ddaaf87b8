"""max_tests/conftest.py's GPU gating, run in child pytest processes on this CPU-only machine.

A `gpu` test without a CUDA device skips with the reason, fails under GPU_TESTS_REQUIRED=1
(what --config=gpu sets), runs on the CPU under GPU_TEST_DEVICE=cpu (the `_on_cpu` twins) and
says in the log which device it ran on; a misspelt device is a usage error. Each child imports
torch (the gating asks it for CUDA): about 3 s each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TESTS = """
import pytest

@pytest.mark.gpu
def test_on_the_device(device):
    assert device.type in ("cpu", "cuda")

def test_without_the_marker():
    pass
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """pytest over TESTS, with max_tests/conftest.py's hooks as the folder's conftest."""
    (tmp_path / "conftest.py").write_text("from max_tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_gated.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_TEST", "CUDA_"))}
    child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module", autouse=True)
def _cpu_only():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the gating's CPU-only paths do not apply")


def test_without_a_gpu_a_gpu_test_skips_with_its_reason(tmp_path):
    """Planted: the skip without its reason, or a skip under GPU_TESTS_REQUIRED unset read
    as a failure (`!= "0"`)."""
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 1 skipped" in done.stdout
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED [1] ")]
    assert len(skips) == 1, done.stdout
    assert skips[0].endswith(
        ": no CUDA device (torch 2.13.0+cpu, torch.cuda.is_available() is False)"
    )
    assert "device under test of the gpu tests: cuda (default)" in done.stdout


def test_under_gpu_tests_required_a_gpu_test_fails_naming_the_fix(tmp_path):
    """--config=gpu on a machine without a GPU: a failure, not a silent skip; a test without
    the marker still runs. Planted: the required check dropped (a skip)."""
    done = _run(tmp_path, GPU_TESTS_REQUIRED="1")
    assert done.returncode == 1, done.stdout
    assert "1 passed, 1 error" in done.stdout  # pytest.fail in the setup: an error
    assert (
        "Failed: no CUDA device (torch 2.13.0+cpu, torch.cuda.is_available() is False); this "
        "test needs a GPU (--config=gpu sets $GPU_TESTS_REQUIRED=1)"
    ) in done.stdout


def test_on_the_cpu_a_gpu_test_runs_and_the_log_says_so(tmp_path):
    """GPU_TEST_DEVICE=cpu (the `_on_cpu` twins): the gpu test runs on the CPU, also under
    GPU_TESTS_REQUIRED=1, and the log names the device and where it came from. Planted: the
    cpu device gated like cuda (a skip)."""
    done = _run(tmp_path, GPU_TEST_DEVICE="cpu", GPU_TESTS_REQUIRED="1")
    assert done.returncode == 0, done.stdout
    assert "2 passed" in done.stdout
    assert "device under test of the gpu tests: cpu ($GPU_TEST_DEVICE=cpu)" in done.stdout


def test_a_misspelt_device_is_a_usage_error(tmp_path):
    """A typo must not quietly test the wrong device: pytest stops with a usage error (exit
    4) naming the value and the accepted ones. Planted: the pattern check dropped."""
    done = _run(tmp_path, GPU_TEST_DEVICE="gpu0")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "$GPU_TEST_DEVICE is 'gpu0'; expected cpu, cuda or cuda:N" in done.stderr
