"""The engine against its own goldens and against the torch (transformers) goldens, on the CPU.

Teacher-forced: for each golden the engine is fed the golden's own tokens, so every step of
every case is compared (goldens/compare.py). One test per checkpoint variant and
execution mode (engine.MODES), all held to the same goldens (made by `eager`) and tolerances:
id `{size}-{encoding}-{arch}` for eager, `{size}-{encoding}-{arch}-{mode}` for the others.
A failing golden writes an HTML report of all its cases, named on the failure's last line
(failure_report.failures_with_report). One case alone:
  ./bazelw test //max_tests/integration/architectures/llama3:test_llama \\
      --test_arg=-k --test_arg='test_llama[tiny-float32-llama3_1]'
Bazel runs the `compiled` mode in its own target, test_llama_compiled (torch.compile takes
tens of seconds on a cold cache); $LLAMA_TEST_MODES (comma-separated) picks the modes, all of
them by default. $LLAMA_TEST_LANE picks the cases (judge.LANES): `short` in test_llama
(the edit loop), `long` (cases.yaml's long prompts, thousands of positions) in
test_llama_long, `all` by default; the same -k ids select one variant in either target.
Each short case's sampling goldens are checked at every teacher-forced step from the same runs
(the kept-set rule, harness/llama3/sampling_goldens.check_forced), in every mode, speculative
ones included; test_llama_sampling checks the seeded continuations on the serving paths.
So are its constrained goldens (harness/llama3/constrained_goldens.check_forced): the engine
fed each constrained continuation under its constraint, every step's mask equal to the
golden's and its restricted, renormalized row compared by the same rules. $LLAMA_TEST_CHECKS
picks which of the two a case judges, both by default: `goldens` in test_llama (the edit loop:
the constrained runs were 9.6 of its 21.8 s of cases), `constrained` in test_llama_constrained.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from goldens.tolerances import tolerance
from harness.llama3 import constrained_goldens, diagnosis, engine_runs, failure_report, judge
from harness.llama3 import variants as variants_module
from harness.llama3.sampling_goldens import SamplingReport, check_forced
from harness.llama3.variants import LLAMA3_1_ENV, Variant, skip_unavailable, variants
from pipelines.llama3.engine import MODES
from pipelines.llama3.speculative import Speculation

VARIANTS = variants()
MODES_ENV = "LLAMA_TEST_MODES"
LANE_ENV = "LLAMA_TEST_LANE"
SPECULATE_ENV = "LLAMA_TEST_SPECULATE"
CHECKS_ENV = "LLAMA_TEST_CHECKS"
CHECKS = ("goldens", "constrained")
# Set (by .ci/run) to the value it gave LLAMA3_1_GGUF, to prove Bazel passes it through.
EXPECTED_LLAMA3_1_ENV = "EXPECTED_LLAMA3_1_GGUF"


def _modes() -> list[str]:
    chosen = os.environ.get(MODES_ENV, ",".join(MODES)).split(",")
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        raise ValueError(f"${MODES_ENV}: {unknown} not among {', '.join(MODES)}")
    return [mode for mode in MODES if mode in chosen]


def _checks() -> tuple[str, ...]:
    """$LLAMA_TEST_CHECKS: which goldens a case judges (comma-separated; unset: all of CHECKS).
    `goldens`: the engine and torch goldens, with each short case's sampling goldens from the
    same runs; `constrained`: the constrained goldens, a run per constrained continuation."""
    chosen = os.environ.get(CHECKS_ENV, ",".join(CHECKS)).split(",")
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        raise ValueError(f"${CHECKS_ENV}: {unknown} not among {', '.join(CHECKS)}")
    return tuple(check for check in CHECKS if check in chosen)


def _speculate() -> list[int]:
    """$LLAMA_TEST_SPECULATE: the K of each speculative run (comma-separated; unset: none)."""
    ks = [int(k) for k in os.environ.get(SPECULATE_ENV, "").split(",") if k]
    return ks or [0]


def _case_id(variant: Variant, mode: str, k: int = 0) -> str:
    base = variant.test_id if mode == "eager" else f"{variant.test_id}-{mode}"
    return f"{base}-spec{k}" if k else base


def _cases() -> list:
    # variant by variant, its modes together: sharded round-robin, a checkpoint's modes then
    # go to different shards (mode by mode, with an even number of variants, SmolLM2's three
    # modes all went to one shard: 26 s beside 11 s in the edit loop)
    return [
        pytest.param(v, mode, k, id=_case_id(v, mode, k))
        for k in _speculate()
        for v in VARIANTS
        for mode in _modes()
    ]


@pytest.mark.parametrize(("variant", "mode", "k"), _cases())
def test_llama(
    variant: Variant, mode: str, k: int, goldens, record_property, tmp_path: Path
) -> None:
    skip_unavailable(variant)
    # the ggml mode on q4_k and q4_1: its own goldens; everything else: own and torch
    references = [
        (*goldens.load(reference, variant), reference)
        for reference in variants_module.references(variant, mode)
    ]

    lane = os.environ.get(LANE_ENV, "all")
    start = time.perf_counter()
    engine = engine_runs.load_engine(variant, "cpu", mode=mode)
    if k:  # every teacher-forced run through K + 1-row verification forwards
        engine = engine_runs.Speculating(engine, Speculation(k=k))
    loaded = time.perf_counter()
    checks = _checks()
    judged = references if "goldens" in checks else []
    verdicts, memo = [], {}  # memo: a token sequence both goldens hold runs once
    sampled = SamplingReport()
    for golden, name, reference in judged:
        tol = tolerance(reference, variant.encoding, "cpu")
        verdicts.append(
            judge.check(engine, golden, name, reference, tol, variant, memo=memo, lane=lane)
        )
    # The sampling goldens' teacher-forced distributions, from the same runs (the memo)
    for golden, _, reference in judged:
        tol = tolerance(reference, variant.encoding, "cpu")
        cases = [c for c in judge.in_lane(golden, variant.model, lane).cases if c.sampling]
        runs = engine_runs.forced_runs(engine, dataclasses.replace(golden, cases=cases), memo)
        for case, run in zip(cases, runs, strict=True):
            sampled.add(check_forced(case, run, tol, f"{reference} golden"))
    # The constrained goldens: the engine fed each constrained continuation
    restricted = constrained_goldens.ConstrainedReport()
    if "constrained" in checks:
        for golden, _, reference in references:
            tol = tolerance(reference, variant.encoding, "cpu")
            for case in judge.in_lane(golden, variant.model, lane).cases:
                restricted.add(
                    constrained_goldens.check_forced(case, engine, tol, f"{reference} golden")
                )
    model_seconds = time.perf_counter() - loaded
    record_property("load_seconds", round(loaded - start, 4))
    record_property("model_seconds", round(model_seconds, 4))
    # .ci/run adds these up from the JUnit XML into its closing line, and names the three
    # entries closest to their thresholds (bazel/test_summary.py).
    ambiguous = sum(v.ambiguous_steps for v in verdicts) + restricted.ambiguous_steps
    record_property("ambiguous_steps", ambiguous + restricted.ambiguous_greedy)
    golden_checks = sum(v.steps + v.prompt_positions for v in verdicts) + sampled.checks
    golden_checks += restricted.checks
    record_property("golden_checks", golden_checks)
    for verdict in verdicts:
        share, metric, where = verdict.headroom()
        test_id = _case_id(variant, mode, k)
        entry = verdict.tolerance.key
        record_property("headroom", f"{entry}|{share:.6g}|{test_id}|{where}|{metric}")
    print(
        f"{variant.test_id} ({mode}, {lane} cases): load {(loaded - start) * 1000:.1f} ms, "
        f"model {model_seconds:.3f} s"
    )
    for verdict in verdicts:
        print("  " + verdict.summary())
    if sampled.checks:
        print("  " + sampled.summary())
    if restricted.checks:
        print("  " + restricted.summary())
    reports = failure_report.report_directory(tmp_path)
    failures = [
        failure
        for (golden, _, _), verdict in zip(judged, verdicts, strict=True)
        for failure in failure_report.failures_with_report(
            verdict,
            golden,
            engine.tokenizer.decode,
            reports,
            _case_id(variant, mode, k),
            diagnosis.diverging_layer(engine, variant, golden, verdict),
            run_of=(variant, engine, mode),
        )
    ]
    failures += sampled.failures + restricted.failures
    if checks == ("constrained",) and not restricted.checks:
        failures.append(
            f"{_case_id(variant, mode, k)}: ${CHECKS_ENV}=constrained, and none of "
            f"the {', '.join(reference for *_, reference in references)} goldens holds a "
            f"constrained golden of the {lane} lane: this case checks nothing"
        )
    assert not failures, "\n\n".join(failures)


def test_checkpoint_override_env_reaches_this_test() -> None:
    """`LLAMA3_1_GGUF` in the user's shell reaches the test (.bazelrc: --test_env)."""
    expected = os.environ.get(EXPECTED_LLAMA3_1_ENV)
    if expected is None:
        pytest.skip(f"set by .ci/run's probe run only (${EXPECTED_LLAMA3_1_ENV})")
    assert os.environ.get(LLAMA3_1_ENV) == expected
    (llama3_1,) = variants("llama3_1")
    assert llama3_1.unavailable_reason == f"{expected} does not exist"
