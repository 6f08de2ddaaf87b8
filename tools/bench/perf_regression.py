"""Compare a bench record with a committed baseline and flag performance regressions.

Only the ratios engine / transformers are compared, never absolute times: on shared machines
the absolute numbers wander with whatever else runs, while both sides of a ratio are measured
in the same process, their generations alternating, and so see much the same load. Each ratio
(per engine mode and metric) has a noise band measured when the baseline was made; a change
beyond the band in the bad direction is a REGRESSION, beyond it in the good direction
"improved", else "ok", each measured as a growth (a throughput ratio halved is 100% slower,
as a time doubled is: `verdict`). Load is in seconds (lower is better), prefill and decode in
tokens/s (higher is better). A record's other peers (llama.cpp, whose load is null when llama-bench
measured it) and its `peer_versions` are kept for people, never compared.

A baseline is made from several bench runs on one machine (`--write-baseline OUT RUN...`):
its ratio is each ratio's median, its band max(spread * safety factor, floor), where spread
is (max - min) / median over the runs. It keeps every run's ratios, so the band can be
re-derived by hand.

Refused (exit 2), because the ratios would measure a different experiment: a record whose
schema_version differs, whose setup (checkpoint, thread count, prompt and generation
lengths, repeats, device, dtype) differs from the baseline's, or that lacks a mode the
baseline has; also a different machine class (CPU model, the CPU flags that choose kernels
where both record them, or core count), since the two implementations use different kernels
whose ratio can move between CPUs, unless
`--allow-other-machine` turns that into a warning. Different torch/transformers/python
versions only warn: they are a likely cause worth naming, not a reason to refuse. So does a
record measured under another load than the baseline's runs (1-minute load average at the
start more than one core's worth apart): ratios are not load-invariant. With two threads on
two busy cores, transformers' decode slowed far more than the engine's (baseline notes).

Hot-ops records (`bench_hot_ops --json FILE`, kind "hot_ops") are read the same way, with
the eager mode as the peer measured in the same process: each op's time in a packed mode and
kernel build over the eager mode's for the same shape, op and rows (`smollm2/ggml/avx2`,
`qkv@1`; lower is better), so a kernel change that slows one op shows on that op's line. Its
baseline is made from hot-ops runs and compares hot-ops records only.

This is a tool for people, not a CI timing gate: one run on a busy machine can still fall
outside a band.

Exit status: 0 no regression, 1 regression, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from goldens.cli_files import PathError, output_directory, user_path, write_atomically
from tools.bench import record as bench_record

BASELINE_SCHEMA_VERSION = 1
BASELINE_KIND = "perf_regression baseline"
DEFAULT_SAFETY_FACTOR = 2.0
DEFAULT_FLOOR = 0.05
MIN_BASELINE_RUNS = 3  # fewer runs say too little about the spread
MACHINE_KEYS = ("cpu_model", "cpu_count")
FEATURES_KEY = "cpu_features"  # compared where both sides record them
REFRESH_HINT = "the same model string may be another CPU level; refresh the baseline"
LOAD_KEY = "load_average_start"
LOAD_TOLERANCE = 1.0  # one core's worth of other work moves the ratios (module docstring)
RERUN = "rerun `./bazelw run //tools:bench -- --json FILE`"
HOT_OPS_RERUN = "rerun `./bazelw run //tools:bench_hot_ops -- --json FILE` (eager among --modes)"
HOT_OPS_SCHEMA_VERSION = 2  # tools/bench/hot_ops.py's SCHEMA_VERSION (this imports no torch)
REFRESH = "make a baseline with --write-baseline (README.md, perf_regression)"
ANOTHER_BASELINE = f"pass the committed tools/bench/baseline.json or {REFRESH}"

EXAMPLES = """\
examples:
  # the committed baseline was measured with one thread (its notes say why)
  ./bazelw run //tools:bench -- --threads 1 --json bench.json
  ./bazelw run //tools:perf_regression -- --baseline tools/bench/baseline.json bench.json
  # the hot ops against theirs (the committed one's notes give the bench_hot_ops options)
  ./bazelw run //tools:bench_hot_ops -- --shapes=smollm2 --rows=1,64 --threads=1 \\
      --repeats=9 --json hot_ops.json
  ./bazelw run //tools:perf_regression -- --baseline tools/bench/hot_ops_baseline.json \\
      hot_ops.json
  # a new baseline from five runs (for i in 1 2 3 4 5; do ... --json run_$i.json; done)
  ./bazelw run //tools:perf_regression -- --write-baseline tools/bench/baseline.json \\
      --notes 'why and under what load' run_*.json
