"""Compare a teacher-forced run of a model with a golden case, step by step, and say what moved.

The run is fed the golden's own tokens (prompt, then the golden's greedy tokens so far), so
every step of every case compares the same prefix, before and after any divergence. Each
step records the run's greedy choice and its full next-token logits. At every step:

  1. log-probabilities (logit minus logsumexp) of the golden's top-k ids: |Δ| <= logprob_atol;
  2. top-k overlap: the share of the golden's top-k ids in the run's top-k;
  3. KL(golden || run) over the golden's top-k ids plus one bucket for the rest of the
     vocabulary, from the stored logsumexp: a lower bound of the full KL, exact in the limit;
  4. the greedy token. A different choice is AMBIGUOUS, not a failure, only when all of:
     the run's token is in the golden's top-k within the near-tie margin of the golden's
     top-1, the golden's top-1 is within the margin of the run's top-1 in the run's logits,
     and checks 1-3 pass at that step. Anything else is a FAIL.

The golden's recorded prompt positions (long prompts: a spread of thousands of positions from
one prefill) are checked by the same rules 1-4, the greedy token being the argmax there.

A case fails on any failing step or prompt position, or when the run's own tokenization of
the prompt differs from the golden's input ids. Ambiguous steps are counted and reported,
never hidden.
Free-running greedy agreement is reported too: the run, fed the golden's prefix, chose the
golden's token up to `greedy_agreement`; a free-running generation would diverge there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from goldens.schema import Case, Step, logsumexp, top_k_ids
from goldens.tolerances import Tolerance

PASS, FAIL, AMBIGUOUS = "PASS", "FAIL", "AMBIGUOUS"


@dataclasses.dataclass(frozen=True)
class LogprobDiff:
    token_id: int
    expected: float  # the golden's log-probability
    actual: float  # the run's

    @property
    def abs_diff(self) -> float:
        return abs(self.actual - self.expected)


@dataclasses.dataclass(frozen=True)
class StepCheck:
    step: int  # the generated step; for a prompt position, its index among the recorded ones
    status: str
    metric: str  # what decided: token, logprob, topk_overlap, kl, missing; "" for PASS
    detail: str  # the measured value against its threshold
    expected_token: int
    actual_token: int | None
    golden_gap: float  # golden top-1 minus top-2 logit
    max_logprob_diff: float
    kl: float
    topk_overlap: float
    worst: list[LogprobDiff]
    position: int = -1  # the sequence position whose next-token logits these are
    in_prompt: bool = False  # a recorded prompt position, not a generated step

    @property
    def where(self) -> str:
        """'prompt position 4097' or 'step 3 (position 8419)'."""
        if self.in_prompt:
            return f"prompt position {self.position}"
        return f"step {self.step} (position {self.position})"


@dataclasses.dataclass(frozen=True)
class CaseReport:
    case_id: str
    prompt: str
    status: str  # PASS or FAIL; ambiguous steps are counted in `ambiguous_steps`
    steps: list[StepCheck]  # every step of the golden
    input_ids_match: bool
    tolerance: Tolerance
    prompt_checks: list[StepCheck] = dataclasses.field(default_factory=list)  # its positions

    @property
    def first_failing(self) -> StepCheck | None:
        """The first failing generated step."""
        return next((s for s in self.steps if s.status == FAIL), None)

    @property
    def first_failing_check(self) -> StepCheck | None:
        """The failing check of the lowest sequence position, prompt positions included."""
        return next((s for s in self.checks if s.status == FAIL), None)

    @property
    def checks(self) -> list[StepCheck]:
        """Prompt positions, then the generated steps: in sequence order."""
        return [*self.prompt_checks, *self.steps]

    @property
    def ambiguous_steps(self) -> list[StepCheck]:
        return [s for s in self.checks if s.status == AMBIGUOUS]

    @property
    def greedy_agreement(self) -> int:
        """Leading steps whose greedy token equals the golden's (free-running agreement)."""
        for s in self.steps:
            if s.actual_token != s.expected_token:
                return s.step
        return len(self.steps)

    @property
    def failing_metrics(self) -> list[str]:
        metrics = [] if self.input_ids_match else ["input_ids"]
        return metrics + sorted({s.metric for s in self.checks if s.status == FAIL})

    @property
    def max_logprob_diff(self) -> float:
        return max((s.max_logprob_diff for s in self.checks), default=0.0)

    @property
    def max_kl(self) -> float:
        return max((s.kl for s in self.checks), default=0.0)


