"""The comparison on synthetic runs: what passes, what fails, what is ambiguous, and how the
failure reads."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from goldens import compare, tolerances
from goldens.record import CaseSpec, record_case
from goldens.sanity import degeneracy_problems
from goldens.schema import Case, Golden, Provenance, Step
from goldens.tolerances import MODE_REFERENCES, Tolerance, entries, judged_lane, tolerance

VOCAB = 64
TOL = Tolerance(
    "own/float32/cpu",
    logprob_atol=1e-4,
    kl_max=1e-6,
    topk_overlap_min=0.95,
    near_tie_margin=2e-4,
    why="test",
)
LOOSE_TIE = dataclasses.replace(TOL, logprob_atol=1e-2, kl_max=1e-3, near_tie_margin=2e-2)


def _logits(steps: int = 6, seed: int = 0) -> np.ndarray:
    # A fixed, well-separated pattern: step i prefers token (3 * i + 1) % VOCAB by a wide gap.
    base = np.cos(np.arange(VOCAB)[None, :] * (np.arange(steps)[:, None] + 1) * 0.7 + seed)
    logits = base.astype(np.float32) * 2.0
    for i in range(steps):
        logits[i, (3 * i + 1) % VOCAB] = 8.0
    return logits


def _case(logits: np.ndarray, top_k: int = 20):
    tokens = [int(np.argmax(row)) for row in logits]
    spec = CaseSpec("prose", "The capital of France is", len(tokens), top_k)
    return record_case(spec, [1, 2, 3], tokens, logits, lambda ids: f"<{ids[0]}>", set()), tokens


def _greedy(logits: np.ndarray) -> list[int]:
    return [int(np.argmax(row)) for row in logits]


def test_identical_run_passes_with_zero_difference():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens, logits, TOL)
    assert report.status == compare.PASS
    assert report.max_logprob_diff == pytest.approx(0.0, abs=1e-6)
    assert report.max_kl == pytest.approx(0.0, abs=1e-9)
    assert report.first_failing is None
    assert report.greedy_agreement == 6


def test_a_shift_of_every_logit_is_not_a_change_of_log_probabilities():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens, logits + 3.0, TOL)
    assert report.status == compare.PASS


def test_logprob_drift_beyond_atol_fails_at_that_step_and_later_steps_are_still_compared():
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[3, case.steps[3].topk_ids[5]] += 1e-3  # not enough to change the token
    moved[5, case.steps[5].topk_ids[2]] += 1e-3
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, TOL)
    assert report.status == compare.FAIL
    assert report.first_failing.step == 3
    assert report.first_failing.metric == "logprob"
    assert [s.step for s in report.steps if s.status == compare.FAIL] == [3, 5]
    assert report.first_failing.max_logprob_diff == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nan_or_infinite_logit_at_the_goldens_token_fails_that_step(bad):
    """A NaN or +inf logit makes the row's log-probabilities NaN, which compare as within
    every bound; argmax still picks the golden's token. It passed (planted: the comparison
    without its NaN check); now it fails, named, and the steps around it still pass."""
    logits = _logits()
    case, tokens = _case(logits)
    broken = logits.copy()
    broken[2, tokens[2]] = bad
    report = compare.compare_case(case, [1, 2, 3], tokens, broken, TOL)
    assert [(s.step, s.status) for s in report.steps if s.status != compare.PASS] == [
        (2, compare.FAIL)
    ]
    assert report.first_failing.metric == "nonfinite"


def test_a_server_row_of_nan_log_probabilities_fails_that_step():
    logits = _logits()
    case, tokens = _case(logits)
    rows = [compare.TopLogprobs.from_logits(row, 20) for row in logits]
    rows[2] = compare.TopLogprobs(rows[2].ids, (math.nan,) * len(rows[2].ids))
    report = compare.compare_case(case, [1, 2, 3], tokens, rows, TOL)
    assert report.status == compare.FAIL
    assert (report.first_failing.step, report.first_failing.metric) == (2, "nonfinite")


def test_drift_within_tolerance_passes():
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[:, 10] += 5e-5
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, TOL)
    assert report.status == compare.PASS


def test_changed_token_above_margin_fails_and_names_both_tokens():
    logits = _logits()
    case, _tokens = _case(logits)
    moved = logits.copy()
    moved[2, 40] = 9.0
    report = compare.compare_case(case, [1, 2, 3], _greedy(moved), moved, TOL)
    assert report.status == compare.FAIL
    step = report.first_failing
    assert (step.step, step.expected_token, step.actual_token) == (2, 7, 40)
    assert report.greedy_agreement == 2
    text = compare.format_failure(report, case, "g.json", lambda ids: f"<{ids[0]}>", "REGEN")
    assert "first failing step: 2 of 6" in text
    assert "golden token 7 '<7>'" in text and "run's greedy choice 40 '<40>'" in text
    assert "free-running greedy agreement: 2 of 6" in text
    assert "worst log-probability differences" in text and "REGEN" in text


def _near_tie_golden():
    logits = _logits()
    logits[1, 20] = logits[1, 4] - 5e-3  # runner-up within LOOSE_TIE's near-tie margin
    case, _tokens = _case(logits)
    assert case.steps[1].top_gap < LOOSE_TIE.near_tie_margin
    return logits, case


def test_a_swap_at_a_near_tie_with_passing_numbers_is_ambiguous_and_every_step_is_checked():
    logits, case = _near_tie_golden()
    run = logits.copy()
    run[1, 20] = logits[1, 4] + 1e-3  # the run picks the runner-up; log-probs move ~3e-3
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, LOOSE_TIE)
    assert report.status == compare.PASS
    assert [s.step for s in report.ambiguous_steps] == [1]
    assert len(report.steps) == 6 and report.greedy_agreement == 1


def test_a_swap_at_a_near_tie_fails_when_the_logprobs_moved_too_far():
    logits, case = _near_tie_golden()
    run = logits.copy()
    run[1, 20] = logits[1, 4] + 1e-3
    run[1, case.steps[1].topk_ids[3]] += 0.5  # a bug elsewhere in the same step
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, LOOSE_TIE)
    assert report.status == compare.FAIL
    assert report.first_failing.step == 1 and report.first_failing.metric == "logprob"
    assert not report.ambiguous_steps


def test_a_swap_is_not_ambiguous_when_the_run_prefers_its_token_by_more_than_the_margin():
    logits, case = _near_tie_golden()
    run = logits.copy()
    run[1, 20] = logits[1, 4] + 0.05  # beyond the margin in the run's distribution
    loose_numbers = dataclasses.replace(LOOSE_TIE, logprob_atol=1.0, kl_max=1.0)
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, loose_numbers)
    assert report.status == compare.FAIL
    assert report.first_failing.metric == "token"
    assert "ranks the golden's token" in report.first_failing.detail


def test_a_run_that_picks_a_token_outside_the_goldens_near_ties_fails():
    logits, case = _near_tie_golden()
    run = logits.copy()
    run[1, 50] = logits[1, 4] + 1e-3  # a near-tie in the run, but not one the golden had
    loose_numbers = dataclasses.replace(LOOSE_TIE, logprob_atol=10.0, kl_max=10.0)
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, loose_numbers)
    assert report.status == compare.FAIL
    assert report.first_failing.metric == "token"


def test_a_run_that_emits_one_token_at_every_step_fails_even_at_a_golden_near_tie():
    logits, case = _near_tie_golden()
    constant = np.zeros_like(logits)
    constant[:, 20] = 58.0
    report = compare.compare_case(case, [1, 2, 3], _greedy(constant), constant, LOOSE_TIE)
    assert report.status == compare.FAIL
    assert all(s.status == compare.FAIL for s in report.steps)


def test_kl_from_topk_equals_full_kl_when_topk_covers_the_vocabulary():
    logits = _logits(steps=1)
    case, tokens = _case(logits, top_k=VOCAB)
    run = logits.copy()
    run[0, :10] += 0.3
    p = np.exp(logits[0] - np.logaddexp.reduce(logits[0].astype(np.float64)))
    q = np.exp(run[0] - np.logaddexp.reduce(run[0].astype(np.float64)))
    full_kl = float(np.sum(p * np.log(p / q)))
    loose = Tolerance("t", 1.0, 1.0, 0.0, 1e-3, "")
    report = compare.compare_case(case, [1, 2, 3], tokens, run, loose)
    assert report.max_kl == pytest.approx(full_kl, rel=1e-4)


def test_topk_tail_bucket_makes_kl_a_lower_bound():
    logits = _logits(steps=1)
    case, tokens = _case(logits, top_k=20)
    run = logits.copy()
    tail = [i for i in range(VOCAB) if i not in case.steps[0].topk_ids]
    run[0, tail] += 1.0  # moves mass into the tail only
    loose = Tolerance("t", 10.0, 10.0, 0.0, 1e-3, "")
    report = compare.compare_case(case, [1, 2, 3], tokens, run, loose)
    assert 0 < report.max_kl < math.inf


def test_run_that_ends_early_fails_at_the_missing_step():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens[:4], logits[:4], TOL)
    assert report.status == compare.FAIL
    assert report.first_failing.step == 4
    assert "ended early" in report.first_failing.detail


def test_changed_input_ids_fail_even_when_logits_match():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 4], tokens, logits, TOL)
    assert report.status == compare.FAIL
    text = compare.format_failure(report, case, "g", str, "R", [1, 2, 4])
    assert "input ids differ" in text


def test_every_encoding_and_device_has_a_documented_tolerance():
    for reference in ("own", "torch"):
        for encoding in ("float32", "bfloat16", "q4_k", "q4_1"):
            for device in ("cpu", "cuda"):
                tol = tolerance(reference, encoding, device)
                assert tol.why.strip()
                assert tol.near_tie_margin == pytest.approx(2 * tol.logprob_atol), tol.key
        for reference_fallback in ("bfloat16",):
            assert tolerance(reference, reference_fallback, "cuda", fallback=True).why
    for encoding in ("q4_k", "q4_1"):  # the ggml mode's goldens, on the CPU only
        tol = tolerance("ggml", encoding, "cpu")
        assert tol.why.strip() and tol.near_tie_margin == pytest.approx(2 * tol.logprob_atol)


def test_missing_tolerance_names_the_key():
    with pytest.raises(KeyError, match="own/float16/cpu"):
        tolerance("own", "float16", "cpu")


def test_an_entry_that_judges_the_short_cases_narrows_every_lane_that_asks_more():
    short = dataclasses.replace(TOL, key="ggml/q4_k/llama_cpp", cases="short")
    assert judged_lane("all", short) == "short"
    assert judged_lane("short", short) == "short"
    with pytest.raises(ValueError, match="ggml/q4_k/llama_cpp judges the short cases only"):
        judged_lane("long", short)
    for lane in ("all", "short", "long"):
        assert judged_lane(lane, TOL) == lane
    assert tolerance("ggml", "q4_k", "llama_cpp").cases == "short"  # the one entry that does


def test_an_entry_with_unknown_cases_is_refused_naming_it(monkeypatch):
    table = {"own": {"float32": {"cpu": {**_entry(), "cases": "long"}}}}
    monkeypatch.setattr(tolerances, "_table", lambda: table)
    with pytest.raises(ValueError, match="own/float32/cpu: cases 'long' is not one of all, short"):
        tolerance("own", "float32", "cpu")


def _entry() -> dict:
    return {
        "logprob_atol": 1e-3, "kl_max": 1e-6, "topk_overlap_min": 0.95,
        "near_tie_margin": 2e-3, "why": "w",
    }  # fmt: skip


def _golden(cases) -> Golden:
    prov = Provenance(
        "engine",
        "1",
        "m",
        "float32",
        "all",
        "cpu",
        "float32",
        "f.gguf",
        "0" * 64,
        "2.13.0",
        "float32",
    )
    return Golden(prov, cases)


def test_sanity_flags_constant_tokens_flat_logits_and_near_ties():
    flat = np.zeros((10, 50), dtype=np.float32)
    flat[:, 7] = 1e-4
    case = record_case(CaseSpec("flat", "x", 10, 20), [1], [7] * 10, flat, str, set())
    problems = degeneracy_problems(_golden([case]), near_tie_margin=1e-3)
    assert any("only 1 distinct tokens" in p for p in problems)
    assert any("near-ties" in p for p in problems)
    assert any("logit std" in p for p in problems)


def test_sanity_accepts_a_discriminating_golden():
    logits = _logits(steps=10)
    case, _ = _case(logits)
    assert degeneracy_problems(_golden([case]), near_tie_margin=1e-3) == []


def test_sanity_refuses_an_exact_top1_tie():
    logits = _logits(steps=10)
    logits[4, 30] = logits[4].max()  # a second token with exactly the top-1 logit
    case, _ = _case(logits)
    problems = degeneracy_problems(_golden([case]), near_tie_margin=1e-3)
    assert any("1 exact top-1 ties" in p and "('prose', 4)" in p for p in problems)


def test_every_tolerance_sits_between_its_noise_floor_and_its_mutation_floor():
    from goldens.tolerances import MODE_REFERENCES, entries

    judged = entries() + [t for ref in MODE_REFERENCES for t in entries(ref)]
    for tol in judged + [t.long for t in judged if t.long is not None]:
        assert tol.noise_floor and tol.mutation_floor, f"{tol.key}: floors not recorded"
        assert tol.noise_floor.logprob < tol.logprob_atol < tol.mutation_floor.logprob, tol
        assert tol.noise_floor.kl < tol.kl_max, tol
        if tol.key.endswith(("/cpu", "/cpu/long")):  # another CPU's kernels must pass too
            assert tol.isa_noise_floor, f"{tol.key}: cross-ISA noise floor not recorded"
            assert tol.isa_noise_floor.logprob < tol.logprob_atol, tol
            assert tol.isa_noise_floor.kl < tol.kl_max, tol


def _case_with_positions(logits: np.ndarray, prompt_rows: np.ndarray, positions: list[int]):
    tokens = _greedy(logits)
    spec = CaseSpec("long", "a long prompt", len(tokens), 20, positions_every=256, long=True)
    input_ids = list(range(1, max(positions) + 3))
    case = record_case(
        spec,
        input_ids,
        tokens,
        logits,
        lambda ids: f"<{ids[0]}>",
        set(),
        positions=positions,
        prompt_logits=prompt_rows,
    )
    return case, tokens, input_ids


def test_prompt_positions_are_compared_by_the_step_rules_and_named_by_position():
    logits, prompt_rows = _logits(), _logits(steps=3, seed=1)
    positions = [0, 255, 4097]
    case, tokens, input_ids = _case_with_positions(logits, prompt_rows, positions)
    rows = dict(zip(positions, prompt_rows, strict=True))
    same = compare.compare_case(case, input_ids, tokens, logits, TOL, rows)
    assert same.status == compare.PASS and len(same.prompt_checks) == 3
    nudge = np.zeros(VOCAB, dtype=np.float32)
    nudge[case.position_steps[2].topk_ids[3]] = 1e-3  # not enough to change the argmax
    moved = {**rows, 4097: rows[4097] + nudge}
    report = compare.compare_case(case, input_ids, tokens, logits, TOL, moved)
    assert report.status == compare.FAIL
    assert report.first_failing is None  # every generated step passes
    check = report.first_failing_check
    assert (check.in_prompt, check.position, check.metric) == (True, 4097, "logprob")
    assert check.where == "prompt position 4097"
    assert report.steps[0].position == len(input_ids) - 1  # the last prompt position
    text = compare.format_failure(report, case, "g.json", lambda ids: "x", "regen")
    assert "prompt positions: 1 of 3 fail, the first at position 4097" in text
    assert "first failing check: prompt position 4097 of 4099 (metric logprob)" in text


def test_a_prompt_position_the_run_lacks_fails_as_missing():
    logits, prompt_rows = _logits(), _logits(steps=2, seed=1)
    case, tokens, input_ids = _case_with_positions(logits, prompt_rows, [3, 9])
    report = compare.compare_case(case, input_ids, tokens, logits, TOL, {3: prompt_rows[0]})
    assert report.status == compare.FAIL
    assert [(c.position, c.metric) for c in report.prompt_checks if c.status == "FAIL"] == [
        (9, "missing")
    ]


def test_an_entrys_long_thresholds_judge_the_long_cases_only():
    """bfloat16's `cpu` entry holds its short cases to 0.05 and its long ones to `long`'s
    0.12 (one flipped rounding through a long prompt); the rest of the entry is inherited,
    and an entry without `long` judges every case alike."""
    entry = tolerance("own", "bfloat16", "cpu")
    assert entry.for_case(long=False) is entry and entry.logprob_atol == 0.05
    long = entry.for_case(long=True)
    assert (long.key, long.logprob_atol, long.kl_max, long.near_tie_margin) == (
        "own/bfloat16/cpu/long",
        0.12,
        2e-3,
        0.24,
    )
    assert long.topk_overlap_min == entry.topk_overlap_min
    assert long.noise_floor == entry.noise_floor and long.mutation_floor == entry.mutation_floor
    assert long.isa_noise_floor.logprob == 0.0867 and long.long is None
    float32 = tolerance("own", "float32", "cpu")
    assert float32.long is None and float32.for_case(long=True) is float32


# format_failure's whole text, from hand-made reports whose every printed value is known: a
# token's text is its id in angle brackets, so a slice off by one shows.
def _brackets(ids) -> str:
    return "".join(f"<{i}>" for i in ids)


def _step(token: int) -> Step:
    return Step(token, f"<{token}>", [token, 5], [3.0, 1.75], 3.5, {})


def _check(step: int, token: int, **failing) -> compare.StepCheck:
    fields = {
        "status": compare.PASS,
        "metric": "",
        "detail": "",
        "actual_token": token,
        "max_logprob_diff": 0.0,
        "kl": 0.0,
        "topk_overlap": 1.0,
        "worst": [],
    }
    return compare.StepCheck(
        step=step, expected_token=token, golden_gap=1.25, **{**fields, **failing}
    )


WORST = [
    compare.LogprobDiff(13, expected=-0.5, actual=-0.503),
    compare.LogprobDiff(7, expected=-2.25, actual=-2.249),
    compare.LogprobDiff(9, expected=-6.0, actual=-4.5, bounded=True),  # nothing known: 0
]


def test_the_failure_text_of_a_generated_step_reads_in_full():
    case = Case(
        "prose", "The capital of France is", [1, 2, 3], [_step(t) for t in (11, 12, 13, 14)]
    )
    failing = _check(
        2,
        13,
        status=compare.FAIL,
        metric="logprob",
        detail="max |Δ log-prob| 0.003 > 0.0001 over the golden top-2 (id 13: ...)",
        actual_token=40,
        max_logprob_diff=0.003,
        kl=2.5e-05,
        topk_overlap=0.5,
        worst=WORST,
        position=4,
    )
    steps = [_check(0, 11), _check(1, 12), failing, _check(3, 14)]
    report = compare.CaseReport("prose", case.prompt, compare.FAIL, steps, True, TOL)
    text = compare.format_failure(report, case, "g.json", _brackets, "REGEN")
    assert text.splitlines() == [
        "golden mismatch in case 'prose' ('The capital of France is', 3 prompt tokens) "
        "against g.json",
        "  tolerance own/float32/cpu: |Δ log-prob| 0.0001, KL 1e-06, top-k overlap 0.95, "
        "near-tie margin 0.0002",
        "  teacher-forced: 1 of 4 steps fail (logprob), 0 ambiguous; max |Δ log-prob| 0.003, "
        "max KL 2.5e-05",
        "  free-running greedy agreement: 2 of 4 steps",
        "  first failing step: 2 of 4 (metric logprob)",
        "  golden token 13 '<13>' (golden top-1/top-2 gap 1.25), run's greedy choice 40 '<40>'",
        "  max |Δ log-prob| 0.003 > 0.0001 over the golden top-2 (id 13: ...)",
        "  golden text so far: '<11><12><13>'",
        "  worst log-probability differences at this step:",
        "          id  token                  golden          run        |Δ|",
        "          13  '<13>'                   -0.5       -0.503      0.003",
        "           7  '<7>'                   -2.25       -2.249      0.001",
        "           9  '<9>'                      -6       <=-4.5          0",
        "  at this step: KL 2.5e-05, top-k overlap 0.50, max |Δ log-prob| 0.003",
        "  regenerate the golden (if the change is intended): REGEN",
    ]


def test_the_failure_text_of_a_prompt_position_reads_in_full():
    input_ids = list(range(100, 120))  # 20 prompt tokens; position 12 predicts id 113
    case = Case(
        "long",
        "a long prompt",
        input_ids,
        [_step(11), _step(12)],
        positions=[4, 12],
        position_steps=[_step(105), _step(500)],
    )
    failing = _check(
        1,
        500,
        status=compare.FAIL,
        metric="kl",
        detail="KL(golden||run) 0.02 > 1e-06",
        actual_token=501,
        max_logprob_diff=5e-05,
        kl=0.02,
        worst=WORST[:1],
        position=12,
        in_prompt=True,
    )
    prompt_checks = [_check(0, 105, position=4, in_prompt=True), failing]
    steps = [_check(0, 11, position=19), _check(1, 12, position=20)]
    report = compare.CaseReport(
        "long", case.prompt, compare.FAIL, steps, True, TOL, prompt_checks=prompt_checks
    )
    text = compare.format_failure(report, case, "g.json", _brackets, "REGEN")
    assert text.splitlines() == [
        "golden mismatch in case 'long' ('a long prompt', 20 prompt tokens) against g.json",
        "  tolerance own/float32/cpu: |Δ log-prob| 0.0001, KL 1e-06, top-k overlap 0.95, "
        "near-tie margin 0.0002",
        "  teacher-forced: 0 of 2 steps fail (kl), 0 ambiguous; max |Δ log-prob| 5e-05, "
        "max KL 0.02",
        "  free-running greedy agreement: 2 of 2 steps",
        "  prompt positions: 1 of 2 fail, the first at position 12 (recorded up to position 12)",
        "  first failing check: prompt position 12 of 20 (metric kl); the next prompt token is 113",
        "  golden greedy choice there 500 '<500>' (golden top-1/top-2 gap 1.25), run's 501 '<501>'",
        "  KL(golden||run) 0.02 > 1e-06",
        "  prompt text before it: ...'<105><106><107><108><109><110><111><112>'",
        "  worst log-probability differences at this step:",
        "          id  token                  golden          run        |Δ|",
        "          13  '<13>'                   -0.5       -0.503      0.003",
        "  at this step: KL 0.02, top-k overlap 1.00, max |Δ log-prob| 5e-05",
        "  regenerate the golden (if the change is intended): REGEN",
    ]


# The boundaries and guards a mutation sweep found unpinned: each test below passed every
# plant of its rule (a strict comparison at the bound, the NaN guard of a partial row, the
# tail bucket's noise floor raised to 1e-3) before it was written, and fails each now.


def test_a_logprob_difference_exactly_at_the_tolerance_passes():
    """Check 1 is `|Δ| <= logprob_atol`: a step whose max |Δ| equals the tolerance passes."""
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[3, case.steps[3].topk_ids[5]] += 1e-3
    measured = compare.compare_case(case, [1, 2, 3], tokens, moved, TOL).steps[3]
    at_bound = dataclasses.replace(TOL, logprob_atol=measured.max_logprob_diff, kl_max=1.0)
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, at_bound)
    assert report.steps[3].max_logprob_diff == at_bound.logprob_atol
    assert report.status == compare.PASS
    just_below = dataclasses.replace(
        at_bound, logprob_atol=math.nextafter(at_bound.logprob_atol, 0)
    )
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, just_below)
    assert (report.first_failing.step, report.first_failing.metric) == (3, "logprob")


def test_a_kl_exactly_at_kl_max_passes():
    """Check 3 fails only on `KL > kl_max`: a step whose KL equals kl_max passes."""
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[3, case.steps[3].topk_ids[5]] += 1e-3
    loose = dataclasses.replace(TOL, logprob_atol=1.0, kl_max=1.0)
    kl = compare.compare_case(case, [1, 2, 3], tokens, moved, loose).steps[3].kl
    assert kl > 0
    report = compare.compare_case(
        case, [1, 2, 3], tokens, moved, dataclasses.replace(loose, kl_max=kl)
    )
    assert report.status == compare.PASS
    below = dataclasses.replace(loose, kl_max=math.nextafter(kl, 0))
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, below)
    assert (report.first_failing.step, report.first_failing.metric) == (3, "kl")


def test_a_run_token_exactly_the_margin_below_the_goldens_top1_is_not_a_near_tie():
    """The golden side of the tie rule uses the same boundary as the run side (a gap equal to
    the margin is not 'within' it: `run_gap >= margin` fails, so must `golden_gap >= margin`)."""
    logits, case = _near_tie_golden()
    run = logits.copy()
    run[1, 20] = (
        logits[1, 4] + 1e-3
    )  # the run picks the golden's runner-up, as in the ambiguous test
    lp = case.steps[1].topk_log_probs()
    where = list(case.steps[1].topk_ids).index(20)
    golden_gap = float(lp[0] - lp[where])
    tol = dataclasses.replace(LOOSE_TIE, near_tie_margin=golden_gap)
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, tol)
    assert report.steps[1].status == compare.FAIL and report.steps[1].metric == "token"
    assert "golden ranks the run's token" in report.steps[1].detail
    wider = dataclasses.replace(tol, near_tie_margin=math.nextafter(golden_gap, math.inf))
    report = compare.compare_case(case, [1, 2, 3], _greedy(run), run, wider)
    assert [s.step for s in report.ambiguous_steps] == [1] and report.status == compare.PASS


def test_a_server_row_whose_last_log_probability_is_nan_fails_that_step():
    """A partial row with NaN only at its k-th (the bound a missing golden id is held to): the
    bounded |Δ| is NaN, which compares as within every bound. It must fail as nonfinite."""
    logits = _logits()
    case, tokens = _case(logits)
    rows = [compare.TopLogprobs.from_logits(row, 20) for row in logits]
    golden = list(case.steps[2].topk_ids)
    outsider = next(i for i in range(64) if i not in golden)
    full = dict(zip(rows[2].ids, rows[2].logprobs, strict=True))
    ids = (*golden[:19], outsider)  # the golden's 20th is missing: bounded by the NaN
    rows[2] = compare.TopLogprobs(ids, (*(full.get(i, -30.0) for i in golden[:19]), math.nan))
    report = compare.compare_case(case, [1, 2, 3], tokens, rows, TOL)
    assert report.steps[2].bounded == 1
    assert report.status == compare.FAIL
    assert (report.first_failing.step, report.first_failing.metric) == (2, "nonfinite")


def test_a_run_that_drains_a_small_golden_tail_fails_on_kl():
    """KL check 3 counts the golden's tail bucket (everything outside its top-k) unless it is
    below float32 rounding noise (1e-6): a golden tail of ~5e-4 that the run empties fails."""
    vocab, k = 64, 20
    golden = np.full((1, vocab), -20.0, dtype=np.float32)
    golden[0, :k] = np.linspace(4.0, 0.0, k, dtype=np.float32)
    golden[0, k:] = -5.5  # 44 tail ids: a tail mass of ~6e-4
    spec = CaseSpec("prose", "The capital of France is", 1, k)
    case = record_case(spec, [1, 2, 3], [0], golden, lambda ids: f"<{ids[0]}>", set())
    p = np.exp(golden[0].astype(np.float64) - np.logaddexp.reduce(golden[0].astype(np.float64)))
    assert 1e-5 < p[k:].sum() < 1e-3
    run = golden.copy()
    run[0, k:] = -40.0  # the tail emptied; the top-k log-probs move by ~the tail mass only
    loose = dataclasses.replace(TOL, logprob_atol=1e-2, kl_max=1e-3)
    report = compare.compare_case(case, [1, 2, 3], [0], run, loose)
    assert report.steps[0].max_logprob_diff < 1e-2
    assert (report.steps[0].status, report.steps[0].metric) == (compare.FAIL, "kl")


def test_a_server_row_with_a_log_probability_above_zero_fails_that_step() -> None:
    """A server's top log-probability above 0 (a probability above 1) is no distribution: the
    step fails as nonfinite, naming it. It raised OverflowError (math.exp(800)) in the KL's
    rest, and 0.5 failed as a log-prob difference, which names another cause. A near-certain
    token's float32 rounding (a few 1e-8 above 0) is not refused."""
    logits = _logits()
    case, tokens = _case(logits)
    golden = list(case.steps[2].topk_ids)
    outsider = next(i for i in range(64) if i not in golden)
    for above in (800.0, 0.5):
        rows = [compare.TopLogprobs.from_logits(row, 20) for row in logits]
        rows[2] = compare.TopLogprobs((outsider, *rows[2].ids[1:]), (above, *rows[2].logprobs[1:]))
        report = compare.compare_case(case, [1, 2, 3], tokens, rows, TOL)
        assert (report.first_failing.step, report.first_failing.metric) == (2, "nonfinite")
        assert f"top log-probability {above:.5g} is above 0" in report.first_failing.detail
    rows = [compare.TopLogprobs.from_logits(row, 20) for row in logits]
    rows[2] = compare.TopLogprobs(rows[2].ids, (3e-8, *rows[2].logprobs[1:]))
    assert compare.compare_case(case, [1, 2, 3], tokens, rows, TOL).steps[2].metric != "nonfinite"


