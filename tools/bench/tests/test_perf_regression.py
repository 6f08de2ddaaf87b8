"""perf_regression's comparison logic on recorded data: real bench records measured on the
2-core development machine (testdata/), and copies of them with one ratio moved on purpose.

testdata/baseline_runs/ holds the five runs tools/bench/baseline.json was first made from;
testdata/normal_*.json are two further runs of the same session, held out of the baseline.
The tests make their own baseline from these runs, so refreshing the committed baseline leaves
them as they are. No test runs the benchmark: timing is not a CI gate.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench import perf_regression, record
from tools.bench.perf_regression import main

HERE = Path(__file__).resolve().parents[1]  # tools/bench
TESTDATA = HERE / "testdata"
BASELINE_RUNS = sorted((TESTDATA / "baseline_runs").glob("run_*.json"))
NORMAL_RUNS = sorted(TESTDATA.glob("normal_*.json"))
COMMITTED_BASELINE = HERE / "baseline.json"
# Engine timing field behind each ratio, to keep a doctored record self-consistent.
FIELD = {
    "load": "load_seconds",
    "prefill": "prefill_tokens_per_second",
    "decode": "decode_tokens_per_second",
}


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(record.dumps(data))
    return path


def _scaled(data: dict[str, Any], metric: str, factor: float) -> dict[str, Any]:
    """A copy whose engine `metric` (and so its ratio) is `factor` times the recorded one."""
    result = copy.deepcopy(data)
    result["engine"]["eager"][FIELD[metric]] *= factor
    result["ratios"]["eager"][metric] *= factor
    return result


@pytest.fixture
def baseline(tmp_path: Path) -> Path:
    """A baseline made from the recorded runs, as `--write-baseline` makes the committed one."""
    path = tmp_path / "baseline.json"
    assert main(["--write-baseline", str(path), *map(str, BASELINE_RUNS)]) == 0
    return path


def _rows(out: str) -> dict[str, str]:
    """Table lines by "mode metric"."""
    return {
        " ".join(line.split()[:2]): line for line in out.splitlines() if line.startswith("eager ")
    }


def test_testdata_is_there():
    assert len(BASELINE_RUNS) == 5
    assert len(NORMAL_RUNS) == 2


@pytest.mark.parametrize("run", NORMAL_RUNS, ids=lambda path: path.name)
def test_normal_runs_report_no_regression(baseline, run, capsys):
    assert main(["--baseline", str(baseline), str(run)]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out
    assert set(_rows(out)) == {"eager load", "eager prefill", "eager decode"}
    assert out.rstrip().endswith("no regression")


def test_decode_slowed_by_20_percent_is_a_regression(baseline, tmp_path, capsys):
    slow = _write(tmp_path / "slow.json", _scaled(_read(NORMAL_RUNS[0]), "decode", 0.8))
    assert main(["--baseline", str(baseline), str(slow)]) == 1
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["eager decode"].endswith("REGRESSION")
    assert rows["eager prefill"].endswith("ok")
    assert "REGRESSION: eager decode outside the noise band" in out


def test_slower_load_is_a_regression(baseline, tmp_path, capsys):
    """Load is seconds: a higher ratio is the bad direction."""
    band = _read(baseline)["band"]["eager"]["load"]
    slow = _write(tmp_path / "slow.json", _scaled(_read(NORMAL_RUNS[0]), "load", 1.5 + 2 * band))
    assert main(["--baseline", str(baseline), str(slow)]) == 1
    assert _rows(capsys.readouterr().out)["eager load"].endswith("REGRESSION")


@pytest.mark.parametrize("metric", record.METRICS)
def test_an_improvement_is_not_a_regression(baseline, tmp_path, capsys, metric):
    """Each ratio moved twice its band's width in the good direction (load: down)."""
    band = _read(baseline)["band"]["eager"][metric]
    factor = (1 - band) / 2 if metric in record.LOWER_IS_BETTER else 1 + 2 * band
    fast = _write(tmp_path / "fast.json", _scaled(_read(NORMAL_RUNS[0]), metric, factor))
    assert main(["--baseline", str(baseline), str(fast)]) == 0
    out = capsys.readouterr().out
    assert _rows(out)[f"eager {metric}"].endswith("improved")
    assert "REGRESSION" not in out


