"""Tiny random Llama checkpoints: their shape, their weights, and their GGUF files.

The one tiny-checkpoint writer of the repository: `gen_tiny_model` writes the committed
checkpoints with `write_gguf` (the full Llama 3.1 tokenizer, tied output, Llama 3.1 rope
scaling), and the engine's and tools' tests write their small random ones with
`write_tiny_llama` (the 263-token byte vocabulary of `byte_vocab`, an output matrix of its own,
any GGML type): the same weight recipe (`hf_weights`), the same file writer.

The weights are drawn so the model is a useful golden subject rather than a constant
predictor: the embedding is tied to the output and kept small next to what the blocks add, so
each next token depends on the block outputs (attention over the context and the MLP) and not
only on the current token; the final norm's gain sets the logit spread (standard deviation
about LOGIT_STD over the vocabulary). Whether every greedy step of the golden prompts clears
the near-tie margin still depends on the draw, so the committed checkpoints use seeds whose
goldens pass max_tests/integration/architectures/llama3/test_golden_sanity.py (no exact ties,
few near-ties).

The file follows llama.cpp's conventions (convert_hf_to_gguf.py for a Llama 3.1 checkpoint):
the weights are defined in Hugging Face layout and pipelines/llama3/gguf_writer.py (the one
GGUF writer, shared with the engine's tests) permutes the Q/K rows into llama.cpp's
interleaved rotary layout on the way out; the Llama 3.1 rope scaling is carried by the
`rope_freqs` tensor, not by metadata keys.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.quants import quantize as gguf_quantize

from pipelines.llama3 import gguf_writer
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.gguf_loader import ARCHITECTURE
from tools.gen_tiny_model import counter_rng, nvfp4, q4_k

ENCODINGS = ("float32", "bfloat16", "q4_k", "nvfp4")

# The 2-D weights' storage type and the general.file_type written for each encoding. 1-D norms
# and rope_freqs stay F32 in every encoding, as llama.cpp keeps them.
WEIGHT_TYPE = {
    "float32": GGMLQuantizationType.F32,
    "bfloat16": GGMLQuantizationType.BF16,
    "q4_k": GGMLQuantizationType.Q4_K,
    "nvfp4": GGMLQuantizationType.NVFP4,
}
# Every 2-D weight is Q4_K here; llama.cpp calls that mix Q4_K_S (Q4_K_M would add Q6_K).
# NVFP4 likewise covers every 2-D weight, the tied embedding (and so the output) included.
FILE_TYPE = {
    "float32": LlamaFileType.ALL_F32,
    "bfloat16": LlamaFileType.MOSTLY_BF16,
    "q4_k": LlamaFileType.MOSTLY_Q4_K_S,
    "nvfp4": LlamaFileType.MOSTLY_NVFP4,
}
# Values per block of the block-quantized encodings: every row length must be a multiple.
ROW_MULTIPLE = {"q4_k": q4_k.QK_K, "nvfp4": nvfp4.QK_NVFP4}
QUANTIZERS = {
    GGMLQuantizationType.Q4_K: q4_k.quantize_q4_k,
    GGMLQuantizationType.NVFP4: nvfp4.quantize_nvfp4,
}

LOGIT_STD = 12.0  # target spread of the logits over the vocabulary (see module docstring)
QK_SCALE = 1.5  # q and k weights a bit larger than 1/sqrt(d) so attention is not uniform


@dataclass(frozen=True)
class TinyLlamaConfig:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    intermediate_dim: int
    vocab_size: int = 128256
    context_length: int = 131072
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    # Llama 3.1 rope scaling (rope_type "llama3").
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    bos_token_id: int = 128000
    eos_token_id: int = 128009
    # The output projection: token_embd.weight (as the committed checkpoints have it) or an
    # output.weight of its own.
    tied: bool = True
    # Llama 3.1 rope scaling (the rope_freqs tensor from the factors above), or plain RoPE.
    rope_scaling: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.n_heads

    def llama_config(self) -> LlamaConfig:
        """The engine's LlamaConfig of the same model (the file's metadata comes from it)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            dim=self.hidden_dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.intermediate_dim,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            context_length=self.context_length,
            tie_word_embeddings=self.tied,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            **self._rope_scaling(),
        )

    def _rope_scaling(self) -> dict[str, object]:
        if not self.rope_scaling:
            return {}
        return {
            "rope_scaling_type": "llama3",
            "rope_scaling_factor": self.rope_factor,
            "rope_low_freq_factor": self.rope_low_freq_factor,
            "rope_high_freq_factor": self.rope_high_freq_factor,
            "rope_original_context_length": self.rope_original_context,
            "rope_freq_factors": tuple(float(f) for f in rope_freq_factors(self)),
        }

    def hf_config(self) -> dict[str, object]:
        """The Hugging Face LlamaConfig (config.json) of the same model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_dim,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_dim,
            "max_position_embeddings": self.context_length,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": self.n_heads,
            "num_hidden_layers": self.n_layers,
            "num_key_value_heads": self.n_kv_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": {
                "factor": self.rope_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "original_max_position_embeddings": self.rope_original_context,
                "rope_type": "llama3",
            },
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }


def rope_freq_factors(config: TinyLlamaConfig) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 rope scaling, as llama.cpp's converter computes them."""
    dim = config.head_dim
    low_freq_wavelen = config.rope_original_context / config.rope_low_freq_factor
    high_freq_wavelen = config.rope_original_context / config.rope_high_freq_factor
    factors = []
    for i in range(0, dim, 2):
        freq = 1.0 / (config.rope_theta ** (i / dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(config.rope_factor)
        else:
            smooth = (config.rope_original_context / wavelen - config.rope_low_freq_factor) / (
                config.rope_high_freq_factor - config.rope_low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / config.rope_factor + smooth))
    return np.array(factors, dtype=np.float32)


def unit_rows(weight: np.ndarray) -> np.ndarray:
    """Rows scaled to norm 1.

    With rows of equal norm the tied output ranks tokens by direction alone; otherwise the few
    longest rows win the argmax for most states (hubness in low dimension) and greedy decoding
    settles on one token. The squared norm is summed column by column in float64, a fixed order
    of correctly rounded operations, so the result is the same on every machine.
    """
    out = np.empty(weight.shape, dtype=np.float32)
    for start in range(0, weight.shape[0], _UNIT_ROWS_CHUNK):  # rows in the cache
        wide = weight[start : start + _UNIT_ROWS_CHUNK].astype(np.float64)
        squared_norm = np.zeros(wide.shape[0], dtype=np.float64)
        for column in np.ascontiguousarray(wide.T):
            squared_norm += column * column
        out[start : start + _UNIT_ROWS_CHUNK] = wide / np.sqrt(squared_norm)[:, None]
    return out


_UNIT_ROWS_CHUNK = 2048


def hf_weights(config: TinyLlamaConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF tensor name, float32 weight in Hugging Face layout), in llama.cpp's file order."""

    def draw(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
        return counter_rng.normal(seed, name, shape, std)

    def gain(name: str, size: int, base: float) -> np.ndarray:
        # Around `base` rather than exactly it, so a norm weight applied wrongly shows.
        return (base * (1.0 + draw(name, (size,), 0.2).astype(np.float64))).astype(np.float32)

    h, hd, ffn = config.hidden_dim, config.head_dim, config.intermediate_dim
    q_dim, kv_dim = config.n_heads * hd, config.n_kv_heads * hd
    if config.rope_scaling:
        yield "rope_freqs.weight", rope_freq_factors(config)
    yield "token_embd.weight", unit_rows(draw("token_embd.weight", (config.vocab_size, h), 1.0))
    for layer in range(config.n_layers):
        blk = f"blk.{layer}"
        yield f"{blk}.attn_norm.weight", gain(f"{blk}.attn_norm.weight", h, 1.0)
        qk_std = QK_SCALE / math.sqrt(h)
        yield f"{blk}.attn_q.weight", draw(f"{blk}.attn_q.weight", (q_dim, h), qk_std)
        yield f"{blk}.attn_k.weight", draw(f"{blk}.attn_k.weight", (kv_dim, h), qk_std)
        yield f"{blk}.attn_v.weight", draw(f"{blk}.attn_v.weight", (kv_dim, h), 1 / math.sqrt(h))
        yield (
            f"{blk}.attn_output.weight",
            draw(f"{blk}.attn_output.weight", (h, q_dim), 1 / math.sqrt(q_dim)),
        )
        yield f"{blk}.ffn_norm.weight", gain(f"{blk}.ffn_norm.weight", h, 1.0)
        yield f"{blk}.ffn_gate.weight", draw(f"{blk}.ffn_gate.weight", (ffn, h), 1 / math.sqrt(h))
        yield f"{blk}.ffn_up.weight", draw(f"{blk}.ffn_up.weight", (ffn, h), 1 / math.sqrt(h))
        yield (
            f"{blk}.ffn_down.weight",
            draw(f"{blk}.ffn_down.weight", (h, ffn), 2 / math.sqrt(ffn)),
        )
    # Tied output: logits = token_embd @ (output_norm * normalized h); the embedding rows have
    # norm ~1, so the gain is the logit standard deviation. An untied output's rows have norm 1
    # too, for the same spread.
    yield "output_norm.weight", gain("output_norm.weight", h, LOGIT_STD)
    if not config.tied:
        yield "output.weight", unit_rows(draw("output.weight", (config.vocab_size, h), 1.0))


def tensor_shapes(config: TinyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the file and its numpy shape, in file order, without drawing weights."""
    h, ffn = config.hidden_dim, config.intermediate_dim
    q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if config.rope_scaling:
        shapes["rope_freqs.weight"] = (config.head_dim // 2,)
    shapes["token_embd.weight"] = (config.vocab_size, h)
    for layer in range(config.n_layers):
        blk = f"blk.{layer}"
        shapes |= {
            f"{blk}.attn_norm.weight": (h,),
            f"{blk}.attn_q.weight": (q_dim, h),
            f"{blk}.attn_k.weight": (kv_dim, h),
            f"{blk}.attn_v.weight": (kv_dim, h),
            f"{blk}.attn_output.weight": (h, q_dim),
            f"{blk}.ffn_norm.weight": (h,),
            f"{blk}.ffn_gate.weight": (ffn, h),
            f"{blk}.ffn_up.weight": (ffn, h),
            f"{blk}.ffn_down.weight": (h, ffn),
        }
    shapes["output_norm.weight"] = (h,)
    if not config.tied:
        shapes["output.weight"] = (config.vocab_size, h)
    return shapes


def nvfp4_quantization_config(config: TinyLlamaConfig) -> dict[str, object]:
    """The `quantization_config` of an nvfp4 checkpoint, in the shape NVFP4 users look for.

    Hugging Face NVFP4 checkpoints describe E2M1 weights in groups of 16 with an E4M3 scale
    per group and list what stays unquantized under `ignore`. This one says the same of the
    GGUF file, plus what differs there: no per-tensor second-level scale, 64-value blocks of
    36 bytes, the doubled E2M1 table read against half the scale, and GGUF tensor names. The
    output projection is tied to token_embd.weight, so it is NVFP4 too.
    """
    shapes = tensor_shapes(config)
    return {
        "quant_method": "gguf",
        "format": "nvfp4",
        "ggml_type": GGMLQuantizationType.NVFP4.name,
        "ggml_type_id": int(GGMLQuantizationType.NVFP4),
        "weight_format": "e2m1",
        "num_bits": 4,
        "group_size": nvfp4.SUB_BLOCK,
        "scale_format": "ue4m3",
        "scale_convention": (
            "one unsigned E4M3 byte (bias 7) per group; ggml decodes it at half its value "
            "and multiplies the doubled E2M1 table {0, 1, 2, 3, 4, 6, 8, 12} (bit 3: sign), "
            "so each weight is e2m1 * ue4m3 exactly; byte 0x7F reads as 0"
        ),
        "global_scale": None,
        "block_size": nvfp4.QK_NVFP4,
        "block_bytes": nvfp4.BLOCK_BYTES,
        "tensor_names": "gguf",
        "quantized": [name for name, shape in shapes.items() if len(shape) == 2],
        "ignore": [name for name, shape in shapes.items() if len(shape) == 1],
        "ignore_format": "float32",
        "tied_lm_head": "token_embd.weight",
    }


def hf_config_for(config: TinyLlamaConfig, encoding: str) -> dict[str, object]:
    """config.json of a checkpoint: the LlamaConfig, plus a quantization_config for nvfp4.

    The other encodings keep the plain LlamaConfig that config.json has always held.
    """
    hf_config = config.hf_config()
    if encoding == "nvfp4":
        hf_config["quantization_config"] = nvfp4_quantization_config(config)
    return hf_config


def quantize(weight: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A matrix's blocks: this package's quantizers where gguf-py has none (Q4_K, NVFP4)."""
    if qtype in QUANTIZERS:
        return QUANTIZERS[qtype](weight)
    return gguf_quantize(weight, qtype)


def write_gguf(
    path: Path, config: TinyLlamaConfig, encoding: str, seed: int, vocab: gguf_writer.Vocabulary
) -> None:
    """Write a committed-style checkpoint (`gen_tiny_model`) to `path` (the caller makes it
    atomic): `encoding`'s weight type, general.name and file type, the quantization version."""
    write_checkpoint(
        path,
        config,
        seed,
        WEIGHT_TYPE[encoding],
        vocab=vocab,
        name=f"tiny-llama-3.1-{encoding}",
        file_type=FILE_TYPE[encoding],
        quantization_version=2,  # GGML_QNT_VERSION, as llama.cpp's converter writes it
    )


def write_checkpoint(
    path: str | os.PathLike,
    config: TinyLlamaConfig,
    seed: int,
    weight_type: GGMLQuantizationType,
    *,
    vocab: gguf_writer.Vocabulary | None,
    rope_freqs: np.ndarray | None = None,
    architecture: str = ARCHITECTURE,
    **metadata: object,
) -> dict[str, np.ndarray]:
    """Write `config`'s model drawn from `seed` (`hf_weights`) to `path`, its 2-D weights as
    `weight_type`; returns the weights (float32, Hugging Face layout) by GGUF tensor name.

    `rope_freqs` replaces the rope scaling's factors with others (written as the rope_freqs
    tensor; the config needs `rope_scaling=False`), `architecture` the general.architecture
    (a file the engine must refuse), `metadata` goes to gguf_writer.write_gguf.
    """
    weights = dict(hf_weights(config, seed))
    if rope_freqs is not None:
        if config.rope_scaling:
            raise ValueError(
                "rope_freqs replaces no factors: give a config with rope_scaling=False"
            )
        weights = {"rope_freqs.weight": np.asarray(rope_freqs, dtype=np.float32)} | weights
    gguf_writer.write_gguf(
        path,
        config.llama_config(),
        weights.items(),
        weight_type,
        vocab=vocab,
        quantize=quantize,
        architecture=architecture,
        **metadata,
    )
    return weights


# The special tokens of the byte vocabulary, after its 256 bytes and 5 merges.
_BYTE_VOCAB_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]
_BYTE_VOCAB_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a p"]


def byte_vocab(pre: str = "llama-bpe") -> gguf_writer.Vocabulary:
    """A 263-token byte-level BPE vocabulary: the 256 byte characters, five merges ("Ġt", "he",
    "Ġthe", "Ġc", "ap") and two control tokens, begin and end of text; `pre` is the
    pre-tokenizer name written (llama.cpp's; the engine refuses the ones it does not know)."""
    from pipelines.llama3.tokenizer import _byte_alphabet

    tokens = list(_byte_alphabet().values())
    tokens += [merge.replace(" ", "") for merge in _BYTE_VOCAB_MERGES] + _BYTE_VOCAB_SPECIAL
    n_special = len(_BYTE_VOCAB_SPECIAL)
    return gguf_writer.Vocabulary(
        tokens=tokens,
        token_types=[1] * (len(tokens) - n_special) + [3] * n_special,
        merges=_BYTE_VOCAB_MERGES,
        bos_token_id=tokens.index("<|begin_of_text|>"),
        eos_token_id=tokens.index("<|end_of_text|>"),
        pre=pre,
    )


def write_tiny_llama(
    path: str | os.PathLike,
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
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    architecture: str = ARCHITECTURE,
    with_tokenizer: bool = True,
    tokenizer_pre: str = "llama-bpe",
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
) -> dict[str, np.ndarray]:
    """A small random checkpoint for tests (milliseconds to write and to load): the byte
    vocabulary, an output matrix of its own unless `tied`, plain RoPE unless `rope_freqs`
    are given, 2-D weights as `weight_type` but those `tensor_types` names (GGUF tensor name
    -> type). Returns the weights (float32, Hugging Face layout) by GGUF tensor name."""
    vocab = byte_vocab(tokenizer_pre)
    config = TinyLlamaConfig(
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=dim,
        intermediate_dim=ffn_dim,
        vocab_size=len(vocab.tokens),
        context_length=context_length,
        rope_theta=rope_theta,
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        tied=tied,
        rope_scaling=False,
    )
    return write_checkpoint(
        path,
        config,
        seed,
        weight_type,
        vocab=vocab if with_tokenizer else None,
        rope_freqs=rope_freqs,
        architecture=architecture,
        tensor_types=tensor_types,
    )
