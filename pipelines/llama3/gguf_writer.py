"""Write a Llama GGUF file as llama.cpp's converter does: what gguf_loader reads, in reverse.

Weights come in as float32 in Hugging Face layout and are stored in llama.cpp's: wq and wk
rows permuted into its interleaved rotary order (`permute_qk`, which the loader's
`unpermute_qk` undoes), matrices in the chosen type, 1-D tensors (norms, rope_freqs) in
float32. tools/gen_tiny_model/tiny_llama.py writes every tiny checkpoint with it: the
committed ones and the tests' small random ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.gguf_loader import ARCHITECTURE, permute_qk


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The tokenizer.ggml.* keys of a byte-level BPE vocabulary (llama.cpp's "gpt2" model)."""

    tokens: Sequence[str]
    token_types: Sequence[int]  # gguf.TokenType: NORMAL for BPE tokens, CONTROL for special
    merges: Sequence[str]  # "left right", in rank order
    bos_token_id: int
    eos_token_id: int
    pre: str = "llama-bpe"  # the pre-tokenizer llama.cpp applies
    chat_template: str | None = None


def file_layout(name: str, weight: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """A tensor as the file stores it: wq and wk rows permuted for llama.cpp's RoPE."""
    if name.endswith(".attn_q.weight"):
        return permute_qk(weight, config.n_heads)
    if name.endswith(".attn_k.weight"):
        return permute_qk(weight, config.n_kv_heads)
    return weight


def write_gguf(
    path: str | os.PathLike,
    config: LlamaConfig,
    weights: Iterable[tuple[str, np.ndarray]],
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    vocab: Vocabulary | None = None,
    quantize: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] = gguf_quantize,
    name: str | None = None,
    file_type: int | None = None,
    quantization_version: int | None = None,
    architecture: str = ARCHITECTURE,
    tensor_types: Mapping[str, GGMLQuantizationType] | None = None,
) -> None:
    """Write `weights` ((GGUF tensor name, float32 weight in Hugging Face layout), in file
    order) and `config`'s hyperparameters to `path`.

    2-D weights are stored as `weight_type`, or as `tensor_types` names for a tensor (as
    `llama-quantize --tensor-type` mixes them; `quantize` makes the blocks: gguf-py's by
    default), 1-D ones as float32. The metadata is what `read_config` reads; Llama 3.1 rope
    scaling travels as the rope_freqs tensor among `weights`, the token ids in `vocab`.
    `name` (general.type and general.name), `file_type` and `quantization_version` are only
    written when given, as is the tokenizer.
    """
    writer = GGUFWriter(path, architecture)
    if name is not None:
        writer.add_type("model")
        writer.add_name(name)
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    if vocab is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.token_types)
        writer.add_token_merges(vocab.merges)
        writer.add_bos_token_id(vocab.bos_token_id)
        writer.add_eos_token_id(vocab.eos_token_id)
        writer.add_add_bos_token(True)
        if vocab.chat_template is not None:
            writer.add_chat_template(vocab.chat_template)
    if quantization_version is not None:
        writer.add_quantization_version(quantization_version)
    for tensor_name, weight in weights:
        stored = file_layout(tensor_name, weight, config)
        qtype = (tensor_types or {}).get(tensor_name, weight_type)
        if stored.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, stored)
        else:
            writer.add_tensor(tensor_name, quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
