"""The engine on the device under test (CUDA) against hardware-keyed goldens.

Which golden a GPU run is compared with:
  1. the golden of this exact GPU (`{model}_{encoding}_{gpu}_golden.json`, and torch's
     `torch_{model}_{encoding}_{gpu}_golden.json`) with the `cuda` tolerance;
  2. else, for bfloat16, the CPU golden (`..._all_...`) with the looser `cuda_fallback`
     tolerance; for float32 and the quantized encodings the CPU golden is the reference
     anyway (TF32 off), with the `cuda` tolerance.
The engine is teacher-forced with each golden's tokens (as test_llama on the CPU); the test
prints which golden and tolerance it used and the comparison's summary. A failing golden writes
an HTML report of all its cases, named on the failure's last line.

With GPU_TEST_DEVICE=cpu (the `test_llama_gpu_on_cpu` target, in every CI run) the same code
runs on the CPU, whose hardware key is `all`: rule 1 picks the CPU goldens, under the `cuda`
tolerance, which a CPU run passes with room to spare. That adds no engine coverage beyond
test_llama (same runs, tighter `cpu` tolerance) and takes as long as test_llama; what it buys is
that this file's own code (golden selection, hardware keys, reports) is run on every change
instead of only when someone has a GPU. Rule 2 (`cuda_fallback`) is reached only on a GPU
without its own goldens: `test_a_gpu_without_its_own_golden_takes_the_cpu_golden_and_the_fallback`
runs the selection for an imaginary GPU on the CPU. On a GPU every case runs, the long ones
included; the CPU twin runs the short cases only (test_llama_long holds the CPU to the long
ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from goldens import schema
from goldens.tolerances import tolerance
from harness.llama3 import diagnosis, engine_runs, failure_report, golden_files, judge
from harness.llama3.variants import Variant, variants

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
def test_llama_gpu(
    variant: Variant, device: torch.device, goldens, record_property, tmp_path: Path
) -> None:
    if variant.path is None:
        pytest.skip(f"{variant.model}: {variant.unavailable_reason}")
    gpu = golden_files.hardware(str(device))
    engine = engine_runs.load_engine(variant, str(device))
    failures, ambiguous, memo = [], 0, {}  # memo: a token sequence both goldens hold runs once
    lane = "short" if device.type == "cpu" else "all"
    reports = failure_report.report_directory(tmp_path)
    for reference in ("own", "torch"):
        golden, name, tol, note = _golden_for_this_gpu(goldens, reference, variant, gpu)
        record_property(f"{reference}_golden", f"{name} ({note})")
        verdict = judge.check(
            engine, golden, name, reference, tol, variant, device.type, memo=memo, lane=lane
        )
        print(f"{variant.test_id} on {gpu} ({note}): {verdict.summary()}")
        failures += failure_report.failures_with_report(
            verdict,
            golden,
            engine.tokenizer.decode,
            reports,
            f"{variant.test_id}-{device.type}",
            diagnosis.diverging_layer(engine, variant, golden, verdict),
        )
        ambiguous += verdict.ambiguous_steps
    record_property("ambiguous_steps", ambiguous)
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("reference", ["own", "torch"])
def test_a_gpu_without_its_own_golden_takes_the_cpu_golden_and_the_fallback(
    goldens, reference: str
) -> None:
    """Rule 2, the path every GPU takes while no GPU's bfloat16 goldens are pinned, which the
    CPU twin's run of test_llama_gpu (hardware key `all`: rule 1) never reaches: a GPU with
    no golden of its own gets the CPU golden and the `cuda_fallback` tolerance."""
    variant = next(v for v in VARIANTS if v.test_id == "tiny-bfloat16-llama3_1")
    gpu = schema.hardware_key("Imaginary GPU 9000 (no goldens)")
    assert goldens.find(reference, variant, hardware=gpu) is None
    golden, name, tol, note = _golden_for_this_gpu(goldens, reference, variant, gpu)
    cpu_name = golden_files.golden_file_name(reference, variant, "all")
    assert name.file_name == cpu_name and gpu not in cpu_name
    assert golden == goldens.load(reference, variant)[0]
    assert tol.key == f"{reference}/bfloat16/cuda_fallback"
    looser = (tol.logprob_atol, tol.kl_max, tol.topk_overlap_min, tol.near_tie_margin)
    assert looser == (1.2e-1, 2.0e-3, 0.8, 2.4e-1)  # tolerances.yaml's cuda_fallback entries
    assert note == f"fallback: no {gpu} golden, CPU golden with {tol.key}"


def test_hardware_key_names_the_device(device: torch.device) -> None:
    """The key goldens of this device are filed under: the GPU's name, `all` on the CPU."""
    if device.type == "cpu":
        expected = "all"
    else:
        expected = schema.hardware_key(torch.cuda.get_device_name(device))
    assert golden_files.hardware(str(device)) == expected
