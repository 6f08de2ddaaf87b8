"""Why a verdict against the torch goldens failed: the first layer and sub-block at which the
engine and transformers part ways (localize.py's hooks on both models)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from goldens import compare, schema
from harness.llama3 import localize, torch_reference
from harness.llama3.judge import Verdict
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine


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
