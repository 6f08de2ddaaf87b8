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

Each property runs FUZZ_EXAMPLES (200) examples, about 1 s each; with the planted-bug tests
(shrinking is most of their time) the file takes about 40 s on 2 shared cores. The
runs use testing/fuzz.py's settings: deterministic (derandomize=True, no example database), so
CI sees the same examples every time; on a failure hypothesis prints the falsifying example and
a `@reproduce_failure(...)` line (print_blob=True) that replays exactly that example.

The `test_planted_*` tests prove each property can fail: each plants one realistic bug in
compare.py with monkeypatch (a one-line edit of the function's source, or a replaced
function), calls the property, asserts that it raises, and that the first failing example came
within the FUZZ_EXAMPLES budget (not only while shrinking).
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
    # Mostly the golden's runner-ups (a real swap), else any id, in or out of the top-k.
    others = st.integers(0, subject.vocab - 1).filter(lambda t: t != expected)
    token = data.draw(st.sampled_from(golden.steps[step].topk_ids[1:3]) | others, "token")
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
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_tie_rule_that_accepts_any_token_fails_the_token_property(monkeypatch):
    monkeypatch.setattr(compare, "_tie_reason", lambda *args: None)
    planted = first_failure(
        monkeypatch, test_a_token_change_beyond_the_tie_rule_fails, match="token change accepted"
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_tie_rule_without_the_run_side_fails_the_token_property(monkeypatch):
    # Only the golden's gap is checked: a run that prefers a golden near-tie by a mile passes.
    _plant(monkeypatch, compare._tie_reason, "if run_gap >= margin:", "if False:")
    planted = first_failure(
        monkeypatch, test_a_token_change_beyond_the_tie_rule_fails, match="token change accepted"
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_tail_by_position_fails_the_order_property(monkeypatch):
    # The run's tail bucket taken as ids k.. (as if the golden's top-k were ids 0..k-1).
    _plant(monkeypatch, compare._check_step, "outside[ids] = False", "outside[: len(ids)] = False")
    planted = first_failure(
        monkeypatch, test_the_verdict_does_not_depend_on_the_order_of_ids, match="differ"
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_run_normalized_by_the_goldens_logsumexp_fails_the_shift_property(monkeypatch):
    # The run's log-probs taken against the golden's stored logsumexp instead of its own.
    _plant(
        monkeypatch,
        compare._check_step,
        "row.astype(np.float64) - logsumexp(row)",
        "row.astype(np.float64) - gstep.logsumexp",
    )
    planted = first_failure(
        monkeypatch, test_a_constant_shift_of_the_logits_changes_nothing, match="differ"
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_top_k_without_the_kth_ties_fails_the_sort_property(monkeypatch):
    # Candidates strictly above the k-th value: the k-th and its ties are lost.
    _plant(monkeypatch, schema.top_k_ids, "negated <= kth", "negated < kth")
    planted = first_failure(monkeypatch, test_top_k_ids_equals_a_stable_full_sort)
    assert planted.first <= FUZZ_EXAMPLES
