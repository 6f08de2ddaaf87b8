"""The shared pytest runner: empty targets fail, and so does a selection matching nothing.

Each test runs bazel/pytest_runner.py in a throwaway project the way Bazel does: the cwd is
the runfiles root (holding pyproject.toml), the target's own test files are arguments, and
the package's other test files are listed in PYTEST_SIBLING_TESTS, as the pytest_test macro
sets it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "bazel" / "pytest_runner.py"
TYPO = "test_llama[tiny-float32-llama3_l]"
RIGHT = "test_llama[tiny-float32-llama3_1]"


@pytest.fixture
def project(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tmp_path / "test_sample.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_empty.py").write_text("X = 1\n")
    (tmp_path / "test_llama.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('variant', ['tiny-float32-llama3_1', 'tiny-q4_k-llama3_1'])\n"
        "def test_llama(variant):\n"
        "    assert variant\n"
    )
    return tmp_path


def _run(project, *args, siblings=(), env=None):
    return subprocess.run(
        [sys.executable, str(RUNNER), *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
        # This interpreter's import path, so pytest comes from wherever it came from here.
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join(sys.path),
            "PYTEST_SIBLING_TESTS": " ".join(siblings),
            **(env or {}),
        },
    )


def test_a_target_that_collects_nothing_fails(project):
    result = _run(project, "test_empty.py", siblings=["test_llama.py"])
    assert result.returncode == 5
    assert "collected no test and has no -k/-m selection" in result.stdout


def test_a_selection_matching_nothing_anywhere_fails_naming_the_expression(project):
    result = _run(project, "test_sample.py", "-k", TYPO, siblings=["test_llama.py"])
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test in this target nor in the other test files" in (
        result.stdout
    )
    assert "(test_llama.py)" in result.stdout
    # The nearest real id, so the typo is easy to spot.
    assert f"test ids look like {RIGHT}" in result.stdout


def test_a_selection_matching_a_sibling_file_passes_and_names_it(project):
    result = _run(project, "test_sample.py", "-k", RIGHT, siblings=["test_llama.py"])
    assert result.returncode == 0, result.stdout
    assert f"-k '{RIGHT}' selects 1 test in test_llama.py" in result.stdout
    assert "ran in sibling file(s)" in result.stdout


def test_a_selection_matching_this_target_runs_exactly_it(project):
    result = _run(project, "test_llama.py", "-k", RIGHT, siblings=["test_sample.py"])
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 deselected" in result.stdout
    assert "sibling" not in result.stdout


def test_a_selection_in_a_package_without_other_test_files_fails(project):
    result = _run(project, "test_sample.py", "-k", TYPO)
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test in this target" in result.stdout
    assert "its package has no other test files" in result.stdout


def test_a_marker_selection_matching_nothing_fails_too(project):
    result = _run(project, "test_sample.py", "-m", "gpu", siblings=["test_llama.py"])
    assert result.returncode == 5
    assert "-m 'gpu' selects no test in this target nor in the other test" in result.stdout


def test_bazel_test_filter_matching_nothing_fails(project):
    result = _run(
        project, "test_sample.py", siblings=["test_llama.py"], env={"TESTBRIDGE_TEST_ONLY": TYPO}
    )
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test" in result.stdout


def test_bazel_test_filter_matching_a_sibling_passes(project):
    result = _run(
        project, "test_sample.py", siblings=["test_llama.py"], env={"TESTBRIDGE_TEST_ONLY": RIGHT}
    )
    assert result.returncode == 0, result.stdout
    assert "selects 1 test in test_llama.py" in result.stdout


def test_bazel_test_filter_becomes_k(project):
    result = _run(project, "test_sample.py", env={"TESTBRIDGE_TEST_ONLY": "test_one"})
    assert result.returncode == 0
    assert "1 passed" in result.stdout


def test_a_failing_selected_test_still_fails(project):
    (project / "test_bad.py").write_text("def test_llama():\n    assert False\n")
    result = _run(project, "test_bad.py", "-k", "test_llama", siblings=["test_llama.py"])
    assert result.returncode == 1


def test_a_sibling_that_fails_to_collect_fails_naming_the_error(project):
    (project / "test_broken.py").write_text("import no_such_module_here\n")
    result = _run(
        project, "test_sample.py", "-k", RIGHT, siblings=["test_llama.py", "test_broken.py"]
    )
    assert result.returncode == 2
    assert "could not be collected" in result.stdout
    assert "test_broken.py: ModuleNotFoundError: No module named 'no_such_module_here'" in (
        result.stdout
    )


def test_a_sibling_missing_from_the_runfiles_fails_naming_it(project):
    result = _run(project, "test_sample.py", "-k", RIGHT, siblings=["test_gone.py"])
    assert result.returncode == 2
    assert "missing from the runfiles: test_gone.py" in result.stdout
