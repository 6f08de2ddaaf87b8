"""The ggml mode's goldens are proven like the others: the unmutated mode passes them, and
every known bug of the mode (ggml_mutations.py) and every checkpoint edit
(checkpoint_mutations.py) fails them under the `ggml/*/cpu` entries, each by at least the
entry's mutation floor. Tiny Q4_K over every case; SmolLM2 Q4_1 over the short cases (its
8-bit numerics are chaotic: any of these moves it by tenths, and its long case costs minutes).
Prints each checkpoint's row of the matrix.
"""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from goldens.tolerances import tolerance
from harness.llama3 import checkpoint_mutations, engine_runs, judge
from harness.llama3.variants import GGML_ENCODINGS, variants
from max_tests.integration.architectures.llama3 import ggml_mutations

VARIANTS = [v for v in variants() if v.encoding in GGML_ENCODINGS and v.model != "llama3_1"]


def _lane(variant) -> str:
    return "all" if variant.model == "tinyllama" else "short"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.test_id)
def test_the_ggml_goldens_catch_every_mutation(variant, goldens, capsys) -> None:
    if variant.path is None:
        pytest.fail(f"the ggml mutation matrix needs {variant.unavailable_reason}")
    golden, name = goldens.load("ggml", variant)
    tol = tolerance("ggml", variant.encoding, "cpu")
    lane = _lane(variant)

    def check(engine, mutated=variant):
        return judge.check(engine, golden, name, "ggml", tol, mutated, lane=lane)

    rows = [("unmutated", check(engine_runs.load_engine(variant, "cpu", mode="ggml")))]
    for mutation in ggml_mutations.MUTATIONS:
        engine = mutation.apply(engine_runs.load_engine(variant, "cpu", mode="ggml"))
        rows.append((mutation.name, check(engine)))
    for mutation in checkpoint_mutations.MUTATIONS:
        with tempfile.TemporaryDirectory() as folder:
            copy = checkpoint_mutations.mutated_copy(variant.path, mutation, folder)
            mutated = dataclasses.replace(variant, path=copy)
            engine = engine_runs.load_engine(mutated, "cpu", mode="ggml")
            rows.append((mutation.name, check(engine, mutated)))
    with capsys.disabled():
        print(f"\nggml mutation matrix, {variant.test_id}, {lane} cases, [{tol.key}]:")
        for label, verdict in rows:
            state = "FAIL" if verdict.failures else "PASS"
            greedy = sum(r.greedy_agreement for r in verdict.reports)
            print(
                f"  {label:<18} {state}  max |Δ log-prob| {verdict.max_logprob_diff:.3g}, "
                f"max KL {verdict.max_kl:.3g}, greedy {greedy}/{verdict.steps}"
            )
    (_, unmutated), mutants = rows[0], rows[1:]
    assert not unmutated.failures, unmutated.summary()
    floor = tol.mutation_floor
    for label, verdict in mutants:
        assert verdict.failures, f"{tol.key} lets {label} through: {verdict.summary()}"
        assert verdict.max_logprob_diff >= floor.logprob * 0.999, (
            f"{label} moved the ggml mode by {verdict.max_logprob_diff:.3g}, under {tol.key}'s "
            f"mutation floor {floor.logprob:g} ({floor.measured}): measure again"
        )
