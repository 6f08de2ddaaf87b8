"""The shared pytest runner: empty targets fail, unless a selection ran elsewhere in a suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "bazel" / "pytest_runner.py"


@pytest.fixture
def project(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tmp_path / "test_sample.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_empty.py").write_text("X = 1\n")
    return tmp_path


def _run(project, *args, env=None):
    return subprocess.run(
        [sys.executable, str(RUNNER), *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
        # This interpreter's import path, so pytest comes from wherever it came from here.
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
    )


def test_a_target_that_collects_nothing_fails(project):
    assert _run(project, "test_empty.py").returncode == 5


def test_a_selection_that_matches_nothing_here_passes_and_says_so(project):
    result = _run(project, "test_sample.py", "-k", "test_llama")
    assert result.returncode == 0
    assert "matched no test in this target" in result.stdout


def test_a_failing_selected_test_still_fails(project):
    (project / "test_bad.py").write_text("def test_llama():\n    assert False\n")
    assert _run(project, "test_bad.py", "-k", "test_llama").returncode == 1


def test_bazel_test_filter_becomes_k(project):
    result = _run(project, "test_sample.py", env={"TESTBRIDGE_TEST_ONLY": "test_one"})
    assert result.returncode == 0
    assert "1 passed" in result.stdout
