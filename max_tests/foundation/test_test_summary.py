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
  <properties><property name="ambiguous_steps" value="2"/>
   <property name="golden_checks" value="120"/></properties>
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
    assert counts == {"passed": 4, "failed": 2, "skipped": 2, "ambiguous": 4, "checks": 240}
    assert test_summary.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        "tests: 4 passed, 2 failed, 2 skipped, 4 ambiguous steps, 240 golden checks (steps and "
        "prompt positions compared by the judge lanes)\n"
    )


def test_no_test_run_at_all_is_an_error(tmp_path):
    assert test_summary.main([str(tmp_path)]) == 1
    assert test_summary.main([str(tmp_path / "missing")]) == 2


def _headroom(entry: str, share: float, test: str, where: str) -> str:
    return f'<property name="headroom" value="{entry}|{share}|{test}|{where}|logprob"/>'


def test_the_three_entries_closest_to_their_thresholds_are_named(tmp_path, capsys):
    bf16, f32 = "tiny-bfloat16-llama3_1", "tiny-float32-llama3_1"
    props = [
        _headroom("own/bfloat16/cpu", 0.95, bf16, "prose, step 7 (position 12)"),
        _headroom("own/bfloat16/cpu", 0.2, f"{bf16}-quantized", "code, step 1"),
        _headroom("own/float32/cpu", 0.35, f32, "long_8k, prompt position 4097"),
        _headroom("torch/q4_k/cpu", 0.5, "tiny-q4_k-llama3_1", "prose, step 0 (position 5)"),
        _headroom("torch/float32/cpu", 1e-5, f32, "prose, step 0 (position 5)"),
    ]
    xml = XML.replace(
        '<property name="ambiguous_steps" value="2"/>',
        '<property name="ambiguous_steps" value="2"/>' + "".join(props),
    )
    (tmp_path / "test.xml").write_text(xml)
    assert test_summary.closest(tmp_path) == [
        "own/bfloat16/cpu 95% (tiny-bfloat16-llama3_1, prose, step 7 (position 12), logprob)",
        "torch/q4_k/cpu 50% (tiny-q4_k-llama3_1, prose, step 0 (position 5), logprob)",
        "own/float32/cpu 35% (tiny-float32-llama3_1, long_8k, prompt position 4097, logprob)",
    ]
    assert test_summary.main([str(tmp_path)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("closest to tolerance: own/bfloat16/cpu 95% (tiny-bfloat16-llama3_1")


def test_a_sharded_target_counts_once(tmp_path):
    """Bazel writes each shard's XML and their merge: only the merge is counted."""
    target = tmp_path / "test_llama_serving"
    for shard in ("shard_1_of_2", "shard_2_of_2"):
        (target / shard).mkdir(parents=True)
        (target / shard / "test.xml").write_text(XML)
    assert test_summary.summarize(tmp_path)["passed"] == 4  # no merge: the shards count
    (target / "test.xml").write_text(XML)
    assert test_summary.summarize(tmp_path)["passed"] == 2


LANES = Path("max_tests/integration/architectures/llama3")


def test_every_lane_that_counts_golden_checks_counts_its_ambiguous_steps_too() -> None:
    """README: ambiguous steps are counted in .ci/run's closing line. A lane recording only
    `golden_checks` (the serving and speculation lanes did) let its near-tie flips read as
    "0 ambiguous steps"."""
    sources = sorted(LANES.glob("*.py"))
    counting = [p for p in sources if 'record_property("golden_checks"' in p.read_text()]
    assert len(counting) >= 4, [p.name for p in counting]
    silent = [p.name for p in counting if 'record_property("ambiguous_steps"' not in p.read_text()]
    assert silent == []


def test_the_probe_passes_only_where_its_test_passed(tmp_path, capsys):
    """CI's probe (.ci/run): LLAMA3_1_GGUF reached test_llama only if its probe test passed;
    a skip (EXPECTED_LLAMA3_1_GGUF did not arrive) exited 0 and was taken for a pass before."""
    shard = tmp_path / "test_llama" / "shard_1_of_2"
    shard.mkdir(parents=True)
    probe = '<testsuites><testsuite><testcase name="test_probe{}"{}</testsuite></testsuites>'
    (shard / "test.xml").write_text(probe.format("", "/>"))
    assert test_summary.main(["--passed", "test_probe", str(tmp_path)]) == 0
    (shard / "test.xml").write_text(probe.format("[x]", '><skipped message="no"/></testcase>'))
    assert test_summary.main(["--passed", "test_probe", str(tmp_path)]) == 1
    assert "test_probe did not pass under" in capsys.readouterr().out
    assert test_summary.main(["--passed", "test_other", str(tmp_path)]) == 1
