"""The shared pytest runner: empty targets fail, and so does a selection matching nothing.

Each test runs bazel/pytest_runner.py the way Bazel does: the cwd is a runfiles folder holding
pyproject.toml and symlinks to the target's own test files in a throwaway source tree (a
MODULE.bazel, a package with a BUILD.bazel), the own files are arguments, and the package's
other test files are found through those symlinks.
"""

import hashlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "bazel" / "pytest_runner.py"
TYPO = "test_llama[tiny-float32-llama3_l]"
RIGHT = "test_llama[tiny-float32-llama3_1]"


@pytest.fixture
def project(tmp_path):
    """The package folder of a source tree: test_sample.py, test_empty.py, test_llama.py."""
    (tmp_path / "MODULE.bazel").write_text("")
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "BUILD.bazel").write_text("")
    (package / "test_sample.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    (package / "test_empty.py").write_text("X = 1\n")
    (package / "test_llama.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('variant', ['tiny-float32-llama3_1', 'tiny-q4_k-llama3_1'])\n"
        "def test_llama(variant):\n"
        "    assert variant\n"
    )
    return package


def _run(package, *args, env=None, copies=False):
    """The runner over `args` (own test files by name, then pytest arguments) from a runfiles
    folder linking (or, with `copies`, copying: a remote worker) the own files."""
    runfiles = package.parent.parent / f"runfiles_{package.parent.name}"
    runfiles.mkdir(exist_ok=True)
    (runfiles / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    for arg in args:
        if arg.endswith(".py"):
            target, source = runfiles / arg, package / arg
            target.unlink(missing_ok=True)
            if copies:
                target.write_text(source.read_text())
            else:
                target.symlink_to(source)
    return subprocess.run(
        [sys.executable, str(RUNNER), *args],
        cwd=runfiles,
        capture_output=True,
        text=True,
        timeout=60,
        # This interpreter's import path, so pytest comes from wherever it came from here.
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join(sys.path),
            "XML_OUTPUT_FILE": str(runfiles / "test.xml"),
            **(env or {}),
        },
    )


def _cases(package):
    """(name, skipped message or None) of each case of the last run's JUnit XML."""
    xml = package.parent.parent / f"runfiles_{package.parent.name}" / "test.xml"
    cases = ET.parse(xml).getroot().iter("testcase")
    return [(c.get("name"), getattr(c.find("skipped"), "attrib", {}).get("message")) for c in cases]


def test_a_target_that_collects_nothing_fails(project):
    result = _run(project, "test_empty.py")
    assert result.returncode == 5
    assert "collected no test and has no -k/-m selection" in result.stdout


def test_a_selection_matching_nothing_anywhere_fails_naming_the_expression(project):
    result = _run(project, "test_sample.py", "-k", TYPO)
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test in this target nor in the other test files" in (
        result.stdout
    )
    assert "pkg/test_llama.py" in result.stdout
    # The nearest real id, so the typo is easy to spot.
    assert f"test ids look like {RIGHT}" in result.stdout


def test_a_selection_matching_a_sibling_file_passes_and_names_it(project):
    result = _run(project, "test_sample.py", "-k", RIGHT)
    assert result.returncode == 0, result.stdout
    assert f"-k '{RIGHT}' selects 1 test in pkg/test_llama.py" in result.stdout
    assert "ran in sibling file(s)" in result.stdout
    # Not a target whose tests passed: one skipped case says so in its JUnit XML.
    [(name, message)] = _cases(project)
    assert name == "none of this target's tests selected"
    assert "selects 1 test in pkg/test_llama.py" in message


def test_a_selection_matching_this_target_runs_exactly_it(project):
    result = _run(project, "test_llama.py", "-k", RIGHT)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 deselected" in result.stdout
    assert "sibling" not in result.stdout


def test_a_selection_in_a_package_without_other_test_files_fails(project):
    for name in ("test_llama.py", "test_empty.py"):
        (project / name).unlink()
    result = _run(project, "test_sample.py", "-k", TYPO)
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test in this target" in result.stdout
    assert "its package has no other test files" in result.stdout


def test_a_marker_selection_matching_nothing_fails_too(project):
    result = _run(project, "test_sample.py", "-m", "gpu")
    assert result.returncode == 5
    assert "-m 'gpu' selects no test in this target nor in the other test" in result.stdout


def test_bazel_test_filter_matching_nothing_fails(project):
    result = _run(project, "test_sample.py", env={"TESTBRIDGE_TEST_ONLY": TYPO})
    assert result.returncode == 5
    assert f"-k '{TYPO}' selects no test" in result.stdout


def test_bazel_test_filter_matching_a_sibling_passes(project):
    result = _run(project, "test_sample.py", env={"TESTBRIDGE_TEST_ONLY": RIGHT})
    assert result.returncode == 0, result.stdout
    assert "selects 1 test in pkg/test_llama.py" in result.stdout


