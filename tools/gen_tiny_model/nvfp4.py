"""NVFP4 quantization in numpy, byte for byte what ggml's `quantize_row_nvfp4_ref` writes.

GGUF type NVFP4 (40) stores 64 values in 36 bytes: 4 scale bytes, one unsigned E4M3 (UE4M3,
bias 7) per sub-block of 16 values, then 32 bytes of 4-bit E2M1 codes. gguf-py reads the type
(`gguf.quants.NVFP4`) but has no quantizer, hence this module.

ggml keeps the E2M1 table doubled, as integers ({0, 1, 2, 3, 4, 6, 8, 12} and their negatives,
KVALUES below), and halves the scale when it decodes a UE4M3 byte, so kvalue * decoded scale
is the true E2M1 value times the true UE4M3 scale. Each sub-block's scale is
UE4M3(max |x| / 6): the largest E2M1 magnitude, 6, lands on the sub-block's largest value.
Each value then takes the table entry nearest to it, the lowest index on a tie (ggml's
`best_index_mxfp4`); so code 8 (a second zero) is never written. Byte j of a sub-block's 8
code bytes holds value j in its low nibble and value j + 8 in its high nibble.

There is no per-tensor second-level scale in this format (NVIDIA's safetensors NVFP4 has one):
a sub-block whose max |x| / 6 is under 2^-6 gets a subnormal scale with at most 3 significant
bits, and one under 2^-10 gets scale 0 (every value reads back as 0).
"""

from __future__ import annotations

import numpy as np

QK_NVFP4 = 64  # values per block
SUB_BLOCK = 16  # values per scale
SUB_BLOCKS = QK_NVFP4 // SUB_BLOCK
BLOCK_BYTES = SUB_BLOCKS + QK_NVFP4 // 2  # 4 scale bytes, 32 bytes of nibbles
# E2M1 values times two, indexed by the 4-bit code (bit 3 is the sign).
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
E2M1_MAX = np.float32(6.0)
UE4M3_MAX = np.float32(448.0)  # 1.75 * 2^8, the largest finite E4M3
UE4M3_SATURATED = 0x7E  # the byte of 448; 0x7F is E4M3's NaN, which the decoder reads as 0
UE4M3_BIAS = 7
_SUBNORMAL_STEP = np.float32(2.0**-9)  # E4M3 subnormals are man * 2^-9
_CHUNK_SUB_BLOCKS = 1024  # sub-blocks per pass: the (n, 16, 16) errors in 1 MiB (3x over 64 MiB)


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> UE4M3 bytes as ggml_fp32_to_ue4m3 rounds them.

    Not plain round-to-nearest-even: a normal value rounds half up on the first dropped
    mantissa bit; anything whose exponent reaches 15 (256 and up, or rounding up into it)
    saturates to 448 (0x7E); a subnormal is trunc(x * 512 + 0.5) capped at 7, so values just
    under 2^-6 stay subnormal (7 * 2^-9) instead of rounding up to 2^-6. Zero, negative
    values and NaN give 0.
    """
    x = np.asarray(x, dtype=np.float32)
    positive = x > 0  # False for NaN as well, as `!(x > 0)` is in C
    clipped = np.minimum(np.where(positive, x, np.float32(0)), UE4M3_MAX)
    return np.where(positive, _encode_positive(clipped), 0).astype(np.uint8)


def _encode_positive(x: np.ndarray) -> np.ndarray:
    """UE4M3 byte of each x in (0, 448] (other entries give garbage the caller drops)."""
    bits = x.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + UE4M3_BIAS
    mantissa = ((bits >> 20) & 0x7).astype(np.int32) + ((bits >> 19) & 0x1).astype(np.int32)
    carry = mantissa > 7
    mantissa = np.where(carry, 0, mantissa)
    rounded_exponent = exponent + carry
    normal = np.where(rounded_exponent >= 15, UE4M3_SATURATED, (rounded_exponent << 3) | mantissa)
    subnormal = np.minimum((x * np.float32(512) + np.float32(0.5)).astype(np.int32), 7)
    return np.where(exponent <= 0, subnormal, normal)


def ue4m3_to_fp32(codes: np.ndarray) -> np.ndarray:
    """UE4M3 bytes -> float32 scales at half their E4M3 value (the doubled-table convention).

    Follows ggml_ue4m3_to_fp32 and gguf-py: bit 7 is ignored, except that only 0x7F (NaN in
    E4M3) reads as 0; subnormals (exponent field 0) are man * 2^-9. Every result is exact.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    exponent = ((codes >> 3) & 0xF).astype(np.int32)
    mantissa = (codes & 0x7).astype(np.float32)
    normal = np.ldexp(np.float32(1) + mantissa / np.float32(8), exponent - UE4M3_BIAS)
    raw = np.where(exponent == 0, mantissa * _SUBNORMAL_STEP, normal).astype(np.float32)
    return np.where(codes == 0x7F, np.float32(0), raw * np.float32(0.5)).astype(np.float32)


