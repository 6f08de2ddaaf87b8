"""The engine against its own goldens and against the torch (transformers) goldens, on the CPU.

One test per checkpoint variant, id `{size}-{encoding}-{arch}`; one case alone:
  ./bazelw test //max_tests/integration:tests \\
      --test_arg=-k --test_arg='test_llama[tiny-float32-llama3_1]'
"""

from __future__ import annotations

import time

import pytest

from max_tests.goldens.tolerances import tolerance
from max_tests.integration.architectures.llama3 import golden_run
from max_tests.integration.architectures.llama3.variants import Variant, variants

VARIANTS = variants()


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.test_id for v in VARIANTS])
def test_llama(variant: Variant, goldens, record_property) -> None:
    if variant.path is None:
        pytest.skip(f"{variant.model}: {variant.unavailable_reason}")
    references = [(*goldens.load(reference, variant), reference) for reference in ("own", "torch")]

    start = time.perf_counter()
    engine = golden_run.load_engine(variant, "cpu")
    loaded = time.perf_counter()
    runs = golden_run.run_cases(engine, variant.model)
    model_seconds = time.perf_counter() - loaded
    record_property("load_seconds", round(loaded - start, 4))
    record_property("model_seconds", round(model_seconds, 4))
    print(
        f"{variant.test_id}: load {(loaded - start) * 1000:.1f} ms, "
        f"{len(runs)} cases {model_seconds * 1000:.1f} ms"
    )

    failures, ambiguous = [], []
    for golden, name, reference in references:
        tol = tolerance(reference, variant.encoding, "cpu")
        f, a = golden_run.compare_runs(
            runs, golden, name, reference, tol, variant, engine.tokenizer.decode
        )
        failures += f
        ambiguous += a
    if ambiguous:
        record_property("ambiguous", ", ".join(ambiguous))
        print("near-ties (not followed further): " + ", ".join(ambiguous))
    assert not failures, "\n\n".join(failures)