def test_bazel_test_filter_becomes_k(project):
    result = _run(project, "test_sample.py", env={"TESTBRIDGE_TEST_ONLY": "test_one"})
    assert result.returncode == 0
    assert "1 passed" in result.stdout


def test_a_failing_selected_test_still_fails(project):
    (project / "test_bad.py").write_text("def test_llama():\n    assert False\n")
    result = _run(project, "test_bad.py", "-k", "test_llama")
    assert result.returncode == 1


def test_a_sibling_that_fails_to_collect_fails_naming_the_error(project):
    (project / "test_broken.py").write_text("import no_such_module_here\n")
    result = _run(project, "test_sample.py", "-k", RIGHT)
    assert result.returncode == 2
    assert "could not be collected" in result.stdout
    assert "pkg/test_broken.py: ModuleNotFoundError: No module named 'no_such_module_here'" in (
        result.stdout
    )


def test_a_subpackage_is_not_a_sibling(project):
    sub = project / "sub"
    sub.mkdir()
    (sub / "BUILD.bazel").write_text("")
    (sub / "test_other.py").write_text("def test_elsewhere():\n    pass\n")
    result = _run(project, "test_sample.py", "-k", "test_elsewhere")
    assert result.returncode == 5, result.stdout


def test_an_edit_of_a_sibling_is_seen_without_it_being_in_the_runfiles(project):
    """Siblings are read from the source tree, so they need not be data of the target (an
    edit of one test file reruns only its own target)."""
    assert _run(project, "test_sample.py", "-k", "test_new").returncode == 5
    (project / "test_llama.py").write_text("def test_new():\n    pass\n")
    assert _run(project, "test_sample.py", "-k", "test_new").returncode == 0


def test_without_a_source_tree_the_selection_is_not_checked_and_says_so(project):
    result = _run(project, "test_sample.py", "-k", TYPO, copies=True)
    assert result.returncode == 0, result.stdout
    assert "no source tree here to check it" in result.stdout
    [(_, message)] = _cases(project)
    assert "none of this target's tests ran" in message


def _shard_env(project, index: int, total: int = 2) -> dict:
    status = project.parent / f"shard_status_{index}"
    return {
        "TEST_TOTAL_SHARDS": str(total),
        "TEST_SHARD_INDEX": str(index),
        "TEST_SHARD_STATUS_FILE": str(status),
    }


def test_shards_split_the_selected_tests_and_together_run_each_once(project):
    (project / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', range(5))\ndef test_n(n):\n    pass\n"
    )
    ran = []
    for index in (0, 1):
        result = _run(project, "test_many.py", "-v", env=_shard_env(project, index))
        assert result.returncode == 0, result.stdout
        assert (project.parent / f"shard_status_{index}").exists()  # tells Bazel it shards
        ran.append(sorted(name for name, skipped in _cases(project) if skipped is None))
    assert ran == [["test_n[0]", "test_n[2]", "test_n[4]"], ["test_n[1]", "test_n[3]"]]
    contiguous = []
    for index in (0, 1):
        env = _shard_env(project, index) | {"PYTEST_SHARDS": "contiguous"}
        assert _run(project, "test_many.py", env=env).returncode == 0
        contiguous.append(sorted(name for name, skipped in _cases(project) if skipped is None))
    assert contiguous == [["test_n[0]", "test_n[1]", "test_n[2]"], ["test_n[3]", "test_n[4]"]]
    # weighted: test_n[0] weighs 4 = the other four together, so it is a shard of its own
    weighted = []
    for index in (0, 1):
        env = _shard_env(project, index) | {
            "PYTEST_SHARDS": "contiguous",
            "PYTEST_SHARD_WEIGHTS": "n[0]=2 [0]=2",
        }
        assert _run(project, "test_many.py", env=env).returncode == 0
        weighted.append(sorted(name for name, skipped in _cases(project) if skipped is None))
    assert weighted == [["test_n[0]"], ["test_n[1]", "test_n[2]", "test_n[3]", "test_n[4]"]]
    env = _shard_env(project, 0) | {"PYTEST_SHARDS": "contiguous", "PYTEST_SHARD_WEIGHTS": "n"}
    result = _run(project, "test_many.py", env=env)
    assert result.returncode != 0
    assert "PYTEST_SHARD_WEIGHTS entry 'n': write WORD=NUMBER" in result.stdout + result.stderr


@pytest.mark.parametrize("weight", ["-1", "0", "nan", "inf"])
def test_a_weight_that_is_not_positive_and_finite_is_refused(project, weight):
    """Planted before the check: `[p]=-1` over four cases put test_n[q] in no shard, and
    every shard passed."""
    (project / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', 'pqrs')\ndef test_n(n):\n    pass\n"
    )
    env = _shard_env(project, 0) | {
        "PYTEST_SHARDS": "contiguous",
        "PYTEST_SHARD_WEIGHTS": f"[p]={weight}",
    }
    result = _run(project, "test_many.py", env=env)
    assert result.returncode != 0
    assert f"PYTEST_SHARD_WEIGHTS entry '[p]={weight}': a weight is a positive number" in (
        result.stdout + result.stderr
    )


