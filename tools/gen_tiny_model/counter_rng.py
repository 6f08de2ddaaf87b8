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


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN_GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, stream: str) -> np.uint64:
    """A 64-bit key per (seed, stream name), so each tensor draws from its own stream."""
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def uniform(seed: int, stream: str, size: int, offset: int = 0) -> np.ndarray:
    """`size` float64 values in [0, 1): element i depends only on (seed, stream, offset + i)."""
    key = _splitmix64(np.array([stream_key(seed, stream)], dtype=np.uint64))[0]
    counters = np.arange(offset, offset + size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(counters * _GOLDEN_GAMMA + key)
    # The top 53 bits convert to float64 exactly.
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def normal(seed: int, stream: str, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    """float32 values with mean 0 and standard deviation `std`, reproducible bit for bit."""
    size = math.prod(shape)
    total = np.zeros(size, dtype=np.float64)
    for term in range(_IRWIN_HALL_TERMS):
        total += uniform(seed, f"{stream}#{term}", size)
    values = (total - _IRWIN_HALL_TERMS / 2) * (_IRWIN_HALL_SCALE * std)
    return values.astype(np.float32).reshape(shape)
