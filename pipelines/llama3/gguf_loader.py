"""GGUF checkpoint -> LlamaConfig and float tensors named after the model's parameters.

Parsing is `gguf_file.GGUFFile` (memory-mapped); this module only knows which llama.* keys
and tensor names mean what, checks them, and turns the raw bytes into torch tensors.
"""

import dataclasses
import os
import pathlib

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pipelines.llama3 import packing, quants
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.gguf_file import CheckpointError, GGUFFile, TensorInfo

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


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor index; tensor data stays on disk."""
    return GGUFFile(path)


def metadata_value(reader: GGUFFile, key: str, default: object = None) -> object:
    """A metadata value: str, int, float or bool; a read-only numpy array for numeric arrays,
    a tuple of str for string arrays; `default` if absent."""
    return reader.fields.get(key, default)


def _required(reader: GGUFFile, path: pathlib.Path, key: str) -> object:
    value = metadata_value(reader, key)
    if value is None:
        raise CheckpointError(path, f"missing metadata key {key}")
    return value


def _positive(reader: GGUFFile, path: pathlib.Path, key: str, default: object = None) -> int:
    """A size from the metadata: an integer of at least 1 (a 0 would divide by zero later)."""
    value = (
        _required(reader, path, key) if default is None else metadata_value(reader, key, default)
    )
    if not isinstance(value, int | float) or int(value) != value or value < 1:
        raise CheckpointError(path, f"metadata {key} = {value!r} is not a positive integer")
    return int(value)


def read_config(reader: GGUFFile, path: str | os.PathLike) -> LlamaConfig:
    path = pathlib.Path(path)
    architecture = metadata_value(reader, "general.architecture")
    if architecture != ARCHITECTURE:
        raise CheckpointError(
            path, f"architecture {architecture!r} is not supported (this engine runs 'llama')"
        )
    arch = ARCHITECTURE
    tensors = reader.tensors
    if "token_embd.weight" not in tensors:
        raise CheckpointError(path, "missing tensor token_embd.weight")

    dim = _positive(reader, path, f"{arch}.embedding_length")
    n_heads = _positive(reader, path, f"{arch}.attention.head_count")
    n_kv_heads = _positive(reader, path, f"{arch}.attention.head_count_kv", n_heads)
    n_layers = _positive(reader, path, f"{arch}.block_count")
    if n_layers * len(BLOCK_TENSORS) > len(tensors):  # before building names for every layer
        raise CheckpointError(
            path,
            f"block_count {n_layers} needs {len(BLOCK_TENSORS)} tensors per layer; "
            f"the file holds {len(tensors)} tensors in all",
        )
    vocab_size = metadata_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:  # older files: the embedding's row count
        vocab_size = int(tensors["token_embd.weight"].shape[0])

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
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=_positive(reader, path, f"{arch}.feed_forward_length"),
        head_dim=_positive(reader, path, f"{arch}.rope.dimension_count", dim // n_heads or 1),
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
    if freq_factors is not None and len(freq_factors) != config.head_dim // 2:
        raise CheckpointError(  # llama.cpp refuses it too (check_tensor_dims)
            path,
            f"tensor {ROPE_FREQS_TENSOR!r} holds {len(freq_factors)} factors; a head of "
            f"{config.head_dim} dimensions rotates {config.head_dim // 2} pairs",
        )
    return config


def load_config(path: str | os.PathLike) -> LlamaConfig:
    """The checkpoint's configuration, without touching its tensor data."""
    return read_config(open_gguf(path), path)


def load_tensor(
    reader: GGUFFile, name: str, path: str | os.PathLike, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """One tensor, dequantized to float32, in numpy/torch shape order (GGUF ne reversed)."""
    tensor = reader.tensors.get(name)
    if tensor is None:
        raise CheckpointError(path, f"missing tensor {name}")
    return _dequantize(tensor, reader.tensor_data(name), path, device)


def _dequantize(
    tensor: TensorInfo,
    raw: np.ndarray,
    path: str | os.PathLike,
    device: str | torch.device,
    copy: bool = True,
    check_finite: bool = True,
) -> torch.Tensor:
    if tensor.tensor_type not in quants.SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in quants.SUPPORTED_TYPES))
        raise CheckpointError(
            path,
            f"tensor {tensor.name} has unsupported type {tensor.tensor_type.name} "
            f"(supported: {supported})",
        )
    try:
        return quants.dequantize(
            raw, tensor.tensor_type, tensor.shape, device, copy=copy, check_finite=check_finite
        )
    except quants.NonFiniteError:
        raise CheckpointError(
            path, f"tensor {tensor.name} holds NaN or infinite values (corrupted?)"
        ) from None