def test_every_test_falls_in_exactly_one_shard_in_order() -> None:
    """The contiguous cut over drawn counts, shard counts 1-5 and positive weights (seeded):
    each test in one shard of 0..total-1, the shards in the tests' order (so each is a run)."""
    import random

    sys.path.insert(0, str(RUNNER.parent))
    try:
        import pytest_runner
    finally:
        sys.path.remove(str(RUNNER.parent))
    rng = random.Random(35)
    for _ in range(500):
        total, count = rng.randint(1, 5), rng.randint(1, 40)
        ids = [f"test_x[{i}]" for i in range(count)]
        weights = {f"[{i}]": rng.choice([1e-3, 0.5, 1.0, 7.0, 400.0]) for i in range(count)}
        shards = pytest_runner._Shard(total, 0, True, weights)._shards(ids)
        assert all(0 <= s < total for s in shards), (total, weights, shards)
        assert shards == sorted(shards), (total, weights, shards)


def test_a_shard_left_without_a_test_passes_saying_so(project):
    result = _run(project, "test_llama.py", "-k", RIGHT, env=_shard_env(project, 1))
    assert result.returncode == 0, result.stdout
    [(name, message)] = _cases(project)
    assert name == "none of this target's tests selected"
    assert "shard 2 of 2 holds none of the 1 selected tests" in message
    # a selection matching nothing still fails, sharded or not
    result = _run(project, "test_llama.py", "-k", TYPO, env=_shard_env(project, 0))
    assert result.returncode == 5


def _runner_module():
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import pytest_runner
    finally:
        sys.path.remove(str(RUNNER.parent))
    return pytest_runner


def test_the_weights_of_every_word_in_an_id_multiply() -> None:
    """Module docstring: with "smollm2=10 chunked=3" a test whose id holds both words weighs
    30, one with neither 1. The cut follows the product: [30, 1 x 30] splits after the first
    test. Catches adding the factors (`sum(...) or 1`: 13, and the cut moves)."""
    runner = _runner_module()
    shard = runner._Shard(2, 0, True, {"smollm2": 10.0, "chunked": 3.0})
    assert shard._weight("test_x[smollm2-chunked]") == 30
    assert shard._weight("test_x[smollm2-plain]") == 10
    assert shard._weight("test_x[tiny]") == 1
    ids = ["test_x[smollm2-chunked]"] + [f"test_x[tiny-{i}]" for i in range(30)]
    assert shard._shards(ids) == [0] + [1] * 30


def test_a_light_test_after_a_very_heavy_one_still_falls_in_the_last_shard() -> None:
    """Any positive finite weight is accepted, so the float sum can swallow a light last test
    (1e9 + 1e-9 == 1e9): its start is then the whole total, one past the last shard, and it
    would run in no shard. Catches dropping the clamp `min(self.total - 1, ...)`."""
    runner = _runner_module()
    shard = runner._Shard(2, 0, True, {"[heavy]": 1e9, "[light]": 1e-9})
    assert shard._shards(["test_x[heavy]", "test_x[light]"]) == [0, 1]


def _properties(package) -> list[tuple[str, str]]:
    """(name, value) of each testsuite property of the last run's JUnit XML."""
    xml = package.parent.parent / f"runfiles_{package.parent.name}" / "test.xml"
    return [(p.get("name"), p.get("value")) for p in ET.parse(xml).getroot().iter("property")]


def test_a_shard_left_without_a_test_records_the_collection_it_split(project):
    """Module docstring: each shard's JUnit XML records what it split, an empty shard's too,
    so CI's summary compares every shard of the target. Both shards of a one-test selection
    record the same count and sha256 of the node id. Catches the empty shard's skipped-case
    XML dropping `_record_collection` (no property: a differing order went unseen)."""
    node = f"test_llama.py::{RIGHT}".encode()
    recorded = [("shard_collection", f"1 tests, sha256 {hashlib.sha256(node).hexdigest()}")]
    for index in (0, 1):
        result = _run(project, "test_llama.py", "-k", RIGHT, env=_shard_env(project, index))
        assert result.returncode == 0, result.stdout
        assert _properties(project) == recorded, index


def test_a_selection_matching_nothing_leaves_no_skipped_case(project):
    """The skipped case is written only where the target passes (the selection ran in a
    sibling): a failing selection's XML holds no case, so CI's summary says that no test of
    the target reported a result rather than that it crashed after passing tests. Catches
    writing the skipped case whatever the exit code."""
    result = _run(project, "test_sample.py", "-k", TYPO)
    assert result.returncode == 5
    assert _cases(project) == []