@pytest.mark.parametrize(
    ("metric", "change", "verdict"),
    [
        ("decode", -0.09, "ok"),  # 9.9% slower: tokens/s 0.91x, each token 1.099x the time
        ("decode", -0.10, "REGRESSION"),  # 11.1% slower
        ("decode", +0.09, "ok"),
        ("decode", +0.11, "improved"),
        ("load", +0.09, "ok"),
        ("load", +0.11, "REGRESSION"),
        ("load", -0.09, "ok"),
        ("load", -0.10, "improved"),  # 11.1% faster
    ],
)
def test_verdict_direction_and_band_edge(metric, change, verdict):
    lower = metric in record.LOWER_IS_BETTER
    assert perf_regression.verdict(change, band=0.10, lower_is_better=lower) == verdict


def test_baseline_is_median_and_band_is_spread_times_safety(baseline):
    data = _read(baseline)
    runs = [_read(path)["ratios"]["eager"]["decode"] for path in BASELINE_RUNS]
    median = sorted(runs)[2]
    assert data["ratios"]["eager"]["decode"] == median
    spread = (max(runs) - min(runs)) / median
    assert data["noise"]["spread"]["eager"]["decode"] == pytest.approx(spread)
    expected = max(spread * 2, 0.05)  # README: twice the spread, at least 5% (not the constants)
    assert data["band"]["eager"]["decode"] == pytest.approx(expected)
    assert data["noise"]["run_ratios"]["eager"]["decode"] == runs


def test_committed_baseline_is_readable_and_consistent():
    data = perf_regression.check_baseline(COMMITTED_BASELINE, _read(COMMITTED_BASELINE))
    noise = data["noise"]
    for mode, metrics in data["band"].items():
        for metric, band in metrics.items():
            spread = noise["spread"][mode][metric]
            assert band == pytest.approx(max(spread * noise["safety_factor"], noise["floor"]))
    assert data["notes"]


def _bad_input(tmp_path: Path, baseline: Path, case: str) -> tuple[list[str], Path]:
    """Arguments for one bad-input case, and the file the message must name."""
    good = _read(NORMAL_RUNS[0])
    if case == "missing record":
        return ["--baseline", str(baseline), str(tmp_path / "nope.json")], tmp_path / "nope.json"
    if case == "missing baseline":
        missing = tmp_path / "no_baseline.json"
        return ["--baseline", str(missing), str(NORMAL_RUNS[0])], missing
    if case == "bad JSON":
        path = tmp_path / "torn.json"
        path.write_text('{"schema_version": 1, "ratios": ')
        return ["--baseline", str(baseline), str(path)], path
    if case == "not an object":
        path = tmp_path / "list.json"
        path.write_text("[1, 2]")
        return ["--baseline", str(baseline), str(path)], path
    if case == "record schema":
        path = _write(tmp_path / "v99.json", good | {"schema_version": 99})
        return ["--baseline", str(baseline), str(path)], path
    if case == "baseline schema":
        path = _write(tmp_path / "old_baseline.json", _read(baseline) | {"schema_version": 0})
        return ["--baseline", str(path), str(NORMAL_RUNS[0])], path
    if case == "record as baseline":
        return ["--baseline", str(NORMAL_RUNS[0]), str(NORMAL_RUNS[1])], NORMAL_RUNS[0]
    if case == "threads":
        path = _write(tmp_path / "t4.json", good | {"setup": good["setup"] | {"threads": 4}})
        return ["--baseline", str(baseline), str(path)], path
    if case == "machine":
        path = _write(tmp_path / "m.json", good | {"machine": good["machine"] | {"cpu_count": 64}})
        return ["--baseline", str(baseline), str(path)], path
    if case == "missing mode":
        path = _write(
            tmp_path / "modes.json", good | {"ratios": {"compiled": good["ratios"]["eager"]}}
        )
        return ["--baseline", str(baseline), str(path)], path
    if case == "bad ratio":
        ratios = {"eager": good["ratios"]["eager"] | {"decode": 0}}
        path = _write(tmp_path / "zero.json", good | {"ratios": ratios})
        return ["--baseline", str(baseline), str(path)], path
    raise AssertionError(case)


