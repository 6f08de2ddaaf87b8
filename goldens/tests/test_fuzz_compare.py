"""Property-based tests of the golden comparison (compare.py) on random goldens and runs.

test_compare.py pins hand-made cases; a verdict that is wrong only for some vocabulary size,
top-k, step count, logit scale or tolerance can slip between them. Here hypothesis draws
random next-token logits (vocabulary 50-300, 1-10 steps, top-k from 2 up to the whole
vocabulary, logit scale 0.5-20 around an offset of -30..30), records a golden from them with
`record_case` (the producers' own path, so every Step field is valid: top-k sorted by logit
then id, float64 logsumexp, stats), and checks four properties of `compare_case`:

- identical inputs PASS: a run whose logits are the golden's source logits passes under every
  entry of tolerances.yaml, with no ambiguous step and |Δ log-prob|, KL at rounding level;
- a token change beyond the tie rule FAILS: the run's greedy token at one step is moved to
  another id so that the tie rule cannot excuse it (the run prefers it by at least the
  near-tie margin, the golden ranks it at least the margin below its top-1, or it is outside
  the golden's top-k), under random tolerances, loose ones included, where only the token
  check can catch it; that step FAILs (metric token or a numeric one) and no other step does;
- the verdict does not depend on the order of ids: renumbering the vocabulary with one
  permutation in golden and run gives the same status, per-step statuses and metrics, first
  failing step, and max |Δ log-prob| and KL to float64 rounding;
- a constant shift of all logits changes nothing: log-probabilities are invariant, so shifting
  the golden's source logits by one constant and the run's by another gives the same report.

Each property runs FUZZ_EXAMPLES (200) examples; with the planted-bug tests (each stops at
its first failing example, unshrunk) the file takes about 12 s on 2 shared cores. The
runs use testing/fuzz.py's settings: deterministic (derandomize=True, no example database), so
CI sees the same examples every time; on a failure hypothesis prints the falsifying example and
a `@reproduce_failure(...)` line (print_blob=True) that replays exactly that example.

The `test_planted_*` tests prove each property can fail: each plants one realistic bug in
compare.py with monkeypatch (a one-line edit of the function's source, or a replaced
function), calls the property, asserts that it raises, and that the first failing example came
within the first half of the FUZZ_EXAMPLES budget (not shrinking, hypothesis stops at
FUZZ_EXAMPLES, so `first <= FUZZ_EXAMPLES` could not fail; the half is a margin).
"""

from __future__ import annotations
import __future__

import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from goldens import compare, schema
from goldens.record import CaseSpec, record_case
from goldens.schema import Case
from goldens.tolerances import Tolerance, entries
from testing.fuzz import first_failure, fuzz_settings

FUZZ_EXAMPLES = 200
INPUT_IDS = [1, 2, 3]
# The stored logsumexp is rounded to 9 decimals, so a golden's own log-probs differ from its
# source logits' by up to 5e-10; sums in another order add float64 rounding (~1e-14).
ROUNDING = 2e-9
# Logits on a grid of 2**-10 with |logit| < 2**11 stay exact in float32 after a shift by a
# multiple of 2**-10 below 2**10 (2**21 grid steps fit the 24-bit mantissa).
GRID = 1024.0


@dataclasses.dataclass(frozen=True)
class Subject:
    """Random next-token logits (float32, steps x vocab) and the top-k a golden keeps."""

    logits: np.ndarray
    top_k: int

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]


def _greedy(logits: np.ndarray) -> list[int]:
    """Greedy tokens; np.argmax takes the lowest id of a tie, as the golden's top-k order does."""
    return [int(np.argmax(row)) for row in logits]


def _golden(logits: np.ndarray, top_k: int) -> Case:
    spec = CaseSpec("fuzz", "a prompt", len(logits), top_k)
    return record_case(spec, INPUT_IDS, _greedy(logits), logits, lambda ids: f"<{ids[0]}>", set())


