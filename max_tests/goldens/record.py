"""Turn one generation (input ids, greedy tokens, per-step logits) into a golden case.

Shared by every producer (evaluate_llama for the engine, run_torch_llama for transformers),
so both write the same schema from the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import yaml

from max_tests.goldens.schema import Case, step_from_logits

CASES_FILE = Path(__file__).with_name("cases.yaml")


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    id: str
    prompt: str
    steps: int
    top_k: int


@functools.cache
def _cases_table(path: Path = CASES_FILE) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def case_specs(model: str) -> list[CaseSpec]:
    """The golden prompts of `model`, as cases.yaml lists them."""
    table = _cases_table()
    defaults = table["defaults"]
    try:
        prompts = table["models"][model]["prompts"]
    except KeyError:
        raise KeyError(f"cases.yaml has no prompts for model {model!r}") from None
    return [
        CaseSpec(
            id=p["id"],
            prompt=p["text"],
            steps=int(p.get("steps", defaults["steps"])),
            top_k=int(p.get("top_k", defaults["top_k"])),
        )
        for p in prompts
    ]


def record_case(
    spec: CaseSpec,
    input_ids: Sequence[int],
    tokens: Sequence[int],
    logits: np.ndarray,
    decode: Callable[[Sequence[int]], str],
    eos_ids: set[int],
    full_logits: bool = False,
) -> Case:
    """`logits[i]` are the next-token logits that chose `tokens[i]`."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {logits.shape[0]} rows of logits")
    steps = [
        step_from_logits(logits[i], tokens[i], decode([tokens[i]]), spec.top_k, full=full_logits)
        for i in range(len(tokens))
    ]
    return Case(
        id=spec.id,
        prompt=spec.prompt,
        input_ids=[int(t) for t in input_ids],
        steps=steps,
        stopped_on_eos=bool(tokens) and int(tokens[-1]) in eos_ids,
    )


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