BAD_INPUTS = [
    "missing record",
    "missing baseline",
    "bad JSON",
    "not an object",
    "record schema",
    "baseline schema",
    "record as baseline",
    "threads",
    "machine",
    "missing mode",
    "bad ratio",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_naming_file_and_fix(baseline, tmp_path, capsys, case):
    argv, culprit = _bad_input(tmp_path, baseline, case)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("perf_regression: error: ")
    assert str(culprit) in lines[0]
    assert any(fix in lines[0] for fix in ("rerun", "refresh", "make a baseline")), lines[0]


def test_other_machine_compares_with_a_warning_when_allowed(baseline, tmp_path, capsys):
    good = _read(NORMAL_RUNS[0])
    other = _write(tmp_path / "m.json", good | {"machine": good["machine"] | {"cpu_count": 64}})
    assert main(["--baseline", str(baseline), "--allow-other-machine", str(other)]) == 0
    assert "warning: other machine class (cpu_count 2 vs 64)" in capsys.readouterr().err


AVX2_ONLY, AVX512 = ["avx2", "fma"], ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]


def _with_features(path: Path, features) -> dict[str, Any]:
    data = _read(path)
    return data | {"machine": data["machine"] | {"cpu_features": features}}


def test_a_cpu_of_another_level_under_the_same_model_string_is_refused(baseline, tmp_path, capsys):
    """One model string ("Intel(R) Xeon(R) Processor") names VMs with AVX2 alone and with
    AVX-512: a record whose kernel-choosing flags differ from the baseline's is another
    machine class (before, only the model string and core count were compared)."""
    runs = [_write(tmp_path / p.name, _with_features(p, AVX512)) for p in BASELINE_RUNS]
    made = tmp_path / "avx512_baseline.json"
    assert main(["--write-baseline", str(made), *map(str, runs)]) == 0
    capsys.readouterr()
    same = _write(tmp_path / "same.json", _with_features(NORMAL_RUNS[0], AVX512))
    assert main(["--baseline", str(made), str(same)]) == 0
    assert "warning" not in capsys.readouterr().err
    other = _write(tmp_path / "avx2.json", _with_features(NORMAL_RUNS[0], AVX2_ONLY))
    assert main(["--baseline", str(made), str(other)]) == 2
    assert "another machine class than the baseline (cpu_features [" in capsys.readouterr().err
    # a baseline made before the flags were recorded: compared, with a warning that says so
    assert main(["--baseline", str(baseline), str(other)]) == 0
    assert "cpu_features not recorded in the baseline or the record" in capsys.readouterr().err


def test_other_versions_only_warn(baseline, tmp_path, capsys):
    good = _read(NORMAL_RUNS[0])
    newer = _write(tmp_path / "v.json", good | {"versions": good["versions"] | {"torch": "9.9"}})
    assert main(["--baseline", str(baseline), str(newer)]) == 0
    assert "warning: other versions (torch" in capsys.readouterr().err


def test_write_baseline_refuses_runs_of_different_setups(tmp_path, capsys):
    good = _read(NORMAL_RUNS[0])
    other = _write(tmp_path / "t4.json", good | {"setup": good["setup"] | {"threads": 4}})
    out = tmp_path / "baseline.json"
    runs = [*map(str, NORMAL_RUNS), str(other)]
    assert main(["--write-baseline", str(out), *runs]) == 2
    assert f"record {other} differs from" in capsys.readouterr().err
    assert not out.exists()


