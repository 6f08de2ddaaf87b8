"""Teacher-forced runs compared with a golden: the verdict of one variant against one golden
under one tolerance, lane by lane (short and long cases)."""

from __future__ import annotations

import dataclasses

from goldens import compare, schema
from goldens.record import CaseSpec, case_specs
from goldens.tolerances import Tolerance, judged_lane
from harness.llama3.engine_runs import Run, forced_runs
from harness.llama3.golden_files import GoldenSource, regenerate_command
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A run of one variant compared with one golden under one tolerance."""

    source: GoldenSource  # the golden file and its folder
    reference: str  # own | torch
    tolerance: Tolerance
    reports: list[compare.CaseReport]
    failures: list[str]  # diagnoses, one per failing case (or case-list mismatch)
    runs: tuple[Run, ...] = ()  # the teacher-forced runs compared

    @property
    def golden_name(self) -> str:
        return str(self.source)

    @property
    def ambiguous_steps(self) -> int:
        return sum(len(r.ambiguous_steps) for r in self.reports)

    @property
    def steps(self) -> int:
        return sum(len(r.steps) for r in self.reports)

    @property
    def prompt_positions(self) -> int:
        return sum(len(r.prompt_checks) for r in self.reports)

    @property
    def last_position(self) -> int:
        """The highest sequence position compared (a generated step or a prompt position)."""
        return max((c.position for r in self.reports for c in r.checks), default=0)

    @property
    def max_logprob_diff(self) -> float:
        return max((r.max_logprob_diff for r in self.reports), default=0.0)

    @property
    def max_kl(self) -> float:
        return max((r.max_kl for r in self.reports), default=0.0)

    def headroom(self) -> tuple[float, str, str]:
        """(share, metric, where): the worst check's |Δ log-prob| or KL as a share of this
        tolerance's threshold (1.0 is at the threshold), and where it was."""
        worst = (0.0, "logprob", "")
        for case_report in self.reports:
            tolerance = case_report.tolerance  # a long case's own where the entry has them
            for check in case_report.checks:
                for metric, value, limit in (
                    ("logprob", check.max_logprob_diff, tolerance.logprob_atol),
                    ("kl", check.kl, tolerance.kl_max),
                ):
                    if value / limit > worst[0]:
                        worst = (value / limit, metric, f"{case_report.case_id}, {check.where}")
        return worst

    def summary(self) -> str:
        agreement = sum(r.greedy_agreement for r in self.reports)
        ambiguous = ", ".join(
            f"{r.case_id} step {s.step}" for r in self.reports for s in r.ambiguous_steps
        )
        return (
            f"{self.reference} {self.golden_name} [{self.tolerance.key}]: "
            f"{'FAIL' if self.failures else 'PASS'}, {self.steps} steps teacher-forced "
            f"and {self.prompt_positions} prompt positions, up to position "
            f"{self.last_position}, "
            f"max |Δ log-prob| {self.max_logprob_diff:.3g}, max KL {self.max_kl:.3g}, "
            f"greedy agreement {agreement}/{self.steps}, "
            f"ambiguous steps {self.ambiguous_steps}" + (f" ({ambiguous})" if ambiguous else "")
        )


# Golden lanes: the short cases run in the edit loop's suite, the long ones (cases.yaml
# `generate:`, thousands of positions) in a target of their own; "all" is both.
LANES = ("all", "short", "long")


def _in_lane(spec: CaseSpec, lane: str) -> bool:
    return lane == "all" or spec.long == (lane == "long")


def in_lane(golden: schema.Golden, model: str, lane: str) -> schema.Golden:
    """`golden` with the cases of one lane only. A case that cases.yaml does not list stays
    in every lane (compare_runs reports it)."""
    if lane not in LANES:
        raise ValueError(f"lane {lane!r} is not one of {', '.join(LANES)}")
    elsewhere = {spec.id for spec in case_specs(model) if not _in_lane(spec, lane)}
    return dataclasses.replace(golden, cases=[c for c in golden.cases if c.id not in elsewhere])


def compare_runs(
    runs: list[Run],
    golden: schema.Golden,
    source: GoldenSource,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    decode,
    device: str = "cpu",
    lane: str = "all",
) -> Verdict:
    """Teacher-forced runs (`forced_runs` of this golden) against the golden, case by case;
    with a `lane`, only that lane's cases (and cases.yaml's cases of that lane), and only the
    cases the tolerance judges (its `cases`)."""
    lane = judged_lane(lane, tolerance)
    golden = in_lane(golden, variant.model, lane)
    by_id = {run.spec.id: run for run in runs}
    failures, reports = [], []
    regenerate = regenerate_command(variant, reference, device)
    listed = [(s.id, s.prompt) for s in case_specs(variant.model) if _in_lane(s, lane)]
    recorded = [(case.id, case.prompt) for case in golden.cases]
    if listed != recorded:
        failures.append(
            f"golden {source} has cases {_short(recorded)}, cases.yaml lists "
            f"{_short(listed)}: regenerate with {regenerate}"
        )
    long_ids = {s.id for s in case_specs(variant.model) if s.long}
    for case in golden.cases:
        run = by_id.get(case.id)
        if run is None:
            failures.append(f"no run of case {case.id!r} of golden {source}")
            continue
        report = compare_run(case, run, tolerance.for_case(case.id in long_ids))
        reports.append(report)
        if report.status == compare.FAIL:
            failures.append(
                compare.format_failure(report, case, str(source), decode, regenerate, run.input_ids)
            )
    return Verdict(source, reference, tolerance, reports, failures, tuple(runs))


def compare_run(case: schema.Case, run: Run, tolerance: Tolerance) -> compare.CaseReport:
    """One teacher-forced run against its golden case."""
    prompt_rows = dict(zip(run.positions, run.prompt_logits, strict=True)) if run.positions else {}
    return compare.compare_case(case, run.input_ids, run.tokens, run.logits, tolerance, prompt_rows)


def _short(cases: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Case ids and prompts for a message, long prompts cut to their first words."""
    return [(i, p if len(p) <= 80 else f"{p[:40]}... ({len(p)} characters)") for i, p in cases]


def check(
    engine: Llama3Engine,
    golden: schema.Golden,
    source: GoldenSource,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    device: str = "cpu",
    memo: dict | None = None,
    lane: str = "all",
) -> Verdict:
    """The engine teacher-forced on `golden` (the cases of `lane`) and compared with it
    under `tolerance` (`memo`: see `forced_runs`)."""
    lane = judged_lane(lane, tolerance)
    runs = forced_runs(engine, in_lane(golden, variant.model, lane), memo)
    decode = engine.tokenizer.decode
    return compare_runs(runs, golden, source, reference, tolerance, variant, decode, device, lane)