def _compare(golden: Case, run: np.ndarray, tol: Tolerance) -> compare.CaseReport:
    return compare.compare_case(golden, INPUT_IDS, _greedy(run), run, tol)


@st.composite
def subjects(draw: st.DrawFn) -> Subject:
    vocab = draw(st.integers(50, 300), label="vocab")
    steps = draw(st.integers(1, 10), label="steps")
    top_k = draw(st.integers(2, vocab), label="top_k")
    scale = draw(st.floats(0.5, 20.0), label="scale")
    offset = draw(st.floats(-30.0, 30.0), label="offset")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((steps, vocab)) * scale + offset).astype(np.float32)
    return Subject(logits, top_k)


@st.composite
def runs(draw: st.DrawFn, subject: Subject) -> np.ndarray:
    """A run near the golden: noise of a random size on a random share of the logits, and
    possibly fewer steps than the golden (a run that ended early)."""
    noise = draw(st.sampled_from([0.0, 1e-6, 1e-4, 1e-2, 1.0]), label="noise")
    share = draw(st.floats(0.0, 1.0), label="share")
    steps = draw(st.integers(0, len(subject.logits)), label="run_steps")
    seed = draw(st.integers(0, 2**32 - 1), label="run_seed")
    rng = np.random.default_rng(seed)
    mask = rng.random(subject.logits.shape) < share
    moved = subject.logits + noise * mask * rng.standard_normal(subject.logits.shape)
    return moved.astype(np.float32)[:steps]


def _log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(np.log10(low), np.log10(high)).map(lambda e: float(10.0**e))


@st.composite
def tolerances(draw: st.DrawFn) -> Tolerance:
    """An entry of tolerances.yaml or a random one, from strict to loose enough that a moved
    logit passes every numeric check."""
    if draw(st.booleans(), label="yaml entry"):
        return draw(st.sampled_from(entries()))
    return Tolerance(
        "fuzz/random/cpu",
        logprob_atol=draw(_log_uniform(1e-6, 10.0), label="logprob_atol"),
        kl_max=draw(_log_uniform(1e-8, 10.0), label="kl_max"),
        topk_overlap_min=draw(st.floats(0.0, 1.0), label="topk_overlap_min"),
        near_tie_margin=draw(_log_uniform(1e-5, 2.0), label="near_tie_margin"),
        why="fuzz",
    )


def _verdict(report: compare.CaseReport) -> list[tuple[str, str]]:
    return [(s.status, s.metric) for s in report.steps]


def _numbers(report: compare.CaseReport) -> np.ndarray:
    """Per step: max |Δ log-prob|, KL, top-k overlap."""
    return np.array([(s.max_logprob_diff, s.kl, s.topk_overlap) for s in report.steps])


def _assert_same_report(a: compare.CaseReport, b: compare.CaseReport, atol: float) -> None:
    assert a.status == b.status, f"status differs: {a.status}, {b.status}"
    assert _verdict(a) == _verdict(b), "per-step verdicts differ"
    first_a, first_b = a.first_failing, b.first_failing
    assert (first_a and first_a.step) == (first_b and first_b.step), "first failing step differs"
    np.testing.assert_allclose(
        _numbers(a), _numbers(b), rtol=1e-9, atol=atol, err_msg="per-step metrics differ"
    )
    assert a.max_logprob_diff == pytest.approx(b.max_logprob_diff, rel=1e-9, abs=atol), (
        "max |Δ log-prob| differs"
    )
    assert a.max_kl == pytest.approx(b.max_kl, rel=1e-9, abs=atol), "max KL differs"


@fuzz_settings(FUZZ_EXAMPLES)
@given(subject=subjects(), tol=st.sampled_from(entries()))
def test_a_run_with_the_goldens_own_logits_passes(subject: Subject, tol: Tolerance) -> None:
    golden = _golden(subject.logits, subject.top_k)
    report = _compare(golden, subject.logits, tol)
    assert report.status == compare.PASS, f"identical run: {_verdict(report)}"
    assert not report.ambiguous_steps
    assert report.greedy_agreement == len(subject.logits)
    assert report.max_logprob_diff <= ROUNDING
    assert report.max_kl <= ROUNDING
    assert all(s.topk_overlap == 1.0 for s in report.steps)


