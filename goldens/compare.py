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

A run may know only its own top-k at a step (an HTTP server's log-probabilities,
`TopLogprobs`): then what is known is compared and what is bounded is bounded, never guessed
(a partial verdict fails only where the full one would):

  1. a golden id in the run's top-k: its |Δ| as above; one missing from it has a run
     log-probability at most the run's k-th, so |Δ| is at least (golden - run's k-th) and
     that lower bound is checked (the step counts it in `bounded`);
  2. top-k overlap: the golden's top-k ids among the run's first k;
  3. KL over the golden ids the run knows plus one bucket for everything else on both sides
     (the golden's tail and the missing ids, the run's mass outside them): merging outcomes
     never raises a KL, so this is a lower bound of check 3's, equal to it when the run's
     top-k holds the golden's;
  4. the greedy token is the run's top-1; when the golden's token is not in the run's top-k,
     the run prefers its own by at least its top-1 minus its k-th.

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


# A served log-probability above this is a probability above 1 by more than float32 rounding
# of a near-certain token's (its log-probability can round to a few 1e-8 above 0).
ABOVE_ZERO = 1e-5


@dataclasses.dataclass(frozen=True)
class TopLogprobs:
    """A run's next-token distribution where only its top-k is known: ids and log-probabilities,
    best first (what an OpenAI-compatible server answers). Every other id's log-probability is
    at most the last one's."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.ids or len(self.ids) != len(self.logprobs):
            raise ValueError(f"{len(self.ids)} ids and {len(self.logprobs)} log-probabilities")
        if any(b > a for a, b in zip(self.logprobs, self.logprobs[1:], strict=False)):
            raise ValueError(f"log-probabilities not in descending order: {self.logprobs}")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"repeated ids in a top-k: {self.ids}")

    @classmethod
    def from_logits(cls, row: np.ndarray, k: int) -> TopLogprobs:
        """The top-k of a full row of logits, as a server would answer it."""
        log_probs = np.asarray(row, dtype=np.float64) - logsumexp(row)
        ids = top_k_ids(row, k)
        return cls(tuple(int(i) for i in ids), tuple(float(log_probs[i]) for i in ids))

    @property
    def token(self) -> int:
        """The run's greedy choice: its top-1."""
        return self.ids[0]

    @property
    def bound(self) -> float:
        """The k-th log-probability: no id outside the top-k has more."""
        return self.logprobs[-1]


@dataclasses.dataclass(frozen=True)
class LogprobDiff:
    token_id: int
    expected: float  # the golden's log-probability
    actual: float  # the run's; with `bounded`, the most it can be (its top-k's last)
    bounded: bool = False  # the id is not in the run's top-k: |Δ| is at least abs_diff

    @property
    def abs_diff(self) -> float:
        if self.bounded:
            return max(self.expected - self.actual, 0.0)
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
    bounded: int = 0  # golden top-k ids outside a partial run's top-k (only bounded there)

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


Row = np.ndarray | TopLogprobs  # a run's full next-token logits, or only its top-k


def _as_row(row: Row) -> Row:
    return row if isinstance(row, TopLogprobs) else np.asarray(row, dtype=np.float32)


def greedy_token(row: Row) -> int:
    return row.token if isinstance(row, TopLogprobs) else int(np.argmax(row))


def compare_case(
    golden: Case,
    input_ids: Sequence[int] | None,
    tokens: Sequence[int],
    logits: np.ndarray | Sequence[Row],
    tolerance: Tolerance,
    prompt_logits: Mapping[int, Row] | None = None,
) -> CaseReport:
    """Compare a teacher-forced run (its input ids, its greedy choice at each step and the
    per-step logits, row i after the golden's first i tokens: full rows, or `TopLogprobs`
    where the run knows only its top-k) with a golden case. `prompt_logits` maps a prompt
    position to the run's row there (the golden's recorded positions; one the run lacks fails
    as missing). `input_ids` None: the run could not say how it tokenizes the prompt (it was
    given the golden's ids), so only the logits are compared."""
    if isinstance(logits, np.ndarray):
        logits = np.asarray(logits, dtype=np.float32)
    else:
        logits = [_as_row(row) for row in logits]
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
            row = _as_row(row)
            check = _check_step(j, gstep, greedy_token(row), row, tolerance)
        prompt_checks.append(dataclasses.replace(check, position=position, in_prompt=True))
    input_ids_match = input_ids is None or list(input_ids) == list(golden.input_ids)
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


