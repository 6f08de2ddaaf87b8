"""A counter-based random stream whose values are the same on every machine and numpy version.

numpy's Generator streams may change between releases and its transcendental functions may
differ in the last bit between CPUs, so the tiny checkpoints draw from splitmix64 (integer
arithmetic only) and shape the uniforms into a bell curve with additions and one multiplication,
operations IEEE 754 rounds the same everywhere.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Irwin-Hall with 4 terms: the sum of 4 uniforms on [0, 1) has variance 4/12, so centring it
# and multiplying by sqrt(3) gives mean 0, variance 1 and tails bounded at +-2*sqrt(3).
_IRWIN_HALL_TERMS = 4
_IRWIN_HALL_SCALE = math.sqrt(12.0 / _IRWIN_HALL_TERMS)


# Values are made this many at a time, in place: a whole Llama 3 embedding (128256 x 256) at
# once took 16 s in 262 MB temporaries per operation; in chunks that stay in the cache, 2 s.
_CHUNK = 1 << 15
_COUNTS = np.arange(_CHUNK, dtype=np.uint64)


def _splitmix64(z: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's output function of z + gamma, computed in place in z (uint64)."""
    t = np.empty_like(z) if scratch is None else scratch
    np.add(z, _GOLDEN_GAMMA, out=z)
    for shift, mix in ((30, _MIX1), (27, _MIX2)):
        np.right_shift(z, np.uint64(shift), out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, mix, out=z)
    np.right_shift(z, np.uint64(31), out=t)
    np.bitwise_xor(z, t, out=z)
    return z


def stream_key(seed: int, stream: str) -> np.uint64:
    """A 64-bit key per (seed, stream name), so each tensor draws from its own stream."""
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def uniform(seed: int, stream: str, size: int, offset: int = 0) -> np.ndarray:
    """`size` float64 values in [0, 1): element i depends only on (seed, stream, offset + i)."""
    key = _splitmix64(np.array([stream_key(seed, stream)], dtype=np.uint64))[0]
    out = np.empty(size, dtype=np.float64)
    z = np.empty(min(size, _CHUNK), dtype=np.uint64)
    t = np.empty_like(z)
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        zc = z[:n]
        np.add(_COUNTS[:n], np.uint64(offset + start), out=zc)  # the counters, wrapping
        np.multiply(zc, _GOLDEN_GAMMA, out=zc)
        np.add(zc, key, out=zc)
        _splitmix64(zc, t[:n])
        # The top 53 bits convert to float64 exactly.
        np.right_shift(zc, np.uint64(11), out=zc)
        np.multiply(zc, 1.0 / (1 << 53), out=out[start : start + n])
    return out


def normal(seed: int, stream: str, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    """float32 values with mean 0 and standard deviation `std`, reproducible bit for bit."""
    size = math.prod(shape)
    values = np.empty(size, dtype=np.float32)
    scale = _IRWIN_HALL_SCALE * std
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        total = np.zeros(n, dtype=np.float64)
        for term in range(_IRWIN_HALL_TERMS):
            total += uniform(seed, f"{stream}#{term}", n, offset=start)
        values[start : start + n] = (total - _IRWIN_HALL_TERMS / 2) * scale
    return values.reshape(shape)
