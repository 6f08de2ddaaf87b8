"""Run this repository's engine over the golden cases of one variant.

evaluate_llama writes goldens from free-running greedy runs (`run_cases`); the tests feed
the engine each golden's own tokens (`forced_runs`, teacher forcing) and compare every step
(`compare_runs`; `check` does both). Both load and tokenize the same way. A failing verdict
comes with an HTML report of all its cases (`failures_with_report`, max_tests/goldens/report.py)
and, against the torch goldens, the first layer and sub-block where the engine and transformers
part ways (`diverging_layer`, localize.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from max_tests.goldens import compare, locate, report, schema
from max_tests.goldens.record import CaseSpec, case_specs, file_sha256, record_case
from max_tests.goldens.tolerances import Tolerance
from max_tests.integration.architectures.llama3 import localize, torch_reference
from max_tests.integration.architectures.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine
from tools.cli_files import output_directory, user_path

ENGINE_PRODUCER_VERSION = "llama3-engine/2"
EVALUATE = "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama"
RUN_TORCH = "./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama"
# Goldens are computed on one torch thread, as every golden test runs (bazel/pytest.bzl):
# float32 sums split over a machine's threads round differently (3.5e-5 in log-probability at
# 8k positions between 1 and 2 threads), and a golden must not depend on the machine's cores.
GOLDEN_THREADS = 1
# Bazel's folder for a test's extra outputs; it zips them into bazel-testlogs after the test.
UNDECLARED_OUTPUTS_ENV = "TEST_UNDECLARED_OUTPUTS_DIR"


@dataclasses.dataclass(frozen=True)
class Run:
    """One engine generation for one case: what the comparison and the golden both need."""

    spec: CaseSpec
    input_ids: list[int]
    tokens: list[int]
    logits: np.ndarray  # [steps, vocab] float32
    seconds: float
    positions: list[int] = dataclasses.field(default_factory=list)  # prompt positions
    prompt_logits: np.ndarray | None = None  # [len(positions), vocab] float32, same prefill


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A run of one variant compared with one golden under one tolerance."""

    golden_name: str
    reference: str  # own | torch
    tolerance: Tolerance
    reports: list[compare.CaseReport]
    failures: list[str]  # diagnoses, one per failing case (or case-list mismatch)

    @property
    def ambiguous_steps(self) -> int:
        return sum(len(r.ambiguous_steps) for r in self.reports)

    @property
    def steps(self) -> int:
        return sum(len(r.steps) for r in self.reports)

    @property
    def prompt_positions(self) -> int:
        return sum(len(r.prompt_checks) for r in self.reports)

    @property
    def last_position(self) -> int:
        """The highest sequence position compared (a generated step or a prompt position)."""
        return max((c.position for r in self.reports for c in r.checks), default=0)

    @property
    def max_logprob_diff(self) -> float:
        return max((r.max_logprob_diff for r in self.reports), default=0.0)

    @property
    def max_kl(self) -> float:
        return max((r.max_kl for r in self.reports), default=0.0)

    def headroom(self) -> tuple[float, str, str]:
        """(share, metric, where): the worst check's |Δ log-prob| or KL as a share of this
        tolerance's threshold (1.0 is at the threshold), and where it was."""
        worst = (0.0, "logprob", "")
        for case_report in self.reports:
            for check in case_report.checks:
                for metric, value, limit in (
                    ("logprob", check.max_logprob_diff, self.tolerance.logprob_atol),
                    ("kl", check.kl, self.tolerance.kl_max),
                ):
                    if value / limit > worst[0]:
                        worst = (value / limit, metric, f"{case_report.case_id}, {check.where}")
        return worst

    def summary(self) -> str:
        agreement = sum(r.greedy_agreement for r in self.reports)
        ambiguous = ", ".join(
            f"{r.case_id} step {s.step}" for r in self.reports for s in r.ambiguous_steps
        )
        return (
            f"{self.reference} {self.golden_name} [{self.tolerance.key}]: "
            f"{'FAIL' if self.failures else 'PASS'}, {self.steps} steps teacher-forced "
            f"and {self.prompt_positions} prompt positions, up to position "
            f"{self.last_position}, "
            f"max |Δ log-prob| {self.max_logprob_diff:.3g}, max KL {self.max_kl:.3g}, "
            f"greedy agreement {agreement}/{self.steps}, "
            f"ambiguous steps {self.ambiguous_steps}" + (f" ({ambiguous})" if ambiguous else "")
        )


