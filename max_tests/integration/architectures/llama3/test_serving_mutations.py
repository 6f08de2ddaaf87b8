"""Every serving-path bug fails the goldens in the scenario that takes its path, and the solo
lane alone lets each through: the matrix (rows: unmutated and the bugs of
mutations.SERVING_MUTATIONS; columns: solo and the scenarios; cells: PASS or the first
failing check, or RAISED) is printed, for the engine's own goldens of the tiny float32
(eager) and Q4_K (quantized, where decode rows run the paged kernel) checkpoints, short cases.
"""

from __future__ import annotations

import pytest
import torch

from goldens import compare
from goldens.tolerances import tolerance
from harness.llama3 import engine_runs, judge, scenarios
from harness.llama3.variants import Variant, variants
from max_tests.integration.architectures.llama3 import mutations
from pipelines.llama3.serving import Request, ServingEngine

COLUMNS = scenarios.SCENARIOS  # solo first


def _variant(encoding: str) -> Variant:
    return next(v for v in variants("tinyllama", encoding) if v.path is not None)


def _cell(verdict: judge.Verdict) -> str:
    if not verdict.failures:
        return "PASS"
    failing = next((r for r in verdict.reports if r.status == compare.FAIL), None)
    if failing is None:  # the case list itself differs
        return "FAIL"
    check = failing.first_failing
    return f"FAIL@p{check.position}" if check.in_prompt else f"FAIL@step{check.step}"


def _cells(
    engine, serving_class, golden, source, tol, variant, scenario, solo_memo: dict
) -> list[str]:
    """Each serving's cell: PASS, the first failing check, or RAISED (the serving engine
    raised, or kept blocks after every request finished)."""
    if scenario == "solo":  # generate: no serving class in its path, one run for every row
        verdict = judge.check(
            engine, golden, source, "own", tol, variant, memo=solo_memo, lane="short"
        )
        return [_cell(verdict)]
    cells = []
    for serving in scenarios.servings(scenario, "short"):
        try:
            served = scenarios.served_runs(engine, golden, serving, serving_class)
        except (scenarios.BlocksHeld, RuntimeError, KeyError, ValueError):
            cells.append("RAISED")
            continue
        for runs in [served.runs, *served.copies]:  # pressure: every copy
            verdict = judge.compare_runs(
                runs, golden, source, "own", tol, variant, engine.tokenizer.decode, lane="short"
            )
            cells.append(_cell(verdict))
    return cells


@pytest.mark.parametrize(("encoding", "mode"), [("float32", "eager"), ("q4_k", "quantized")])
def test_each_serving_bug_fails_in_its_scenario_and_only_solo_misses_it(
    goldens, encoding: str, mode: str
) -> None:
    variant = _variant(encoding)
    golden, source = goldens.load("own", variant)
    golden = judge.in_lane(golden, variant.model, "short")
    tol = tolerance("own", encoding, "cpu")
    rows = [None, *mutations.SERVING_MUTATIONS]
    matrix: dict[tuple[str, str], str] = {}
    # A serving bug is in its class (no config overrides, no patch of the engine): one engine
    # for every row, and one solo run.
    engine, solo_memo = engine_runs.load_engine(variant, mode=mode), {}
    for mutation in rows:
        serving_class = ServingEngine if mutation is None else mutation.serving_class
        name = "unmutated" if mutation is None else mutation.name
        for scenario in COLUMNS:
            cells = _cells(engine, serving_class, golden, source, tol, variant, scenario, solo_memo)
            matrix[name, scenario] = next((c for c in cells if c != "PASS"), "PASS")
    width = max(len(r.name) for r in mutations.SERVING_MUTATIONS) + 2
    lines = [" " * width + " ".join(f"{c:>14}" for c in COLUMNS)]
    for mutation in rows:
        name = "unmutated" if mutation is None else mutation.name
        lines.append(f"{name:<{width}}" + " ".join(f"{matrix[name, c]:>14}" for c in COLUMNS))
    print(f"\n{variant.test_id} ({mode}), own golden, short cases:\n" + "\n".join(lines))

    assert all(matrix["unmutated", c] == "PASS" for c in COLUMNS), "\n".join(lines)
    for mutation in mutations.SERVING_MUTATIONS:
        assert matrix[mutation.name, "solo"] == "PASS", f"{mutation.name}: solo takes its path?"
        assert matrix[mutation.name, mutation.scenario] != "PASS", (
            f"{mutation.name} passes its scenario {mutation.scenario}:\n" + "\n".join(lines)
        )


