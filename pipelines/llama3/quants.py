"""GGML tensor types to float32 torch tensors.

One function per type, over a [n_blocks, type_size] uint8 tensor of raw blocks, returning
[n_blocks, block_size] float32. Each follows gguf-py's numpy `dequantize_blocks` operation for
operation (same float32 products and sums in the same order), so the results are bit-identical
to `gguf.quants.dequantize`; torch only makes them fast and lets them run on the GPU.
Block layouts are llama.cpp's (ggml-common.h).
"""

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values per k-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


# E2M1 values doubled (ggml's kvalues_mxfp4, shared by MXFP4 and NVFP4), indexed by the 4-bit
# code; the scale decoders return half the scale to match.
_KVALUES_FP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
UE4M3_NAN = 0x7F  # E4M3's NaN byte, which ggml and gguf-py read as a zero scale


def _ue4m3_half(scales: torch.Tensor) -> torch.Tensor:
    """UE4M3 scale bytes -> float32 at half their value, as gguf-py's NVFP4.ue4m3_to_fp32.

    Bit 7 is ignored, except that 0x7F alone reads as 0. A normal byte (exponent field e > 0,
    mantissa m) is (1 + m/8) * 2^(e - 7) / 2, built here straight from float32 bits; a
    subnormal one is m * 2^-9 / 2. Every value is exact, so bits equal gguf-py's on any device.
    """
    exponent = ((scales >> 3) & 0x0F).to(torch.int32)
    mantissa = (scales & 0x07).to(torch.int32)
    # float32 bits of (1 + m/8) * 2^(e - 8): biased exponent e - 8 + 127, mantissa m << 20
    normal = (((exponent + 119) << 23) | (mantissa << 20)).view(torch.float32)
    subnormal = mantissa.float() * 2.0**-10
    value = torch.where(exponent == 0, subnormal, normal)
    return torch.where(scales == UE4M3_NAN, torch.zeros_like(value), value)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q8_0: f16 d, int8 qs[32]
    d = _f16(blocks, 0)
    qs = blocks[:, 2:].contiguous().view(torch.int8).float()
    return qs * d


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_0: f16 d, u8 qs[16] (value = d * (nibble - 8))
    d = _f16(blocks, 0)
    qs = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    return d * qs


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_1: f16 d, f16 m, u8 qs[16] (value = d * nibble + m)
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    qs = _nibbles(blocks[:, 4:]).float()
    return (d * qs) + m