def hardware(device: str) -> str:
    """`all` on the CPU (results do not depend on the machine beyond tolerance), else the GPU."""
    if device == "cpu":
        return "all"
    return schema.hardware_key(torch.cuda.get_device_name(torch.device(device)))


def load_engine(
    variant: Variant, device: str = "cpu", overrides: dict | None = None, mode: str = "eager"
) -> Llama3Engine:
    if variant.path is None:
        raise FileNotFoundError(f"{variant.model} {variant.encoding}: {variant.unavailable_reason}")
    return Llama3Engine.from_gguf(
        variant.path, device=device, dtype=variant.dtype, overrides=overrides, mode=mode
    )


def _run(spec: CaseSpec, input_ids: list[int], out, seconds: float, positions) -> Run:
    prompt_logits = None if out.prompt_logits is None else out.prompt_logits.float().numpy()
    logits = out.logits.float().numpy()
    return Run(spec, input_ids, list(out.tokens), logits, seconds, list(positions), prompt_logits)


def run_case(engine: Llama3Engine, spec: CaseSpec) -> Run:
    input_ids = engine.tokenizer.encode(spec.prompt)
    positions = spec.positions(len(input_ids))
    start = time.perf_counter()
    out = engine.generate(input_ids, max_new_tokens=spec.steps, prompt_positions=positions)
    return _run(spec, input_ids, out, time.perf_counter() - start, positions)


def run_cases(engine: Llama3Engine, model: str) -> list[Run]:
    return [run_case(engine, spec) for spec in case_specs(model)]


def forced_run(engine: Llama3Engine, case: schema.Case) -> Run:
    """The engine fed the golden's tokens: its own tokenization of the prompt, then the
    golden's greedy tokens; row i of the logits follows the golden's first i tokens."""
    spec = CaseSpec(case.id, case.prompt, len(case.steps), len(case.steps[0].topk_ids))
    input_ids = engine.tokenizer.encode(case.prompt)
    # The golden's prompt positions, where the run's prompt has them (a tokenizer that
    # changed fails on input ids anyway; its positions past the run's prompt go missing).
    positions = [p for p in case.positions if p < len(input_ids) - 1]
    start = time.perf_counter()
    out = engine.generate(
        input_ids, len(case.steps), forced_tokens=case.token_ids, prompt_positions=positions
    )
    return _run(spec, input_ids, out, time.perf_counter() - start, positions)


def forced_runs(engine: Llama3Engine, golden: schema.Golden, memo: dict | None = None) -> list[Run]:
    """`forced_run` of every case. With `memo` (one dict per engine), a prompt and token
    sequence already run, e.g. by the other golden of the same checkpoint, is not run again:
    the engine's own and the torch goldens mostly hold the same greedy tokens."""
    if memo is None:
        return [forced_run(engine, case) for case in golden.cases]
    runs = []
    for case in golden.cases:
        top_k = len(case.steps[0].topk_ids)
        key = (case.prompt, tuple(case.token_ids), top_k, tuple(case.positions))
        if key not in memo:
            memo[key] = forced_run(engine, case)
        runs.append(
            dataclasses.replace(memo[key], spec=dataclasses.replace(memo[key].spec, id=case.id))
        )
    return runs


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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), e.g. "Intel(R) Xeon(R) Processor"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def engine_golden(
    variant: Variant,
    engine: Llama3Engine,
    runs: list[Run],
    device: str,
    full_logits: bool = False,
    mode: str = "eager",
) -> schema.Golden:
    """The engine's golden (eager), or another mode's run in the same format (producer
    `engine-MODE`, never published as a golden)."""
    tokenizer = engine.tokenizer
    producer = "engine" if mode == "eager" else f"engine-{mode}"
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
        )
        for r in runs
    ]
    return schema.Golden(provenance=prov, cases=cases)


def golden_file_name(reference: str, variant: Variant, hardware: str = "all") -> str:
    """The file name of the `reference` ("own" or "torch") golden of `variant`."""
    producer = "torch" if reference == "torch" else "engine"
    return schema.golden_file_name(variant.model, variant.encoding, hardware, producer)


def find_golden(
    reference: str, variant: Variant, testdata: Path, hardware: str = "all"
) -> tuple[schema.Golden, str] | None:
    """The golden and a description of where it was found (locate.py's sources), or None."""
    name = golden_file_name(reference, variant, hardware)
    path, _ = locate.find_golden(reference, name, testdata)
    return None if path is None else (schema.read(path), f"{name} ({path.parent})")


