"""GGUF checkpoint -> LlamaConfig and float tensors named after the model's parameters.

Parsing is gguf-py's `GGUFReader` (memory-mapped); this module only knows which llama.* keys
and tensor names mean what, checks them, and turns the raw bytes into torch tensors.
"""

import os
import pathlib

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from pipelines.llama3 import quants
from pipelines.llama3.config import LlamaConfig

ARCHITECTURE = "llama"

# GGUF tensor name -> model parameter name ({i} is the block index).
GLOBAL_TENSORS = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
BLOCK_TENSORS = {
    "blk.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attention.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attention.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attention.wv.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attention.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.feed_forward.w2.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.feed_forward.w3.weight",
}
ROPE_FREQS_TENSOR = "rope_freqs.weight"


class CheckpointError(ValueError):
    """A checkpoint file this engine cannot use; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = pathlib.Path(path)
        self.problem = problem


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its np.memmap.

    Still memory-mapped, but slicing a plain ndarray skips np.memmap's per-view bookkeeping,
    which made parsing a 49k-token vocabulary take seconds instead of under one.
    """

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._mapped = mapped.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Parse a GGUF file's header, metadata and tensor index; tensor data stays on disk."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    try:
        reader = _Reader(path, "r")
    except Exception as error:  # gguf-py reports damage as whatever numpy or struct raised
        raise CheckpointError(
            path, f"not a readable GGUF file (truncated or corrupted?): {error}"
        ) from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise CheckpointError(
                path,
                f"tensor {tensor.name} needs {tensor.n_bytes} bytes, "
                f"file has {tensor.data.nbytes} (truncated?)",
            )
    return reader


def metadata_value(reader: GGUFReader, key: str, default: object = None) -> object:
    """A metadata value as a Python value (str, int, float, bool or list); `default` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(value)
    return value


def _required(reader: GGUFReader, path: pathlib.Path, key: str) -> object:
    value = metadata_value(reader, key)
    if value is None:
        raise CheckpointError(path, f"missing metadata key {key}")
    return value


def read_config(reader: GGUFReader, path: str | os.PathLike) -> LlamaConfig:
    path = pathlib.Path(path)
    architecture = metadata_value(reader, "general.architecture")
    if architecture != ARCHITECTURE:
        raise CheckpointError(
            path, f"architecture {architecture!r} is not supported (this engine runs 'llama')"
        )
    arch = ARCHITECTURE
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(path, "missing tensor token_embd.weight")

    dim = int(_required(reader, path, f"{arch}.embedding_length"))
    n_heads = int(_required(reader, path, f"{arch}.attention.head_count"))
    n_kv_heads = int(metadata_value(reader, f"{arch}.attention.head_count_kv", n_heads))
    vocab_size = metadata_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:  # older files: the embedding's row count, GGUF ne = [dim, vocab]
        vocab_size = int(tensors["token_embd.weight"].shape[1])

    scaling_type = metadata_value(reader, f"{arch}.rope.scaling.type")
    freq_factors = None
    if ROPE_FREQS_TENSOR in tensors:
        freq_factors = tuple(
            float(x) for x in load_tensor(reader, ROPE_FREQS_TENSOR, path).tolist()
        )
        # Llama 3.1 files carry the factors as a tensor and usually no scaling type.
        scaling_type = scaling_type or "llama3"
    if scaling_type == "none":
        scaling_type = None

    config = LlamaConfig(
        vocab_size=int(vocab_size),
        dim=dim,
        n_layers=int(_required(reader, path, f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=int(_required(reader, path, f"{arch}.feed_forward_length")),
        head_dim=int(metadata_value(reader, f"{arch}.rope.dimension_count", dim // n_heads)),
        rope_theta=float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_required(reader, path, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(metadata_value(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling_type=scaling_type,
        rope_scaling_factor=float(
            metadata_value(
                reader, f"{arch}.rope.scaling.factor", max(freq_factors) if freq_factors else 1.0
            )
        ),
        rope_original_context_length=int(
            metadata_value(reader, f"{arch}.rope.scaling.original_context_length", 8192)
        ),
        rope_freq_factors=freq_factors,
        bos_token_id=metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata_value(reader, "tokenizer.ggml.eos_token_id"),
    )
    if config.n_heads % config.n_kv_heads:
        raise CheckpointError(
            path, f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
        )
    return config


def load_config(path: str | os.PathLike) -> LlamaConfig:
    """The checkpoint's configuration, without touching its tensor data."""
    return read_config(open_gguf(path), path)