def bucket_kl(golden_lp: np.ndarray, run_lp_topk: np.ndarray, run_tail: float) -> float:
    """KL over the golden's top-k plus a tail bucket; golden_lp are its log-probabilities."""
    p = np.exp(golden_lp)
    p_tail = max(1.0 - p.sum(), 0.0)
    p = p / (p.sum() + p_tail)  # renormalize: the stored logsumexp is rounded
    q = np.exp(run_lp_topk)
    kl = float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))
    # The golden's tail below float32 rounding noise of its stored logsumexp counts as empty.
    if p_tail > 1e-6:
        kl += p_tail * (math.log(p_tail) - math.log(max(run_tail, 1e-300)))
    return max(kl, 0.0)


def compare_case(
    golden: Case,
    input_ids: Sequence[int],
    tokens: Sequence[int],
    logits: np.ndarray,
    tolerance: Tolerance,
    prompt_logits: Mapping[int, np.ndarray] | None = None,
) -> CaseReport:
    """Compare a teacher-forced run (its input ids, its greedy choice at each step and the
    per-step full logits, row i after the golden's first i tokens) with a golden case.
    `prompt_logits` maps a prompt position to the run's logits there (the golden's recorded
    positions; one the run lacks fails as missing)."""
    logits = np.asarray(logits, dtype=np.float32)
    prompt_logits = prompt_logits or {}
    last_prompt = len(golden.input_ids) - 1
    checks = []
    for i, gstep in enumerate(golden.steps):
        if i < len(tokens):
            check = _check_step(i, gstep, int(tokens[i]), logits[i], tolerance)
        else:
            check = _missing_step(i, gstep, "the run has no logits for this step (it ended early)")
        checks.append(dataclasses.replace(check, position=last_prompt + i))
    prompt_checks = []
    recorded = zip(golden.positions, golden.position_steps, strict=True)
    for j, (position, gstep) in enumerate(recorded):
        row = prompt_logits.get(position)
        if row is None:
            check = _missing_step(j, gstep, "the run has no logits at this prompt position")
        else:
            row = np.asarray(row, dtype=np.float32)
            check = _check_step(j, gstep, int(np.argmax(row)), row, tolerance)
        prompt_checks.append(dataclasses.replace(check, position=position, in_prompt=True))
    input_ids_match = list(input_ids) == list(golden.input_ids)
    failed = not input_ids_match or any(c.status == FAIL for c in [*prompt_checks, *checks])
    return CaseReport(
        case_id=golden.id,
        prompt=golden.prompt,
        status=FAIL if failed else PASS,
        steps=checks,
        input_ids_match=input_ids_match,
        tolerance=tolerance,
        prompt_checks=prompt_checks,
    )


def _missing_step(i: int, gstep: Step, detail: str) -> StepCheck:
    return StepCheck(
        step=i,
        status=FAIL,
        metric="missing",
        detail=detail,
        expected_token=gstep.token_id,
        actual_token=None,
        golden_gap=gstep.top_gap,
        max_logprob_diff=math.inf,
        kl=math.inf,
        topk_overlap=0.0,
        worst=[],
    )