def _admitted_by_tie_rule(
    golden: Case, run: np.ndarray, step: int, token: int, margin: float
) -> bool:
    """The tie rule as docs/goldens.md states it, computed here: the run's token is in the
    golden's top-k within the margin of its top-1, and the golden's top-1 is within the margin
    of the run's choice in the run's logits."""
    gstep = golden.steps[step]
    if token not in gstep.topk_ids:
        return False
    golden_gap = gstep.topk_logits[0] - gstep.topk_logits[gstep.topk_ids.index(token)]
    run_gap = float(run[step, token] - run[step, gstep.token_id])
    return golden_gap < margin and run_gap < margin


@fuzz_settings(FUZZ_EXAMPLES)
@given(subject=subjects(), tol=tolerances(), data=st.data())
def test_a_token_change_beyond_the_tie_rule_fails(
    subject: Subject, tol: Tolerance, data: st.DataObject
) -> None:
    step = data.draw(st.integers(0, len(subject.logits) - 1), label="step")
    logits = subject.logits.copy()
    if data.draw(st.booleans(), label="golden near-tie"):
        # The golden's runner-up within the margin: the zone where the tie rule may excuse a swap.
        order = np.argsort(-logits[step], kind="stable")
        fraction = data.draw(st.floats(0.0, 0.99), label="runner-up gap / margin")
        logits[step, order[1]] = logits[step, order[0]] - np.float32(fraction * tol.near_tie_margin)
    golden = _golden(logits, subject.top_k)
    expected = golden.steps[step].token_id
    # Mostly the golden's runner-ups (a real swap, the runner-up itself most often: the one a
    # golden near-tie puts within the margin), else any id, in or out of the top-k.
    others = st.integers(0, subject.vocab - 1).filter(lambda t: t != expected)
    runner_up = st.just(golden.steps[step].topk_ids[1])
    token = data.draw(
        runner_up | st.sampled_from(golden.steps[step].topk_ids[1:3]) | others, "token"
    )
    run = logits.copy()
    row = run[step]
    top = row.max()
    # Either the run prefers its token by at least the margin, or only just (then the golden's
    # own gap must be what rules the tie out).
    wide = data.draw(st.booleans(), label="wide run gap")
    floor = max(top, np.float32(row[expected] + tol.near_tie_margin)) if wide else top
    value = np.float32(floor)
    while value <= top or (wide and float(value - row[expected]) < tol.near_tie_margin):
        value = np.nextafter(value, np.float32(np.inf))
    row[token] = value
    assume(not _admitted_by_tie_rule(golden, run, step, token, tol.near_tie_margin))

    report = _compare(golden, run, tol)
    checked = report.steps[step]
    assert (checked.expected_token, checked.actual_token) == (expected, token)
    assert checked.status == compare.FAIL, f"token change accepted: {checked.status}"
    assert checked.metric in {"token", "logprob", "topk_overlap", "kl"}
    assert report.status == compare.FAIL
    assert [s.step for s in report.steps if s.status != compare.PASS] == [step]


def _tie_near_top(logits: np.ndarray, k: int) -> bool:
    """Equal values among a row's k + 1 largest: there the top-k and greedy choice depend on ids
    by design (ties are broken by id), so the order property does not hold."""
    top = -np.sort(-logits, axis=1)[:, : k + 1]
    return bool((np.diff(top, axis=1) == 0).any())