"""


class InputError(ValueError):
    """A file cannot be compared; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a record's ratios are and how to read them: bench's or bench_hot_ops'."""

    name: str
    schema_version: int
    keys: tuple[str, ...]  # the blocks a record of this kind must have
    ratio: str  # what each ratio divides, for the table's title
    group: str  # what a ratios key names (a column title)
    rerun: str
    fixed_metrics: tuple[str, ...] | None  # every group's metrics; None: the group's own
    lower_is_better: frozenset[str] | None  # None: every metric (times)

    def metrics(self, group: Any) -> list[str]:
        if self.fixed_metrics is not None:
            return list(self.fixed_metrics)
        return sorted(group) if isinstance(group, dict) else []

    def lower(self, metric: str) -> bool:
        return self.lower_is_better is None or metric in self.lower_is_better


BENCH = Kind(
    name="bench",
    schema_version=bench_record.SCHEMA_VERSION,
    keys=("machine", "versions", "setup", "conditions", "engine", "peers", "ratios"),
    ratio="engine/transformers",
    group="mode",
    rerun=RERUN,
    fixed_metrics=bench_record.METRICS,
    lower_is_better=bench_record.LOWER_IS_BETTER,
)
HOT_OPS = Kind(
    name="hot_ops",
    schema_version=HOT_OPS_SCHEMA_VERSION,
    keys=("machine", "versions", "setup", "conditions", "ratios"),
    ratio="op time, mode/eager",
    group="shape/mode/build",
    rerun=HOT_OPS_RERUN,
    fixed_metrics=None,
    lower_is_better=None,
)
KINDS = {kind.name: kind for kind in (BENCH, HOT_OPS)}


def kind_of(data: dict[str, Any], path: Path) -> Kind:
    """A record's kind: bench records carry none, hot-ops records "hot_ops"."""
    name = data.get("kind", BENCH.name)
    if name not in KINDS:
        raise InputError(
            f"record {path} is of kind {name!r}; perf_regression reads bench and hot_ops "
            f"records ({RERUN}, or {HOT_OPS_RERUN})"
        )
    return KINDS[name]


@dataclasses.dataclass(frozen=True)
class Row:
    """One ratio compared: baseline against record, judged against its noise band."""

    mode: str  # the ratios group: an engine mode, or shape/mode/build for hot ops
    metric: str
    baseline: float
    record: float
    band: float
    lower_is_better: bool = False

    @property
    def change(self) -> float:
        """Relative change of the ratio, record against baseline (+0.1 is 10% higher)."""
        return self.record / self.baseline - 1.0

    @property
    def verdict(self) -> str:
        return verdict(self.change, self.band, self.lower_is_better)


def verdict(change: float, band: float, lower_is_better: bool) -> str:
    """ok inside the band; outside it, REGRESSION or improved depending on the direction.

    Each direction is judged as a growth: a slowdown by how much longer things take, a
    speedup by how much faster. A throughput ratio (higher is better) that halves is +100%
    slower, as a time that doubles is; judged as its -50% change it stayed inside any band
    above 0.5, and no slowdown at all could leave a band of 1 or more."""
    ratio = 1.0 + change  # record / baseline
    slower = ratio - 1.0 if lower_is_better else 1.0 / ratio - 1.0
    faster = 1.0 / ratio - 1.0 if lower_is_better else ratio - 1.0
    if slower > band:
        return "REGRESSION"
    if faster > band:
        return "improved"
    return "ok"


