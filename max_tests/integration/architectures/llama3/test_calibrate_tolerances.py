"""calibrate_tolerances: what each row measures and which floors it prints (docs/goldens.md,
"How calibrate_tolerances measures the floors"), on stubs: no engine runs, no golden is read
(0.05 s). The floors it prints are what tolerances.yaml's thresholds sit between."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from harness.llama3 import variants
from harness.llama3.variants import LLAMA3_1_ENV, Variant
from max_tests.integration.architectures.llama3 import calibrate_tolerances as calibrate
from max_tests.integration.architectures.llama3 import mutations


def test_each_row_is_the_worst_over_every_case_and_bos_is_left_out(monkeypatch) -> None:
    """docs/goldens.md:427-437: the own noise is the engine on 1 thread against its golden,
    the torch noise the engine against transformers', then each mutation that applies to the
    file, except `bos`, against both goldens; every row teacher-forced over every case (lane
    `all`, short and long) under MEASURE. Plants: worst() judging lane "short"; the own noise
    at the default thread count; `bos` measured; a mutation that does not apply measured."""
    goldens = {
        ref: types.SimpleNamespace(reference=ref, last_position=8400) for ref in ("own", "torch")
    }
    no_scaling = types.SimpleNamespace(rope_freq_factors=None, rope_scaling_type=None)

    def load(variant, mutation):
        return types.SimpleNamespace(config=no_scaling, mutation=mutation)

    calls = []

    def check(engine, golden, source, reference, tolerance, variant, lane="all", **_):
        name = engine.mutation.name if engine.mutation else None
        calls.append((name, golden.reference, lane, torch.get_num_threads(), tolerance))
        return types.SimpleNamespace(max_logprob_diff=0.5, max_kl=0.25)

    monkeypatch.setattr(calibrate, "load_golden", lambda reference, variant, d: goldens[reference])
    monkeypatch.setattr(calibrate.mutations, "load", load)
    monkeypatch.setattr(calibrate.judge, "check", check)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = calibrate.measure(Variant("tinyllama", "float32", "tiny", "llama3_1", Path("x")))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    measured = [
        m.name
        for m in mutations.MUTATIONS
        if m.name not in ("bos", "rope_factor_4", "rope_scaling_dropped")  # no rope scaling
    ]
    assert [r[:2] for r in rows] == [
        ("noise", "own: 1 thread vs the golden's 1"),
        ("noise", "torch: engine vs transformers"),
        *[("mutation", f"{ref}: {name}") for name in measured for ref in ("own", "torch")],
    ]
    assert calls[0][:4] == (None, "own", "all", 1)  # the own noise: one thread
    assert all(lane == "all" and tol is calibrate.MEASURE for _, _, lane, _, tol in calls)
    assert all(r[2:] == (0.5, 0.25) for r in rows)


def test_the_floors_printed_are_the_smallest_logprob_and_smallest_kl_apart(
    monkeypatch, capsys
) -> None:
    """docs/goldens.md:438-441 and 535-537: per reference the mutation floor is the smallest
    log-prob and, apart, the smallest KL over the mutations (they may come from different
    mutations); the cross-ISA noise floor the worst kernel level; a llama3_1 checkpoint is
    set aside. Plants: the KL of the smallest log-prob's mutation; the mildest level taken;
    llama3_1 measured."""
    rows = [
        ("noise", "own: 1 thread vs 2", 5e-10, 4e-15),
        ("noise", "torch: engine vs transformers", 1e-5, 7e-12),
        ("mutation", "own: q_weight", 0.08, 3e-3),
        ("mutation", "torch: q_weight", 0.07, 2e-3),
        ("mutation", "own: attn_scale", 0.2, 2e-4),
        ("mutation", "torch: attn_scale", 0.3, 5e-4),
    ]
    levels = [
        ("kernels", "own: aten avx2", 5e-5, 1e-12),
        ("kernels", "own: aten default", 3e-5, 4e-12),
    ]
    seen = []
    monkeypatch.setattr(calibrate, "measure", lambda v, d=None: seen.append(v.model) or list(rows))
    monkeypatch.setattr(calibrate, "kernel_noise", lambda v, d, levels_asked: list(levels))
    # a llama3_1 file (the tiny float32 one given as Llama 3.1): set aside
    monkeypatch.setenv(LLAMA3_1_ENV, str(variants.testdata_directory() / "tiny_llama.gguf"))
    assert calibrate.main(["--encoding=float32", "--kernel-levels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == ["tinyllama"]
    assert "  mutation floor (own): 0.08 log-prob (own: q_weight), KL 0.0002" in out
    assert "  mutation floor (torch): 0.07 log-prob (torch: q_weight), KL 0.0005" in out
    assert "  cross-ISA noise floor (own): 5e-05 log-prob (own: aten avx2), KL 4e-12" in out