# docs/goldens.md's claims about the comparison that no test held (a claims audit): each test
# below passed its plant before it was written, and fails with it now.


def test_topk_overlap_is_checked_and_named_before_kl():
    """docs/goldens.md:117-123: the checks run in the order logprob, topk_overlap, kl, token,
    and the first that fails names the step's metric. Two tail ids raised just above the
    golden's 19th move no golden log-prob past 1e-3 but leave 18 of its top-20 in the run's
    top-20 (overlap 0.90 < 0.95); the KL also exceeds a tight kl_max, and the step is still
    named topk_overlap. Plants caught: the overlap check dropped; kl checked before overlap."""
    logits = _logits()
    case, tokens = _case(logits)
    step = case.steps[3]
    tail = [i for i in range(VOCAB) if i not in step.topk_ids]
    risers = sorted(tail, key=lambda i: -logits[3, i])[:2]
    run = logits.copy()
    run[3, risers] = logits[3, step.topk_ids[-2]] + 0.01
    wide = dataclasses.replace(TOL, logprob_atol=1e-3)
    for kl_max in (1.0, TOL.kl_max):
        report = compare.compare_case(
            case, [1, 2, 3], tokens, run, dataclasses.replace(wide, kl_max=kl_max)
        )
        assert [s.step for s in report.steps if s.status == compare.FAIL] == [3]
        checked = report.steps[3]
        assert checked.max_logprob_diff < wide.logprob_atol
        assert checked.topk_overlap == pytest.approx(0.9)
        assert (checked.metric, checked.detail) == ("topk_overlap", "top-20 overlap 0.90 < 0.95")
    assert checked.kl > TOL.kl_max  # the KL fails too, and does not name the step


