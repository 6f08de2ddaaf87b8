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
prefix of that ranking whose probability reaches top_p (the first token always; a prefix whose
mass equals top_p exactly is enough, `top_p`); min-p keeps
the tokens whose probability is at least min_p times the most likely one's. The draw walks the
kept tokens in id order (not in that ranking) and takes the one whose cumulative interval
holds the uniform: the cumulative probability at each id then moves by at most the total
variation when the probabilities move, so two near-equal distributions draw differently only
where the uniform lies that close to a boundary (`compare_draws`; in ranking order, two near-tied
tokens that swap ranks would swap whole intervals).

**The kept-set rule** (`compare_kept`): near a top-k, top-p or min-p threshold, logits within
a tolerance may keep different tokens, as near a tie they may choose different greedy tokens.
`kept_bounds(run's logits, settings, history, atol)` computes, stage by stage of the chain and
apart from it, the tokens the chain keeps however a reference within atol of these logits
(the premise below) ranks them (certain) and those it may keep (possible): any two penalized
logits' difference may be off by 2 atol max(r, 1/r) (divided by T after the temperature
stage); top-k keeps a token for certain when fewer than k others could rank above it,
possibly when fewer than k surely do; top-p and min-p compare the mass or probability that
could (or surely does) rank above a token, each ratio off by that factor. At one step, P (the
reference's processed distribution) against Q (the run's):

1. the kept tokens of both P and Q lie between the run's bounds (each holds every certain
   token and none that is not possible), else FAIL;
2. TV(P, Q), over the tokens both keep, each renormalized, is at most the margin the logits'
   tolerance allows (`draw_margin`: the processed log-probabilities are within delta =
   2 atol max(r, 1/r) / T, r the repetition penalty, T the temperature, so TV <=
   expm1(delta) / 2), else FAIL;
3. kept sets that differ but pass 1 and 2 are BOUNDARY (counted, not failed).

The tolerance's premise (both rules): every log-probability within atol of the reference's;
with a repetition penalty (r != 1), every raw logit within atol of the reference's. That
penalty divides or multiplies a seen token's raw logit, so a common shift of all logits, which
moves no log-probability, moves the penalized ones apart (shift 0.5, r 1.3: FAILs,
`test_a_common_logit_shift_breaks_only_the_repetition_penalty`); presence and frequency
subtract the same amounts in both runs, and temperature and the truncations see only
differences. Under the premise any two penalized logits' difference is off by at most
2 atol max(r, 1/r); logits within atol/2 meet both forms. A run that meets only the
log-probability form under a repetition penalty may FAIL without a bug: a false alarm, never a
missed one.

**The draw rule** (`compare_draws`), for a run whose logits legitimately differ from the
reference's within a tolerance, like the near-tie rule for greedy tokens: at one step, with the
same uniform u, P draws a and Q draws b. The kept-set rule is checked first, whether the draws
differ or not. If a != b the draw is AMBIGUOUS (counted, not failed) only when

1. the kept sets differ at a BOUNDARY (the draw then lies past the tolerance's reach: after it
   the continuations follow different histories); or, with the same kept tokens,
2. u lies within TV(P, Q) of P's cumulative boundary next to a on b's side, and within TV(P, Q)
   of Q's boundary next to b on a's side.

A correct draw from both always satisfies 2 when it differs (the cumulative probability at any
id moves by at most TV), so a FAIL there is a draw that no tolerance explains: another uniform,
another seed, another position, another order. After an ambiguous draw the continuations
follow different histories and are compared no further.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
from collections.abc import Sequence

import numpy as np
import torch

