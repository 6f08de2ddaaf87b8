"""Perplexity and KL-divergence statistics over a text slice, computed as llama-perplexity does.

The slice: the text's tokens (a BOS first where the checkpoint adds one) cut into whole
chunks of `n_ctx` tokens (the remainder dropped); each chunk is one forward from position 0
with a fresh cache, its first token replaced by BOS where the checkpoint adds one; the logits
at positions n_ctx/2 .. n_ctx-2 score the tokens after them (n_ctx - 1 - n_ctx/2 a chunk).

Per scored token: nll = -log p_model(token); against a base model, KLD = KL(base || model) =
sum_i p_base(i) (log p_base(i) - log p_model(i)) over the whole vocabulary (exact here;
llama-perplexity stores the base's log-probabilities in 16 bits over the 16 nats below the top
one, about 1e-4 nats of resolution: its figures differ from these by that much), and whether
the two models' most likely tokens are the same.

Summaries (llama-perplexity's formulas): PPL = exp(mean nll) +/- PPL * standard error of the
mean nll; mean KLD +/- its standard error; percentiles by linear interpolation on the sorted
values at fraction * (N - 1); same-top rate p +/- sqrt(p (1 - p) / (N - 1)).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch


def chunks(tokens: Sequence[int], n_ctx: int, max_chunks: int, bos: int | None) -> list[list[int]]:
    """The slice's chunks: whole `n_ctx` pieces of `tokens` (at most `max_chunks`, all when
    it is 0), each starting with `bos` when given (the piece's first token replaced)."""
    count = len(tokens) // n_ctx
    if max_chunks:
        count = min(count, max_chunks)
    pieces = [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(count)]
    if bos is not None:
        for piece in pieces:
            piece[0] = bos
    return pieces


def scored(n_ctx: int) -> slice:
    """The logit rows of a chunk that are scored (each predicts the token after it)."""
    return slice(n_ctx // 2, n_ctx - 1)


def targets(piece: Sequence[int], n_ctx: int) -> list[int]:
    """The tokens the scored rows of a chunk predict: each the one after its row."""
    rows = scored(n_ctx)
    return list(piece[rows.start + 1 : rows.stop + 1])


def kl_divergence(base: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(base || model) of each row, from rows of log-probabilities."""
    return (base.exp() * (base - logp)).sum(dim=1)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Rows of log-probabilities (float64) from rows of logits."""
    return torch.log_softmax(logits.double(), dim=-1)


@dataclasses.dataclass
class Scores:
    """Per-token values of one model over the slice (and against the base, when there is one)."""

    nll: list[np.ndarray] = dataclasses.field(default_factory=list)
    kld: list[np.ndarray] = dataclasses.field(default_factory=list)
    same_top: list[np.ndarray] = dataclasses.field(default_factory=list)

    def add_chunk(
        self, logp: torch.Tensor, targets: Sequence[int], base: torch.Tensor | None
    ) -> None:
        """`logp` [rows, vocab] the model's scored rows, `targets` the tokens they predict,
        `base` the base model's rows (None for the base itself)."""
        index = torch.tensor(list(targets), dtype=torch.long)
        self.nll.append((-logp.gather(1, index[:, None])[:, 0]).numpy())
        if base is not None:
            self.kld.append(kl_divergence(base, logp).numpy())
            self.same_top.append((base.argmax(dim=1) == logp.argmax(dim=1)).numpy())


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error, as llama-perplexity computes them (0 when N <= 10)."""
    n = len(values)
    mean = float(values.mean())
    variance = float((values.astype(np.float64) ** 2).mean()) - mean * mean
    if n <= 10 or variance <= 0:
        return mean, 0.0
    return mean, math.sqrt(variance / (n - 1))


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: interpolated at fraction * (N - 1) of the sorted values."""
    position = fraction * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    part = position - low
    return float((1 - part) * sorted_values[low] + part * sorted_values[high])


# The figures a row of the table (and of the golden) holds, in order.
FIGURES = ("ppl", "ppl_err", "kld_mean", "kld_err", "kld_p99", "kld_p999", "kld_max", "same_top")


def summary(scores: Scores) -> dict[str, float]:
    """The row's figures: PPL (+/-) always; the KLD statistics and same-top rate (a fraction)
    against the base (absent for the base itself)."""
    nll = np.concatenate(scores.nll)
    mean, error = mean_and_error(nll)
    ppl = math.exp(mean)
    row = {"tokens": float(len(nll)), "ppl": ppl, "ppl_err": ppl * error}
    if scores.kld:
        kld = np.sort(np.concatenate(scores.kld))
        same = np.concatenate(scores.same_top).astype(np.float64)
        row["kld_mean"], row["kld_err"] = mean_and_error(kld)
        row["kld_p99"] = percentile(kld, 0.99)
        row["kld_p999"] = percentile(kld, 0.999)
        row["kld_max"] = float(kld[-1])
        row["same_top"] = float(same.mean())
    return row


__all__ = [
    "FIGURES",
    "Scores",
    "chunks",
    "kl_divergence",
    "log_probs",
    "mean_and_error",
    "percentile",
    "scored",
    "summary",
    "targets",
]
