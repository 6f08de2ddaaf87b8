"""The engine on CUDA against hardware-keyed goldens.

Which golden a GPU run is compared with:
  1. the golden of this exact GPU (`{model}_{encoding}_{gpu}_golden.json`, and torch's
     `torch_{model}_{encoding}_{gpu}_golden.json`) with the `cuda` tolerance;
  2. else, for bfloat16, the CPU golden (`..._all_...`) with the looser `cuda_fallback`
     tolerance; for float32 and the quantized encodings the CPU golden is the reference
     anyway (TF32 off), with the `cuda` tolerance.
The engine is teacher-forced with each golden's tokens (as test_llama on the CPU); the test
prints which golden and tolerance it used and the comparison's summary. A failing golden writes
an HTML report of all its cases, named on the failure's last line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from max_tests.goldens import schema
from max_tests.goldens.tolerances import tolerance
from max_tests.integration.architectures.llama3 import golden_run
from max_tests.integration.architectures.llama3.variants import Variant, variants

pytestmark = pytest.mark.gpu
VARIANTS = variants()


def _golden_for_this_gpu(goldens, reference: str, variant: Variant, gpu: str):
    """(golden, name, tolerance, note): exact hardware first, then the documented fallback."""
    if variant.encoding == "bfloat16":
        exact = goldens.find(reference, variant, hardware=gpu)
        if exact is not None:
            return *exact, tolerance(reference, variant.encoding, "cuda"), f"exact {gpu}"
        golden, name = goldens.load(reference, variant)
        tol = tolerance(reference, variant.encoding, "cuda", fallback=True)
        return golden, name, tol, f"fallback: no {gpu} golden, CPU golden with {tol.key}"
    golden, name = goldens.load(reference, variant)
    return golden, name, tolerance(reference, variant.encoding, "cuda"), "CPU golden"


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.test_id for v in VARIANTS])
def test_llama_gpu(variant: Variant, goldens, record_property, tmp_path: Path) -> None:
    if variant.path is None:
        pytest.skip(f"{variant.model}: {variant.unavailable_reason}")
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = golden_run.hardware("cuda")
    engine = golden_run.load_engine(variant, "cuda")
    failures, ambiguous = [], 0
    reports = golden_run.report_directory(tmp_path)
    for reference in ("own", "torch"):
        golden, name, tol, note = _golden_for_this_gpu(goldens, reference, variant, gpu)
        record_property(f"{reference}_golden", f"{name} ({note})")
        verdict = golden_run.check(engine, golden, name, reference, tol, variant, "cuda")
        print(f"{variant.test_id} on {gpu} ({note}): {verdict.summary()}")
        failures += golden_run.failures_with_report(
            verdict,
            golden,
            engine.tokenizer.decode,
            reports,
            f"{variant.test_id}-cuda",
            golden_run.diverging_layer(engine, variant, golden, verdict),
        )
        ambiguous += verdict.ambiguous_steps
    record_property("ambiguous_steps", ambiguous)
    assert not failures, "\n\n".join(failures)


def test_hardware_key_of_this_gpu_names_the_device() -> None:
    name = torch.cuda.get_device_name(0)
    assert golden_run.hardware("cuda") == schema.hardware_key(name)
    assert golden_run.hardware("cpu") == "all"
