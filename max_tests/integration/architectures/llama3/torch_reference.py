"""transformers' own Llama on a GGUF file: the independent reference the engine is checked against.

transformers' GGUF loader ignores Llama 3.1 rope scaling (docs/environment.md), so the config is
rebuilt with llama3 rope parameters whenever the file carries `rope_freqs`, and the model's
inverse frequencies are checked against the file's before anything runs. Used by
testdata/run_torch_llama.py (the torch goldens) and localize.py (the first diverging layer).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub: everything is local files
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import gguf
import numpy as np
import torch

from max_tests.integration.architectures.llama3.variants import Variant

# Llama 3.1's published rope scaling; checked against the file's rope_freqs before use.
LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _read_metadata(path: Path) -> tuple[float, np.ndarray | None]:
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("llama.rope.freq_base")
    theta = float(field.parts[field.data[0]][0]) if field else 10000.0
    freqs = next(
        (
            np.array(t.data, dtype=np.float32)
            for t in reader.tensors
            if t.name == "rope_freqs.weight"
        ),
        None,
    )
    return theta, freqs


def load_model(path: Path, dtype: torch.dtype, device: str = "cpu"):
    """transformers' LlamaForCausalLM for one GGUF file, rope scaling restored, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    theta, rope_freqs = _read_metadata(path)
    if rope_freqs is not None:
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": theta, **LLAMA3_ROPE}
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=dtype
    ).to(device)
    model.eval()
    if rope_freqs is not None:
        _adopt_rope_freqs(model, path, theta, rope_freqs)
    return model


def _adopt_rope_freqs(model, path: Path, theta: float, rope_freqs: np.ndarray) -> None:
    """Check that transformers' own llama3 scaling is the file's rope_freqs, then use the
    file's factors exactly, as llama.cpp and the engine do (unscaled inverse frequencies
    divided by rope_freqs, in float32).

    The two agree to about one float32 ulp, and one ulp is not nothing: in the smoothed band
    (factor 2.69) it moved one row of the bfloat16 cos table at position 2993, and at 8k
    positions a bfloat16 run drifted 0.08 in log-probability from the engine (bit-identical
    with the file's factors)."""
    rotary = model.model.rotary_emb
    head_dim = rope_freqs.shape[0] * 2
    # transformers' default rope: 1 / theta ** (arange(0, dim, 2) / dim), in float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = 1.0 / (theta**exponents)
    used = rotary.inv_freq.double().cpu().numpy()
    if not np.allclose(base.double().numpy() / rope_freqs, used, rtol=1e-5):
        raise SystemExit(
            f"transformers reference: {path}: rope_freqs are not Llama 3.1's llama3 "
            f"scaling {LLAMA3_ROPE}; transformers cannot reproduce this file"
        )
    adopted = (base / torch.from_numpy(rope_freqs)).to(rotary.inv_freq.device)
    rotary.inv_freq.copy_(adopted)
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = adopted.clone()


def load_reference(variant: Variant, device: str):
    """transformers' model and tokenizer for one variant's GGUF."""
    from transformers import AutoTokenizer

    model = load_model(variant.path, variant.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(variant.path.parent), gguf_file=variant.path.name)
    return model, tokenizer
