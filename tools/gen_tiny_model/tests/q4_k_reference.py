"""A literal, one-block-at-a-time transcription of llama.cpp's quantize_row_q4_K_ref.

Slow on purpose: it mirrors the C loops statement by statement (float32 arithmetic, the same
summation order) so the vectorized quantizer can be checked against it byte for byte.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def _nearest_int(value: np.float32) -> int:
    return int(np.rint(value))


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep):
    n = len(x)
    lo, hi = x[0], x[0]
    sum_w = weights[0]
    sum_x = f32(sum_w * x[0])
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w = f32(sum_w + weights[i])
        sum_x = f32(sum_x + f32(weights[i] * x[i]))
    lo = min(lo, f32(0))
    levels = [0] * n
    if hi == lo:
        return f32(0), f32(-lo), levels
    iscale = f32(f32(nmax) / f32(hi - lo))
    scale = f32(f32(1) / iscale)
    best = f32(0)
    for i in range(n):
        levels[i] = max(0, min(nmax, _nearest_int(f32(iscale * f32(x[i] - lo)))))
        diff = f32(f32(f32(scale * f32(levels[i])) + lo) - x[i])
        best = f32(best + f32(weights[i] * f32(diff * diff)))
    for step in range(nstep + 1):
        iscale = f32(f32(f32(rmin + f32(rdelta * f32(step))) + f32(nmax)) / f32(hi - lo))
        sum_l = sum_l2 = sum_xl = f32(0)
        trial = [0] * n
        for i in range(n):
            trial[i] = max(0, min(nmax, _nearest_int(f32(iscale * f32(x[i] - lo)))))
            wl = f32(weights[i] * f32(trial[i]))
            sum_l = f32(sum_l + wl)
            sum_l2 = f32(sum_l2 + f32(wl * f32(trial[i])))
            sum_xl = f32(sum_xl + f32(wl * x[i]))
        det = f32(f32(sum_w * sum_l2) - f32(sum_l * sum_l))
        if det > 0:
            this_scale = f32(f32(f32(sum_w * sum_xl) - f32(sum_x * sum_l)) / det)
            this_min = f32(f32(f32(sum_l2 * sum_x) - f32(sum_l * sum_xl)) / det)
            if this_min > 0:
                this_min = f32(0)
                this_scale = f32(sum_xl / sum_l2)
            err = f32(0)
            for i in range(n):
                diff = f32(f32(f32(this_scale * f32(trial[i])) + this_min) - x[i])
                err = f32(err + f32(weights[i] * f32(diff * diff)))
            if err < best:
                levels, best, scale, lo = trial, err, this_scale, this_min
    return scale, f32(-lo), levels


def quantize_block(x: np.ndarray) -> bytes:
    """One 256-value block -> 144 bytes, as quantize_row_q4_K_ref writes it."""
    x = x.astype(np.float32)
    levels = [0] * 256
    scales, mins = [f32(0)] * 8, [f32(0)] * 8
    max_scale = max_min = f32(0)
    for j in range(8):
        sub = x[32 * j : 32 * j + 32]
        sum_x2 = f32(0)
        for v in sub:
            sum_x2 = f32(sum_x2 + f32(v * v))
        av_x = f32(np.sqrt(f32(sum_x2 / f32(32))))
        weights = [f32(av_x + abs(v)) for v in sub]
        scales[j], mins[j], levels[32 * j : 32 * j + 32] = make_qkx2_quants(
            sub, weights, 15, f32(-1.0), f32(0.1), 20
        )
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    inv_scale = f32(f32(63) / max_scale) if max_scale > 0 else f32(0)
    inv_min = f32(f32(63) / max_min) if max_min > 0 else f32(0)
    packed = [0] * 12
    for j in range(8):
        ls = min(63, _nearest_int(f32(inv_scale * scales[j])) & 0xFF)
        lm = min(63, _nearest_int(f32(inv_min * mins[j])) & 0xFF)
        if j < 4:
            packed[j] = ls
            packed[j + 4] = lm
        else:
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            packed[j - 4] |= (ls >> 4) << 6
            packed[j] |= (lm >> 4) << 6
    d = np.float16(f32(max_scale / f32(63)))
    dmin = np.float16(f32(max_min / f32(63)))
    for j in range(8):
        if j < 4:
            sc, m = packed[j] & 63, packed[j + 4] & 63
        else:
            sc = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4)
            m = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)
        dd = f32(f32(d) * f32(sc))
        if not dd:
            continue
        dm = f32(f32(dmin) * f32(m))
        for ii in range(32):
            level = _nearest_int(f32(f32(x[32 * j + ii] + dm) / dd))
            levels[32 * j + ii] = max(0, min(15, level))
    qs = bytearray()
    for j in range(0, 256, 64):
        qs += bytes(levels[j + i] | (levels[j + i + 32] << 4) for i in range(32))
    return d.tobytes() + dmin.tobytes() + bytes(packed) + bytes(qs)