def test_a_prompt_positions_greedy_token_is_the_runs_argmax():
    """docs/goldens.md:105-107: each recorded prompt position is checked by the step rules,
    its greedy token being the run's argmax there. A run whose argmax at position 255 is
    another id, beyond any near-tie, fails that position on `token` even when every numeric
    check is loosened away. Plant caught: the prompt position's token taken as the golden's
    (the token check can then never fail at a prompt position)."""
    logits, prompt_rows = _logits(), _logits(steps=3, seed=1)
    positions = [0, 255, 4097]
    case, tokens, input_ids = _case_with_positions(logits, prompt_rows, positions)
    rows = dict(zip(positions, prompt_rows, strict=True))
    golden = case.position_steps[1]
    other = next(i for i in range(VOCAB) if i not in golden.topk_ids)
    moved = rows[255].copy()
    moved[other] = moved.max() + 1.0
    loose = Tolerance("t", 10.0, 10.0, 0.0, 2e-4, "")
    report = compare.compare_case(case, input_ids, tokens, logits, loose, {**rows, 255: moved})
    assert report.first_failing is None
    check = report.first_failing_check
    assert (check.position, check.metric, check.actual_token) == (255, "token", other)
    assert check.expected_token == golden.token_id
    assert check.detail == (
        f"greedy token differs: the run's token {other} is not in the golden's top-20"
    )


