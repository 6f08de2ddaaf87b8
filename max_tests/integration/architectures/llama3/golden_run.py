"""Run this repository's engine over the golden cases of one variant.

Both evaluate_llama (which writes goldens) and test_llama (which checks against them) call
this, so a golden and the run it is compared with are produced the same way.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from max_tests.goldens import compare, schema
from max_tests.goldens.record import CaseSpec, case_specs, file_sha256, record_case
from max_tests.goldens.tolerances import Tolerance
from max_tests.integration.architectures.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine

ENGINE_PRODUCER_VERSION = "llama3-engine/1"
EVALUATE = "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama"
RUN_TORCH = "./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama"


@dataclasses.dataclass(frozen=True)
class Run:
    """One engine generation for one case: what the comparison and the golden both need."""

    spec: CaseSpec
    input_ids: list[int]
    tokens: list[int]
    logits: np.ndarray  # [steps, vocab] float32
    seconds: float


def hardware(device: str) -> str:
    """`all` on the CPU (results do not depend on the machine beyond tolerance), else the GPU."""
    if device == "cpu":
        return "all"
    return schema.hardware_key(torch.cuda.get_device_name(torch.device(device)))


def load_engine(
    variant: Variant, device: str = "cpu", overrides: dict | None = None
) -> Llama3Engine:
    if variant.path is None:
        raise FileNotFoundError(f"{variant.model} {variant.encoding}: {variant.unavailable_reason}")
    return Llama3Engine.from_gguf(
        variant.path, device=device, dtype=variant.dtype, overrides=overrides
    )


def run_case(engine: Llama3Engine, spec: CaseSpec) -> Run:
    input_ids = engine.tokenizer.encode(spec.prompt)
    start = time.perf_counter()
    out = engine.generate(input_ids, max_new_tokens=spec.steps)
    seconds = time.perf_counter() - start
    return Run(spec, input_ids, list(out.tokens), out.logits.float().numpy(), seconds)


def run_cases(engine: Llama3Engine, model: str) -> list[Run]:
    return [run_case(engine, spec) for spec in case_specs(model)]


def provenance(
    variant: Variant, producer: str, producer_version: str, device: str
) -> schema.Provenance:
    """What made a golden: no paths, no clocks, so the file is the same on any machine."""
    return schema.Provenance(
        producer=producer,
        producer_version=producer_version,
        model=variant.model,
        encoding=variant.encoding,
        hardware=hardware(device),
        device=torch.device(device).type,
        dtype=str(variant.dtype).removeprefix("torch."),
        checkpoint=variant.path.name,
        checkpoint_sha256=file_sha256(variant.path),
        torch_version=torch.__version__.split("+")[0],
    )


def engine_golden(
    variant: Variant, engine: Llama3Engine, runs: list[Run], device: str, full_logits: bool = False
) -> schema.Golden:
    tokenizer = engine.tokenizer
    prov = provenance(variant, "engine", ENGINE_PRODUCER_VERSION, device)
    cases = [
        record_case(
            r.spec,
            r.input_ids,
            r.tokens,
            r.logits,
            tokenizer.decode,
            tokenizer.eos_ids,
            full_logits=full_logits,
        )
        for r in runs
    ]
    return schema.Golden(provenance=prov, cases=cases)


def regenerate_command(variant: Variant, producer: str, device: str = "cpu") -> str:
    tool = RUN_TORCH if producer == "torch" else EVALUATE
    return f"{tool} -- --model={variant.model} --encoding={variant.encoding} --device={device}"


def compare_runs(
    runs: list[Run],
    golden: schema.Golden,
    golden_name: str,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    decode,
    device: str = "cpu",
) -> tuple[list[str], list[str]]:
    """Diagnoses of the failing cases, and the cases that stopped at a near-tie."""
    by_id = {run.spec.id: run for run in runs}
    failures, ambiguous = [], []
    regenerate = regenerate_command(variant, reference, device)
    for case in golden.cases:
        run = by_id.get(case.id)
        if run is None:
            failures.append(
                f"golden {golden_name} has case {case.id!r}, which cases.yaml no longer lists: "
                f"regenerate with {regenerate}"
            )
            continue
        report = compare.compare_case(case, run.input_ids, run.tokens, run.logits, tolerance)
        if report.status == compare.FAIL:
            failures.append(
                compare.format_failure(report, case, golden_name, decode, regenerate, run.input_ids)
            )
        elif report.status == compare.AMBIGUOUS:
            ambiguous.append(f"{reference}/{case.id} step {report.first_diverging.step}")
    return failures, ambiguous