def _full_evidence(gstep: Step, row: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    ids = np.asarray(gstep.topk_ids)
    golden_lp = gstep.topk_log_probs()
    # One float64 copy of the row and one exp over it (a step of a 128k vocabulary is 1 MB
    # a pass): the log-normalizer as schema.logsumexp computes it, bit for bit, and the same
    # exponentials for the tail.
    wide = row.astype(np.float64)
    peak = wide.max()
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, failed as nonfinite (_check_step)
        mass = np.exp(wide - peak)  # each id's probability, times `total`
    total = float(mass.sum())
    run_lp = wide[ids] - (peak + math.log(total))
    k = len(ids)
    run_topk = top_k_ids(row, k)
    overlap = len(set(run_topk.tolist()) & set(ids.tolist())) / k
    # The run's tail is summed directly: 1 - sum(top-k) would cancel to noise when it is small.
    mass[ids] = 0.0
    kl = bucket_kl(golden_lp, run_lp, float(mass.sum()) / total)
    return run_lp, np.ones(k, dtype=bool), overlap, kl


def _partial_evidence(gstep: Step, top: TopLogprobs) -> tuple[np.ndarray, np.ndarray, float, float]:
    ids = list(gstep.topk_ids)
    if len(top.ids) < len(ids):
        raise ValueError(
            f"the run's top-{len(top.ids)} is shorter than the golden's top-{len(ids)}: ask the "
            f"engine for {len(ids)} log-probabilities per position"
        )
    golden_lp = gstep.topk_log_probs()
    run = dict(zip(top.ids, top.logprobs, strict=True))
    known = np.array([i in run for i in ids], dtype=bool)
    run_lp = np.array([run.get(i, top.bound) for i in ids], dtype=np.float64)
    k = len(ids)
    # Known golden ids one by one; the golden's tail and its ids the run does not know merged
    # into one bucket, against the run's mass outside the known ids: 1 minus their sum, at
    # least what its other top-k ids hold, and not below float32 rounding of that sum (servers
    # compute log-probs in float32). A larger rest only lowers the KL: still a lower bound.
    known_lp = run_lp[known]
    known_mass = float(np.exp(known_lp).sum())
    golden_ids = set(ids)
    overlap = len(set(top.ids[:k]) & golden_ids) / k
    with np.errstate(over="ignore"):  # a log-probability above ~709: inf, failed (_check_step)
        others = float(
            sum(
                np.exp(lp)
                for i, lp in zip(top.ids, top.logprobs, strict=True)
                if i not in golden_ids
            )
        )
    run_rest = max(1.0 - known_mass, others, known_mass * 2.0**-24)
    kl = bucket_kl(golden_lp[known], known_lp, run_rest)
    return run_lp, known, overlap, kl


def _check_step(i: int, gstep: Step, token: int, row: Row, tol: Tolerance) -> StepCheck:
    ids = np.asarray(gstep.topk_ids)
    golden_lp = gstep.topk_log_probs()
    if isinstance(row, TopLogprobs):
        run_lp, known, overlap, kl = _partial_evidence(gstep, row)
    else:
        run_lp, known, overlap, kl = _full_evidence(gstep, row)
    # A golden id the run's top-k lacks: its log-prob is at most run_lp (the run's k-th), so
    # |Δ| is at least golden - run_lp (and nothing is known when the golden's is lower).
    diffs = np.where(known, np.abs(run_lp - golden_lp), np.maximum(golden_lp - run_lp, 0.0))
    worst_order = np.argsort(-diffs, kind="stable")[:5]
    worst = [
        LogprobDiff(int(ids[j]), float(golden_lp[j]), float(run_lp[j]), not bool(known[j]))
        for j in worst_order
    ]
    k = len(ids)
    max_diff = float(diffs.max())

    metric, detail = "", ""
    if math.isnan(max_diff) or math.isnan(kl):  # NaN compares as within every bound
        metric = "nonfinite"
        detail = (
            "the run's log-probabilities hold NaN (a NaN or +inf logit): nothing it says can "
            "be compared"
        )
    elif isinstance(row, TopLogprobs) and row.logprobs[0] > ABOVE_ZERO:  # best first
        metric = "nonfinite"
        detail = (
            f"the run's top log-probability {row.logprobs[0]:.5g} is above 0 (a probability "
            "above 1): not a distribution, nothing it says can be compared"
        )
    elif max_diff > tol.logprob_atol:
        j = int(np.argmax(diffs))
        metric = "logprob"
        run_text = f"{run_lp[j]:.5g}" if known[j] else f"at most {run_lp[j]:.5g} (not in its top-k)"
        detail = (
            f"max |Δ log-prob| {max_diff:.3g} > {tol.logprob_atol:g} over the golden top-{k} "
            f"(id {int(ids[j])}: golden {golden_lp[j]:.5g}, run {run_text})"
        )
    elif overlap < tol.topk_overlap_min:
        metric, detail = "topk_overlap", f"top-{k} overlap {overlap:.2f} < {tol.topk_overlap_min:g}"
    elif kl > tol.kl_max:
        metric, detail = "kl", f"KL(golden||run) {kl:.3g} > {tol.kl_max:g}"
    status = FAIL if metric else PASS

    if token != gstep.token_id:
        run_gap = _run_gap(row, token, gstep.token_id)
        tie = _tie_reason(gstep, golden_lp, ids, token, run_gap, tol.near_tie_margin)
        if status == PASS and tie is None:
            status, metric = AMBIGUOUS, "token"
            detail = (
                f"greedy token differs at a near-tie (golden gap {gstep.top_gap:.3g}, run gap "
                f"{run_gap:.3g} < margin {tol.near_tie_margin:g}) and every other check passes"
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
        bounded=int((~known).sum()),
    )


def _run_gap(row: Row, token: int, golden_token: int) -> float:
    """How much the run prefers its `token` to the golden's: exact from a full row; from a
    top-k without the golden's token, the least it can be (its top-1 minus its k-th)."""
    if not isinstance(row, TopLogprobs):
        return float(row[token] - row[golden_token])
    run = dict(zip(row.ids, row.logprobs, strict=True))
    return run.get(token, row.bound) - run.get(golden_token, row.bound)


def _tie_reason(
    gstep: Step, golden_lp: np.ndarray, ids: np.ndarray, token: int, run_gap: float, margin: float
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
                    f"{_run_value(d):>12} {d.abs_diff:>10.3g}"
                )
        lines.append(
            f"  at this step: KL {step.kl:.3g}, top-k overlap {step.topk_overlap:.2f}, "
            f"max |Δ log-prob| {step.max_logprob_diff:.3g}"
        )
    lines.append(f"  regenerate the golden (if the change is intended): {regenerate}")
    return "\n".join(lines)


def _run_value(d: LogprobDiff) -> str:
    """The run's log-probability as a table cell: '<= x' where only its bound is known."""
    return f"<={d.actual:.6g}" if d.bounded else f"{d.actual:.6g}"