def test_the_token_failure_texts_name_the_tie_rules_reason():
    """docs/goldens.md:145-150: a token that fails the tie rule with checks 1-3 passing fails
    on `token` with the reason ("not in the golden's top-20"); a numeric failure at a step
    whose greedy token differs adds "and the greedy token differs" to its detail. Plants
    caught: the reason's text changed; the numeric failure's suffix dropped."""
    logits, case = _near_tie_golden()
    outside = logits.copy()
    outside[1, 50] = logits[1, 4] + 1e-3  # id 50 is not in the golden's top-20 at step 1
    loose = dataclasses.replace(LOOSE_TIE, logprob_atol=10.0, kl_max=10.0)
    report = compare.compare_case(case, [1, 2, 3], _greedy(outside), outside, loose)
    assert (report.steps[1].metric, report.steps[1].detail) == (
        "token",
        "greedy token differs: the run's token 50 is not in the golden's top-20",
    )
    tie_and_drift = logits.copy()
    tie_and_drift[1, 20] = logits[1, 4] + 1e-3  # a near-tie swap ...
    tie_and_drift[1, case.steps[1].topk_ids[3]] += 0.5  # ... beside a log-prob failure
    report = compare.compare_case(case, [1, 2, 3], _greedy(tie_and_drift), tie_and_drift, LOOSE_TIE)
    assert report.steps[1].metric == "logprob"
    assert report.steps[1].detail.endswith("; and the greedy token differs: at a near-tie")
    plain = _logits()
    plain_case, _ = _case(plain)
    far = plain.copy()
    far[2, 40] = 9.0  # id 40 is not in the golden's top-20 at step 2
    report = compare.compare_case(plain_case, [1, 2, 3], _greedy(far), far, TOL)
    assert report.steps[2].metric == "logprob"
    assert report.steps[2].detail.endswith(
        "; and the greedy token differs: the run's token 40 is not in the golden's top-20"
    )