def _q4_k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of 6-bit scales and mins into 8 of each per super-block."""
    n_blocks = scales.shape[0]
    scales = scales.reshape(n_blocks, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128]; 8 sub-blocks of 32 values
    n_blocks = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mins = _q4_k_scales_mins(blocks[:, 4:16])
    d = (d * sc.float()).reshape(n_blocks, -1, 1)
    dm = (dmin * mins.float()).reshape(n_blocks, -1, 1)
    # [n_blocks, 4, 32] bytes -> [n_blocks, 4, 2, 32] nibbles -> [n_blocks, 8, 32]
    qs = blocks[:, 16:].reshape(n_blocks, 4, 1, 32)
    qs = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n_blocks, 8, 32).float()
    return (d * qs - dm).reshape(n_blocks, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q6_K: u8 ql[128], u8 qh[64], int8 scales[16], f16 d; 16 sub-blocks of 16 values
    n_blocks = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    d = (d * scales).reshape(n_blocks, QK_K // 16, 1)
    # low 4 bits: [n_blocks, 2, 64] -> [n_blocks, 2, 2, 64] -> [n_blocks, 8, 32]
    ql = ql.reshape(n_blocks, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n_blocks, 8, 32)
    # high 2 bits: [n_blocks, 2, 32] -> [n_blocks, 2, 4, 32] -> [n_blocks, 8, 32]
    qh = qh.reshape(n_blocks, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2).reshape(n_blocks, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    q = q.reshape(n_blocks, QK_K // 16, -1).float()
    return (d * q).reshape(n_blocks, QK_K)


def dequantize_nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block_nvfp4: u8 d[4] (UE4M3, one per 16 values), u8 qs[32] (E2M1 codes); byte j of a
    # sub-block's 8 holds value j (low nibble) and value j + 8 (high nibble)
    n_blocks = blocks.shape[0]
    d = _ue4m3_half(blocks[:, :4]).reshape(n_blocks, 4, 1)
    codes = _nibbles(blocks[:, 4:].reshape(n_blocks, 4, 8)).long()
    kvalues = torch.tensor(_KVALUES_FP4, dtype=torch.float32, device=blocks.device)
    return (d * kvalues[codes]).reshape(n_blocks, 64)


BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: dequantize_q8_0,
    GGMLQuantizationType.Q4_0: dequantize_q4_0,
    GGMLQuantizationType.Q4_1: dequantize_q4_1,
    GGMLQuantizationType.Q4_K: dequantize_q4_k,
    GGMLQuantizationType.Q6_K: dequantize_q6_k,
    GGMLQuantizationType.NVFP4: dequantize_nvfp4,
}
FLOAT_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED_TYPES = frozenset(BLOCK_DEQUANTIZERS) | frozenset(FLOAT_TYPES)


# Blocks unpacked per step on the CPU: the temporaries (a few MiB) are reused from the heap,
# instead of several passes over freshly allocated full-size tensors, which page faults make slow.
CPU_CHUNK_BLOCKS = 65536


class NonFiniteError(ValueError):
    """Dequantized values contain NaN or infinity: the scales in the file are damaged."""


def dequantize(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    device: str | torch.device = "cpu",
    copy: bool = True,
    check_finite: bool = True,
) -> torch.Tensor:
    """Raw GGUF tensor bytes (numpy, possibly memory-mapped) -> float32 tensor of `shape`.

    `shape` is numpy order (slowest dimension first), the reverse of GGUF's ne[]. The bytes move
    to `device` still packed, so a GPU does the unpacking. The result owns its memory, except
    for F32 on the CPU with `copy=False`: then it is a view of `raw` (which must be writable,
    e.g. a private copy-on-write map). Raises NonFiniteError when a value is NaN or infinite
    (unless `check_finite` is False: the caller checked these bytes before).
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    with warnings.catch_warnings():
        # A read-only mapping makes torch warn; nothing here writes into it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        packed = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    packed = packed.to(device)
    if qtype in FLOAT_TYPES:
        values = packed.view(FLOAT_TYPES[qtype])
        if qtype != GGMLQuantizationType.F32:
            values = values.float()
        elif values.device.type == "cpu" and (copy or not raw.flags.writeable):
            values = values.clone()  # so nothing keeps pointing into a shared map of the file
        if check_finite:
            _check_finite(values)
        return values.reshape(shape)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = packed.reshape(-1, type_size)
    n_blocks = blocks.shape[0]
    dequantize_blocks = BLOCK_DEQUANTIZERS[qtype]
    if blocks.device.type != "cpu":
        values = dequantize_blocks(blocks)
        if check_finite:
            _check_finite(values)
        return values.reshape(shape)
    values = torch.empty(n_blocks, block_size, dtype=torch.float32)
    for start in range(0, n_blocks, CPU_CHUNK_BLOCKS):
        chunk = dequantize_blocks(blocks[start : start + CPU_CHUNK_BLOCKS])
        if check_finite:
            _check_finite(chunk)
        values[start : start + CPU_CHUNK_BLOCKS] = chunk
    return values.reshape(shape)


def _check_finite(values: torch.Tensor) -> None:
    # NaN and infinity survive a sum (finite GGUF values cannot overflow float32 this way), and
    # one reduction is much cheaper than materialising isfinite's mask.
    if not bool(torch.isfinite(values.sum())):
        raise NonFiniteError("holds NaN or infinite values")
