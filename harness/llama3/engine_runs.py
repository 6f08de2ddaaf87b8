"""This repository's engine run over the golden cases of one variant.

evaluate_llama writes goldens from free-running greedy runs (`run_cases`); the tests feed the
engine each golden's own tokens (`forced_runs`, teacher forcing) and compare every step
(judge.py). Both load and tokenize the same way.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from goldens import schema
from goldens.engines.base import forced_inputs
from goldens.record import CaseSpec, case_specs
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.speculative import Speculation

# Goldens are computed on one torch thread, as every golden test runs (bazel/pytest.bzl):
# float32 sums split over a machine's threads round differently (3.5e-5 in log-probability at
# 8k positions between 1 and 2 threads), and a golden must not depend on the machine's cores.
GOLDEN_THREADS = 1


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
    speculation: object | None = None  # a speculative run's speculative.Stats


class Speculating:
    """`engine` with every generation speculative (`speculation`): what the golden lanes judge
    to hold speculation to the goldens. Teacher-forced, the forced tokens are the proposals, so
    each forward scores K + 1 rows of the checked sequence (pipelines/llama3/speculative.py)."""

    def __init__(self, engine: Llama3Engine, speculation: Speculation) -> None:
        self.engine, self.speculation = engine, speculation

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, speculation=self.speculation, **kwargs)


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
    return Run(
        spec, input_ids, list(out.tokens), logits, seconds, list(positions), prompt_logits,
        out.speculation,
    )  # fmt: skip


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
    input_ids, positions = forced_inputs(case, engine.tokenizer.encode(case.prompt))
    start = time.perf_counter()
    out = engine.generate(
        input_ids, len(case.steps), forced_tokens=case.token_ids, prompt_positions=positions
    )
    return _run(spec, input_ids, out, time.perf_counter() - start, positions)


def memo_key(case: schema.Case) -> tuple:
    """What a forced run of `case` depends on: prompt, forced tokens, top-k, prompt positions."""
    return (case.prompt, tuple(case.token_ids), len(case.steps[0].topk_ids), tuple(case.positions))


def forced_runs(engine: Llama3Engine, golden: schema.Golden, memo: dict | None = None) -> list[Run]:
    """`forced_run` of every case. With `memo` (one dict per engine), a prompt and token
    sequence already run, e.g. by the other golden of the same checkpoint, is not run again:
    the engine's own and the torch goldens mostly hold the same greedy tokens."""
    if memo is None:
        return [forced_run(engine, case) for case in golden.cases]
    runs = []
    for case in golden.cases:
        key = memo_key(case)
        if key not in memo:
            memo[key] = forced_run(engine, case)
        runs.append(
            dataclasses.replace(memo[key], spec=dataclasses.replace(memo[key].spec, id=case.id))
        )
    return runs
