"""A literal, one-value-at-a-time transcription of ggml's quantize_row_nvfp4_ref.

Slow on purpose: it follows the C statement by statement (float32 arithmetic, the scalar
ggml_fp32_to_ue4m3 / ggml_ue4m3_to_fp32 conversions, best_index_mxfp4's loop with its strict
`<`) so the vectorized quantizer in tools/gen_tiny_model/nvfp4.py can be checked against it
byte for byte.
"""

from __future__ import annotations

import math
import struct

import numpy as np

f32 = np.float32
QK_NVFP4 = 64
QK_NVFP4_SUB = 16
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _float_bits(x: np.float32) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def fp32_to_ue4m3(x: np.float32) -> int:
    """ggml_fp32_to_ue4m3: clip to [0, 448], subnormals truncated after +0.5, half-up rounding."""
    x = f32(x)
    if not x > 0:
        return 0
    if x > f32(448):
        x = f32(448)
    bits = _float_bits(x)
    fp32_exp = ((bits >> 23) & 0xFF) - 127
    fp32_man = (bits >> 20) & 0x7
    exp = fp32_exp + 7
    if exp <= 0:
        man = int(f32(f32(x * f32(512)) + f32(0.5)))  # C's (int) truncates
        if man < 1:
            return 0
        return min(man, 7)
    if exp >= 15:
        return 0x7E
    man = fp32_man + ((bits >> 19) & 1)
    if man > 7:
        man = 0
        exp += 1
        if exp >= 15:
            return 0x7E
    return (exp << 3) | man


def ue4m3_to_fp32(x: int) -> np.float32:
    """ggml_ue4m3_to_fp32: half the UE4M3 value (the kvalues table is doubled); 0x7F reads 0."""
    if x == 0 or x == 0x7F:
        return f32(0)
    exp = (x >> 3) & 0xF
    man = x & 0x7
    if exp == 0:
        raw = f32(math.ldexp(float(man), -9))
    else:
        raw = f32(math.ldexp(float(f32(f32(1) + f32(f32(man) / f32(8)))), exp - 7))
    return f32(raw * f32(0.5))


def best_index_mxfp4(x: np.float32, e: np.float32) -> int:
    best_index = 0
    best_err = abs(f32(f32(KVALUES_MXFP4[0]) * e) - x)
    for i in range(1, 16):
        err = abs(f32(f32(KVALUES_MXFP4[i]) * e) - x)
        if err < best_err:
            best_index = i
            best_err = err
    return best_index


def quantize_block(x: np.ndarray) -> bytes:
    """One 64-value block -> 36 bytes (d[4], qs[32]), as quantize_row_nvfp4_ref writes it."""
    x = np.asarray(x, dtype=np.float32)
    assert x.shape == (QK_NVFP4,)
    d_bytes = bytearray(4)
    qs = bytearray(32)
    for s in range(QK_NVFP4 // QK_NVFP4_SUB):
        xb = x[s * QK_NVFP4_SUB : (s + 1) * QK_NVFP4_SUB]
        amax = f32(0)
        for v in xb:
            if amax < abs(v):
                amax = abs(v)
        ue = fp32_to_ue4m3(f32(amax / f32(6)))
        d_bytes[s] = ue
        d = ue4m3_to_fp32(ue)
        for j in range(QK_NVFP4_SUB // 2):
            x0 = best_index_mxfp4(xb[j], d)
            x1 = best_index_mxfp4(xb[QK_NVFP4_SUB // 2 + j], d)
            qs[s * (QK_NVFP4_SUB // 2) + j] = x0 | (x1 << 4)
    return bytes(d_bytes) + bytes(qs)