ORDERS = ("transformers", "llama_cpp")
# Below a thousandth, a temperature changes nothing but its overflow: at 1e-3 a logit gap of
# 0.75 already leaves the lower token exp(-750), under float64's smallest number, so the draw
# is the greedy token except between logits that close; and any float32 logit, even after
# the largest penalties, divided by 1e-3 stays finite (3.4e38 x 1e3 / 1e-3 = 3.4e44), where
# 1e-308 made a logit of 2 inf and every probability NaN (token 0 drawn, not the argmax).
# Temperature 0 is greedy decoding, no sampler (the server maps it so itself).
TEMPERATURE_MIN = 1e-3
# A factor of a thousand either way already makes a repeated token certain or impossible; a
# penalty far outside it divides a logit into inf (1e-320 did, through the server).
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
# Presence and frequency subtract from logits: a thousand either way already makes a seen token
# certain or impossible (OpenAI's API allows [-2, 2]); far outside it, frequency x count
# overflows (-1e308 on a token seen twice made its logit inf and every probability NaN), and a
# huge presence rounds the seen tokens' logits together.
ADDITIVE_PENALTY_RANGE = (-1e3, 1e3)
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


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
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN and inf pass no range check below
                problems.append(f"{name}={value} must be a finite number")
        if problems:
            raise ValueError("sampler settings: " + "; ".join(problems))
        if not self.temperature > 0:
            problems.append(f"temperature={self.temperature} must be > 0 (greedy: no sampler)")
        elif self.temperature < TEMPERATURE_MIN:
            problems.append(
                f"temperature={self.temperature} must be >= {TEMPERATURE_MIN:g} (smaller is "
                "greedy to float64 and overflows the logits; greedy: no sampler)"
            )
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must lie in (0, 1] (1: off)")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p} must lie in [0, 1) (0: off)")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            problems.append(
                f"repetition_penalty={self.repetition_penalty} must lie in [{low:g}, {high:g}] "
                "(1: off)"
            )
        low, high = ADDITIVE_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= getattr(self, name) <= high:
                problems.append(
                    f"{name}={getattr(self, name)} must lie in [{low:g}, {high:g}] (0: off)"
                )
        if self.order not in ORDERS:
            problems.append(f"order={self.order!r} is not one of {', '.join(ORDERS)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            problems.append(f"seed={self.seed} must lie in [0, 2**64)")
        if problems:
            raise ValueError("sampler settings: " + "; ".join(problems))


# The fields another engine's sampler shares with this one (llama.cpp's request names too).
SHARED_FIELDS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float}


def settings_text(sampler: dict) -> str:
    """{"temperature": 1.5, "top_k": 20} -> `temperature=1.5,top_k=20` (settings_from_text's
    input: the tools' --sampler defaults)."""
    return ",".join(f"{k}={v}" for k, v in sampler.items())


def settings_from_text(text: str) -> dict:
    """`temperature=1.5,top_k=20` -> {"temperature": 1.5, "top_k": 20}, checked by
    SamplerSettings; ValueError naming the bad item (the tools' --sampler option)."""
    sampler = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in SHARED_FIELDS or not value:
            raise ValueError(
                f"--sampler item {item!r}: give KEY=VALUE with KEY one of "
                f"{', '.join(SHARED_FIELDS)}"
            )
        try:
            sampler[key] = SHARED_FIELDS[key](value)
        except ValueError:
            raise ValueError(f"--sampler item {item!r}: {value!r} is not a number") from None
    SamplerSettings(**sampler)  # refuses bad values, naming the field
    return sampler


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


# Above this many values at or above kth_largest's one-pass bound, it partitions them all.
_BOUNDED_CANDIDATES = 4096


def kth_largest(values: np.ndarray, k: int) -> float:
    """The k-th largest of `values` (0 < k < len), as np.partition finds it (NaN counts as the
    largest), in one pass where it can: of k disjoint slices' peaks the lowest has k values at
    or above it, so only those are partitioned (a 128k-entry row: 0.1 ms instead of 1.5 ms
    at every step of every sampled case)."""
    n = len(values)
    width = n // k
    bound = values[: k * width].reshape(k, width).max(axis=1).min()  # NaN where a slice has one
    if not np.isnan(bound) and not np.isnan(values[k * width :]).any():
        above = values[values >= bound]
        if len(above) <= _BOUNDED_CANDIDATES:
            return np.partition(above, len(above) - k)[len(above) - k]
    return np.partition(values, n - k)[n - k]