def test_a_changed_tokenization_fails_on_the_input_ids_metric():
    """docs/goldens.md:345-346: a case whose run tokenizes the prompt otherwise fails with
    metric `input_ids` (how a BOS or tokenizer change shows), even when every step passes.
    Plant caught: failing_metrics without "input_ids" (the failure text then says "input
    ids" by its fallback, and the report's metric list is empty)."""
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 4], tokens, logits, TOL)
    assert report.status == compare.FAIL and report.first_failing_check is None
    assert report.failing_metrics == ["input_ids"]
    drifted = logits.copy()
    drifted[3, case.steps[3].topk_ids[5]] += 1e-3
    both = compare.compare_case(case, [1, 2, 4], tokens, drifted, TOL)
    assert both.failing_metrics == ["input_ids", "logprob"]
    text = compare.format_failure(report, case, "g", str, "R", [1, 2, 4])
    assert "teacher-forced: 0 of 6 steps fail (input_ids), 0 ambiguous" in text


def test_every_judged_entry_has_a_near_tie_margin_of_twice_its_logprob_atol():
    """docs/goldens.md:152: `near_tie_margin` is 2 x logprob_atol in every entry, the long
    cases' thresholds and the ggml mode's, llama_cpp and external columns included (the test
    above enumerates only the cpu/cuda columns of four encodings). Plant caught: an nvfp4,
    external or llama_cpp entry with another margin."""
    judged = entries() + [t for ref in MODE_REFERENCES for t in entries(ref)]
    judged += [t.long for t in judged if t.long is not None]
    assert {t.key.split("/")[2] for t in judged} >= {"cpu", "cuda", "llama_cpp", "external"}
    for tol in judged:
        assert tol.why.strip(), tol.key  # docs/goldens.md:413: and a measured why
        assert tol.near_tie_margin == pytest.approx(2 * tol.logprob_atol, rel=1e-12), tol.key