def _check_step(i: int, gstep: Step, token: int, row: np.ndarray, tol: Tolerance) -> StepCheck:
    ids = np.asarray(gstep.topk_ids)
    golden_lp = gstep.topk_log_probs()
    run_lp_all = row.astype(np.float64) - logsumexp(row)
    run_lp = run_lp_all[ids]
    diffs = np.abs(run_lp - golden_lp)
    worst_order = np.argsort(-diffs, kind="stable")[:5]
    worst = [LogprobDiff(int(ids[j]), float(golden_lp[j]), float(run_lp[j])) for j in worst_order]
    k = len(ids)
    run_topk = top_k_ids(row, k)
    overlap = len(set(run_topk.tolist()) & set(ids.tolist())) / k
    # The run's tail is summed directly: 1 - sum(top-k) would cancel to noise when it is small.
    outside = np.ones(row.size, dtype=bool)
    outside[ids] = False
    kl = bucket_kl(golden_lp, run_lp, float(np.exp(run_lp_all[outside]).sum()))
    max_diff = float(diffs.max())

    metric, detail = "", ""
    if max_diff > tol.logprob_atol:
        j = int(np.argmax(diffs))
        metric = "logprob"
        detail = (
            f"max |Δ log-prob| {max_diff:.3g} > {tol.logprob_atol:g} over the golden top-{k} "
            f"(id {int(ids[j])}: golden {golden_lp[j]:.5g}, run {run_lp[j]:.5g})"
        )
    elif overlap < tol.topk_overlap_min:
        metric, detail = "topk_overlap", f"top-{k} overlap {overlap:.2f} < {tol.topk_overlap_min:g}"
    elif kl > tol.kl_max:
        metric, detail = "kl", f"KL(golden||run) {kl:.3g} > {tol.kl_max:g}"
    status = FAIL if metric else PASS

    if token != gstep.token_id:
        tie = _tie_reason(gstep, golden_lp, ids, token, row, tol.near_tie_margin)
        if status == PASS and tie is None:
            status, metric = AMBIGUOUS, "token"
            detail = (
                f"greedy token differs at a near-tie (golden gap {gstep.top_gap:.3g}, run gap "
                f"{float(row[token] - row[gstep.token_id]):.3g} < margin "
                f"{tol.near_tie_margin:g}) and every other check passes"
            )
        elif status == PASS:
            status, metric, detail = FAIL, "token", f"greedy token differs: {tie}"
        else:
            detail += f"; and the greedy token differs: {tie or 'at a near-tie'}"
    return StepCheck(
        step=i,
        status=status,
        metric=metric,
        detail=detail,
        expected_token=gstep.token_id,
        actual_token=token,
        golden_gap=gstep.top_gap,
        max_logprob_diff=max_diff,
        kl=kl,
        topk_overlap=overlap,
        worst=worst,
    )


def _tie_reason(
    gstep: Step, golden_lp: np.ndarray, ids: np.ndarray, token: int, row: np.ndarray, margin: float
) -> str | None:
    """Why a different greedy token is not a fair near-tie answer; None when it is."""
    where = np.flatnonzero(ids == token)
    if where.size == 0:
        return f"the run's token {token} is not in the golden's top-{len(ids)}"
    golden_gap = float(golden_lp[0] - golden_lp[where[0]])
    if golden_gap >= margin:
        return (
            f"the golden ranks the run's token {golden_gap:.3g} below its top-1 "
            f"(near-tie margin {margin:g})"
        )
    run_gap = float(row[token] - row[gstep.token_id])
    if run_gap >= margin:
        return (
            f"the run ranks the golden's token {run_gap:.3g} below its own top-1 "
            f"(near-tie margin {margin:g})"
        )
    return None


