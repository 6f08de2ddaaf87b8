"""The comparison catches real regressions: each perturbation of the engine must fail against
goldens of the unperturbed engine, and the diagnosis must name the first diverging step.

The baseline is computed in the test from the same checkpoint, so this pins the comparison's
power independently of any published golden.
"""

from __future__ import annotations

import pytest
import torch

from max_tests.goldens import compare
from max_tests.goldens.tolerances import tolerance
from max_tests.integration.architectures.llama3 import golden_run
from max_tests.integration.architectures.llama3.variants import variants

TINY = next(v for v in variants("tinyllama", "float32"))


@pytest.fixture(scope="module")
def baseline():
    if TINY.path is None:
        pytest.fail(f"the mutation test needs {TINY.unavailable_reason}")
    engine = golden_run.load_engine(TINY)
    return golden_run.engine_golden(TINY, engine, golden_run.run_cases(engine, "tinyllama"), "cpu")


def _perturb_one_weight(engine):
    with torch.no_grad():
        engine.model.layers[0].attention.wq.weight[0, 0] += 0.05


def _shift_kv_cache_position(engine):
    forward = engine.model.forward

    def shifted(tokens, start_pos, *args, **kwargs):
        if tokens.shape[1] == 1:  # a decode step: write and read the cache one slot late
            start_pos += 1
        return forward(tokens, start_pos, *args, **kwargs)

    engine.model.forward = shifted


MUTATIONS = {
    "one_weight": ({}, _perturb_one_weight),
    "rope_theta": ({"rope_theta": 10000.0}, None),
    "norm_epsilon": ({"rms_norm_eps": 1e-3}, None),
    "kv_cache_position": ({}, _shift_kv_cache_position),
}


def test_unperturbed_engine_matches_its_baseline(baseline):
    engine = golden_run.load_engine(TINY)
    tol = tolerance("own", "float32", "cpu")
    for run, case in zip(golden_run.run_cases(engine, "tinyllama"), baseline.cases, strict=True):
        report = compare.compare_case(case, run.input_ids, run.tokens, run.logits, tol)
        assert report.status == compare.PASS, report
        assert report.max_abs_diff == 0.0


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_mutation_is_caught_with_its_first_diverging_step(mutation, baseline):
    overrides, patch = MUTATIONS[mutation]
    engine = golden_run.load_engine(TINY, overrides=overrides)
    if patch:
        patch(engine)
    tol = tolerance("own", "float32", "cpu")
    reports = []
    for run, case in zip(golden_run.run_cases(engine, "tinyllama"), baseline.cases, strict=True):
        report = compare.compare_case(case, run.input_ids, run.tokens, run.logits, tol)
        reports.append((report, case, run))
    failed = [(r, c, run) for r, c, run in reports if r.status == compare.FAIL]
    assert failed, f"{mutation} went unnoticed: {[r.status for r, _, _ in reports]}"
    report, case, run = failed[0]
    step = report.first_diverging
    text = compare.format_failure(report, case, "baseline", str, "regen", run.input_ids)
    assert f"first diverging step: {step.step} of {len(case.steps)}" in text
    assert step.metric in {"token", "logits", "topk_overlap", "kl"}
    if mutation == "kv_cache_position":
        # Prefill does not touch the decode path: the first decode step is the first to move.
        assert all(r.first_diverging.step == 1 for r, _, _ in failed), [
            r.first_diverging.step for r, _, _ in failed
        ]
