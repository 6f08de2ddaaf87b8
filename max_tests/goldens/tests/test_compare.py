"""The comparison on synthetic runs: what passes, what fails, what is ambiguous, and how the
failure reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from max_tests.goldens import compare
from max_tests.goldens.record import CaseSpec, record_case
from max_tests.goldens.sanity import degeneracy_problems
from max_tests.goldens.schema import Golden, Provenance
from max_tests.goldens.tolerances import Tolerance, tolerance

VOCAB = 64
TOL = Tolerance(
    "own/float32/cpu",
    atol=1e-4,
    rtol=1e-5,
    kl_max=1e-6,
    topk_overlap_min=0.95,
    near_tie_margin=1e-3,
    why="test",
)


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


def test_identical_run_passes_with_zero_difference():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens, logits, TOL)
    assert report.status == compare.PASS
    assert report.max_abs_diff == 0.0
    assert report.max_kl == pytest.approx(0.0, abs=1e-9)
    assert report.first_diverging is None


def test_logit_drift_beyond_atol_fails_at_that_step():
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[3, case.steps[3].topk_ids[5]] += 1e-3  # not enough to change the token
    report = compare.compare_case(case, [1, 2, 3], tokens, moved, TOL)
    assert report.status == compare.FAIL
    assert report.first_diverging.step == 3
    assert report.first_diverging.metric == "logits"
    assert report.first_diverging.max_abs_diff == pytest.approx(1e-3, rel=1e-3)


def test_drift_within_tolerance_passes():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens, logits + 5e-5, TOL)
    assert report.status == compare.PASS


def test_changed_token_above_margin_fails_and_names_both_tokens():
    logits = _logits()
    case, tokens = _case(logits)
    moved = logits.copy()
    moved[2, 40] = 9.0
    tokens2 = [*tokens[:2], 40, *tokens[3:]]
    report = compare.compare_case(case, [1, 2, 3], tokens2, moved, TOL)
    assert report.status == compare.FAIL
    step = report.first_diverging
    assert (step.step, step.metric, step.expected_token, step.actual_token) == (2, "token", 7, 40)
    text = compare.format_failure(report, case, "g.json", lambda ids: f"<{ids[0]}>", "REGEN")
    assert "first diverging step: 2 of 6" in text
    assert "expected token 7 '<7>'" in text and "got 40 '<40>'" in text
    assert "worst logit differences" in text and "REGEN" in text


def test_near_tie_is_ambiguous_and_stops_following_the_case():
    logits = _logits()
    logits[1, 20] = logits[1, 4] - 5e-4  # runner-up within the near-tie margin
    case, tokens = _case(logits)
    assert case.steps[1].top_gap < TOL.near_tie_margin
    run = logits.copy()
    run[1, 20] = logits[1, 4] + 5e-4  # the run picks the runner-up
    tokens2 = [*tokens[:1], 20, 0, 0, 0, 0]  # later steps would diverge: not compared
    report = compare.compare_case(case, [1, 2, 3], tokens2, run, TOL)
    assert report.status == compare.AMBIGUOUS
    assert report.first_diverging.step == 1
    assert len(report.steps) == 2


def test_kl_from_topk_equals_full_kl_when_topk_covers_the_vocabulary():
    logits = _logits(steps=1)
    case, tokens = _case(logits, top_k=VOCAB)
    run = logits.copy()
    run[0, :10] += 0.3
    p = np.exp(logits[0] - np.logaddexp.reduce(logits[0].astype(np.float64)))
    q = np.exp(run[0] - np.logaddexp.reduce(run[0].astype(np.float64)))
    full_kl = float(np.sum(p * np.log(p / q)))
    loose = Tolerance("t", 1.0, 0.0, 1.0, 0.0, 1e-3, "")
    report = compare.compare_case(case, [1, 2, 3], tokens, run, loose)
    assert report.max_kl == pytest.approx(full_kl, rel=1e-4)


def test_topk_tail_bucket_makes_kl_a_lower_bound():
    logits = _logits(steps=1)
    case, tokens = _case(logits, top_k=20)
    run = logits.copy()
    tail = [i for i in range(VOCAB) if i not in case.steps[0].topk_ids]
    run[0, tail] += 1.0  # moves mass into the tail only
    loose = Tolerance("t", 10.0, 0.0, 10.0, 0.0, 1e-3, "")
    report = compare.compare_case(case, [1, 2, 3], tokens, run, loose)
    assert 0 < report.max_kl < math.inf


def test_run_that_ends_early_fails_at_the_missing_step():
    logits = _logits()
    case, tokens = _case(logits)
    report = compare.compare_case(case, [1, 2, 3], tokens[:4], logits[:4], TOL)
    assert report.status == compare.FAIL
    assert report.first_diverging.step == 4
    assert "stopped" in report.first_diverging.detail


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
                assert tol.near_tie_margin > tol.atol, tol.key
        for reference_fallback in ("bfloat16",):
            assert tolerance(reference, reference_fallback, "cuda", fallback=True).why


def test_missing_tolerance_names_the_key():
    with pytest.raises(KeyError, match="own/float16/cpu"):
        tolerance("own", "float16", "cpu")


def _golden(cases) -> Golden:
    prov = Provenance(
        "engine", "1", "m", "float32", "all", "cpu", "float32", "f.gguf", "0" * 64, "2.13.0"
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