def load_tensor(
    reader: GGUFReader, name: str, path: str | os.PathLike, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """One tensor, dequantized to float32, in numpy/torch shape order (GGUF ne reversed)."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise CheckpointError(path, f"missing tensor {name}")
    return _dequantize(tensor, path, device)


def _dequantize(tensor, path: str | os.PathLike, device: str | torch.device) -> torch.Tensor:
    if tensor.tensor_type not in quants.SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in quants.SUPPORTED_TYPES))
        raise CheckpointError(
            path,
            f"tensor {tensor.name} has unsupported type {tensor.tensor_type.name} "
            f"(supported: {supported})",
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        return quants.dequantize(tensor.data, tensor.tensor_type, shape, device)
    except quants.NonFiniteError:
        raise CheckpointError(
            path, f"tensor {tensor.name} holds NaN or infinite values (corrupted?)"
        ) from None


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of wq/wk.

    llama.cpp interleaves each head's rows (pairs (x0, x1), (x2, x3)... for its RoPE); this
    model rotates the two halves of each head (x[:d/2], x[d/2:]), the layout transformers uses.
    """
    rows, cols = weight.shape
    # [n_heads * head_dim, dim] -> [n_heads, head_dim/2, 2, dim] -> [n_heads, 2, head_dim/2, dim]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    )


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    c = config
    shapes = {
        "tok_embeddings.weight": (c.vocab_size, c.dim),
        "norm.weight": (c.dim,),
        "output.weight": (c.vocab_size, c.dim),
    }
    for i in range(c.n_layers):
        shapes |= {
            f"layers.{i}.attention_norm.weight": (c.dim,),
            f"layers.{i}.attention.wq.weight": (c.n_heads * c.head_dim, c.dim),
            f"layers.{i}.attention.wk.weight": (c.n_kv_heads * c.head_dim, c.dim),
            f"layers.{i}.attention.wv.weight": (c.n_kv_heads * c.head_dim, c.dim),
            f"layers.{i}.attention.wo.weight": (c.dim, c.n_heads * c.head_dim),
            f"layers.{i}.ffn_norm.weight": (c.dim,),
            f"layers.{i}.feed_forward.w1.weight": (c.ffn_dim, c.dim),
            f"layers.{i}.feed_forward.w2.weight": (c.dim, c.ffn_dim),
            f"layers.{i}.feed_forward.w3.weight": (c.ffn_dim, c.dim),
        }
    return shapes


def load_weights(
    reader: GGUFReader,
    config: LlamaConfig,
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Every model parameter, dequantized on `device`, cast to `dtype`, Q/K rows unpermuted.

    With tied embeddings "output.weight" is absent; the model shares tok_embeddings.weight.
    """
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    names = dict(GLOBAL_TENSORS)
    for i in range(config.n_layers):
        names |= {gguf.format(i=i): param.format(i=i) for gguf, param in BLOCK_TENSORS.items()}
    if config.tie_word_embeddings:
        del names["output.weight"]
    expected = _expected_shapes(config)

    weights = {}
    for gguf_name, param in names.items():
        if gguf_name not in gguf_tensors:
            raise CheckpointError(path, f"missing tensor {gguf_name}")
        weight = _dequantize(gguf_tensors[gguf_name], path, device)
        if tuple(weight.shape) != expected[param]:
            raise CheckpointError(
                path,
                f"tensor {gguf_name} has shape {tuple(weight.shape)}, "
                f"config implies {expected[param]}",
            )
        if gguf_name.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, config.n_heads)
        elif gguf_name.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, config.n_kv_heads)
        weights[param] = weight.to(dtype)
    return weights