@fuzz_settings(FUZZ_EXAMPLES)
@given(
    subject=subjects(),
    tol=tolerances(),
    data=st.data(),
    perm_seed=st.integers(0, 2**32 - 1),
)
def test_the_verdict_does_not_depend_on_the_order_of_ids(
    subject: Subject, tol: Tolerance, data: st.DataObject, perm_seed: int
) -> None:
    run = data.draw(runs(subject), label="run")
    assume(not _tie_near_top(subject.logits, subject.top_k))
    assume(not _tie_near_top(run, subject.top_k))
    perm = np.random.default_rng(perm_seed).permutation(subject.vocab)  # id v becomes perm[v]

    def renumbered(logits: np.ndarray) -> np.ndarray:
        out = np.empty_like(logits)
        out[:, perm] = logits
        return out

    report = _compare(_golden(subject.logits, subject.top_k), run, tol)
    permuted = _compare(_golden(renumbered(subject.logits), subject.top_k), renumbered(run), tol)
    _assert_same_report(report, permuted, atol=ROUNDING)
    assert [perm[s.actual_token] for s in report.steps if s.actual_token is not None] == [
        s.actual_token for s in permuted.steps if s.actual_token is not None
    ]


@fuzz_settings(FUZZ_EXAMPLES)
@given(
    subject=subjects(),
    tol=tolerances(),
    data=st.data(),
    golden_shift=st.integers(-(2**20), 2**20),
    run_shift=st.integers(-(2**20), 2**20),
)
def test_a_constant_shift_of_the_logits_changes_nothing(
    subject: Subject, tol: Tolerance, data: st.DataObject, golden_shift: int, run_shift: int
) -> None:
    logits = np.round(subject.logits * GRID) / GRID
    run = np.round(data.draw(runs(subject), label="run") * GRID) / GRID
    report = _compare(_golden(logits, subject.top_k), run, tol)
    shifted = _compare(
        _golden(logits + np.float32(golden_shift / GRID), subject.top_k),
        run + np.float32(run_shift / GRID),
        tol,
    )
    _assert_same_report(report, shifted, atol=ROUNDING)


@fuzz_settings(FUZZ_EXAMPLES)
@given(
    # Few distinct values, so ties at the k-th place are common; NaN and infinities included.
    row=st.lists(
        st.sampled_from([-np.inf, -1.5, 0.0, 0.25, 0.25, 2.0, np.inf, np.nan]), min_size=1
    ).map(lambda values: np.asarray(values, dtype=np.float32)),
    k=st.integers(1, 12),
)
def test_top_k_ids_equals_a_stable_full_sort(row: np.ndarray, k: int) -> None:
    expected = np.argsort(-row, kind="stable")[:k]
    np.testing.assert_array_equal(schema.top_k_ids(row, k), expected)


@st.composite
def reranked_runs(
    draw: st.DrawFn,
    subject: Subject,
    swap: bool | None = None,
    bump: float | None = None,
    seed: int | None = None,
) -> np.ndarray:
    """A run that ranks new ids into its top-k: at every step a few ids outside the golden's
    top-k lifted near the top (above or below its top-1), and possibly the golden's runner-up
    swapped above its top-1 (a near-tie answer, or not). Golden ids fall out of the run's top-k
    while the run still values them: where a partial verdict knows least."""
    run = subject.logits.copy()
    if seed is None:
        seed = draw(st.integers(0, 2**32 - 1), label="rerank seed")
    rng = np.random.default_rng(seed)
    intruders = draw(st.integers(1, 3), label="intruders")
    lift = draw(st.floats(-2.0, 0.5), label="lift")
    if swap is None:
        swap = draw(st.booleans(), label="swap runner-up")
    if bump is None:
        bump = draw(st.floats(1e-6, 1.0), label="runner-up above the top-1 by")
    for row in run:
        order = np.argsort(-row, kind="stable")
        top = row[order[0]]
        outside = order[subject.top_k :]
        if outside.size:
            chosen = rng.choice(outside, size=min(intruders, outside.size), replace=False)
            # With a swap, the new ids sit between the golden's top-1 and its runner-up: the
            # golden's choice leaves the run's top-k while the run still almost ties it.
            spread = bump if swap else lift
            row[chosen] = top + np.float32(spread) * rng.random(chosen.size).astype(np.float32)
        if swap:
            row[order[1]] = max(top + np.float32(bump), np.nextafter(row.max(), np.inf))
    return run