def _ranked(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((ids, -values))  # logit descending, then id ascending
    return ids[order], values[order]


def _possible(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, logits) of the tokens a step can draw: every one, but those at -inf (outside a
    constraint's language: constrained.apply_mask), which no truncation counts or keeps."""
    if not np.isneginf(values.min()):
        return np.arange(len(values), dtype=np.int64), values
    ids = np.flatnonzero(~np.isneginf(values))
    return ids, values[ids]


def _ranked_for(values: np.ndarray, settings: SamplerSettings) -> tuple[np.ndarray, np.ndarray]:
    """The tokens the chain's truncations see, ranked where they need the ranking.

    With top-k, only the tokens at or above the k-th logit (its ties included) can be kept,
    and every step before top-k (temperature) is elementwise: those are ranked, not the whole
    vocabulary. Without truncation there is nothing to rank (the draw walks id order).
    """
    ids, values = _possible(values)
    s = settings
    if 0 < s.top_k < len(values):
        kth = kth_largest(values, s.top_k)
        candidates = np.flatnonzero(values >= kth)
        return _ranked(ids[candidates], values[candidates])
    if s.top_k or s.top_p < 1.0 or s.min_p > 0.0:
        return _ranked(ids, values)
    return ids, values


def _softmax(values: np.ndarray) -> np.ndarray:
    e = np.exp(values - values.max())
    total = e.sum()
    if not np.isfinite(total):  # NaN: a value inf or NaN (processed refuses those it is given)
        raise ValueError(
            "sampling: the processed probabilities are not finite (a logit divided by the "
            "temperature overflowed float64?): no distribution to draw from"
        )
    return e / total


def _refuse_non_finite(values: np.ndarray) -> None:
    """ValueError unless the row's largest logit is finite: a NaN anywhere or a +inf gives NaN
    probabilities (token 0 was drawn, not the argmax), and a row all -inf keeps no token."""
    top = values.max()  # NaN where any value is NaN
    if not np.isfinite(top):
        what = "every logit is -inf" if np.isneginf(top) else "a logit is NaN or +inf"
        raise ValueError(f"sampling: the step's logits are not drawable: {what}")


def top_k(ids, values, k: int):
    return (ids[:k], values[:k]) if k else (ids, values)


def top_p(ids, values, p: float):
    """The smallest ranked prefix whose probability reaches `p`: a token is kept when the mass
    ranked above it (cumsum - probs, in float64) is below `p`. At an exact tie, a prefix whose
    mass equals `p` is enough: four equal logits at top_p 0.5 keep two (0.25 + 0.25, exact in
    binary). A mass equal to `p` only in decimal is decided by the rounding of that sum."""
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
    """(kept ids, their probabilities): the distribution a step draws from. The ids are
    ranked (logit descending, id ascending) where a truncation is set, else in id order."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    values = penalized(values, settings, history)
    _refuse_non_finite(values)
    ids, values = _ranked_for(values, settings)
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


def _by_id(ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept ids ascending, and the cumulative probability up to each (normalized)."""
    order = np.argsort(ids, kind="stable")
    cdf = np.cumsum(probs[order])
    return ids[order], cdf / cdf[-1]


def pick(ids: np.ndarray, probs: np.ndarray, u):
    """The kept token(s) whose cumulative interval, in id order, holds the uniform(s) `u`."""
    ids, cdf = _by_id(ids, probs)
    index = np.searchsorted(cdf, np.asarray(u), side="right")
    return ids[np.minimum(index, len(ids) - 1)]


# --- the kept set under a tolerance --------------------------------------------------------


def _stage_bounds(name, settings, tight, loose, slack):
    """One truncation's (tight, loose) survivors, each (ids, values) ranked by the run's values,
    tight a prefix of loose; `slack`: how far any two tokens' value difference may be off."""
    s = settings
    (ids_t, v_t), (ids_l, v_l) = tight, loose
    if name == "top_k" and s.top_k:
        # certain: fewer than k others could rank above it; possible: fewer than k surely do
        could_above = np.searchsorted(-v_l, -(v_t - slack), side="right") - 1
        surely_above = np.searchsorted(-v_t, -(v_l + slack), side="left")
        return (ids_t[could_above < s.top_k], v_t[could_above < s.top_k]), (
            ids_l[surely_above < s.top_k],
            v_l[surely_above < s.top_k],
        )
    if name == "top_p" and s.top_p < 1.0:
        return _top_p_bounds(s.top_p, tight, loose, slack)
    if name == "min_p" and s.min_p > 0.0 and len(v_l):
        # relative to the most likely kept token: the largest it could be (tight), the smallest
        top_hi, top_lo = v_l[0], (v_t[0] if len(v_t) else v_l[-1])
        floor = np.log(s.min_p)
        keep_t, keep_l = v_t - top_hi - slack >= floor, v_l - top_lo + slack >= floor
        return (ids_t[keep_t], v_t[keep_t]), (ids_l[keep_l], v_l[keep_l])
    return tight, loose


def _top_p_bounds(p, tight, loose, slack):
    """top-p's survivors when each probability ratio may be off by a factor exp(slack): the
    mass ranked above a token, as a share of the kept set's, at its largest (tight: kept even
    then) and its smallest (loose: kept then)."""
    (ids_t, v_t), (ids_l, v_l) = tight, loose
    if not len(v_l):
        return tight, loose
    w = np.exp(v_l - v_l[0])  # the loose set's weights; the tight set is its first len(v_t)
    total_t, total_l = w[: len(v_t)].sum(), w.sum()
    cum = np.concatenate(([0.0], np.cumsum(w)))
    # for each token: the mass that could rank above it, and the mass that surely does
    could = cum[np.searchsorted(-v_l, -(v_l - slack), side="right")] - w
    surely = cum[np.searchsorted(-v_l, -(v_l + slack), side="left")]
    grow, shrink = np.exp(slack), np.exp(-slack)
    # tight: above at its largest against the rest at its smallest (only tight tokens surely
    # there); loose: above at its smallest (tight tokens) against the rest at its largest
    rest_lo = np.maximum(total_t - np.minimum(could, total_t), 0.0)
    share_hi = grow * could / np.maximum(grow * could + shrink * rest_lo, 1e-300)
    above_lo = np.minimum(surely, total_t)
    share_lo = (
        shrink * above_lo / np.maximum(shrink * above_lo + grow * (total_l - above_lo), 1e-300)
    )
    first_t = could[: len(v_t)] == 0.0  # nothing could rank above it: always kept
    keep_t = (share_hi[: len(v_t)] < p) | first_t
    keep_l = (share_lo < p) | (surely == 0.0)
    return (ids_t[keep_t], v_t[keep_t]), (ids_l[keep_l], v_l[keep_l])


def kept_bounds(
    logits: torch.Tensor | np.ndarray,
    settings: SamplerSettings,
    history: Sequence[int] = (),
    logprob_atol: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(certain, possible): the ids the chain keeps from these logits however a reference whose
    log-probabilities are within `logprob_atol` of them ranks its tokens (with a repetition
    penalty: whose raw logits are; the premise in the module docstring), and the ids it may
    keep (the kept-set rule, module docstring). With atol 0 both are `processed`'s kept ids."""
    if logprob_atol <= 0.0:
        ids, _ = processed(logits, settings, history)
        return ids, ids
    values = penalized(np.asarray(logits, dtype=np.float64).reshape(-1), settings, history)
    _refuse_non_finite(values)
    s = settings
    r = s.repetition_penalty
    slack = 2.0 * logprob_atol * max(r, 1.0 / r)  # any two penalized logits' difference
    ids, values = _possible(values)
    if 0 < s.top_k < len(values):
        kth = kth_largest(values, s.top_k)
        candidates = np.flatnonzero(values >= kth - slack * (1 + 1e-9) - 1e-12)
        ids, values = _ranked(ids[candidates], values[candidates])
    else:
        ids, values = _ranked(ids, values)
    tight = loose = (ids, values)
    for name in CHAINS[s.order]:
        if name == "temperature":
            tight, loose = (
                (tight[0], tight[1] / s.temperature),
                (loose[0], loose[1] / s.temperature),
            )
            slack /= s.temperature
        else:
            tight, loose = _stage_bounds(name, s, tight, loose, slack)
    return tight[0], loose[0]


# --- the draw rule ---------------------------------------------------------------------------


def draw_margin(logprob_atol: float, settings: SamplerSettings) -> float:
    """The largest TV between two processed distributions that keep the same tokens, of logits
    whose log-probabilities are within `logprob_atol` of each other (with a repetition
    penalty: whose raw logits are; a common shift moves the penalized ones; module docstring)."""
    r = settings.repetition_penalty
    delta = 2.0 * logprob_atol * max(r, 1.0 / r) / settings.temperature
    return float(np.expm1(delta) / 2.0)


@dataclasses.dataclass(frozen=True)
class DrawVerdict:
    verdict: str  # "equal", "AMBIGUOUS" or "FAIL"
    reference_token: int
    run_token: int
    tv: float
    detail: str = ""


def _boundary_gap(ids: np.ndarray, cdf: np.ndarray, token: int, toward: int, u: float) -> float:
    """|u - the cumulative boundary next to `token` on `toward`'s side| (ids ascending)."""
    i = int(np.searchsorted(ids, token))
    edge = cdf[i] if toward > token else (cdf[i - 1] if i else 0.0)
    return abs(u - float(edge))


@dataclasses.dataclass(frozen=True)
class KeptVerdict:
    """One step's processed distributions compared (the kept-set rule, module docstring)."""

    verdict: str  # "equal": same kept tokens; "BOUNDARY": they differ where allowed; "FAIL"
    tv: float  # over the tokens both keep, each renormalized
    detail: str = ""


def compare_kept(
    reference: tuple[np.ndarray, np.ndarray],
    run: tuple[np.ndarray, np.ndarray],
    bounds: tuple[np.ndarray, np.ndarray] | None,
    margin: float,
) -> KeptVerdict:
    """P = `reference` against Q = `run` (each `processed`'s (ids, probabilities)) at one
    step: P's and Q's kept tokens between the bounds of the run's logits (`kept_bounds`; None:
    P's must be Q's), and TV over the tokens both keep within `margin`."""
    ids_p, cdf_p = _by_id(*reference)
    ids_q, cdf_q = _by_id(*run)
    probs_p, probs_q = np.diff(cdf_p, prepend=0.0), np.diff(cdf_q, prepend=0.0)
    same_kept = np.array_equal(ids_p, ids_q)
    certain, possible = (ids_q, ids_q) if bounds is None else bounds
    # both kept sets between the bounds: the reference's (a tolerance may rank otherwise),
    # and the run's own (the bounds are the chain's definition, computed apart from it)
    for whose, ids in (("reference", ids_p), ("run", ids_q)):
        missing = _absent(certain, ids)[:5].tolist()
        extra = _absent(ids, possible)[:5].tolist()
        if missing or extra:
            parts = [f"lacks {missing}, which the chain keeps however the tolerance ranks them"]
            parts = (parts if missing else []) + (
                [f"keeps {extra}, which the chain cannot keep"] if extra else []
            )
            detail = (
                f"the {whose}'s kept tokens lie outside what the run's logits allow within the "
                f"tolerance: it {' and '.join(parts)}"
            )
            return KeptVerdict("FAIL", float("inf"), detail)
    if not same_kept:  # TV over the tokens both keep: the tolerance's bound holds on them
        common = np.intersect1d(ids_p, ids_q)
        probs_p = probs_p[np.isin(ids_p, common)]
        probs_q = probs_q[np.isin(ids_q, common)]
        probs_p, probs_q = probs_p / probs_p.sum(), probs_q / probs_q.sum()
    tv = 0.5 * float(np.abs(probs_p - probs_q).sum())
    if tv > margin:
        detail = f"TV {tv:.3g} of the processed distributions is over the margin {margin:.3g}"
        return KeptVerdict("FAIL", tv, detail)
    if not same_kept:
        flipped = np.setxor1d(ids_p, ids_q)[:5].tolist()
        return KeptVerdict("BOUNDARY", tv, f"kept-set boundary tokens {flipped}")
    return KeptVerdict("equal", tv)


def _absent(ids: np.ndarray, present: np.ndarray) -> np.ndarray:
    """The token ids of `ids` not in `present` (each without repeats), ascending: what
    np.setdiff1d gives, through a mask over the vocabulary instead of sorting both (a kept set
    without truncation is the whole vocabulary: 6 ms a step for 128k ids)."""
    if len(ids) == 0 or np.array_equal(ids, present):
        return ids[:0]
    mask = np.zeros(int(max(ids.max(), present.max(initial=0))) + 1, dtype=bool)
    mask[present] = True
    return np.sort(ids[~mask[ids]])


def compare_draws(
    reference: tuple[np.ndarray, np.ndarray],
    run: tuple[np.ndarray, np.ndarray],
    u: float,
    margin: float,
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> DrawVerdict:
    """The draw rule (module docstring) at one step: P = `reference`, Q = `run`, each
    (kept ids, probabilities) as `processed` returns them, the step's uniform `u`, the
    largest TV the logits' tolerance allows (`draw_margin`), the run's `kept_bounds` (None:
    the kept sets must be equal)."""
    a, b = int(pick(*reference, u)), int(pick(*run, u))
    kept = compare_kept(reference, run, bounds, margin)
    if kept.verdict == "FAIL":
        return DrawVerdict("FAIL", a, b, kept.tv, kept.detail)
    if a == b:
        return DrawVerdict("equal", a, b, kept.tv)
    if kept.verdict == "BOUNDARY":
        detail = f"the kept sets differ within the tolerance ({kept.detail})"
        return DrawVerdict("AMBIGUOUS", a, b, kept.tv, detail)
    tv = kept.tv
    ids_p, cdf_p = _by_id(*reference)
    ids_q, cdf_q = _by_id(*run)
    gap_p = _boundary_gap(ids_p, cdf_p, a, b, u)
    gap_q = _boundary_gap(ids_q, cdf_q, b, a, u)
    if gap_p > tv or gap_q > tv:
        detail = (
            f"u={u:.6f} lies {gap_p:.3g} from the reference's boundary next to {a} and "
            f"{gap_q:.3g} from the run's next to {b}, more than TV {tv:.3g}: no tolerance "
            "explains the draw (another uniform, seed, position or order?)"
        )
        return DrawVerdict("FAIL", a, b, tv, detail)
    return DrawVerdict("AMBIGUOUS", a, b, tv, f"u within TV {tv:.3g} of the boundary")


# --- counter-based randomness --------------------------------------------------------------

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
# The counter's third word: a domain per stream, so that the token draws, a speculative
# draft's draws and the rejection sampler's acceptance tests never share a uniform.
TOKEN_DOMAIN = int.from_bytes(hashlib.sha256(b"token").digest()[:4], "little")
DRAFT_DOMAIN = int.from_bytes(hashlib.sha256(b"draft").digest()[:4], "little")
ACCEPT_DOMAIN = int.from_bytes(hashlib.sha256(b"accept").digest()[:4], "little")


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


def uniform(seed: int, position, domain: int = TOKEN_DOMAIN):
    """Uniform(s) in [0, 1) with 53 random bits for `seed` at `position` (int or array), in
    the stream `domain` (the token draws' unless told)."""
    position = np.asarray(position, dtype=np.uint64)
    x0, x1, _, _ = philox4x32(
        (position & _LOW, position >> np.uint64(32), domain, 0),
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


def compare_continuations(
    reference: tuple[Sequence[int], torch.Tensor],
    run: tuple[Sequence[int], torch.Tensor],
    settings: SamplerSettings,
    seed: int,
    prompt: Sequence[int],
    margin: float,
    logprob_atol: float | None = None,
) -> list[DrawVerdict]:
    """The draw rule along two seeded continuations of one prompt, each (tokens, logits
    [steps, vocab]) with row i the logits that drew token i: a verdict per step until the
    first that is not "equal" (after it the histories differ), or the shorter's end. With
    `logprob_atol` (the logits' tolerance), kept sets may differ where `kept_bounds` allows."""
    verdicts = []
    (ref_tokens, ref_logits), (run_tokens, run_logits) = reference, run
    history = list(prompt)
    for step in range(min(len(ref_tokens), len(run_tokens))):
        u = float(uniform(seed, len(history)))
        p = processed(ref_logits[step], settings, history)
        q = processed(run_logits[step], settings, history)
        bounds = None
        if logprob_atol is not None:
            bounds = kept_bounds(run_logits[step], settings, history, logprob_atol)
        verdict = compare_draws(p, q, u, margin, bounds)
        if (verdict.reference_token, verdict.run_token) != (ref_tokens[step], run_tokens[step]):
            detail = (
                f"step {step}: the drawn tokens {ref_tokens[step]}, {run_tokens[step]} are not "
                f"the draws {verdict.reference_token}, {verdict.run_token} of their logits"
            )
            verdict = DrawVerdict("FAIL", ref_tokens[step], run_tokens[step], verdict.tv, detail)
        verdicts.append(verdict)
        if verdict.verdict != "equal":
            break
        history.append(ref_tokens[step])
    return verdicts
