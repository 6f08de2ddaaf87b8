"""This repository's engine and transformers behind the engine interface (goldens/engines/base.py),
so that every engine, in-process or over HTTP, is judged by the same driver.

Both answer full logits rows; the tests of this engine keep their own faster path
(engine_runs.forced_runs, memoized across goldens), which this adapter calls underneath.
`external_runs` turns any engine's teacher-forced answers into the `engine_runs.Run`s that
judge.compare_runs takes; `judge_engine` is judge.check for any engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from goldens import schema
from goldens.engines.base import Engine, forced_run
from goldens.record import CaseSpec
from goldens.tolerances import Tolerance, judged_lane
from harness.llama3 import judge
from harness.llama3.engine_runs import Run, load_engine
from harness.llama3.golden_files import GoldenSource
from harness.llama3.variants import Variant


class ThisEngine:
    """pipelines/llama3 (any execution mode) on one checkpoint."""

    full_logits = True
    tokenizes = True

    def __init__(self, variant: Variant, mode: str = "eager", device: str = "cpu") -> None:
        self.engine = load_engine(variant, device, mode=mode)
        self.name = f"this engine ({mode}) on {variant.path.name}"

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.engine.tokenizer.decode(list(ids))

    def teacher_forced(self, prompt, tokens, positions, top_k):
        out = self.engine.generate(
            list(prompt), len(tokens), forced_tokens=list(tokens), prompt_positions=list(positions)
        )
        rows = list(out.logits.float().numpy())
        prompt_rows = [] if out.prompt_logits is None else list(out.prompt_logits.float().numpy())
        return rows, prompt_rows

    def close(self) -> None:
        pass


class Transformers:
    """transformers' Llama on the same GGUF (torch_reference), teacher-forced with its KV cache,
    the final norm and LM head in float32 as the torch goldens were made."""

    full_logits = True
    tokenizes = True

    def __init__(self, variant: Variant, device: str = "cpu") -> None:
        from harness.llama3.torch_reference import load_reference

        self.model, self.tokenizer = load_reference(variant, device)
        self.device = device
        self.name = f"transformers on {variant.path.name}"

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @torch.inference_mode()
    def teacher_forced(self, prompt, tokens, positions, top_k):
        from harness.llama3.torch_reference import float32_head

        model = self.model
        with float32_head(model) as head:
            ids = torch.tensor([list(prompt)], device=self.device)
            out = model.model(ids, use_cache=True)
            prompt_rows = []
            if positions:
                hidden = out.last_hidden_state[0, list(positions)].float()
                prompt_rows = list((hidden @ head.T).cpu().numpy())
            rows = []
            for i in range(len(tokens)):
                rows.append((out.last_hidden_state[0, -1].float() @ head.T).cpu().numpy())
                if i + 1 < len(tokens):
                    out = model.model(
                        torch.tensor([[tokens[i]]], device=self.device),
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
            return rows, prompt_rows

    def close(self) -> None:
        pass


def external_runs(engine: Engine, golden: schema.Golden) -> list[Run]:
    """`engine` teacher-forced on every case of `golden`, as judge.compare_runs takes them
    (rows may be compare.TopLogprobs; input_ids None where the engine cannot tokenize)."""
    runs = []
    for case in golden.cases:
        forced = forced_run(engine, case)
        spec = CaseSpec(case.id, case.prompt, len(case.steps), len(case.steps[0].topk_ids))
        rows = forced.rows
        logits = np.stack(rows) if engine.full_logits and rows else rows
        prompt_rows = forced.prompt_rows
        if engine.full_logits and prompt_rows:
            prompt_rows = np.stack(prompt_rows)
        runs.append(
            dataclasses.replace(
                Run(spec, forced.input_ids, forced.tokens, logits, forced.seconds),
                positions=forced.positions,
                prompt_logits=prompt_rows if forced.positions else None,
            )
        )
    return runs


def judge_engine(
    engine: Engine,
    golden: schema.Golden,
    source: GoldenSource,
    reference: str,
    tolerance: Tolerance,
    variant: Variant,
    lane: str = "all",
) -> judge.Verdict:
    """judge.check for any engine: `engine` teacher-forced on the cases of `lane` of `golden`
    and compared under `tolerance` (the cases it judges)."""
    lane = judged_lane(lane, tolerance)
    runs = external_runs(engine, judge.in_lane(golden, variant.model, lane))
    return judge.compare_runs(
        runs, golden, source, reference, tolerance, variant, engine.decode, lane=lane
    )
