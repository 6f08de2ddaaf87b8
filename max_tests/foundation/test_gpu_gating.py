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


def _run(tmp_path: Path, tests: str = TESTS, **env: str) -> subprocess.CompletedProcess:
    """pytest over `tests`, with max_tests/conftest.py's hooks as the folder's conftest."""
    (tmp_path / "conftest.py").write_text("from max_tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_gated.py").write_text(tests)
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


# --- The gating's decisions in-process (a faked torch.cuda stands
# in for a GPU machine), and the device fixture's TF32 switch in one child run.


def _gating():
    from max_tests import conftest as gating

    return gating


def test_only_exact_device_names_are_accepted(monkeypatch):
    """_device_under_test takes cpu, cuda or cuda:N whole; a name that only begins like one
    ("cpu0", "cuda:1x", "cuda:") is a usage error, not a device. Plant caught: `fullmatch`
    weakened to `match` (the existing "gpu0" case matches no prefix, so it misses it)."""
    gating = _gating()
    for name in ("cpu", "cuda", "cuda:0", "cuda:12"):
        monkeypatch.setenv("GPU_TEST_DEVICE", name)
        assert gating._device_under_test() == name
    for name in ("cpu0", "cuda:1x", "cuda:", "cudax"):
        monkeypatch.setenv("GPU_TEST_DEVICE", name)
        with pytest.raises(pytest.UsageError) as raised:
            gating._device_under_test()
        assert str(raised.value) == f"$GPU_TEST_DEVICE is {name!r}; expected cpu, cuda or cuda:N"


def test_a_cuda_index_past_the_last_device_is_a_problem(monkeypatch):
    """_cuda_problem on a (faked) machine with 1, then 2 CUDA devices: cuda and cuda:0 are
    fine on one, cuda:1 only on two; an index past the last is "no CUDA device N" (so the
    test skips, or fails under --config=gpu, instead of crashing on a device that is not
    there). Plants caught: `>=` as `>`, bare `cuda` defaulting to index 1 instead of 0."""
    import torch

    gating = _gating()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [gating._cuda_problem(n) for n in ("cuda", "cuda:0")] == [None, None]
    assert gating._cuda_problem("cuda:1") == "no CUDA device 1 ($GPU_TEST_DEVICE=cuda:1; 1 found)"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gating._cuda_problem("cuda:1") is None
    assert gating._cuda_problem("cuda:2") == "no CUDA device 2 ($GPU_TEST_DEVICE=cuda:2; 2 found)"


class _GpuItem:
    """A collected test marked `gpu`, as pytest_runtest_setup sees it."""

    def get_closest_marker(self, name):
        return object() if name == "gpu" else None


def test_only_gpu_tests_required_1_turns_the_skip_into_a_failure(monkeypatch):
    """pytest_runtest_setup without CUDA: GPU_TESTS_REQUIRED=1 (what --config=gpu sets)
    fails the test; any other value ("0", empty) skips it with the reason, like unset.
    Caught as BaseException so that a skip cannot pass for the failure. Plant caught: a
    truthiness test of GPU_TESTS_REQUIRED (then "0" fails)."""
    import torch

    gating = _gating()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GPU_TEST_DEVICE", raising=False)
    problem = f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    outcomes = {}
    for value in ("1", "0", ""):
        monkeypatch.setenv("GPU_TESTS_REQUIRED", value)
        try:
            gating.pytest_runtest_setup(_GpuItem())
        except BaseException as ended:  # Failed and Skipped are BaseExceptions
            outcomes[value] = (type(ended), str(ended))
    assert outcomes == {
        "1": (
            pytest.fail.Exception,
            f"{problem}; this test needs a GPU (--config=gpu sets $GPU_TESTS_REQUIRED=1)",
        ),
        "0": (pytest.skip.Exception, problem),
        "": (pytest.skip.Exception, problem),
    }


TF32_TESTS = """
import pytest
import torch

def test_1_tf32_on_before():
    torch.backends.cuda.matmul.allow_tf32 = True

@pytest.mark.gpu
def test_2_off_in_a_gpu_test(device):
    assert torch.backends.cuda.matmul.allow_tf32 is False

def test_3_restored_after():
    assert torch.backends.cuda.matmul.allow_tf32 is True
"""


def test_the_device_fixture_turns_tf32_off_for_the_test_and_back_after(tmp_path):
    """The `device` fixture: TF32 off during the test (the float32 tolerances assume IEEE
    float32) and the flag as it was after it. Plants caught: the switch-off dropped, the
    restore dropped (the flag leaks into the tests after)."""
    done = _run(tmp_path, TF32_TESTS, GPU_TEST_DEVICE="cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
