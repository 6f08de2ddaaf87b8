"""Checkpoint mutations: copies of a GGUF file with one small change that any engine sees.

The engine mutations (mutations.py) patch this repository's code; an external engine (llama.cpp,
a vLLM server) can only be shown a changed file. Each mutation here writes a copy with one
edit, made in place through gguf-py's memory map (`GGUFReader(copy, "r+")`), so everything
else stays byte for byte:

  weight_scaled   one weight matrix (blk.0.attn_v) scaled by 1.002: float values directly,
                  block-quantized ones through their blocks' float16 scales (Q4_0, Q4_1,
                  Q8_0: d (and m); Q4_K: d and dmin), which scales every weight of the block
  norm_weight     one element of one norm vector (blk.0.attn_norm[0]) scaled by 1.05
  rope_theta      llama.rope.freq_base in the metadata scaled by 1.01

A correct engine must FAIL the golden on every one of them (the llama.cpp lane and
`golden check --mutations` assert it); how far each moves a run is its mutation floor
(tolerances.yaml's engine entries).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from testing import gguf_reader

# Bytes per block and where the float16 scales sit in it, for the types scaled by blocks.
_BLOCK_SCALES = {
    GGMLQuantizationType.Q4_0: (18, (0,)),
    GGMLQuantizationType.Q4_1: (20, (0, 2)),
    GGMLQuantizationType.Q8_0: (34, (0,)),
    GGMLQuantizationType.Q4_K: (144, (0, 2)),
}


@dataclasses.dataclass(frozen=True)
class CheckpointMutation:
    name: str
    what: str  # for messages and the matrix
    apply: Callable[[GGUFReader], None]


def _tensor(reader: GGUFReader, name: str):
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"the checkpoint has no tensor {name}")


def scale_tensor(reader: GGUFReader, name: str, factor: float) -> None:
    tensor = _tensor(reader, name)
    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        tensor.data[...] = (tensor.data.astype(np.float32) * factor).astype(tensor.data.dtype)
        return
    if kind == GGMLQuantizationType.BF16:
        raw = tensor.data.view(np.uint16)
        values = (raw.astype(np.uint32) << 16).view(np.float32) * np.float32(factor)
        bits = values.view(np.uint32)
        raw[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return
    if kind not in _BLOCK_SCALES:
        raise ValueError(f"{name}: scaling a {kind.name} tensor is not supported")
    size, offsets = _BLOCK_SCALES[kind]
    blocks = tensor.data.reshape(-1).view(np.uint8).reshape(-1, size)
    for offset in offsets:
        scales = blocks[:, offset : offset + 2].copy().view(np.float16)
        blocks[:, offset : offset + 2] = (
            (scales.astype(np.float32) * factor).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )


def change_norm(reader: GGUFReader, name: str, index: int, factor: float) -> None:
    tensor = _tensor(reader, name)
    if tensor.tensor_type != GGMLQuantizationType.F32:
        raise ValueError(f"{name} is {tensor.tensor_type.name}, norms are float32")
    tensor.data.reshape(-1)[index] *= np.float32(factor)


def scale_metadata(reader: GGUFReader, key: str, factor: float) -> None:
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"the checkpoint has no metadata key {key}")
    value = field.parts[field.data[0]]
    value[...] = value * factor


MUTATIONS = (
    CheckpointMutation(
        "weight_scaled",
        "blk.0.attn_v.weight x1.002",
        lambda r: scale_tensor(r, "blk.0.attn_v.weight", 1.002),
    ),
    CheckpointMutation(
        "norm_weight",
        "blk.0.attn_norm.weight[0] x1.05",
        lambda r: change_norm(r, "blk.0.attn_norm.weight", 0, 1.05),
    ),
    CheckpointMutation(
        "rope_theta",
        "llama.rope.freq_base x1.01",
        lambda r: scale_metadata(r, "llama.rope.freq_base", 1.01),
    ),
)
BY_NAME = {m.name: m for m in MUTATIONS}


def mutated_copy(source: str | Path, mutation: CheckpointMutation, folder: str | Path) -> Path:
    """A copy of `source` in `folder` with `mutation` applied; the source is not touched."""
    source = Path(source)
    target = Path(folder) / f"{source.stem}.{mutation.name}.gguf"
    shutil.copyfile(source, target)
    gguf_reader.install()  # opening the copy parses its vocabulary: 4x faster
    reader = GGUFReader(target, "r+")
    mutation.apply(reader)
    gguf_reader.flush(reader)
    del reader
    return target