def test_compare_takes_exactly_one_record(baseline, capsys):
    assert main(["--baseline", str(baseline), *map(str, NORMAL_RUNS)]) == 2
    assert "--baseline compares one record, got 2" in capsys.readouterr().err


def test_other_load_only_warns(baseline, tmp_path, capsys):
    good = _read(NORMAL_RUNS[0])
    busy_load = _read(baseline)["conditions"]["load_average_start"] + 3
    busy = _write(tmp_path / "busy.json", good | {"conditions": {"load_average_start": busy_load}})
    assert main(["--baseline", str(baseline), str(busy)]) == 0
    assert "warning: other load on the machine" in capsys.readouterr().err


def test_write_baseline_needs_several_runs(tmp_path, capsys):
    out = tmp_path / "baseline.json"
    assert main(["--write-baseline", str(out), *map(str, NORMAL_RUNS)]) == 2
    assert "needs at least 3 runs (got 2)" in capsys.readouterr().err
    assert not out.exists()


def test_a_record_with_a_llama_bench_peer_compares(baseline, tmp_path, capsys):
    """llama.cpp measured by llama-bench (load null, its version named) and the measured read
    bandwidth in the conditions: perf_regression compares the engine/transformers ratios as
    before, and a baseline made from such runs keeps the bandwidth's median."""
    run = _read(NORMAL_RUNS[0])
    run["peers"]["llama.cpp"] = {
        "load_seconds": None,
        "prefill_tokens_per_second": 240.0,
        "decode_tokens_per_second": 110.0,
    }
    run["peer_versions"] = {"llama.cpp": "llama-bench /usr/bin/llama-bench, build_number 11669"}
    run["conditions"]["read_bandwidth_gb_per_s"] = 13.8
    path = _write(tmp_path / "llama_bench.json", run)
    assert main(["--baseline", str(baseline), str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("no regression")
    runs = [_write(tmp_path / f"run_{i}.json", run) for i in range(3)]
    out = tmp_path / "new_baseline.json"
    assert main(["--write-baseline", str(out), *map(str, runs)]) == 0
    assert _read(out)["conditions"]["read_bandwidth_gb_per_s"] == 13.8


# Hot-ops records (bench_hot_ops --json --repeats=9): SmolLM2's shapes, 1 and 64 rows, one
# thread, every build of the development machine. Their baselines take --safety-factor 3
# --floor 0.25, as the committed one (made from all six runs) does: the ratios of 96 ops wander
# more than bench's three (README.md, "Refreshing the performance baseline").
HOT_OPS_RUNS = sorted((TESTDATA / "hot_ops_runs").glob("run_*.json"))
HOT_OPS_BANDS = ["--safety-factor", "3", "--floor", "0.25"]
HOT_OPS_NORMAL, HOT_OPS_BASELINE_RUNS = HOT_OPS_RUNS[0], HOT_OPS_RUNS[1:]
COMMITTED_HOT_OPS_BASELINE = HERE / "hot_ops_baseline.json"


def _hot_baseline(path: Path, runs: list[Path]) -> Path:
    assert main(["--write-baseline", str(path), *HOT_OPS_BANDS, *map(str, runs)]) == 0
    return path


@pytest.fixture
def hot_baseline(tmp_path: Path) -> Path:
    """A baseline from runs 2 to 6; run 1 is held out."""
    return _hot_baseline(tmp_path / "hot_ops_baseline.json", HOT_OPS_BASELINE_RUNS)


def _hot_rows(out: str) -> dict[str, str]:
    """Table lines by "group metric" (smollm2/ggml/avx2 qkv@1)."""
    return {
        " ".join(line.split()[:2]): line for line in out.splitlines() if line.startswith("smollm2/")
    }


def _hot_scaled(data: dict[str, Any], group: str, metric: str, factor: float) -> dict[str, Any]:
    """A copy in which one op of one mode and build took `factor` times as long."""
    shape, mode, build = group.split("/")
    op, rows = metric.split("@")
    result = copy.deepcopy(data)
    key = (shape, mode, build, op, int(rows))
    (entry,) = [
        r
        for r in result["results"]
        if (r["shape"], r["mode"], r["build"], r["op"], r["rows"]) == key
    ]
    entry["seconds"] *= factor
    result["ratios"][group][metric] *= factor
    return result


def test_hot_ops_testdata_is_there():
    assert len(HOT_OPS_RUNS) == 6
    assert all(_read(path)["kind"] == "hot_ops" for path in HOT_OPS_RUNS)
    assert {_read(path)["setup"]["repeats"] for path in HOT_OPS_RUNS} == {9}


def test_a_held_out_hot_ops_run_reports_no_regression(hot_baseline, capsys):
    assert main(["--baseline", str(hot_baseline), str(HOT_OPS_NORMAL)]) == 0
    out = capsys.readouterr().out
    assert "ratios op time, mode/eager" in out
    rows = _hot_rows(out)
    # every packed mode and build of the baseline, every op at 1 and 64 rows
    groups = _read(hot_baseline)["ratios"]
    assert len(rows) == sum(len(metrics) for metrics in groups.values()) == 96
    assert "smollm2/ggml/avx2 qkv@1" in rows and "smollm2/quantized/portable head@64" in rows
    assert "REGRESSION" not in out


def test_the_false_alarm_rate_is_the_one_stated(tmp_path, capsys):
    """Each run held out in turn against a baseline of the other five: 2 of the 576 cells
    compared fall outside their band (both in one run), the rate README.md states."""
    flagged = []
    for held_out in HOT_OPS_RUNS:
        others = [run for run in HOT_OPS_RUNS if run != held_out]
        baseline = _hot_baseline(tmp_path / f"without_{held_out.stem}.json", others)
        main(["--baseline", str(baseline), str(held_out)])
        out = capsys.readouterr().out
        flagged.append(sum(line.endswith("REGRESSION") for line in _hot_rows(out).values()))
    assert sum(flagged) == 2 and max(flagged) == 2, flagged


@pytest.mark.parametrize(
    ("group", "metric"),
    [("smollm2/ggml/avx2", "qkv@1"), ("smollm2/quantized/avx512", "head@1")],
)
def test_one_slower_op_is_a_regression_on_its_line_alone(
    hot_baseline, tmp_path, capsys, group, metric
):
    """A kernel change that makes one op slower by twice its band in one build."""
    band = _read(hot_baseline)["band"][group][metric]
    slow = _hot_scaled(_read(HOT_OPS_NORMAL), group, metric, 1 + 2 * band)
    assert main(["--baseline", str(hot_baseline), str(_write(tmp_path / "slow.json", slow))]) == 1
    out = capsys.readouterr().out
    rows = _hot_rows(out)
    assert rows[f"{group} {metric}"].endswith("REGRESSION")
    assert [line for line in rows.values() if line.endswith("REGRESSION")] == [
        rows[f"{group} {metric}"]
    ]
    assert f"REGRESSION: {group} {metric} outside the noise band" in out


def test_the_committed_baseline_catches_a_doubled_op_in_most_cells():
    """The power README.md states: a 1.5x slower op is outside its band in 37 of the 96
    cells, a 2x slower one in 76 (bands from six runs, safety factor 3, floor 25%)."""
    data = _read(COMMITTED_HOT_OPS_BASELINE)
    bands = [band for metrics in data["band"].values() for band in metrics.values()]
    assert len(bands) == 96
    assert sum(band < 0.5 for band in bands) == 37
    assert sum(band < 1.0 for band in bands) == 76


def test_a_faster_op_is_improved(hot_baseline, tmp_path, capsys):
    group, metric = "smollm2/ggml/avx2", "down@64"
    band = _read(hot_baseline)["band"][group][metric]
    fast = _hot_scaled(_read(HOT_OPS_NORMAL), group, metric, (1 - band) / 2)
    assert main(["--baseline", str(hot_baseline), str(_write(tmp_path / "fast.json", fast))]) == 0
    assert _hot_rows(capsys.readouterr().out)[f"{group} {metric}"].endswith("improved")


def test_bench_and_hot_ops_records_do_not_mix(baseline, hot_baseline, tmp_path, capsys):
    assert main(["--baseline", str(hot_baseline), str(NORMAL_RUNS[0])]) == 2
    err = capsys.readouterr().err
    assert f"record {NORMAL_RUNS[0]} is a bench record and the baseline is made of hot_ops" in err
    assert main(["--baseline", str(baseline), str(HOT_OPS_NORMAL)]) == 2
    assert (
        "is a hot_ops record and the baseline is made of bench records" in capsys.readouterr().err
    )
    out = tmp_path / "mixed.json"
    runs = [*map(str, HOT_OPS_BASELINE_RUNS), str(NORMAL_RUNS[0])]
    assert main(["--write-baseline", str(out), *runs]) == 2
    assert "the runs mix bench and hot_ops records" in capsys.readouterr().err
    assert not out.exists()


def test_a_hot_ops_record_without_the_eager_mode_is_refused(hot_baseline, tmp_path, capsys):
    """Without the eager mode a run has no peer to divide by: nothing to compare."""
    data = _read(HOT_OPS_NORMAL)
    data |= {"ratios": {}, "results": [r for r in data["results"] if r["mode"] != "eager"]}
    path = _write(tmp_path / "no_eager.json", data)
    assert main(["--baseline", str(hot_baseline), str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"perf_regression: error: record {path} has no ratios; rerun `./bazelw run "
        "//tools:bench_hot_ops -- --json FILE` (eager among --modes)"
    )


def test_the_committed_hot_ops_baseline_is_readable_and_consistent():
    data = perf_regression.check_baseline(
        COMMITTED_HOT_OPS_BASELINE, _read(COMMITTED_HOT_OPS_BASELINE)
    )
    assert data["record_kind"] == "hot_ops" and data["notes"]
    noise = data["noise"]
    assert (noise["runs"], noise["safety_factor"], noise["floor"]) == (6, 3.0, 0.25)
    for group, metrics in data["band"].items():
        for metric, band in metrics.items():
            spread = noise["spread"][group][metric]
            assert band == pytest.approx(max(spread * noise["safety_factor"], noise["floor"]))


@pytest.mark.parametrize(
    ("name", "kind"),
    [("baseline.json", perf_regression.BENCH), ("hot_ops_baseline.json", perf_regression.HOT_OPS)],
)
def test_every_committed_band_lets_no_slowdown_past_it(name, kind):
    """Every row of the committed baselines, made slower by 1% more than its band (a
    throughput ratio divided, a time multiplied), is a REGRESSION. Judged as the ratio's
    relative change, a throughput halved was -50%: inside the quantized rows' bands (0.54,
    0.74) and any band of 1 or more (planted: that judgement)."""
    path = COMMITTED_BASELINE.parent / name
    data = _read(path)
    for group, metrics in data["band"].items():
        for metric, band in metrics.items():
            lower = kind.lower(metric)
            slower = (1 + band) * 1.01
            change = slower - 1 if lower else 1 / slower - 1
            assert perf_regression.verdict(change, band, lower) == "REGRESSION", (group, metric)


def test_the_committed_bench_baseline_flags_the_slowdowns_readme_states():
    """The smallest slowdown each committed bench band flags, in percent, as README.md's
    "Refreshing the performance baseline" states them: bands from five runs on a shared
    2-core machine, where the quantized mode's decode ratio moved from 1.69 to 2.30 between
    runs; a 1.25x slower decode is flagged in the eager mode alone. A coarse check: a record
    inside these bands is no proof that nothing got slower."""
    bands = _read(COMMITTED_BASELINE)["band"]
    percent = {mode: {m: round(b * 100) for m, b in ms.items()} for mode, ms in bands.items()}
    assert percent == {
        "eager": {"load": 54, "prefill": 41, "decode": 17},
        "quantized": {"load": 69, "prefill": 74, "decode": 54},
        "ggml": {"load": 172, "prefill": 29, "decode": 32},
    }
    flagged = [mode for mode, metrics in bands.items() if perf_regression.verdict(
        1 / 1.25 - 1, metrics["decode"], False) == "REGRESSION"]  # fmt: skip
    assert flagged == ["eager"], flagged


def test_a_baseline_from_runs_of_other_modes_is_refused_naming_the_run(tmp_path, capsys):
    """A mode some runs lack was dropped from the baseline without a word (intersection)."""
    first = _read(BASELINE_RUNS[0])
    more = first | {"ratios": first["ratios"] | {"quantized": first["ratios"]["eager"]}}
    runs = [_write(tmp_path / "more.json", more), *BASELINE_RUNS[1:]]
    out = tmp_path / "baseline.json"
    assert main(["--write-baseline", str(out), *map(str, runs)]) == 2
    lacking = f"{BASELINE_RUNS[1]} has no mode 'quantized', which other runs have"
    assert lacking in capsys.readouterr().err
    assert not out.exists()


def test_a_baseline_missing_a_band_is_bad_input_not_a_regression(baseline, tmp_path, capsys):
    data = _read(baseline)
    data["band"] = {"quantized": data["band"]["eager"]}  # eager's ratios without a band
    broken = _write(tmp_path / "banded.json", data)
    assert main(["--baseline", str(broken), str(NORMAL_RUNS[0])]) == 2  # a KeyError, exit 1
    assert "has no band for eager/load, eager/prefill, eager/decode" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "band", "lower"),
    [(0.25, 0.25, True), (-0.25 / 1.25, 0.25, False), (-0.5, 1.0, False), (1.0, 1.0, True)],
)
def test_a_change_exactly_at_the_band_edge_is_ok(change, band, lower):
    """Only a change beyond the band is a REGRESSION or "improved" (module docstring): a
    slowdown of exactly the band's width, in either direction of metric, stays "ok", as does
    the speedup of the same size (planted: `slower >= band`)."""
    assert perf_regression.verdict(change, band, lower) == "ok"
    faster = 1 / (1 + change) - 1
    assert perf_regression.verdict(faster, band, lower) == "ok"


def test_a_hot_ops_record_lacking_one_op_is_bad_input(hot_baseline, tmp_path, capsys):
    """A record that lacks one metric of a baseline group is an InputError, exit 2 (compare's
    docstring): hot-ops groups hold their own metrics, so only compare can notice that one op
    is missing (planted: that check dropped, a KeyError and a traceback)."""
    data = _read(HOT_OPS_NORMAL)
    del data["ratios"]["smollm2/ggml/avx2"]["qkv@1"]
    path = _write(tmp_path / "no_qkv.json", data)
    assert main(["--baseline", str(hot_baseline), str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"perf_regression: error: record {path} has no smollm2/ggml/avx2 ratio 'qkv@1'; rerun "
        "`./bazelw run //tools:bench_hot_ops -- --json FILE` (eager among --modes) with the "
        "baseline's settings"
    )


def test_a_record_under_less_load_than_the_baseline_also_warns(baseline, tmp_path, capsys):
    """Loads more than one core's worth apart warn in both directions: a record measured on a
    quieter machine than the baseline's runs is as much another experiment as a busier one
    (planted: only a busier record warned)."""
    good = _read(NORMAL_RUNS[0])
    quiet_load = _read(baseline)["conditions"]["load_average_start"] - 2
    quiet = _write(
        tmp_path / "quiet.json", good | {"conditions": {"load_average_start": quiet_load}}
    )
    assert main(["--baseline", str(baseline), str(quiet)]) == 0
    err = capsys.readouterr().err
    assert f"warning: other load on the machine (1-minute load average {quiet_load}" in err
    near = _write(tmp_path / "near.json", good | {"conditions": {"load_average_start": 3.0}})
    assert main(["--baseline", str(baseline), str(near)]) == 0  # 3.27 vs 3.0: alike
    assert "other load" not in capsys.readouterr().err


def test_a_record_from_another_cpu_model_is_refused(baseline, tmp_path, capsys):
    """The CPU model is part of the machine class (module docstring), as the core count is: a
    record from another model is refused, exit 2, unless --allow-other-machine (planted: only
    the core count compared)."""
    good = _read(NORMAL_RUNS[0])
    machine = good["machine"] | {"cpu_model": "Intel(R) Xeon(R) Processor"}
    other = _write(tmp_path / "xeon.json", good | {"machine": machine})
    assert main(["--baseline", str(baseline), str(other)]) == 2
    err = capsys.readouterr().err
    assert "another machine class than the baseline (cpu_model 'AMD EPYC' vs 'Intel(R)" in err
    assert main(["--baseline", str(baseline), "--allow-other-machine", str(other)]) == 0
    assert "warning: other machine class (cpu_model 'AMD EPYC' vs" in capsys.readouterr().err


def test_a_setting_the_baseline_does_not_record_is_another_setup(baseline, tmp_path, capsys):
    """A record whose setup has a key the baseline lacks (a setting a newer bench records)
    was measured with another setup: refused, exit 2, naming the key (planted: only the
    baseline's setup keys compared)."""
    good = _read(NORMAL_RUNS[0])
    newer = _write(tmp_path / "kv.json", good | {"setup": good["setup"] | {"kv_cache": "q8"}})
    assert main(["--baseline", str(baseline), str(newer)]) == 2
    assert "another setup than the baseline (kv_cache None vs 'q8')" in capsys.readouterr().err


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_ratio_is_bad_input(baseline, tmp_path, capsys, value):
    """Ratios must be positive finite numbers (_check_ratios): JSON as Python writes it can
    hold Infinity and NaN, which would read as "improved" or "ok" (planted: the finiteness
    check dropped)."""
    good = _read(NORMAL_RUNS[0])
    ratios = {"eager": good["ratios"]["eager"] | {"decode": value}}
    path = _write(tmp_path / "inf.json", good | {"ratios": ratios})
    assert main(["--baseline", str(baseline), str(path)]) == 2
    err = capsys.readouterr().err
    assert f"record {path}: ratio eager/decode is {value!r}, not a positive number" in err


def test_a_written_baseline_keeps_its_notes_and_how_it_was_made(tmp_path, capsys):
    """README.md:531-532 ("--notes 'when, which machine, what else was running'"): the notes
    given to --write-baseline are in the baseline, beside the method and the number of runs
    and the safety factor and floor its bands took. Planted: the notes dropped."""
    out = tmp_path / "baseline.json"
    notes = "2026-12-05, the 2-core Xeon, a CI run beside"
    argv = ["--write-baseline", str(out), "--notes", notes, "--floor", "0.1"]
    assert main([*argv, *map(str, BASELINE_RUNS)]) == 0
    data = _read(out)
    assert data["notes"] == notes
    assert data["method"] == (
        "ratio: median over 5 bench runs; spread: (max - min) / median over them; band: "
        "max(spread * 2.0, 0.1)"
    )
    assert (data["noise"]["runs"], data["noise"]["safety_factor"], data["noise"]["floor"]) == (
        5,
        2.0,
        0.1,
    )