def _partial(run: np.ndarray, k: int) -> list[compare.TopLogprobs]:
    """What a server answering with its top-k would return for these logits."""
    return [compare.TopLogprobs.from_logits(row, min(k, row.size)) for row in run]


def _compare_partial(golden: Case, run: np.ndarray, k: int, tol: Tolerance) -> compare.CaseReport:
    return compare.compare_case(golden, INPUT_IDS, _greedy(run), _partial(run, k), tol)


@fuzz_settings(FUZZ_EXAMPLES)
@given(subject=subjects(), tol=tolerances(), data=st.data())
def test_a_partial_run_fails_only_where_the_full_run_fails(
    subject: Subject, tol: Tolerance, data: st.DataObject
) -> None:
    """Soundness of the partial rules: from a run's top-k (k from the golden's to the
    vocabulary's) every
    |Δ log-prob| and KL is at most the full row's, and a step that FAILs partially FAILs in
    full. A partial verdict may miss a failure (what it cannot see), never invent one."""
    # Often a small golden top-k: there a few new ids push the golden's top-1 out of the run's.
    top_k = data.draw(st.integers(2, 4) | st.just(subject.top_k), label="golden top-k")
    subject = dataclasses.replace(subject, top_k=min(top_k, subject.vocab))
    run = data.draw(runs(subject) | reranked_runs(subject), label="run")
    assume(not _tie_near_top(run, subject.top_k))
    # Mostly the golden's own k (a server asked for it), where golden ids fall out most.
    wider = st.integers(subject.top_k, subject.vocab)
    k = data.draw(st.just(subject.top_k) | wider, label="run top-k")
    golden = _golden(subject.logits, subject.top_k)
    full = _compare(golden, run, tol)
    partial = _compare_partial(golden, run, k, tol)
    for f, p in zip(full.steps, partial.steps, strict=True):
        assert p.max_logprob_diff <= f.max_logprob_diff + ROUNDING, (
            f"partial |Δ| above the full one at step {f.step}: {p.max_logprob_diff} > "
            f"{f.max_logprob_diff}"
        )
        assert p.kl <= f.kl * (1 + 1e-9) + ROUNDING, (
            f"partial KL above the full one at step {f.step}: {p.kl} > {f.kl}"
        )
        if p.status == compare.FAIL:
            assert f.status == compare.FAIL, (
                f"partial FAIL where the full run is {f.status} at step {f.step} ({p.detail})"
            )


@fuzz_settings(FUZZ_EXAMPLES)
@given(subject=subjects(), tol=tolerances(), data=st.data())
def test_a_partial_run_that_holds_the_goldens_top_k_is_judged_as_the_full_run(
    subject: Subject, tol: Tolerance, data: st.DataObject
) -> None:
    """Exactness: when the run's top-k contains the golden's (k_run >= k, here the top-k of
    the same ids), the partial comparison sees every golden id: the same |Δ log-prob|,
    overlap and token checks as the full row, and its KL at most the full one's."""
    run = data.draw(runs(subject), label="run")
    assume(not _tie_near_top(run, subject.top_k))
    golden = _golden(subject.logits, subject.top_k)
    covering = [
        max(
            subject.top_k,
            int(np.flatnonzero(np.isin(schema.top_k_ids(row, subject.vocab), s.topk_ids)).max())
            + 1,
        )
        for row, s in zip(run, golden.steps, strict=False)
    ]
    assume(covering)
    full = _compare(golden, run, tol)
    partial = _compare_partial(golden, run, max(covering), tol)
    for f, p in zip(full.steps, partial.steps, strict=True):
        assert p.bounded == 0
        assert p.max_logprob_diff == pytest.approx(f.max_logprob_diff, rel=1e-9, abs=ROUNDING)
        assert p.topk_overlap == f.topk_overlap
        assert p.kl <= f.kl * (1 + 1e-9) + ROUNDING
        if f.metric in ("", "token", "logprob", "topk_overlap"):
            assert (p.status, p.metric) == (f.status, f.metric), f"step {f.step}: {p.detail}"