def test_a_server_top_k_whose_mass_rounds_above_one_keeps_a_float32_rest():
    """docs/goldens.md:366: with a top-k run, the run's mass outside the known ids is the
    largest of 1 - Σ known, its other top-k ids' mass and float32 rounding of Σ known, so
    a server whose float32 log-probabilities sum a hair above 1 (here 1 + 8e-8, each 2.1e-6
    above the golden's) against a golden tail of 2e-6 gets a KL of ~5e-6, not an invented
    failure: without the rounding term its rest is 0 and the tail term alone is ~1.4e-3.
    Plant caught: the rest without float32 rounding (max of the first two only)."""
    vocab, k = 64, 20
    top = np.linspace(4.0, 0.0, k)
    golden = np.full((1, vocab), math.log(2e-6 * np.exp(top).sum() / (vocab - k)), np.float32)
    golden[0, :k] = top
    spec = CaseSpec("prose", "The capital of France is", 1, k)
    case = record_case(spec, [1, 2, 3], [0], golden, lambda ids: f"<{ids[0]}>", set())
    step = case.steps[0]
    assert 1e-6 < 1.0 - np.exp(step.topk_log_probs()).sum() < 3e-6  # the tail term counts
    served = (step.topk_log_probs() + 2.1e-6).astype(np.float32)
    row = compare.TopLogprobs(tuple(step.topk_ids), tuple(float(x) for x in served))
    assert sum(math.exp(x) for x in row.logprobs) > 1.0
    tol = dataclasses.replace(TOL, kl_max=1e-4)
    report = compare.compare_case(case, [1, 2, 3], [0], [row], tol)
    assert report.status == compare.PASS, report.steps[0].detail
    assert 0 < report.steps[0].kl < 1e-5