def load_json(path: Path, what: str, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; anything else is an InputError saying how to get a good one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{what} {path} cannot be read ({error}); {fix}") from None
    except json.JSONDecodeError as error:
        raise InputError(
            f"{what} {path} is not valid JSON (line {error.lineno}: {error.msg}); {fix}"
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {path} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


def _require(data: dict[str, Any], keys: Sequence[str], what: str, path: Path, fix: str) -> None:
    missing = [key for key in keys if not isinstance(data.get(key), dict)]
    if missing:
        raise InputError(f"{what} {path} lacks {', '.join(missing)}; {fix}")


def _check_ratios(ratios: dict[str, Any], kind: Kind, what: str, path: Path, fix: str) -> None:
    """Every group has its metrics as positive finite numbers (a ratio can divide)."""
    if not ratios:
        raise InputError(f"{what} {path} has no ratios; {fix}")
    for mode, metrics in ratios.items():
        names = kind.metrics(metrics)
        if not names:
            raise InputError(f"{what} {path}: ratios {mode!r} holds no numbers; {fix}")
        for metric in names:
            value = metrics.get(metric) if isinstance(metrics, dict) else None
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise InputError(
                    f"{what} {path}: ratio {mode}/{metric} is {value!r}, not a positive number; "
                    f"{fix}"
                )


def check_record(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` if it is a bench or hot-ops record this version reads, else an InputError."""
    kind = kind_of(data, path)
    version = data.get("schema_version")
    if version != kind.schema_version:
        raise InputError(
            f"{kind.name} record {path} has schema_version {version!r}, perf_regression reads "
            f"{kind.schema_version}; {kind.rerun} with this checkout"
        )
    _require(data, kind.keys, "record", path, kind.rerun)
    _check_ratios(data["ratios"], kind, "record", path, kind.rerun)
    return data


def check_baseline(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """`data` if it is a baseline this version reads, else an InputError."""
    if data.get("kind") != BASELINE_KIND:
        raise InputError(
            f"baseline {path} is not a {BASELINE_KIND} (kind {data.get('kind')!r}; a bench "
            f"record?); {ANOTHER_BASELINE}"
        )
    kind = KINDS.get(data.get("record_kind", BENCH.name))
    if kind is None:
        raise InputError(
            f"baseline {path} is for records of kind {data.get('record_kind')!r}, perf_regression "
            f"reads {' and '.join(KINDS)}; {REFRESH}"
        )
    version = data.get("schema_version")
    if (version, data.get("record_schema_version")) != (
        BASELINE_SCHEMA_VERSION,
        kind.schema_version,
    ):
        raise InputError(
            f"baseline {path} has schema_version {version!r} for {kind.name} records "
            f"{data.get('record_schema_version')!r}, perf_regression reads "
            f"{BASELINE_SCHEMA_VERSION} for records {kind.schema_version}; {REFRESH}"
        )
    keys = ("machine", "versions", "setup", "conditions", "ratios", "band")
    _require(data, keys, "baseline", path, REFRESH)
    _check_ratios(data["ratios"], kind, "baseline", path, REFRESH)
    _check_ratios(data["band"], kind, "baseline", path, REFRESH)
    unbanded = [
        f"{mode}/{metric}"
        for mode, metrics in data["ratios"].items()
        for metric in kind.metrics(metrics)
        if metric not in data["band"].get(mode, {})
    ]
    if unbanded:  # a KeyError and exit 1, a regression's status, before
        raise InputError(f"baseline {path} has no band for {', '.join(unbanded)}; {REFRESH}")
    return data


def baseline_kind(baseline: dict[str, Any]) -> Kind:
    return KINDS[baseline.get("record_kind", BENCH.name)]


def _differences(ours: dict[str, Any], theirs: dict[str, Any], keys: Sequence[str]) -> list[str]:
    return [
        f"{key} {ours.get(key)!r} vs {theirs.get(key)!r}"
        for key in keys
        if ours.get(key) != theirs.get(key)
    ]


def _refuse_other_setup(baseline: dict[str, Any], record: dict[str, Any], path: Path) -> None:
    keys = sorted(set(baseline["setup"]) | set(record["setup"]))
    setup = _differences(baseline["setup"], record["setup"], keys)
    if setup:
        raise InputError(
            f"record {path} was measured with another setup than the baseline "
            f"({'; '.join(setup)}); rerun bench with the baseline's settings or {REFRESH}"
        )


def _machine_warning(
    baseline: dict[str, Any], record: dict[str, Any], path: Path, allow_other_machine: bool
) -> list[str]:
    machine = _differences(baseline["machine"], record["machine"], MACHINE_KEYS)
    features = [m.get(FEATURES_KEY) for m in (baseline["machine"], record["machine"])]
    unnamed = []
    if None in features:  # made before records named them: the model string alone
        unnamed = [f"{FEATURES_KEY} not recorded in the baseline or the record: {REFRESH_HINT}"]
    elif features[0] != features[1]:
        machine.append(f"{FEATURES_KEY} {features[0]!r} vs {features[1]!r}")
    if machine and not allow_other_machine:
        raise InputError(
            f"record {path} comes from another machine class than the baseline "
            f"({'; '.join(machine)}); make a baseline on this machine, or pass "
            "--allow-other-machine to compare anyway"
        )
    return unnamed + (
        [f"other machine class ({'; '.join(machine)}): the bands do not apply"] if machine else []
    )


def _versions_warning(baseline: dict[str, Any], record: dict[str, Any]) -> list[str]:
    keys = sorted(set(baseline["versions"]) | set(record["versions"]))
    versions = _differences(baseline["versions"], record["versions"], keys)
    if not versions:
        return []
    return [f"other versions ({'; '.join(versions)}): a change may come from there"]


def _load_warning(baseline: dict[str, Any], record: dict[str, Any]) -> list[str]:
    ours, theirs = baseline["conditions"].get(LOAD_KEY), record["conditions"].get(LOAD_KEY)
    numbers = all(isinstance(value, int | float) for value in (ours, theirs))
    if not numbers or abs(ours - theirs) <= LOAD_TOLERANCE:
        return []
    return [
        f"other load on the machine (1-minute load average {theirs} at the start, baseline "
        f"{ours}): ratios shift with contention, rerun when the load is alike"
    ]


def comparability_warnings(
    baseline: dict[str, Any], record: dict[str, Any], record_path: Path, allow_other_machine: bool
) -> list[str]:
    """Refuse a record from another experiment; the warnings for lesser differences."""
    _refuse_other_kind(baseline, record, record_path)
    _refuse_other_setup(baseline, record, record_path)
    return (
        _machine_warning(baseline, record, record_path, allow_other_machine)
        + _versions_warning(baseline, record)
        + _load_warning(baseline, record)
    )


def _refuse_other_kind(baseline: dict[str, Any], record: dict[str, Any], path: Path) -> Kind:
    """The kind of both, or an InputError when a bench record meets a hot-ops baseline (or
    the other way round)."""
    kind, record_kind = baseline_kind(baseline), kind_of(record, path)
    if record_kind is not kind:
        raise InputError(
            f"record {path} is a {record_kind.name} record and the baseline is made "
            f"of {kind.name} records; pass a {record_kind.name} baseline or {kind.rerun}"
        )
    return kind


def compare(baseline: dict[str, Any], record: dict[str, Any], record_path: Path) -> list[Row]:
    """One row per baseline group (mode) and metric; a record of another kind, or one that
    lacks a group or metric, is an InputError."""
    kind = _refuse_other_kind(baseline, record, record_path)
    rows = []
    for mode, metrics in sorted(baseline["ratios"].items()):
        if mode not in record["ratios"]:
            raise InputError(
                f"record {record_path} has no {kind.group} {mode!r} (it has "
                f"{', '.join(sorted(record['ratios'])) or 'none'}); {kind.rerun} with that one"
            )
        for metric in kind.metrics(metrics):
            if metric not in record["ratios"][mode]:
                raise InputError(
                    f"record {record_path} has no {mode} ratio {metric!r}; {kind.rerun} with "
                    "the baseline's settings"
                )
            rows.append(
                Row(
                    mode,
                    metric,
                    baseline=metrics[metric],
                    record=record["ratios"][mode][metric],
                    band=baseline["band"][mode][metric],
                    lower_is_better=kind.lower(metric),
                )
            )
    return rows


def table(rows: Sequence[Row]) -> str:
    """The comparison as people read it: one line per mode (group) and metric."""
    mode_width = max([10, *(len(row.mode) + 2 for row in rows)])
    metric_width = max([9, *(len(row.metric) + 2 for row in rows)])
    lines = [
        f"{'mode':{mode_width}}{'metric':{metric_width}}{'baseline':>10}{'record':>10}"
        f"{'change':>9}{'band':>9}  verdict"
    ]
    for row in rows:
        band = "±" + format(row.band, ".1%")
        lines.append(
            f"{row.mode:{mode_width}}{row.metric:{metric_width}}{row.baseline:10.4f}"
            f"{row.record:10.4f}{row.change:+9.1%}{band:>9}  {row.verdict}"
        )
    return "\n".join(lines)


def _same_everywhere(runs: Sequence[tuple[Path, dict[str, Any]]], key: str) -> dict[str, Any]:
    """The runs' common `key` block; runs that differ there do not make one baseline."""
    first_path, first = runs[0]
    for path, run in runs[1:]:
        if run[key] != first[key]:
            keys = sorted(set(first[key]) | set(run[key]))
            raise InputError(
                f"record {path} differs from {first_path} in {key} "
                f"({'; '.join(_differences(first[key], run[key], keys))}); "
                "make a baseline from runs of one machine, setup and checkout"
            )
    return first[key]


def make_baseline(
    runs: Sequence[tuple[Path, dict[str, Any]]], notes: str, safety_factor: float, floor: float
) -> dict[str, Any]:
    """A baseline from repeated runs (of one kind): median ratios and bands from their
    spread."""
    kinds = {kind_of(run, path).name for path, run in runs}
    if len(kinds) > 1:
        raise InputError(
            f"the runs mix {' and '.join(sorted(kinds))} records; make a baseline from one kind"
        )
    kind = kind_of(runs[0][1], runs[0][0])
    modes = sorted(set.intersection(*(set(run["ratios"]) for _, run in runs)))
    for path, run in runs:  # a mode some runs lack was dropped without a word before
        lacking = sorted(set.union(*(set(r["ratios"]) for _, r in runs)) - set(run["ratios"]))
        if lacking:
            raise InputError(
                f"run {path} has no {kind.group} {', '.join(map(repr, lacking))}, which other "
                "runs have; make every run with the same --modes"
            )
    run_ratios = {
        mode: {
            m: [run["ratios"][mode][m] for _, run in runs]
            for m in kind.metrics(runs[0][1]["ratios"][mode])
        }
        for mode in modes
    }
    medians = {
        mode: {m: statistics.median(values) for m, values in metrics.items()}
        for mode, metrics in run_ratios.items()
    }
    spread = {
        mode: {m: (max(v) - min(v)) / medians[mode][m] for m, v in metrics.items()}
        for mode, metrics in run_ratios.items()
    }
    band = {
        mode: {m: max(value * safety_factor, floor) for m, value in metrics.items()}
        for mode, metrics in spread.items()
    }
    return {
        "kind": BASELINE_KIND,
        "schema_version": BASELINE_SCHEMA_VERSION,
        "record_kind": kind.name,
        "record_schema_version": kind.schema_version,
        "notes": notes,
        "method": (
            f"ratio: median over {len(runs)} {kind.name} runs; spread: (max - min) / median over "
            f"them; band: max(spread * {safety_factor}, {floor})"
        ),
        "machine": _same_everywhere(runs, "machine"),
        "setup": _same_everywhere(runs, "setup"),
        "versions": _same_everywhere(runs, "versions"),
        "conditions": {
            key: statistics.median(run["conditions"][key] for _, run in runs)
            for key in sorted(set.intersection(*(set(run["conditions"]) for _, run in runs)))
        },
        "ratios": medians,
        "band": band,
        "noise": {
            "floor": floor,
            "runs": len(runs),
            "run_conditions": [run["conditions"] for _, run in runs],
            "run_ratios": run_ratios,
            "safety_factor": safety_factor,
            "spread": spread,
        },
    }


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="perf_regression",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = result.add_mutually_exclusive_group(required=True)
    action.add_argument("--baseline", metavar="FILE", help="compare one RECORD with this baseline")
    action.add_argument(
        "--write-baseline", metavar="FILE", help="write a baseline made from the RECORDs (runs)"
    )
    result.add_argument(
        "records",
        nargs="+",
        metavar="RECORD",
        help="files `bench --json` or `bench_hot_ops --json` wrote",
    )
    result.add_argument(
        "--allow-other-machine",
        action="store_true",
        help="compare a record from another CPU model or core count (a warning, not a refusal)",
    )
    result.add_argument("--notes", default="", help="with --write-baseline: how it was measured")
    result.add_argument("--safety-factor", type=float, default=DEFAULT_SAFETY_FACTOR)
    result.add_argument(
        "--floor", type=float, default=DEFAULT_FLOOR, help="smallest band, 0.05=5%%"
    )
    return result


def _read_record(path: Path) -> dict[str, Any]:
    return check_record(path, load_json(path, "record", RERUN))


def run_compare(args: argparse.Namespace) -> int:
    """Compare the one record with the baseline: print the table, return the exit status."""
    if len(args.records) != 1:
        raise InputError(f"--baseline compares one record, got {len(args.records)}; pass one")
    baseline_path, record_path = user_path(args.baseline), user_path(args.records[0])
    baseline = check_baseline(baseline_path, load_json(baseline_path, "baseline", ANOTHER_BASELINE))
    record = _read_record(record_path)
    warnings = comparability_warnings(baseline, record, record_path, args.allow_other_machine)
    rows = compare(baseline, record, record_path)
    for warning in warnings:
        print(f"perf_regression: warning: {warning}", file=sys.stderr)
    print(f"ratios {baseline_kind(baseline).ratio}: {record_path} against {baseline_path}")
    print(table(rows))
    regressions = [f"{row.mode} {row.metric}" for row in rows if row.verdict == "REGRESSION"]
    if regressions:
        print(f"REGRESSION: {', '.join(regressions)} outside the noise band")
        return 1
    print("no regression")
    return 0


def run_write_baseline(args: argparse.Namespace) -> int:
    """Write the baseline made from the runs and print its ratios and bands."""
    if len(args.records) < MIN_BASELINE_RUNS or args.safety_factor < 1 or args.floor <= 0:
        raise InputError(
            f"--write-baseline needs at least {MIN_BASELINE_RUNS} runs (got "
            f"{len(args.records)}), --safety-factor >= 1 and --floor > 0; pass more runs"
        )
    out = user_path(args.write_baseline)
    output_directory(out.parent, "--write-baseline")
    runs = [(user_path(name), _read_record(user_path(name))) for name in args.records]
    baseline = make_baseline(runs, args.notes, args.safety_factor, args.floor)
    write_atomically(out, bench_record.dumps(baseline))
    for mode, metrics in baseline["ratios"].items():
        for metric, value in metrics.items():
            spread, band = baseline["noise"]["spread"][mode][metric], baseline["band"][mode][metric]
            print(f"{mode:10} {metric:9}{value:10.4f}  spread {spread:6.1%}  band ±{band:.1%}")
    print(f"wrote {out} from {len(runs)} runs", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # usage errors and --help
        return int(stop.code or 0)
    try:
        return run_compare(args) if args.baseline else run_write_baseline(args)
    except (InputError, PathError) as error:
        print(f"perf_regression: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