def test_a_late_rope_planted_in_setup_rope_reaches_generate_and_the_served_requests() -> None:
    """The model mutations rope_late_4096 and rope_late_8192 are planted in `setup_rope`, where
    `generate` (through setup_caches) and the serving engine both get their tables, so the
    bug reaches a served request as it reaches generate. Here at position 8 on a 16-token
    prompt of the tiny float32 checkpoint, served first on a fresh engine: the served logits
    are generate's under the plant, and both moved from the unplanted ones. Planted in
    setup_caches (as it was), the bug vanished: the serving engine built the tables, and
    neither the served nor generate's logits moved."""
    variant = _variant("float32")
    prompt = list(range(1, 17))

    def logits(plant: bool) -> tuple:
        engine = engine_runs.load_engine(variant, mode="eager")
        if plant:
            mutations._rope_late_from(8)(engine)
        served = ServingEngine(engine, block_size=4).serve([Request("r", prompt, 3)])
        return served["r"].output.logits, engine.generate(prompt, 3, stop_on_eos=False).logits

    served, solo = logits(plant=True)
    clean_served, clean_solo = logits(plant=False)
    assert torch.allclose(served, solo, atol=1e-4, rtol=0), (served - solo).abs().max()
    assert torch.allclose(clean_served, clean_solo, atol=1e-4, rtol=0)
    assert (solo - clean_solo).abs().max() > 0.01, "the plant does not move generate"
    assert (served - clean_served).abs().max() > 0.01, "the plant does not reach serving"


def test_each_serving_bug_replaces_the_serving_engine_method_it_names() -> None:
    """docs/goldens.md:760 and the matrix's rows: eight serving bugs, each planted in the
    ServingEngine method it names (its class overrides that method and adds nothing), each
    with a scenario other than solo to fail in. A misspelt `method` plants nothing: the class
    gains an unused method and the slow matrix reads PASS. Plant: cross_sequence_keys's method
    "_context_slot" (0.01 s)."""
    names = [m.name for m in mutations.SERVING_MUTATIONS]
    assert names == [
        "cross_sequence_keys",
        "block_table_off_by_one",
        "rope_chunk_boundary",
        "prefix_hash_unchained",
        "resume_without_last_kv",
        "decode_into_other_sequence",
        "uncounted_shared_hit",
        "eviction_keeps_the_hash",
    ]
    for mutation in mutations.SERVING_MUTATIONS:
        assert callable(getattr(ServingEngine, mutation.method, None)), mutation.name
        mutated = mutation.serving_class
        assert issubclass(mutated, ServingEngine) and mutated is not ServingEngine
        assert set(vars(mutated)) - {"__module__", "__doc__"} == {mutation.method}, mutation.name
        assert getattr(mutated, mutation.method) is mutation.replacement, mutation.name
        assert mutation.scenario in scenarios.SCENARIOS[1:], mutation.name


class _KeepsItsLastBlock(ServingEngine):
    """A planted leak: a finished or preempted sequence keeps its last block."""

    def _release(self, seq) -> None:
        seq.table = seq.table[:-1]
        super()._release(seq)


def test_a_serving_that_keeps_blocks_after_every_request_finished_is_raised(goldens) -> None:
    """docs/goldens.md:765: a matrix cell reads RAISED where the serving engine raised or kept
    blocks after every request finished (scenarios.BlocksHeld: its goldens alone could pass).
    The tiny float32 file's short cases through the batch scenario: a serving class that
    never gives back each sequence's last block is RAISED in all three servings, and the
    harness names the class and the blocks. Plant: scenarios._serve without its
    _check_pool_given_back (the leak then reads PASS)."""
    variant = _variant("float32")
    golden, source = goldens.load("own", variant)
    golden = judge.in_lane(golden, variant.model, "short")
    tol = tolerance("own", "float32", "cpu")
    engine = engine_runs.load_engine(variant, mode="eager")
    cells = _cells(engine, _KeepsItsLastBlock, golden, source, tol, variant, "batch", {})
    assert cells == ["RAISED"] * len(scenarios.servings("batch", "short")), cells
    (batch, *_) = scenarios.servings("batch", "short")
    with pytest.raises(scenarios.BlocksHeld, match=r"_KeepsItsLastBlock: \d+ of \d+ blocks still"):
        scenarios.served_runs(engine, golden, batch, _KeepsItsLastBlock)
