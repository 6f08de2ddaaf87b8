"""Tiny random Llama GGUF files, for fast tests of the loader and model.

Written by gguf_writer.write_gguf (the writer of the committed tiny checkpoints too), which
permutes the Q/K rows the way llama.cpp's converter does, so the engine must undo it.
"""

import pathlib

import gguf
import numpy as np

from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.gguf_writer import Vocabulary, write_gguf

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
    rope_theta: float = 10000.0,
    context_length: int = 256,
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

    config = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=1e-5,
        context_length=context_length,
        tie_word_embeddings=tied,
    )
    vocabulary = Vocabulary(
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        bos_token_id=tokens.index("<|begin_of_text|>"),
        eos_token_id=tokens.index("<|end_of_text|>"),
        pre=tokenizer_pre,
    )
    tensors = list(weights.items())
    if rope_freqs is not None:
        tensors.append(("rope_freqs.weight", rope_freqs.astype(np.float32)))
    write_gguf(
        path,
        config,
        tensors,
        weight_type,
        vocab=vocabulary if with_tokenizer else None,
        architecture=architecture,
    )
    return weights