def test_entries_lists_every_judged_column_the_fallback_columns_included():
    """docs/goldens.md:403: test_mutations applies every entry of an encoding, `cuda` and
    `cuda_fallback` included (entries(encoding=ENC)): entries() leaves out only the
    `judged: false` columns, and the mode references (ggml) unless asked. Plant: entries()
    skipping the `_fallback` columns (the mutation matrix then loses them, green)."""
    table = tolerances._table()

    def judged(refs):
        return sorted(
            f"{ref}/{enc}/{column}"
            for ref in refs
            for enc, columns in table[ref].items()
            for column, entry in columns.items()
            if entry.get("judged", True)
        )

    assert sorted(t.key for t in entries()) == judged(tolerances.REFERENCES)
    assert sorted(t.key for t in entries("ggml")) == judged(MODE_REFERENCES)
    bfloat16 = {t.key for t in entries(encoding="bfloat16")}
    assert {"own/bfloat16/cuda_fallback", "torch/bfloat16/cuda_fallback"} <= bfloat16
    assert all(key.split("/")[1] == "bfloat16" for key in bfloat16)


def test_sanity_asks_a_case_cut_short_for_as_many_distinct_tokens_as_it_has_steps():
    """docs/goldens.md:797: a case needs min(3, steps) distinct greedy tokens, so a case that
    ended on end-of-sequence after 2 distinct steps discriminates. Plant: the rule without
    min() (3 distinct tokens asked of a 2-step case)."""
    case, _ = _case(_logits(steps=2))
    assert degeneracy_problems(_golden([case]), near_tie_margin=1e-3) == []


