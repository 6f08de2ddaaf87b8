"""Tiny random Llama GGUF files written with gguf-py, for fast tests of the loader and model.

Q/K rows are permuted the way llama.cpp's converter does, so the engine must undo it.
"""

import pathlib

import gguf
import numpy as np

# A byte-level vocabulary: the 256 byte characters, a few merges, and two control tokens.
_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]


def _byte_chars() -> list[str]:
    from pipelines.llama3.tokenizer import _byte_alphabet

    return list(_byte_alphabet().values())


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    tokens = _byte_chars()
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a p"]
    tokens += ["Ġt", "he", "Ġthe", "Ġc", "ap", *_SPECIAL]
    token_types = [1] * (len(tokens) - len(_SPECIAL)) + [3] * len(_SPECIAL)
    return tokens, merges, token_types


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_llama(
    path: pathlib.Path,
    *,
    seed: int = 0,
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn_dim: int = 128,
    tied: bool = False,
    rope_freqs: np.ndarray | None = None,
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    architecture: str = "llama",
    with_tokenizer: bool = True,
    tokenizer_pre: str = "llama-bpe",
) -> dict[str, np.ndarray]:
    """Write the file; returns the unpermuted float32 weights by GGUF tensor name."""
    rng = np.random.default_rng(seed)
    tokens, merges, token_types = tiny_vocab()
    vocab = len(tokens)
    head_dim = dim // n_heads

    def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    weights = {
        "token_embd.weight": randn(vocab, dim, scale=8.0),
        "output_norm.weight": 1 + randn(dim, scale=0.5),
    }
    if not tied:
        weights["output.weight"] = randn(vocab, dim, scale=4.0)
    for i in range(n_layers):
        weights |= {
            f"blk.{i}.attn_norm.weight": 1 + randn(dim, scale=0.5),
            f"blk.{i}.attn_q.weight": randn(n_heads * head_dim, dim, scale=2.0),
            f"blk.{i}.attn_k.weight": randn(n_kv_heads * head_dim, dim, scale=2.0),
            f"blk.{i}.attn_v.weight": randn(n_kv_heads * head_dim, dim),
            f"blk.{i}.attn_output.weight": randn(dim, n_heads * head_dim),
            f"blk.{i}.ffn_norm.weight": 1 + randn(dim, scale=0.5),
            f"blk.{i}.ffn_gate.weight": randn(ffn_dim, dim),
            f"blk.{i}.ffn_up.weight": randn(ffn_dim, dim),
            f"blk.{i}.ffn_down.weight": randn(dim, ffn_dim),
        }

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn_dim)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(tokenizer_pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
        writer.add_eos_token_id(tokens.index("<|end_of_text|>"))
        writer.add_add_bos_token(True)
    for name, weight in weights.items():
        stored = weight
        if name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(weight, n_heads)
        elif name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(weight, n_kv_heads)
        if stored.ndim == 2 and weight_type != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(stored, weight_type)
            writer.add_tensor(name, packed, raw_dtype=weight_type)
        else:
            writer.add_tensor(name, stored)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