def permute_qk(weight, n_heads: int):
    """llama.cpp's convert-time row permutation of wq/wk (convert_hf_to_gguf.py's
    LlamaModel.permute), which `unpermute_qk` undoes: each head's two halves (x[:d/2],
    x[d/2:], Hugging Face's layout) interleaved into pairs (x0, x1), (x2, x3)... A numpy array
    or a torch tensor, [n_heads * head_dim, ...]: whole rows move, so raw quantized rows too."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


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


class DequantizedCache:
    """One file's dequantized tensors, kept for its next load (the mutation proofs load a
    checkpoint once per mutation: SmolLM2's Q4_1 tensors took 0.8 s to dequantize a load, a
    copy 0.2 s), up to `limit` bytes: an 8B checkpoint's 32 GB are never doubled. Float32
    tensors on the CPU are views of the file's map and cost nothing to load: never kept."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.limit, self.bytes = limit, 0

    def keep(self, key: tuple, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.bytes + size <= self.limit:
            self.tensors[key] = tensor.clone()
            self.bytes += size


def load_weights(
    reader: GGUFFile,
    config: LlamaConfig,
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    verified: set[str] | None = None,
    keep_packed: bool = False,
    dequantized: DequantizedCache | None = None,
) -> dict[str, torch.Tensor | packing.RawMatrix]:
    """Every model parameter, dequantized on `device`, cast to `dtype`, Q/K rows unpermuted.

    With `keep_packed` (the `quantized` mode: CPU, float32) the matrices stored as Q4_0, Q4_1,
    Q4_K or Q8_0 come back as packing.RawMatrix instead (packed by packed.install), never
    dequantized.

    With tied embeddings "output.weight" is absent; the model shares tok_embeddings.weight.
    Float32 tensors on the CPU are not copied: they are views of a private copy-on-write map
    of the file, so writing into a weight changes neither the file nor any other engine.
    `verified` names tensors already checked finite in this file (skipped, then updated).
    `dequantized` keeps this file's dequantized tensors for the next load (each load gets a
    copy of its own).
    """
    names = dict(GLOBAL_TENSORS)
    for i in range(config.n_layers):
        names |= {gguf.format(i=i): param.format(i=i) for gguf, param in BLOCK_TENSORS.items()}
    if config.tie_word_embeddings:
        del names["output.weight"]
    expected = _expected_shapes(config)
    for gguf_name, param in names.items():
        tensor = reader.tensors.get(gguf_name)
        if tensor is None:
            raise CheckpointError(path, f"missing tensor {gguf_name}")
        if tensor.shape != expected[param]:
            raise CheckpointError(
                path,
                f"tensor {gguf_name} has shape {tensor.shape}, config implies {expected[param]}",
            )

    verified = set() if verified is None else verified
    private = reader.private_tensor_data()
    weights = {}
    for gguf_name, param in names.items():
        info = reader.tensors[gguf_name]
        if keep_packed and packing.can_pack(info.tensor_type, info.shape):
            matrix = packing.RawMatrix(private[gguf_name], info.tensor_type, *info.shape)
            if gguf_name not in verified and not matrix.scales_finite():
                raise CheckpointError(
                    path, f"tensor {gguf_name} holds NaN or infinite values (corrupted?)"
                )
            verified.add(gguf_name)
            weights[param] = _unpermuted(matrix, gguf_name, config)
            continue
        key = (gguf_name, str(device), dtype)
        if dequantized is not None and key in dequantized.tensors:
            weights[param] = dequantized.tensors[key].clone()
            continue
        weight = _dequantize(
            info,
            private[gguf_name],
            path,
            device,
            copy=False,
            check_finite=gguf_name not in verified,
        )
        verified.add(gguf_name)
        weights[param] = _unpermuted(weight, gguf_name, config).to(dtype)
        on_cpu = torch.device(device).type == "cpu"
        if dequantized is not None and not (
            info.tensor_type == GGMLQuantizationType.F32 and on_cpu
        ):
            dequantized.keep(key, weights[param])
    return weights


def _unpermuted(weight, gguf_name: str, config: LlamaConfig):
    """wq and wk with llama.cpp's row permutation undone (dense tensor or RawMatrix)."""
    if gguf_name.endswith("attn_q.weight"):
        heads = config.n_heads
    elif gguf_name.endswith("attn_k.weight"):
        heads = config.n_kv_heads
    else:
        return weight
    if isinstance(weight, packing.RawMatrix):
        rows = torch.arange(weight.rows).reshape(weight.rows, 1)
        return dataclasses.replace(weight, row_order=unpermute_qk(rows, heads).reshape(-1))
    return unpermute_qk(weight, heads)
