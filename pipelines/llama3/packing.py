"""GGUF blocks -> groupwise int4/int8 arrays (PackedWeight), exactly, and back to float32.

GGUF's Q4_0, Q4_1 and Q4_K map exactly onto groupwise int4 (32 values per group, one float32
scale and offset each: w = scale * q + offset), and Q8_0 onto groupwise int8 (w = scale * q).
The kernel library (kernel_library.py) does the packing in one pass; `dequantize` reads the
packed arrays back through the same library, bit-identical to quants.dequantize (the tests
check it on every packable tensor).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pipelines.llama3.kernel_library import library

GROUP = 32
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
INT8_TYPES = (GGMLQuantizationType.Q8_0,)
PACKABLE_TYPES = frozenset(INT4_TYPES + INT8_TYPES)


@dataclasses.dataclass
class PackedWeight:
    """A [rows, cols] weight in groups of 32 along cols.

    int4: q [rows, cols / 32, 16] uint8 (byte j: value j low nibble, value j + 16 high),
          scales [rows, cols / 32, 2] float32 (scale, offset).
    int8: q [rows, cols] int8, scales [rows, cols / 32] float32.
    """

    kind: str  # "int4" | "int8"
    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    cols: int

    # Where and in what it computes: the model reads these as it would a dense weight's.
    dtype = torch.float32
    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * 4


def can_pack(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    return qtype in PACKABLE_TYPES and len(shape) == 2 and shape[1] % GROUP == 0


@dataclasses.dataclass
class RawMatrix:
    """A GGUF matrix's raw blocks, to be packed; `row_order[r]` is the file row that becomes
    row r (llama.cpp's permuted wq/wk), None for the file's order."""

    raw: np.ndarray
    qtype: GGMLQuantizationType
    rows: int
    cols: int
    row_order: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "int8" if self.qtype in INT8_TYPES else "int4"

    def scales_finite(self) -> bool:
        """Whether every float16 scale (and min) in the blocks is finite."""
        # Read as the fields' bit patterns in place (every block size is even, every offset
        # too): a float16 is inf or NaN exactly when its 5 exponent bits are all ones.
        block_bytes = GGML_QUANT_SIZES[self.qtype][1]
        words = np.asarray(self.raw).view(np.uint8).reshape(-1).view(np.uint16)
        blocks = words.reshape(-1, block_bytes // 2)
        exponent = np.uint16(0x7C00)
        return not any(
            bool(((blocks[:, o // 2] & exponent) == exponent).any())
            for o in _SCALE_OFFSETS[self.qtype]
        )


_SCALE_OFFSETS = {  # byte offsets of each block's float16 scale fields
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
}
_PACKERS = {
    GGMLQuantizationType.Q4_0: "pack_q4_0",
    GGMLQuantizationType.Q4_1: "pack_q4_1",
    GGMLQuantizationType.Q4_K: "pack_q4_k",
    GGMLQuantizationType.Q8_0: "pack_q8_0",
}


def pack_rows(parts: list[RawMatrix]) -> PackedWeight:
    """The parts' rows one after the other (a fused projection when several), packed into one
    buffer in a single pass by the kernel library; no value is rounded."""
    kind, cols = parts[0].kind, parts[0].cols
    if any(p.kind != kind or p.cols != cols for p in parts):
        raise ValueError("fused parts must share the packed kind and the column count")
    rows = sum(p.rows for p in parts)
    groups = cols // GROUP
    if kind == "int4":
        q = torch.empty(rows, groups, GROUP // 2, dtype=torch.uint8)
        scales = torch.empty(rows, groups, 2, dtype=torch.float32)
    else:
        q = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, groups, dtype=torch.float32)
    lib, start = library(), 0
    for part in parts:
        raw = torch.from_numpy(np.ascontiguousarray(part.raw).view(np.uint8).reshape(-1))
        order = None if part.row_order is None else part.row_order.to(torch.int64).contiguous()
        getattr(lib, _PACKERS[part.qtype])(
            raw.data_ptr(),
            raw.numel() // part.rows,
            None if order is None else order.data_ptr(),
            part.rows,
            cols,
            q[start].data_ptr(),
            scales[start].data_ptr(),
        )
        start += part.rows
    return PackedWeight(kind, q, scales, rows, cols)


def pack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF blocks of a [rows, cols] tensor -> PackedWeight."""
    if not can_pack(qtype, shape):
        raise ValueError(f"{qtype.name} {shape} has no packed form")
    return pack_rows([RawMatrix(raw, qtype, *shape)])


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """[rows, cols] float32 through the kernel library's own reading of the packed arrays."""
    out = torch.empty(weight.rows, weight.cols, dtype=torch.float32)
    lib = library()
    if weight.kind == "int4":
        lib.q4_dequantize(
            weight.q.data_ptr(),
            weight.scales.data_ptr(),
            weight.rows,
            weight.cols,
            out.data_ptr(),
        )
    else:
        lib.q8_dequantize(
            weight.q.data_ptr(),
            weight.scales.data_ptr(),
            weight.rows,
            weight.cols,
            out.data_ptr(),
        )
    return out