def output_folder(output_dir: str | None, testdata: Path) -> Path:
    """Where a golden-writing tool writes: --output-dir (created, relative to the user's folder)
    or the checkout's testdata folder. Raises cli_files.PathError for a path that is a file."""
    if not output_dir:
        return testdata
    return output_directory(user_path(output_dir).resolve(), "--output-dir")


def regenerate_command(variant: Variant, producer: str, device: str = "cpu") -> str:
    tool = RUN_TORCH if producer == "torch" else EVALUATE
    return f"{tool} -- --model={variant.model} --encoding={variant.encoding} --device={device}"


# Golden lanes: the short cases run in the edit loop's suite, the long ones (cases.yaml
# `generate:`, thousands of positions) in a target of their own; "all" is both.
LANES = ("all", "short", "long")


def _in_lane(spec: CaseSpec, lane: str) -> bool:
    return lane == "all" or spec.long == (lane == "long")


def in_lane(golden: schema.Golden, model: str, lane: str) -> schema.Golden:
    """`golden` with the cases of one lane only. A case that cases.yaml does not list stays
    in every lane (compare_runs reports it)."""
    if lane not in LANES:
        raise ValueError(f"lane {lane!r} is not one of {', '.join(LANES)}")
    elsewhere = {spec.id for spec in case_specs(model) if not _in_lane(spec, lane)}
    return dataclasses.replace(golden, cases=[c for c in golden.cases if c.id not in elsewhere])


def compare_runs(
    runs: list[Run],
    golden: schema.Golden,
    golden_name: str,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    decode,
    device: str = "cpu",
    lane: str = "all",
) -> Verdict:
    """Teacher-forced runs (`forced_runs` of this golden) against the golden, case by case;
    with a `lane`, only that lane's cases (and cases.yaml's cases of that lane)."""
    golden = in_lane(golden, variant.model, lane)
    by_id = {run.spec.id: run for run in runs}
    failures, reports = [], []
    regenerate = regenerate_command(variant, reference, device)
    listed = [(s.id, s.prompt) for s in case_specs(variant.model) if _in_lane(s, lane)]
    recorded = [(case.id, case.prompt) for case in golden.cases]
    if listed != recorded:
        failures.append(
            f"golden {golden_name} has cases {_short(recorded)}, cases.yaml lists "
            f"{_short(listed)}: regenerate with {regenerate}"
        )
    for case in golden.cases:
        run = by_id.get(case.id)
        if run is None:
            failures.append(f"no run of case {case.id!r} of golden {golden_name}")
            continue
        report = compare.compare_case(
            case,
            run.input_ids,
            run.tokens,
            run.logits,
            tolerance,
            dict(zip(run.positions, run.prompt_logits, strict=True)) if run.positions else {},
        )
        reports.append(report)
        if report.status == compare.FAIL:
            failures.append(
                compare.format_failure(report, case, golden_name, decode, regenerate, run.input_ids)
            )
    return Verdict(golden_name, reference, tolerance, reports, failures)


