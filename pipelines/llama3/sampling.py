"""Seeded sampling: the processed distribution of one step, and the draw from it.

A sampled token is a function of the step's logits, the request's settings, its history (the
prompt and the tokens fed so far: the penalties), its seed and the position it is drawn at.
Nothing else: not the batch slot, the batch-mates, the scheduler's step or the chunking. That
is what `uniform` gives: a counter-based generator (Philox4x32-10, Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC'11) keyed by the seed, whose counter is the position.
A request without a seed draws one from the system's randomness (`secrets`) when its decoder
is made: its tokens then differ run to run, and are still independent of its batch-mates.

The chain, in float64 over the whole vocabulary, two named orders (`SamplerSettings.order`):

    penalties  repetition (a seen token's logit divided by it if positive, multiplied if not,
               as transformers' RepetitionPenaltyLogitsProcessor), then presence and
               frequency (logit -= presence * seen + frequency * count, OpenAI's), over the
               history: the prompt and the tokens fed so far;
    transformers   temperature, top-k, top-p, min-p  (transformers' warper order);
    llama_cpp      top-k, top-p, min-p, temperature  (llama.cpp's default chain: temperature
                   last, so top-p and min-p see the untempered distribution).

Every step ranks tokens by (logit descending, id ascending): top-k keeps exactly the first k
(a tie at the k-th logit is broken by id, never over-accepted); top-p keeps the smallest
prefix of that ranking whose probability reaches top_p (the first token always); min-p keeps
the tokens whose probability is at least min_p times the most likely one's. The draw walks the
kept tokens in that ranking and takes the one whose cumulative interval holds the uniform.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Sequence

import numpy as np
import torch

ORDERS = ("transformers", "llama_cpp")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """One request's sampler. Greedy decoding is no sampler at all (`sampling=None`)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    order: str = "transformers"
    seed: int | None = None  # None: one drawn from the system's randomness per request

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature={self.temperature} must be > 0 (greedy: no sampler)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must lie in (0, 1] (1: off)")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p} must lie in [0, 1) (0: off)")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty={self.repetition_penalty} must be > 0 (1: off)")
        if self.order not in ORDERS:
            problems.append(f"order={self.order!r} is not one of {', '.join(ORDERS)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            problems.append(f"seed={self.seed} must lie in [0, 2**64)")
        if problems:
            raise ValueError("sampler settings: " + "; ".join(problems))


# --- the processed distribution ---------------------------------------------------------


def penalized(values: np.ndarray, settings: SamplerSettings, history: Sequence[int]) -> np.ndarray:
    """The logits [vocab] (float64) after the repetition, presence and frequency penalties."""
    s = settings
    if not len(history) or (
        s.repetition_penalty == 1.0 and s.presence_penalty == 0.0 and s.frequency_penalty == 0.0
    ):
        return values
    counts = np.bincount(np.asarray(history, dtype=np.int64), minlength=len(values))
    seen = counts > 0
    out = values.copy()
    if s.repetition_penalty != 1.0:
        v = out[seen]
        out[seen] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    return out - s.presence_penalty * seen - s.frequency_penalty * counts


def _ranked(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((ids, -values))  # logit descending, then id ascending
    return ids[order], values[order]


def _softmax(values: np.ndarray) -> np.ndarray:
    e = np.exp(values - values.max())
    return e / e.sum()


def top_k(ids, values, k: int):
    return (ids[:k], values[:k]) if k else (ids, values)


def top_p(ids, values, p: float):
    if p >= 1.0:
        return ids, values
    probs = _softmax(values)
    before = np.cumsum(probs) - probs  # the mass ranked above each token
    keep = before < p
    keep[0] = True
    return ids[keep], values[keep]


def min_p(ids, values, m: float):
    if m <= 0.0:
        return ids, values
    probs = _softmax(values)
    keep = probs >= m * probs[0]  # probs[0]: the most likely kept token
    return ids[keep], values[keep]


def temperature(ids, values, t: float):
    return ids, values / t


def processed(
    logits: torch.Tensor | np.ndarray, settings: SamplerSettings, history: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """(kept ids, their probabilities), ranked: the distribution a step draws from."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    values = penalized(values, settings, history)
    ids, values = _ranked(np.arange(len(values), dtype=np.int64), values)
    s = settings
    steps = {
        "temperature": lambda i, v: temperature(i, v, s.temperature),
        "top_k": lambda i, v: top_k(i, v, s.top_k),
        "top_p": lambda i, v: top_p(i, v, s.top_p),
        "min_p": lambda i, v: min_p(i, v, s.min_p),
    }
    chain = CHAINS[s.order]
    for name in chain:
        ids, values = steps[name](ids, values)
    return ids, _softmax(values)


CHAINS = {
    "transformers": ("temperature", "top_k", "top_p", "min_p"),
    "llama_cpp": ("top_k", "top_p", "min_p", "temperature"),
}


def pick(ids: np.ndarray, probs: np.ndarray, u):
    """The kept token(s) whose cumulative interval holds the uniform(s) `u` in [0, 1)."""
    cdf = np.cumsum(probs)
    index = np.searchsorted(cdf, np.asarray(u) * cdf[-1], side="right")
    return ids[np.minimum(index, len(ids) - 1)]


# --- counter-based randomness --------------------------------------------------------------

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
# The counter's third word: a domain for the token draws (a later stream, e.g. a speculative
# draft's, takes another).
TOKEN_DOMAIN = int.from_bytes(hashlib.sha256(b"token").digest()[:4], "little")


def philox4x32(counter, key) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 of counters (four uint32 words, arrays broadcast) under key (two words)."""
    c0, c1, c2, c3 = (np.asarray(w, dtype=np.uint64) & _LOW for w in counter)
    k0, k1 = (np.asarray(w, dtype=np.uint64) & _LOW for w in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
        p0, p1 = _M0 * c0, _M1 * c2
        hi0, hi1 = p0 >> np.uint64(32), p1 >> np.uint64(32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, p1 & _LOW, hi0 ^ c3 ^ k1, p0 & _LOW
    return c0, c1, c2, c3


def uniform(seed: int, position):
    """Uniform(s) in [0, 1) with 53 random bits for `seed` at `position` (int or array)."""
    position = np.asarray(position, dtype=np.uint64)
    x0, x1, _, _ = philox4x32(
        (position & _LOW, position >> np.uint64(32), TOKEN_DOMAIN, 0),
        (seed & 0xFFFFFFFF, seed >> 32),
    )
    bits = (x0 >> np.uint64(5)) * np.uint64(1 << 26) + (x1 >> np.uint64(6))
    return bits.astype(np.float64) / float(1 << 53)


def system_seed() -> int:
    """A seed for a request without one: 64 bits of the system's randomness."""
    return secrets.randbits(64)


def sample(
    logits: torch.Tensor,
    settings: SamplerSettings,
    seed: int,
    history: Sequence[int],
    position: int,
) -> int:
    """The token drawn at `position` from the step's processed distribution."""
    ids, probs = processed(logits, settings, history)
    return int(pick(ids, probs, uniform(seed, position)))