def format_failure(
    report: CaseReport,
    golden_case: Case,
    golden_name: str,
    decode: Callable[[Sequence[int]], str],
    regenerate: str,
    actual_input_ids: Sequence[int] = (),
) -> str:
    """A failure as a diagnosis: case, step, tokens, worst log-probs, metric, how to regenerate."""
    tol = report.tolerance
    n = len(golden_case.steps)
    failing = [s for s in report.steps if s.status == FAIL]
    prompt_text = report.prompt if len(report.prompt) <= 80 else report.prompt[:60] + "..."
    lines = [
        f"golden mismatch in case {report.case_id!r} ({prompt_text!r}, "
        f"{len(golden_case.input_ids)} prompt tokens) against {golden_name}",
        f"  tolerance {tol.key}: |Δ log-prob| {tol.logprob_atol:g}, KL {tol.kl_max:g}, "
        f"top-k overlap {tol.topk_overlap_min:g}, near-tie margin {tol.near_tie_margin:g}",
        f"  teacher-forced: {len(failing)} of {n} steps fail "
        f"({', '.join(report.failing_metrics) or 'input ids'}), "
        f"{len(report.ambiguous_steps)} ambiguous; max |Δ log-prob| "
        f"{report.max_logprob_diff:.3g}, max KL {report.max_kl:.3g}",
        f"  free-running greedy agreement: {report.greedy_agreement} of {n} steps",
    ]
    if report.prompt_checks:
        prompt_failing = [s for s in report.prompt_checks if s.status == FAIL]
        first_bad = ""
        if prompt_failing:
            first_bad = f", the first at position {prompt_failing[0].position}"
        lines.append(
            f"  prompt positions: {len(prompt_failing)} of {len(report.prompt_checks)} fail"
            f"{first_bad} (recorded up to position {report.prompt_checks[-1].position})"
        )
    if not report.input_ids_match:
        lines.append(
            f"  input ids differ (tokenizer or BOS changed?): expected {golden_case.input_ids}, "
            f"got {list(actual_input_ids)}"
        )
    step = report.first_failing_check
    if step is not None:
        gsteps = golden_case.position_steps if step.in_prompt else golden_case.steps
        gstep = gsteps[step.step]
        got = (
            "nothing (run ended)"
            if step.actual_token is None
            else f"{step.actual_token} {decode([step.actual_token])!r}"
        )
        if step.in_prompt:
            start = max(step.position - 7, 0)
            context = decode(golden_case.input_ids[start : step.position + 1])
            lines += [
                f"  first failing check: {step.where} of {len(golden_case.input_ids)} "
                f"(metric {step.metric}); the next prompt token is "
                f"{golden_case.input_ids[step.position + 1]}",
                f"  golden greedy choice there {step.expected_token} {gstep.token_text!r} "
                f"(golden top-1/top-2 gap {step.golden_gap:.4g}), run's {got}",
                f"  {step.detail}",
                f"  prompt text before it: {'...' if start else ''}{context!r}",
            ]
        else:
            lines += [
                f"  first failing step: {step.step} of {n} (metric {step.metric})",
                f"  golden token {step.expected_token} {gstep.token_text!r} "
                f"(golden top-1/top-2 gap {step.golden_gap:.4g}), run's greedy choice {got}",
                f"  {step.detail}",
                f"  golden text so far: {decode(golden_case.token_ids[: step.step + 1])!r}",
            ]
        if step.worst:
            lines.append("  worst log-probability differences at this step:")
            lines.append(f"    {'id':>8}  {'token':<16} {'golden':>12} {'run':>12} {'|Δ|':>10}")
            for d in step.worst:
                lines.append(
                    f"    {d.token_id:>8}  {decode([d.token_id])!r:<16} {d.expected:>12.6g} "
                    f"{d.actual:>12.6g} {d.abs_diff:>10.3g}"
                )
        lines.append(
            f"  at this step: KL {step.kl:.3g}, top-k overlap {step.topk_overlap:.2f}, "
            f"max |Δ log-prob| {step.max_logprob_diff:.3g}"
        )
    lines.append(f"  regenerate the golden (if the change is intended): {regenerate}")
    return "\n".join(lines)