def _short(cases: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Case ids and prompts for a message, long prompts cut to their first words."""
    return [(i, p if len(p) <= 80 else f"{p[:40]}... ({len(p)} characters)") for i, p in cases]


def check(
    engine: Llama3Engine,
    golden: schema.Golden,
    golden_name: str,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    device: str = "cpu",
    memo: dict | None = None,
    lane: str = "all",
) -> Verdict:
    """The engine teacher-forced on `golden` (the cases of `lane`) and compared with it
    under `tolerance` (`memo`: see `forced_runs`)."""
    runs = forced_runs(engine, in_lane(golden, variant.model, lane), memo)
    decode = engine.tokenizer.decode
    return compare_runs(
        runs, golden, golden_name, reference, tolerance, variant, decode, device, lane
    )


def report_directory(fallback: Path) -> Path:
    """Where a failing golden test writes its HTML reports: Bazel's undeclared outputs folder,
    else `fallback` (the tests pass pytest's `tmp_path`, of which pytest keeps the last runs)."""
    outputs = os.environ.get(UNDECLARED_OUTPUTS_ENV)
    return Path(outputs) if outputs else fallback


def diverging_layer(
    engine: Llama3Engine, variant: Variant, golden: schema.Golden, verdict: Verdict
) -> tuple[str, str] | None:
    """(case id, where) for a failing verdict against the torch goldens: the first layer and
    sub-block at which the engine and transformers part ways on its first failing case, both fed
    that case's prompt and golden tokens. None for other verdicts. Loads transformers' model."""
    failing = next((r for r in verdict.reports if r.status == compare.FAIL), None)
    if verdict.reference != "torch" or failing is None:
        return None
    case = golden.case(failing.case_id)
    model = _reference_model(variant.path, variant.dtype, str(engine.device))
    divergence = localize.first_divergence(engine, model, case.input_ids, case.token_ids)
    if divergence is None:
        where = (
            "first diverging layer: none, every sub-block agrees with transformers on the "
            "golden's input ids (look at tokenization and BOS)"
        )
    else:
        where = divergence.describe()
    return case.id, where


@functools.lru_cache(maxsize=8)
def _reference_model(path: Path, dtype: torch.dtype, device: str):
    """transformers' model of a checkpoint, loaded once per process for the diagnosis: a
    broken engine fails every variant and mode, and each would load it again (SmolLM2: 7 s).
    The diagnosis only reads it (its hooks are removed after each run)."""
    return torch_reference.load_model(path, dtype, device)


def failures_with_report(
    verdict: Verdict,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    directory: Path,
    test_id: str,
    diagnosis: tuple[str, str] | None = None,
) -> list[str]:
    """`verdict.failures`; when there are any, the HTML report of this golden is written into
    `directory` and a last line names it ("report: PATH"). `diagnosis` (`diverging_layer`) is
    added to the failure text and to its case in the report."""
    if not verdict.failures:
        return []
    path = write_failure_report(verdict, golden, decode, directory, test_id, diagnosis)
    located = [] if diagnosis is None else [f"case {diagnosis[0]!r}: {diagnosis[1]}"]
    return [*verdict.failures, *located, f"report: {path}{_bazel_outputs_hint(directory)}"]


def write_failure_report(
    verdict: Verdict,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    directory: Path,
    test_id: str,
    diagnosis: tuple[str, str] | None = None,
) -> Path:
    """The HTML report of every case of `verdict`, failing and passing, written into
    `directory` as `golden_report_{test_id}_{golden file stem}.html`; returns its path.
    Golden tokens are the golden's stored texts, run tokens `decode([id])` of the run's."""
    golden_file = verdict.golden_name.split(" ")[0]  # find_golden names it "FILE (FOLDER)"
    notes = {} if diagnosis is None else {diagnosis[0]: [diagnosis[1]]}
    views = [
        _case_view(case_report, golden, decode, notes.get(case_report.case_id, []))
        for case_report in verdict.reports
    ]
    failing = sum(v.status == compare.FAIL for v in views)
    summary = [verdict.summary(), f"cases: {failing} of {len(views)} fail"]
    title = f"golden report: {test_id} against {golden_file} ({verdict.reference})"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / report_file_name(test_id, golden_file)
    return report.write_report(path, title, summary, views)


def report_file_name(test_id: str, golden_file: str) -> str:
    """`golden_report_{test_id}_{golden file stem}.html`, in characters safe in any file name."""
    stem = Path(golden_file).name.removesuffix(".json")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"golden_report_{test_id}_{stem}") + ".html"


def _case_view(
    case_report: compare.CaseReport,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    notes: list[str],
) -> report.CaseView:
    case = golden.case(case_report.case_id)
    steps = case_report.steps
    run_tokens = [decode([s.actual_token]) for s in steps if s.actual_token is not None]
    return report.case_view(
        case_report,
        f"{golden.provenance.model} {golden.provenance.encoding} · {case.id}",
        [s.token_text for s in case.steps],
        run_tokens,
        notes=[
            f"free-running greedy agreement: {case_report.greedy_agreement} of {len(steps)}",
            *notes,
        ],
    )


def _bazel_outputs_hint(directory: Path) -> str:
    """Where `bazel test` leaves a report in its undeclared outputs folder: zipped."""
    outputs, target = os.environ.get(UNDECLARED_OUTPUTS_ENV), os.environ.get("TEST_TARGET")
    if not outputs or not target or directory != Path(outputs):
        return ""
    package, _, name = target.split("//", 1)[-1].partition(":")
    return f" (after the test: bazel-testlogs/{package}/{name}/test.outputs/outputs.zip)"