@fuzz_settings(FUZZ_EXAMPLES)
@given(subject=subjects(), data=st.data())
def test_a_near_tie_answer_whose_golden_token_left_the_runs_top_k_stays_ambiguous(
    subject: Subject, data: st.DataObject
) -> None:
    """The tie rule from a top-k: the golden's top-1 pushed out of the run's top-k by new ids
    that sit between it and the run's choice (the golden's runner-up, now just above it).
    Under loose numeric thresholds the full row calls such a swap AMBIGUOUS when both gaps are
    under the margin; the partial verdict, bounding the run's gap by its top-1 minus its k-th,
    must not call it a FAIL."""
    top_k = data.draw(st.integers(2, 4), label="golden top-k")
    subject = dataclasses.replace(subject, top_k=min(top_k, subject.vocab))
    margin = data.draw(st.floats(0.05, 2.0), label="near-tie margin")
    tol = Tolerance("fuzz/loose/cpu", 10.0, 10.0, 0.0, margin, "fuzz")
    logits = subject.logits.copy()
    for row in logits:
        order = np.argsort(-row, kind="stable")
        fraction = data.draw(st.floats(0.0, 0.9), label="golden gap / margin")
        row[order[1]] = row[order[0]] - np.float32(fraction * margin)
    golden = _golden(logits, subject.top_k)
    bump = data.draw(st.floats(1e-3, 0.9), label="run gap / margin") * margin
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    run = data.draw(
        reranked_runs(dataclasses.replace(subject, logits=logits), swap=True, bump=bump, seed=seed)
    )
    full = _compare(golden, run, tol)
    partial = _compare_partial(golden, run, subject.top_k, tol)
    for f, p in zip(full.steps, partial.steps, strict=True):
        if f.status == compare.AMBIGUOUS:
            assert p.status == compare.AMBIGUOUS, (
                f"partial {p.status} where the full run is AMBIGUOUS at step {f.step} ({p.detail})"
            )


def test_a_run_top_k_shorter_than_the_goldens_is_refused():
    logits = np.linspace(4.0, -4.0, 64, dtype=np.float32)[None, :]
    with pytest.raises(ValueError, match="ask the engine for 20 log-probabilities"):
        _compare_partial(_golden(logits, 20), logits, 5, entries("own", "float32")[0])


def test_a_golden_id_below_the_runs_top_k_is_bounded_not_guessed():
    logits = np.linspace(4.0, -4.0, 64, dtype=np.float32)[None, :]
    golden = _golden(logits, 20)
    run = logits.copy()
    run[0, 19] = -30.0  # the golden's 20th id falls far out of the run's distribution
    tol = entries("own", "float32")[0]
    report = _compare_partial(golden, run, 20, tol)
    step = report.steps[0]
    assert step.bounded == 1
    assert step.status == compare.FAIL and step.metric == "logprob"
    assert "not in its top-k" in step.detail
    # The full row knows the value; the partial verdict only a lower bound of its |Δ|.
    assert step.max_logprob_diff < _compare(golden, run, tol).steps[0].max_logprob_diff