def quantize_nvfp4(weights: np.ndarray) -> np.ndarray:
    """Quantize rows of float32 (last dim a multiple of 64) to NVFP4 bytes.

    Returns uint8 of shape (*weights.shape[:-1], weights.shape[-1] // 64 * 36), the raw tensor
    data gguf-py's writer takes with `raw_dtype=GGMLQuantizationType.NVFP4`.
    """
    x = np.ascontiguousarray(weights, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_NVFP4:
        raise ValueError(
            f"NVFP4 needs rows that are a multiple of {QK_NVFP4} values, got {x.shape}"
        )
    if not np.isfinite(x).all():
        raise ValueError("NVFP4 cannot store NaN or infinite values")
    sub_blocks = x.reshape(-1, SUB_BLOCK)
    scales = np.empty(sub_blocks.shape[0], dtype=np.uint8)
    codes = np.empty(sub_blocks.shape, dtype=np.uint8)
    for start in range(0, sub_blocks.shape[0], _CHUNK_SUB_BLOCKS):
        chunk = slice(start, start + _CHUNK_SUB_BLOCKS)
        scales[chunk], codes[chunk] = quantize_sub_blocks(sub_blocks[chunk])
    blocks = pack_blocks(scales, codes)
    return blocks.reshape(*x.shape[:-1], x.shape[-1] // QK_NVFP4 * BLOCK_BYTES)


def quantize_sub_blocks(sub_blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (n, 16) -> (UE4M3 scale byte (n,), 4-bit codes (n, 16)), unpacked."""
    amax = np.abs(sub_blocks).max(axis=1)
    scales = fp32_to_ue4m3(amax / E2M1_MAX)  # float32 division, as in C
    d = ue4m3_to_fp32(scales)
    return scales, nearest_codes(sub_blocks, d)


def nearest_codes(sub_blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The code whose KVALUES[code] * d is nearest each value, lowest code on a tie.

    The distance is |kvalue * d - x| in float32 like ggml's best_index_mxfp4 (the product is
    exact, the difference is rounded), and argmin keeps the first of equal minima as the C
    loop's strict `<` does.
    """
    candidates = d[:, None, None] * KVALUES  # (n, 1, 16), exact
    errors = np.abs(candidates - sub_blocks[:, :, None])
    return errors.argmin(axis=-1).astype(np.uint8)


def pack_blocks(scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Scale bytes (4n,) and codes (4n, 16) -> (n, 36) blocks: 4 scales, then 4 x 8 code bytes.

    Each sub-block's byte j is code j | code j + 8 << 4, the order gguf-py's dequantize_blocks
    reads back (all low nibbles of the 8 bytes, then all high nibbles).
    """
    packed = codes[:, : SUB_BLOCK // 2] | (codes[:, SUB_BLOCK // 2 :] << 4)
    n_blocks = scales.shape[0] // SUB_BLOCKS
    return np.concatenate(
        [scales.reshape(n_blocks, SUB_BLOCKS), packed.reshape(n_blocks, QK_NVFP4 // 2)], axis=1
    )
