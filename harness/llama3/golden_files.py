"""Golden files of a variant: their names, where the pinned ones are found, what made them
(provenance) and the command that makes them again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from goldens import locate, schema
from goldens.cli_files import output_directory, user_path
from goldens.machine import cpu_model
from goldens.record import case_specs, file_sha256, record_case
from harness.llama3 import constrained_goldens, sampling_goldens
from harness.llama3.engine_runs import Run
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine

ENGINE_PRODUCER_VERSION = "llama3-engine/2"

EVALUATE = "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama"

RUN_TORCH = "./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama"


@dataclasses.dataclass(frozen=True)
class GoldenSource:
    """Which golden file a verdict is against, and the folder it was read from."""

    file_name: str
    folder: str = ""

    def __str__(self) -> str:
        return f"{self.file_name} ({self.folder})" if self.folder else self.file_name


def hardware(device: str) -> str:
    """`all` on the CPU (results do not depend on the machine beyond tolerance), else the GPU."""
    if device == "cpu":
        return "all"
    return schema.hardware_key(torch.cuda.get_device_name(torch.device(device)))


def provenance(
    variant: Variant, producer: str, producer_version: str, device: str
) -> schema.Provenance:
    """What made a golden: no paths, no clocks; the machine's share is the CPU model, kernel
    level and thread count, so a file is the same on any machine of that CPU."""
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
        logits_dtype="float32",  # both producers run the final norm and LM head in float32
        cpu=cpu_model(),
        kernel_level=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
    )


def engine_golden(
    variant: Variant,
    engine: Llama3Engine,
    runs: list[Run],
    device: str,
    full_logits: bool = False,
    mode: str = "eager",
) -> schema.Golden:
    """The engine's golden (eager), the ggml mode's (producer `engine-ggml`, the goldens of
    reference "ggml"), or another mode's run in the same format (producer `engine-MODE`,
    never published as a golden); each short case with its sampling goldens
    (sampling_goldens.record: the engine samples each of cases.yaml's samplers) and its
    constrained goldens (constrained_goldens.record: each of cases.yaml's constraints that
    names the case)."""
    tokenizer = engine.tokenizer
    # cases.yaml's long cases record no sampling; a rerun of a golden's cases (a failing
    # test's run, write_run_golden) has specs made from the golden, which do not say `long`
    long_ids = {spec.id for spec in case_specs(variant.model) if spec.long}
    producer = "engine" if mode == "eager" else f"engine-{mode}"  # engine-ggml: its goldens
    prov = provenance(variant, producer, ENGINE_PRODUCER_VERSION, device)
    cases = [
        record_case(
            r.spec,
            r.input_ids,
            r.tokens,
            r.logits,
            tokenizer.decode,
            tokenizer.eos_ids,
            full_logits=full_logits,
            positions=r.positions,
            prompt_logits=r.prompt_logits,
            sampling=[] if _long(r, long_ids) else sampling_goldens.record(engine, r),
            constrained=[] if _long(r, long_ids) else constrained_goldens.record(engine, r),
        )
        for r in runs
    ]
    return schema.Golden(provenance=prov, cases=cases)


def _long(run: Run, long_ids: set[str]) -> bool:
    return run.spec.long or run.spec.id in long_ids


def golden_file_name(reference: str, variant: Variant, hardware: str = "all") -> str:
    """The file name of the `reference` ("own", "torch" or "ggml") golden of `variant`."""
    producer = schema.PRODUCERS[reference]
    return schema.golden_file_name(variant.model, variant.encoding, hardware, producer)


def find_golden(
    reference: str, variant: Variant, testdata: Path, hardware: str = "all"
) -> tuple[schema.Golden, GoldenSource] | None:
    """The golden and where it was found (locate.py's sources), or None."""
    name = golden_file_name(reference, variant, hardware)
    path, _ = locate.find_golden(reference, name, testdata)
    return None if path is None else (schema.read(path), GoldenSource(name, str(path.parent)))


def output_folder(output_dir: str | None, testdata: Path) -> Path:
    """Where a golden-writing tool writes: --output-dir (created, relative to the user's folder)
    or the checkout's testdata folder. Raises cli_files.PathError for a path that is a file."""
    if not output_dir:
        return testdata
    return output_directory(user_path(output_dir).resolve(), "--output-dir")


def regenerate_command(variant: Variant, producer: str, device: str = "cpu") -> str:
    """The command that makes the `producer` (a reference: own, torch, ggml) golden."""
    tool = RUN_TORCH if producer == "torch" else EVALUATE
    mode = " --mode=ggml" if producer == "ggml" else ""
    return (
        f"{tool} -- --model={variant.model} --encoding={variant.encoding} --device={device}{mode}"
    )
