"""Q4_K quantization in numpy, byte for byte in llama.cpp's `block_q4_K` layout.

A super-block holds 256 values as 8 sub-blocks of 32. Each sub-block gets a scale and a min,
found by llama.cpp's `make_qkx2_quants` search (weighted least squares over 21 candidate
grids); both are stored as 6-bit integers relative to the super-block's fp16 `d` and `dmin`.
Each block is 144 bytes: d (fp16), dmin (fp16), scales[12] (packed 6-bit), qs[128] (4-bit
pairs), which is what `gguf.quants.dequantize(..., GGMLQuantizationType.Q4_K)` reads.

Arrays are laid out lanes-first (32, n_sub_blocks) so every reduction over a sub-block is a
fixed sequence of 31 additions in C order: the same bits on every machine, unlike numpy's
SIMD-dispatched pairwise sums.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
SUB_BLOCK = 32
SUB_BLOCKS = QK_K // SUB_BLOCK
BLOCK_BYTES = 2 + 2 + 12 + QK_K // 2  # d, dmin, scales, qs
_CHUNK_BLOCKS = 512  # super-blocks per pass: temporaries of 512 KB, in the cache (1.7x over 8192)

# The constants quantize_row_q4_K_ref passes to make_qkx2_quants.
_NMAX = 15
_RMIN = np.float32(-1.0)
_RDELTA = np.float32(0.1)
_NSTEP = 20


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Quantize rows of float32 (last dim a multiple of 256) to Q4_K bytes.

    Returns uint8 of shape (*weights.shape[:-1], weights.shape[-1] // 256 * 144), the raw
    tensor data gguf-py's writer takes with `raw_dtype=GGMLQuantizationType.Q4_K`.
    """
    x = np.ascontiguousarray(weights, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"Q4_K needs rows that are a multiple of {QK_K} values, got {x.shape}")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = _quantize_blocks(blocks[start:stop])
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * BLOCK_BYTES)


def _lane_sum(lanes: np.ndarray) -> np.ndarray:
    total = lanes[0].copy()
    for lane in lanes[1:]:
        total += lane
    return total


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's make_qkx2_quants over many sub-blocks; x, w are (32, n).

    Returns (levels uint8 (32, n), scale (n,), the_min (n,)): x ~ scale * level - the_min.
    """
    lo = np.minimum(x.min(axis=0), np.float32(0))
    hi = x.max(axis=0)
    flat = hi == lo
    span = np.where(flat, np.float32(1), hi - lo)
    sum_w = _lane_sum(w)
    sum_x = _lane_sum(w * x)
    shifted = x - lo

    iscale = np.float32(_NMAX) / span
    scale = np.float32(1) / iscale
    levels = np.clip(np.rint(iscale * shifted), 0, _NMAX)
    diff = scale * levels + lo - x
    best = _lane_sum(w * (diff * diff))
    offset = lo.copy()

    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(_NSTEP + 1):
            # As in C, later candidates are laid out from the best min found so far.
            span = np.where(flat, np.float32(1), hi - offset)
            step_iscale = (_RMIN + _RDELTA * np.float32(step) + np.float32(_NMAX)) / span
            trial = np.clip(np.rint(step_iscale * (x - offset)), 0, _NMAX)
            wl = w * trial
            sum_l = _lane_sum(wl)
            sum_l2 = _lane_sum(wl * trial)
            sum_xl = _lane_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_min = np.where(positive, np.float32(0), this_min)
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            diff = this_scale * trial + this_min - x
            err = _lane_sum(w * (diff * diff))
            better = (det > 0) & (err < best)
            levels = np.where(better, trial, levels)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            offset = np.where(better, this_min, offset)

    levels = np.where(flat, np.float32(0), levels)
    scale = np.where(flat, np.float32(0), scale)
    return levels.astype(np.uint8), scale.astype(np.float32), (-offset).astype(np.float32)


def _six_bit(values: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    # C stores nearest_int() in a uint8 and then clamps to 63; reproduce the wrap too.
    rounded = np.rint(inverse[:, None] * values).astype(np.int64) & 0xFF
    return np.minimum(rounded, 63).astype(np.uint8)


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    n_blocks = x.shape[0]
    # (blocks, 8, 32) -> lanes-first (32, blocks * 8)
    lanes = np.ascontiguousarray(x.reshape(n_blocks * SUB_BLOCKS, SUB_BLOCK).T)
    av_x = np.sqrt(_lane_sum(lanes * lanes) / np.float32(SUB_BLOCK))
    weights = av_x + np.abs(lanes)
    levels, scales, mins = _make_qkx2_quants(lanes, weights)

    scales = scales.reshape(n_blocks, SUB_BLOCKS)
    mins = mins.reshape(n_blocks, SUB_BLOCKS)
    max_scale = np.maximum(scales.max(axis=1), np.float32(0))
    max_min = np.maximum(mins.max(axis=1), np.float32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, np.float32(63) / max_scale, np.float32(0))
        inv_min = np.where(max_min > 0, np.float32(63) / max_min, np.float32(0))
    ls = _six_bit(scales, inv_scale.astype(np.float32))
    lm = _six_bit(mins, inv_min.astype(np.float32))
    d = (max_scale / np.float32(63)).astype(np.float16)
    dmin = (max_min / np.float32(63)).astype(np.float16)

    packed_scales = np.empty((n_blocks, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)

    # Requantize every value against the rounded 6-bit scale and min it will be read with.
    sub_d = (d.astype(np.float32)[:, None] * ls.astype(np.float32)).reshape(-1)
    sub_m = (dmin.astype(np.float32)[:, None] * lm.astype(np.float32)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(np.rint((lanes + sub_m) / sub_d), 0, _NMAX).astype(np.uint8)
    levels = np.where(sub_d != 0, requantized, levels)

    # Back to (blocks, 256); each 64-value half-pair shares bytes: low nibble j, high j + 32.
    levels = levels.T.reshape(n_blocks, 4, 2, SUB_BLOCK)
    qs = (levels[:, :, 0, :] | (levels[:, :, 1, :] << 4)).reshape(n_blocks, QK_K // 2)

    return np.concatenate(
        [
            d.reshape(n_blocks, 1).view(np.uint8),
            dmin.reshape(n_blocks, 1).view(np.uint8),
            packed_scales,
            qs,
        ],
        axis=1,
    )