def test_sanity_refuses_an_exact_top1_tie_at_a_recorded_prompt_position():
    """goldens/sanity.py: recorded prompt positions are checked like steps; an exact top-1
    tie at one is refused, named by its position (docs/goldens.md:798). Plant: the prompt
    positions' ties left out (only the generated steps' counted)."""
    logits, prompt_rows = _logits(steps=10), _logits(steps=2, seed=1)
    prompt_rows[1, 30] = prompt_rows[1].max()
    case, _, _ = _case_with_positions(logits, prompt_rows, [0, 255])
    problems = degeneracy_problems(_golden([case]), near_tie_margin=1e-3)
    assert [p for p in problems if "exact top-1 ties" in p] == [
        "1 exact top-1 ties (gap 0.0) at [('long', 'prompt position 255')]: the greedy token "
        "there is arbitrary; compute the logits in float32 or choose other prompts"
    ]


def test_a_not_judged_entry_is_refused_naming_its_why_and_measured_distance(monkeypatch):
    """goldens/tolerances.py NotJudged: a `judged: false` entry records the measured distance
    and why, and tolerance() refuses it with both (golden_check prints that line, exit 2):
    the measured |Δ log-prob| then the KL, each where the message says it is (planted: the
    two numbers swapped, which every fast test passed)."""
    entry = {"judged": False, "measured": {"logprob": 0.711, "kl": 0.0395}, "why": "rounds\n  bf16"}
    monkeypatch.setattr(tolerances, "_table", lambda: {"own": {"bfloat16": {"llama_cpp": entry}}})
    with pytest.raises(tolerances.NotJudged) as raised:
        tolerance("own", "bfloat16", "llama_cpp")
    assert str(raised.value) == (
        "own/bfloat16/llama_cpp is not judged: rounds bf16 (measured: max |Δ log-prob| 0.711, "
        "KL 0.0395)"
    )
    assert entry["judged"] is False  # the table's own entry is left as it was
