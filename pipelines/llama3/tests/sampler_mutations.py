"""Planted sampler bugs: each a (sampling attribute, replacement) to monkeypatch into
pipelines/llama3/sampling.py, which the engine's one decoder draws through.

MUTATIONS are the chain's own bugs, proven by test_sampling's G-test at fixed distributions
and by the sampling goldens (test_llama_sampling); DRAW_MUTATIONS break the draw itself (the
uniform's seed or position), which only a seeded continuation recorded elsewhere can see.
"""

from __future__ import annotations

import numpy as np

from pipelines.llama3 import sampling

_TOP_P = sampling.top_p
_PENALIZED = sampling.penalized
_UNIFORM = sampling.uniform
_TEMPERATURE = sampling.temperature


def _top_p_one_too_many(ids, values, p):
    if p >= 1.0:
        return ids, values
    kept = len(_TOP_P(ids, values, p)[0])
    return ids[: kept + 1], values[: kept + 1]


def _top_p_one_too_few(ids, values, p):
    kept_ids, _ = _TOP_P(ids, values, p)
    n = max(1, len(kept_ids) - 1) if p < 1.0 else len(kept_ids)
    return ids[:n], values[:n]


def _top_k_ties(ids, values, k):
    return (ids[values >= values[k - 1]], values[values >= values[k - 1]]) if k else (ids, values)


def _min_p_of_the_total(ids, values, m):
    if m <= 0:
        return ids, values
    e = np.exp(values - values.max())
    keep = e / e.sum() >= m  # relative to the total, not to the most likely token
    return ids[keep], values[keep]


_TEMPERATURE_LATE = {**sampling.CHAINS, "transformers": ("top_k", "top_p", "temperature", "min_p")}

MUTATIONS = {
    "temperature after top-p": ("CHAINS", _TEMPERATURE_LATE),
    "top-p one token too many": ("top_p", _top_p_one_too_many),
    "top-p one token too few": ("top_p", _top_p_one_too_few),
    "top-k ties over-accepted": ("top_k", _top_k_ties),
    "penalties on the wrong tokens": (
        "penalized",
        lambda values, s, history: _PENALIZED(values, s, [t + 1 for t in history]),
    ),
    "min-p relative to the total": ("min_p", _min_p_of_the_total),
}

DRAW_MUTATIONS = {
    "temperature applied twice": ("temperature", lambda ids, v, t: _TEMPERATURE(ids, v / t, t)),
    "the seed ignored": ("uniform", lambda seed, position: _UNIFORM(0, position)),
    "the next position's uniform": (
        "uniform",
        lambda seed, position: _UNIFORM(seed, np.asarray(position) + 1),
    ),
}
