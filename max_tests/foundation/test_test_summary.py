"""CI's closing line: pytest results and ambiguous golden steps counted from JUnit XML."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bazel" / "test_summary.py"
spec = importlib.util.spec_from_file_location("test_summary", SCRIPT)
test_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_summary)

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
 <testcase name="test_llama[tiny-float32-llama3_1]">
  <properties><property name="ambiguous_steps" value="2"/></properties>
 </testcase>
 <testcase name="test_llama[real-unknown-llama3_1]"><skipped message="no file"/></testcase>
 <testcase name="test_llama[tiny-q4_k-llama3_1]">
  <properties><property name="ambiguous_steps" value="1"/></properties>
  <failure message="golden mismatch"/>
 </testcase>
 <testcase name="test_other"/>
</testsuite></testsuites>
"""


def test_counts_passed_failed_skipped_and_ambiguous_steps(tmp_path, capsys):
    target = tmp_path / "max_tests" / "test_llama"
    target.mkdir(parents=True)
    (target / "test.xml").write_text(XML)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "test.xml").write_text(XML.replace('value="2"', 'value="0"'))
    counts = test_summary.summarize(tmp_path)
    assert counts == {"passed": 4, "failed": 2, "skipped": 2, "ambiguous": 4}
    assert test_summary.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "tests: 4 passed, 2 failed, 2 skipped, 4 ambiguous steps\n"


def test_no_test_run_at_all_is_an_error(tmp_path):
    assert test_summary.main([str(tmp_path)]) == 1
    assert test_summary.main([str(tmp_path / "missing")]) == 2
