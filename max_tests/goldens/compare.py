"""Compare one run of a model with a golden case, step by step, and say what moved.

Order of checks at each step, the first failing one decides:
  1. token id: the run's greedy choice must equal the golden's. When it does not and the
     golden's top-1/top-2 gap is under the near-tie margin, the step is AMBIGUOUS (either
     token is a fair answer) and the comparison stops following the case: later steps would
     compare different continuations.
  2. logits of the golden's top-k ids within atol + rtol*|golden|.
  3. top-k overlap: the share of the golden's top-k ids that are in the run's top-k.
  4. KL(golden || run) over the golden's top-k ids plus one bucket for the rest of the
     vocabulary, from the stored logsumexp: a lower bound of the full KL, exact in the limit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from max_tests.goldens.schema import Case, Step
from max_tests.goldens.tolerances import Tolerance

PASS, FAIL, AMBIGUOUS = "PASS", "FAIL", "AMBIGUOUS"


@dataclasses.dataclass(frozen=True)
class LogitDiff:
    token_id: int
    expected: float
    actual: float

    @property
    def abs_diff(self) -> float:
        return abs(self.actual - self.expected)


@dataclasses.dataclass(frozen=True)
class StepCheck:
    step: int
    status: str
    metric: str  # what decided the status: "token", "logits", "topk_overlap", "kl", or ""
    detail: str  # the measured value against its threshold
    expected_token: int
    actual_token: int | None
    golden_gap: float
    max_abs_diff: float
    kl: float
    topk_overlap: float
    worst: list[LogitDiff]


@dataclasses.dataclass(frozen=True)
class CaseReport:
    case_id: str
    prompt: str
    status: str  # PASS, FAIL, or AMBIGUOUS (stopped at a near-tie; counts as passing)
    steps: list[StepCheck]
    input_ids_match: bool
    tolerance: Tolerance

    @property
    def first_diverging(self) -> StepCheck | None:
        return next((s for s in self.steps if s.status != PASS), None)

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.steps), default=0.0)

    @property
    def max_kl(self) -> float:
        return max((s.kl for s in self.steps), default=0.0)


def _softmax_bucket_kl(golden: Step, actual_logits: np.ndarray, actual_lse: float) -> float:
    ids = np.asarray(golden.topk_ids)
    p = np.exp(np.asarray(golden.topk_logits, dtype=np.float64) - golden.logsumexp)
    q_all = np.exp(actual_logits.astype(np.float64) - actual_lse)
    q = q_all[ids]
    # The run's tail is summed directly (no 1 - sum cancellation); the golden's tail below
    # float32 rounding noise of its stored logsumexp counts as empty.
    p_tail = max(1.0 - p.sum(), 0.0)
    p = p / (p.sum() + p_tail)  # renormalize: the stored logsumexp is rounded
    q_tail = q_all.sum() - q.sum()
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))
    if p_tail > 1e-6:
        kl += p_tail * (math.log(p_tail) - math.log(max(q_tail, 1e-300)))
    return max(kl, 0.0)


def _logsumexp(x: np.ndarray) -> float:
    x = x.astype(np.float64)
    peak = x.max()
    return float(peak + math.log(np.exp(x - peak).sum()))


def compare_case(
    golden: Case,
    input_ids: Sequence[int],
    tokens: Sequence[int],
    logits: np.ndarray,
    tolerance: Tolerance,
) -> CaseReport:
    """Compare a run (its input ids, greedy tokens and per-step full logits) with a golden."""
    logits = np.asarray(logits, dtype=np.float32)
    checks: list[StepCheck] = []
    input_ids_match = list(input_ids) == list(golden.input_ids)
    status = PASS
    for i, gstep in enumerate(golden.steps):
        if i >= len(tokens):
            checks.append(_missing_step(i, gstep))
            status = FAIL
            break
        check = _check_step(i, gstep, int(tokens[i]), logits[i], tolerance)
        checks.append(check)
        if check.status != PASS:
            status = check.status
            break
    if not input_ids_match:
        status = FAIL
    return CaseReport(
        case_id=golden.id,
        prompt=golden.prompt,
        status=status,
        steps=checks,
        input_ids_match=input_ids_match,
        tolerance=tolerance,
    )


def _missing_step(i: int, gstep: Step) -> StepCheck:
    return StepCheck(
        step=i,
        status=FAIL,
        metric="token",
        detail="the run stopped (EOS) before this step",
        expected_token=gstep.token_id,
        actual_token=None,
        golden_gap=gstep.top_gap,
        max_abs_diff=math.inf,
        kl=math.inf,
        topk_overlap=0.0,
        worst=[],
    )


def _check_step(i: int, gstep: Step, token: int, row: np.ndarray, tol: Tolerance) -> StepCheck:
    ids = np.asarray(gstep.topk_ids)
    expected = np.asarray(gstep.topk_logits, dtype=np.float64)
    actual = row[ids].astype(np.float64)
    diffs = np.abs(actual - expected)
    allowed = tol.atol + tol.rtol * np.abs(expected)
    worst_order = np.argsort(-diffs, kind="stable")[:5]
    worst = [LogitDiff(int(ids[j]), float(expected[j]), float(actual[j])) for j in worst_order]
    k = len(ids)
    run_topk = np.argsort(-row, kind="stable")[:k]
    overlap = len(set(run_topk.tolist()) & set(ids.tolist())) / k
    kl = _softmax_bucket_kl(gstep, row, _logsumexp(row))
    max_diff = float(diffs.max())

    metric, detail, status = "", "", PASS
    if token != gstep.token_id:
        metric = "token"
        if gstep.top_gap < tol.near_tie_margin:
            status = AMBIGUOUS
            detail = (
                f"golden top-1/top-2 gap {gstep.top_gap:.3g} < near-tie margin "
                f"{tol.near_tie_margin:g}: either token is fair, case not followed further"
            )
        else:
            status = FAIL
            detail = (
                f"token differs and the golden gap {gstep.top_gap:.3g} is above the near-tie "
                f"margin {tol.near_tie_margin:g}"
            )
    elif np.any(diffs > allowed):
        j = int(np.argmax(diffs - allowed))
        metric, status = "logits", FAIL
        detail = (
            f"max |Δlogit| {max_diff:.3g} over the golden top-{k}; id {int(ids[j])} moved "
            f"{diffs[j]:.3g} > atol {tol.atol:g} + rtol {tol.rtol:g}·|{expected[j]:.4g}|"
        )
    elif overlap < tol.topk_overlap_min:
        metric, status = "topk_overlap", FAIL
        detail = f"top-{k} overlap {overlap:.2f} < {tol.topk_overlap_min:g}"
    elif kl > tol.kl_max:
        metric, status = "kl", FAIL
        detail = f"KL(golden||run) {kl:.3g} > {tol.kl_max:g}"
    return StepCheck(
        step=i,
        status=status,
        metric=metric,
        detail=detail,
        expected_token=gstep.token_id,
        actual_token=token,
        golden_gap=gstep.top_gap,
        max_abs_diff=max_diff,
        kl=kl,
        topk_overlap=overlap,
        worst=worst,
    )


def format_failure(
    report: CaseReport,
    golden_case: Case,
    golden_name: str,
    decode: Callable[[Sequence[int]], str],
    regenerate: str,
    actual_input_ids: Sequence[int] = (),
) -> str:
    """A failure as a diagnosis: case, step, tokens, worst logits, metric, how to regenerate."""
    lines = [
        f"golden mismatch in case {report.case_id!r} ({report.prompt!r}) against {golden_name}",
        f"  tolerance {report.tolerance.key}: atol {report.tolerance.atol:g}, "
        f"rtol {report.tolerance.rtol:g}, KL {report.tolerance.kl_max:g}, "
        f"top-k overlap {report.tolerance.topk_overlap_min:g}, "
        f"near-tie margin {report.tolerance.near_tie_margin:g}",
    ]
    if not report.input_ids_match:
        lines.append(
            f"  input ids differ (tokenizer changed?): expected {golden_case.input_ids}, "
            f"got {list(actual_input_ids)}"
        )
    step = report.first_diverging
    if step is not None:
        n = len(golden_case.steps)
        gstep = golden_case.steps[step.step]
        got = (
            "nothing (run ended)"
            if step.actual_token is None
            else f"{step.actual_token} {decode([step.actual_token])!r}"
        )
        lines += [
            f"  first diverging step: {step.step} of {n} ({step.status}, metric {step.metric})",
            f"  expected token {step.expected_token} {gstep.token_text!r} "
            f"(golden top-1/top-2 gap {step.golden_gap:.4g}), got {got}",
            f"  {step.detail}",
            f"  golden text so far: {decode(golden_case.token_ids[: step.step + 1])!r}",
        ]
        if step.worst:
            lines.append("  worst logit differences at this step:")
            lines.append(f"    {'id':>8}  {'token':<16} {'golden':>12} {'run':>12} {'|Δ|':>10}")
            for d in step.worst:
                lines.append(
                    f"    {d.token_id:>8}  {decode([d.token_id])!r:<16} {d.expected:>12.6g} "
                    f"{d.actual:>12.6g} {d.abs_diff:>10.3g}"
                )
        lines.append(
            f"  at this step: KL {step.kl:.3g}, top-k overlap {step.topk_overlap:.2f}, "
            f"max |Δlogit| {step.max_abs_diff:.3g}"
        )
    lines.append(f"  regenerate the golden (if the change is intended): {regenerate}")
    return "\n".join(lines)