def _plant(monkeypatch: pytest.MonkeyPatch, function: Callable, old: str, new: str) -> None:
    """Replace `function` in its module (and where compare.py imported it) by a copy of its
    source with `old` edited to `new`."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == 1, f"{old!r} is not in {function.__name__} once: update the plant"
    flags = __future__.annotations.compiler_flag
    module = sys.modules[function.__module__]
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), module.__file__, "exec", flags=flags), namespace)
    for owner in {module, compare}:
        if getattr(owner, function.__name__, None) is function:
            monkeypatch.setattr(owner, function.__name__, namespace[function.__name__])


def test_planted_step_misalignment_fails_the_identical_run_property(monkeypatch):
    # Teacher-forcing off by one: step i compared with the run's logits of step i - 1.
    _plant(monkeypatch, compare.compare_case, "logits[i], tolerance", "logits[i - 1], tolerance")
    planted = first_failure(
        monkeypatch, test_a_run_with_the_goldens_own_logits_passes, match="identical"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_tie_rule_that_accepts_any_token_fails_the_token_property(monkeypatch):
    monkeypatch.setattr(compare, "_tie_reason", lambda *args: None)
    planted = first_failure(
        monkeypatch, test_a_token_change_beyond_the_tie_rule_fails, match="token change accepted"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_tie_rule_without_the_run_side_fails_the_token_property(monkeypatch):
    # Only the golden's gap is checked: a run that prefers a golden near-tie by a mile passes.
    _plant(monkeypatch, compare._tie_reason, "if run_gap >= margin:", "if False:")
    planted = first_failure(
        monkeypatch, test_a_token_change_beyond_the_tie_rule_fails, match="token change accepted"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_tail_by_position_fails_the_order_property(monkeypatch):
    # The run's tail bucket taken as ids k.. (as if the golden's top-k were ids 0..k-1).
    _plant(monkeypatch, compare._full_evidence, "mass[ids] = 0.0", "mass[: len(ids)] = 0.0")
    planted = first_failure(
        monkeypatch, test_the_verdict_does_not_depend_on_the_order_of_ids, match="differ"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_run_normalized_by_the_goldens_logsumexp_fails_the_shift_property(monkeypatch):
    # The run's log-probs taken against the golden's stored logsumexp instead of its own.
    _plant(
        monkeypatch,
        compare._full_evidence,
        "run_lp = wide[ids] - (peak + math.log(total))",
        "run_lp = wide[ids] - gstep.logsumexp",
    )
    planted = first_failure(
        monkeypatch, test_a_constant_shift_of_the_logits_changes_nothing, match="differ"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_top_k_without_the_kth_ties_fails_the_sort_property(monkeypatch):
    # Candidates strictly above the k-th value: the k-th and its ties are lost.
    _plant(monkeypatch, schema.top_k_ids, "negated <= kth", "negated < kth")
    planted = first_failure(
        monkeypatch, test_top_k_ids_equals_a_stable_full_sort, match="Arrays are not equal"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_bound_taken_as_the_value_fails_the_partial_soundness_property(monkeypatch):
    # A golden id missing from the run's top-k compared as if its log-prob were the k-th's.
    _plant(
        monkeypatch,
        compare._check_step,
        "np.maximum(golden_lp - run_lp, 0.0)",
        "np.abs(run_lp - golden_lp)",
    )
    planted = first_failure(
        monkeypatch, test_a_partial_run_fails_only_where_the_full_run_fails, match="partial"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_rest_without_the_missing_ids_fails_the_partial_soundness_property(monkeypatch):
    # The run's rest bucket as the mass outside its top-k only: the golden ids it lacks lose
    # their share, and the KL comes out above the full one.
    _plant(
        monkeypatch,
        compare._partial_evidence,
        "max(1.0 - known_mass, others, known_mass * 2.0**-24)",
        "max(1.0 - float(np.exp(top.logprobs).sum()), known_mass * 2.0**-24)",
    )
    planted = first_failure(
        monkeypatch, test_a_partial_run_fails_only_where_the_full_run_fails, match="partial"
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first


def test_planted_tie_gap_without_the_bound_fails_the_partial_soundness_property(monkeypatch):
    # A golden token outside the run's top-k taken as infinitely unlikely: near-ties fail.
    _plant(
        monkeypatch,
        compare._run_gap,
        "run.get(golden_token, row.bound)",
        "run.get(golden_token, -math.inf)",
    )
    planted = first_failure(
        monkeypatch,
        test_a_near_tie_answer_whose_golden_token_left_the_runs_top_k_stays_ambiguous,
        match="partial",
    )
    assert planted.first <= FUZZ_EXAMPLES // 2, planted.first
