"""transformers' own Llama on a GGUF file: the independent reference the engine is checked against.

transformers' GGUF loader ignores Llama 3.1 rope scaling (docs/environment.md), so the config is
rebuilt with llama3 rope parameters whenever the file carries `rope_freqs`, and the model's
inverse frequencies are checked against the file's before anything runs. Used by
testdata/run_torch_llama.py (the torch goldens) and localize.py (the first diverging layer).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub: everything is local files
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import gguf
import numpy as np
import torch

from harness.llama3.variants import Variant
from pipelines.llama3.gguf_file import GGUFFile

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


def model_only_copy(path: Path) -> Path:
    """A copy of the GGUF without its vocabulary (same tensor bytes, same model metadata),
    made once per file and process in a temporary folder.

    gguf-py's reader, which transformers uses, builds a numpy view per array element: the
    Llama 3 vocabulary's 128256 tokens and 280147 merges took 50 s of each tiny checkpoint's
    load (three reads of 10-20 s), SmolLM2's 25 s. The model needs none of them. The copy is
    read with the engine's parser (pipelines/llama3/gguf_file.py, checked against gguf-py by
    its tests) and written with gguf-py's writer; test_mutations.py reads the copy and the
    original with gguf-py and compares every tensor's bytes and every non-vocabulary field.
    transformers then loads, dequantizes and unpermutes the weights itself, so the reference
    stays independent where it matters.
    """
    stat = path.stat()
    return _model_only_copy(path.resolve(), stat.st_size, stat.st_mtime_ns)


# Vocabulary arrays the model does not need (their parse is the slow part).
_VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
)


@functools.cache
def _model_only_copy(path: Path, size: int, mtime_ns: int) -> Path:
    source = GGUFFile(path)
    folder = Path(tempfile.mkdtemp(prefix="model_only_gguf_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    copy = folder / path.name
    writer = gguf.GGUFWriter(str(copy), source.fields["general.architecture"])
    for key, value in source.fields.items():
        # GGUFWriter writes the architecture (and the header) itself.
        if key in _VOCABULARY_KEYS or key == "general.architecture":
            continue
        kind, *sub_type = source.field_types[key]
        writer.add_key_value(key, value, kind, sub_type=sub_type[-1] if sub_type else None)
    for info in source.tensors.values():
        block, type_size = gguf.GGML_QUANT_SIZES[info.tensor_type]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
        writer.add_tensor_info(
            info.name, byte_shape, np.dtype(np.uint8), info.n_bytes, raw_dtype=info.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for info in source.tensors.values():
        writer.write_tensor_data(source.tensor_data(info.name))
    writer.close()
    return copy


FLOAT32_SDPA = "sdpa_float32"


@functools.cache
def _float32_sdpa() -> str:
    """Register transformers' SDPA attention computed in float32 and rounded once to the
    compute dtype, as the engine computes it (pipelines/llama3/model.py, Attention): in
    bfloat16 SDPA rounds its softmax probabilities to bfloat16, which way depending on the
    CPU's kernel level. The mask is SDPA's."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def float32_sdpa(module, query, key, value, attention_mask, **kwargs):
        output, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
        return output.to(query.dtype), weights

    AttentionInterface.register(FLOAT32_SDPA, float32_sdpa)
    AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)
    return FLOAT32_SDPA


def load_model(path: Path, dtype: torch.dtype, device: str = "cpu"):
    """transformers' LlamaForCausalLM for one GGUF file, rope scaling restored, in eval mode
    (read from `model_only_copy`: the same weights, without the slow vocabulary parse)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_only_copy(path)
    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    theta, rope_freqs = _read_metadata(source)
    if rope_freqs is not None:
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": theta, **LLAMA3_ROPE}
    if dtype != torch.float32:
        config._attn_implementation = _float32_sdpa()  # as the engine's attention
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=dtype
    ).to(device)
    model.eval()
    if rope_freqs is not None:
        _adopt_rope_freqs(model, path, theta, rope_freqs)
    return model


class BadRopeFreqs(SystemExit):
    """A file whose rope_freqs transformers cannot reproduce: exit status 2 (bad input). The
    message stays the exception's text for callers that catch it (golden_check reports the
    file as not applicable); `_adopt_rope_freqs` prints it to stderr first, because Python
    prints nothing for an uncaught SystemExit whose code is a number."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


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
    wanted = base.double().numpy() / rope_freqs
    if not np.allclose(wanted, used, rtol=1e-5):
        relative = np.abs(wanted - used) / np.abs(used)
        worst = int(relative.argmax())
        message = (
            f"transformers reference: {path}: rope_freqs.weight differs from transformers' "
            f"llama3 rope scaling {LLAMA3_ROPE} at rope_theta {theta:g} (inverse frequency "
            f"{worst} of {len(used)} off by {relative[worst]:.3g}, relative; 1e-5 allowed), so "
            "transformers cannot reproduce this file's rotary embedding. This reference takes "
            "Llama 3.1 files only: give a Llama 3.1 GGUF (llama.cpp's convert_hf_to_gguf.py "
            "writes rope_freqs from these parameters), or judge this file by its own goldens "
            "only (golden_check --golden=own)"
        )
        print(message, file=sys.stderr)
        raise BadRopeFreqs(message)
    adopted = (base / torch.from_numpy(rope_freqs)).to(rotary.inv_freq.device)
    rotary.inv_freq.copy_(adopted)
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = adopted.clone()


def load_reference(variant: Variant, device: str):
    """transformers' model and tokenizer for one variant's GGUF."""
    from transformers import AutoTokenizer

    from testing import gguf_reader

    gguf_reader.install()  # the tokenizer parses the vocabulary: 4.5x faster
    model = load_model(variant.path, variant.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(str(variant.path.parent), gguf_file=variant.path.name)
    return model, tokenizer


@contextlib.contextmanager
def float32_head(model):
    """The final norm in float32 while the block runs, and the LM head's weight in float32
    (yielded): the engine's numerics, whatever the model's dtype (bfloat16 logits of ~40 sit
    on a 0.25 grid and make exact ties)."""
    norm = model.model.norm
    weight, eps = norm.weight.float(), norm.variance_epsilon

    def float32_norm(module, inputs, output):
        x = inputs[0].float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    hook = norm.register_forward_hook(float32_norm)
    try:
        yield model.lm_head.weight.float()  # [vocab, dim]
    finally:
        hook.remove()
