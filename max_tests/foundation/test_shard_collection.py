"""Shards that collected different test orders fail CI's summary, with real hash seeds.

bazel/pytest_runner.py keeps each shard's share by position in the shard's own collection.
A test parametrized over a set of strings is collected in the order of their hashes, and
Python draws a hash seed per process unless PYTHONHASHSEED is set: Bazel runs each shard in a
process of its own, so with seeds 1 and 2 below shard 1 ran charlie, bravo and delta, shard 2
foxtrot, alpha and charlie; echo ran nowhere, charlie twice, and both shards passed. The runner
records each shard's count and sha256 of the ordered node ids; bazel/test_summary.py fails a
target whose shards disagree.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BAZEL = Path(__file__).resolve().parents[2] / "bazel"
RUNNER = BAZEL / "pytest_runner.py"
spec = importlib.util.spec_from_file_location("test_summary", BAZEL / "test_summary.py")
test_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_summary)

SET_PARAMETRIZED = """import pytest

@pytest.mark.parametrize("name", {"alpha", "bravo", "charlie", "delta", "echo", "foxtrot"})
def test_case(name):
    assert name
"""


def _shard(runfiles: Path, index: int, seed: int, xml: Path) -> subprocess.Popen:
    """The runner as Bazel starts shard `index` of 2 (round-robin), under hash seed `seed`."""
    xml.parent.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, str(RUNNER), "test_set.py"],
        cwd=runfiles,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": os.pathsep.join(sys.path),  # pytest from wherever it came from here
            "PYTHONHASHSEED": str(seed),
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # no installed plugin is needed: 0.4 s less
            "TEST_TOTAL_SHARDS": "2",
            "TEST_SHARD_INDEX": str(index),
            "XML_OUTPUT_FILE": str(xml),
        },
    )


def _bep(path: Path, label: str, xmls: list[Path]) -> str:
    events = [
        {
            "id": {"testResult": {"label": label, "run": 1, "shard": i, "attempt": 1}},
            "testResult": {
                "status": "PASSED",
                "testActionOutput": [{"name": "test.xml", "uri": xml.as_uri()}],
            },
        }
        for i, xml in enumerate(xmls, 1)
    ]
    events.append(
        {"id": {"testSummary": {"label": label}}, "testSummary": {"overallStatus": "PASSED"}}
    )
    path.write_text("".join(json.dumps(event) + "\n" for event in events))
    return str(path)


def _ran(xml: Path) -> list[str]:
    return [case.get("name") for case in ET.parse(xml).getroot().iter("testcase")]


def test_shards_of_different_hash_seeds_fail_the_summary(tmp_path, capsys):
    runfiles = tmp_path / "runfiles"
    runfiles.mkdir()
    (runfiles / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (runfiles / "test_set.py").write_text(SET_PARAMETRIZED)
    first = tmp_path / "t" / "shard_1_of_2" / "test.xml"
    same, other = (tmp_path / f"{name}" / "shard_2_of_2" / "test.xml" for name in ("same", "other"))
    # the three shard processes at once: 1.4 s for the test (2-core Intel Xeon, busy)
    running = [
        _shard(runfiles, 0, 1, first),
        _shard(runfiles, 1, 1, same),
        _shard(runfiles, 1, 2, other),
    ]
    for process in running:
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0, out

    # One seed: the two shards ran each test once, and recorded the one collection they split.
    assert sorted(_ran(first) + _ran(same)) == [
        f"test_case[{n}]" for n in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")
    ]
    order = [n for pair in zip(_ran(first), _ran(same), strict=True) for n in pair]
    ids = "\n".join(f"test_set.py::{name}" for name in order).encode()
    recorded = f"6 tests, sha256 {hashlib.sha256(ids).hexdigest()}"
    for xml in (first, same):
        props = ET.parse(xml).getroot().find("testsuite/properties")
        assert [(p.get("name"), p.get("value")) for p in props] == [("shard_collection", recorded)]
    bep = _bep(tmp_path / "same.json", "//pkg:t", [first, same])
    assert test_summary.main([bep]) == 0
    assert capsys.readouterr().out.startswith("tests: 6 passed, 0 failed")

    # Another seed for shard 2: a test ran twice, another in no shard, both shards passed.
    ran = _ran(first) + _ran(other)
    assert len(ran) == 6 and len(set(ran)) < 6, ran
    bep = _bep(tmp_path / "other.json", "//pkg:t", [first, other])
    assert test_summary.main([bep]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tests: 6 passed, 1 failed")
    assert out[1].startswith("//pkg:t: its shards collected different ordered test lists (")
