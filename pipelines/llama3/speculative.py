"""Speculative decoding in `Llama3Engine.generate`: a draft proposes up to K tokens, the model
scores them in one forward, the decoder verifies them.

One step: the token just chosen and the draft's K proposals are fed as one block at the next
positions (`Transformer.forward` with several rows, as a prefill chunk is); row j's logits are
the target's next-token logits after the block's first j + 1 tokens. The decoder (decoder.py,
the same one every path uses) makes its choice from row 0, then from row 1 while its choices
equal the proposals, and so on: the first choice that differs from its proposal replaces it and
ends the step (the positions after it hold the rejected proposals' keys and values, which the
next block overwrites before anything reads them: attention reads the cache only up to the
block's last position); when all K are accepted, the last row's choice is the bonus token.

Greedy: a proposal is accepted iff it is the argmax (the first of equal maxima), so the tokens
are those of decoding without speculation, and the rows are its rows up to the verification
forward's numerics (several positions at once, as a chunk computes them).

Sampling with a deterministic draft (the n-gram draft, a greedy `ModelDraft`: a proposal x is a
point mass q = 1 at x): rejection sampling accepts x with probability min(1, p(x) / q(x)) = p(x)
and on rejection draws from the residual max(0, p - q), normalized: p without x. The decoder's
draw with the position's uniform u realizes exactly that: it accepts iff its draw pick(p, u) is
x (probability p(x)), and its draw is otherwise distributed as the residual (`acceptance` and
`residual` below are the two terms; `emitted` combines them, equal to p: test_speculative). So
the emitted tokens are the target's distribution, and the same tokens as sampling without
speculation, draw for draw.

Sampling with a draft that samples (`SamplingDraft`: each proposal x drawn from the draft's
processed distribution q, with uniforms of its own stream): the rejection sampler proper
(`rejection_step`): accept x iff u < min(1, p(x) / q(x)), u from the acceptance stream;
otherwise draw from max(0, p - q), normalized (`residual_distribution`); after K accepted
proposals the bonus token is drawn from the target's last row (`bonus_distribution`). p is the
decoder's processed distribution of the verification row (penalties, truncations, temperature),
q the one the draft drew from. The emitted token is then distributed as p exactly
(`emitted_distribution`, equal to p to float tolerance: test_speculative_sampling, draws held
to p by the G-test), but the draws are not those of sampling without speculation.

Drafts: `NgramDraft` (prompt lookup, model-free): the tokens that followed the most recent
earlier occurrence of the history's last n tokens (n from `max_n` down to 1); `ModelDraft`:
another engine's greedy tokens, its KV cache kept across steps (`self_draft`: the target
checkpoint's first layers and its head, loaded as a model of its own; `file_draft`: a draft
checkpoint with the target's vocabulary, such as tools/gen_tiny_model's write_draft writes).
Teacher-forced (`forced_tokens`), the forced sequence is the draft: the decoder feeds every
forced token, so every proposal is accepted and each block is a verification forward over the
sequence being checked, which is how the golden lanes hold speculation to the goldens
(test_llama_speculative).

With a constraint (constrained.py) the decoder's rows are masked as without speculation; a
model draft chooses each proposal from its own logits masked after the proposals before it
(its matcher advanced, then rolled back), and `proposals` cuts any draft's proposals at the
first the language refuses (checked the same way): the matcher only ever holds verified
tokens (test_constrained).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pipelines.llama3 import constrained, profiling, sampling


class Draft:
    """What proposes tokens: `propose(history, k)`, up to k tokens to follow `history`.
    `drafted` adds the distributions they were drawn from, for a draft that samples; None
    for a deterministic one (the default)."""

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def drafted(self, history: Sequence[int], k: int, decoder) -> tuple[list[int], list | None]:
        return self.propose(history, k), None


@dataclasses.dataclass(frozen=True)
class NgramDraft(Draft):
    """Prompt lookup: propose what followed the last earlier match of the history's tail."""

    max_n: int = 3

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"NgramDraft max_n={self.max_n} must be at least 1")

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        history = list(history)
        for n in range(min(self.max_n, len(history) - 1), 0, -1):
            tail = history[-n:]
            # the most recent earlier occurrence of the tail (not the tail itself)
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == tail:
                    follow = history[start + n : start + n + k]
                    if follow:
                        return follow
        return []


class ModelDraft(Draft):
    """A model proposes: greedy decoding of a draft engine (a smaller checkpoint with the
    target's vocabulary, or the target's own first layers and head: `self_draft`) from the
    history. Its KV cache lives across calls: the positions of a history it computed before
    are not computed again (another history, another request's, starts again where the two
    differ). Greedy whatever the target samples: a deterministic draft, as the verification
    assumes (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._cached: list[int] = []  # the tokens whose keys are in the draft's cache

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self._run(history, k, _argmax)

    def drafted(self, history: Sequence[int], k: int, decoder) -> tuple[list[int], list | None]:
        return self._masked_run(history, k, decoder, _argmax), None

    def _masked_run(self, history: Sequence[int], k: int, decoder, choose) -> list[int]:
        """`_run`, and with the decoder's constraint each proposal chosen from the draft's
        logits masked by the language after the proposals before it (the matcher advanced
        by each, then rolled back: its state is the verified tokens' only)."""
        matcher = decoder.constraint
        if matcher is None:
            return self._run(history, k, choose)
        taken = 0

        def masked_choose(logits: torch.Tensor, context: list[int]) -> int:
            nonlocal taken
            if matcher.stopped:  # after an end of sequence: verification stops before it
                return choose(logits, context)
            token = choose(decoder.masked(logits), context)
            matcher.consume(token)
            taken += 1
            return token

        try:
            return self._run(history, k, masked_choose)
        finally:
            constrained.rollback_proposals(matcher, taken)

    def _run(self, history: Sequence[int], k: int, choose) -> list[int]:
        """k proposals after `history`, each `choose(logits, context)` of the draft's logits
        after `context` (the history and the proposals before it)."""
        history, model = [int(t) for t in history], self.engine.model
        needed = len(history) + k
        if needed > model.max_seq_len:  # a bigger cache starts empty
            model.setup_caches(max(needed, 2 * model.max_seq_len))
            self._cached = []
        common = self._reusable(history)
        device = self.engine.device
        with torch.inference_mode():
            fed = torch.tensor([history[common:]], dtype=torch.long, device=device)
            logits = model(fed, common, outputs=[fed.shape[1] - 1])[0, -1]
            proposal = [choose(logits, history)]
            for i in range(k - 1):
                token = torch.tensor([[proposal[-1]]], dtype=torch.long, device=device)
                logits = model(token, len(history) + i)[0, -1]
                proposal.append(choose(logits, history + proposal))
        self._cached = history + proposal[:-1]
        return proposal

    def _reusable(self, history: list[int]) -> int:
        """How many of the history's first positions the cache holds already (the last
        history token is always fed: its logits propose the first token)."""
        common = 0
        for ours, theirs in zip(self._cached, history[:-1], strict=False):
            if ours != theirs:
                break
            common += 1
        return common


class SamplingDraft(ModelDraft):
    """A model proposes by sampling: a sampled request's proposals are drawn from the draft
    engine's processed distribution q (the request's sampler settings, penalties over the
    history and the proposals before), each with the uniform of the draft's own stream at the
    proposal's position, and returned with q for the rejection sampler (module docstring). A
    greedy request gets the draft's greedy tokens."""

    def drafted(self, history: Sequence[int], k: int, decoder) -> tuple[list[int], list | None]:
        if decoder.sampling is None:
            return super().drafted(history, k, decoder)
        dists = []

        def draw_one(logits: torch.Tensor, context: list[int]) -> int:
            q = sampling.processed(logits, decoder.sampling, context)
            dists.append(self.reported(q, logits))
            return draw(q, sampling.uniform(decoder.seed, len(context), sampling.DRAFT_DOMAIN))

        return self._masked_run(history, k, decoder, draw_one), dists

    def reported(self, q, logits: torch.Tensor):
        """The distribution reported for a proposal drawn from q: q itself (a seam: the
        acceptance ratio must use the distribution drawn from, test_speculative_sampling)."""
        return q


def _argmax(logits: torch.Tensor, context: list[int]) -> int:
    return int(torch.argmax(logits))


def self_draft(path, layers: int, mode: str = "eager", sample: bool = False) -> ModelDraft:
    """The checkpoint's first `layers` layers, its final norm and its head, as a draft (0: the
    embedding straight into the head); with `sample`, a SamplingDraft."""
    from pipelines.llama3.engine import Llama3Engine  # engine.py imports this module

    engine = Llama3Engine.from_gguf(path, mode=mode, overrides={"n_layers": layers})
    return (SamplingDraft if sample else ModelDraft)(engine)


class DraftMismatch(ValueError):
    """A draft checkpoint whose vocabulary is not its target's."""


def file_draft(path, target, mode: str = "eager", sample: bool = False) -> ModelDraft:
    """The draft checkpoint at `path` as a draft for the engine `target`: refused (DraftMismatch,
    naming both) unless its tokens are the target's, id for id; with `sample`, a SamplingDraft."""
    from pipelines.llama3.engine import Llama3Engine  # engine.py imports this module

    engine = Llama3Engine.from_gguf(path, device=target.device, mode=mode)
    ours, theirs = engine.config.vocab_size, target.config.vocab_size
    same = ours == theirs and (
        engine.tokenizer is None
        or target.tokenizer is None
        or engine.tokenizer.backend.get_vocab(True) == target.tokenizer.backend.get_vocab(True)
    )
    if not same:
        raise DraftMismatch(
            f"the draft {path} has another vocabulary than its target ({ours} tokens, the "
            f"target {theirs}, or other tokens): a draft proposes the target's token ids; "
            "write one with //tools/gen_tiny_model:write_draft --target=TARGET"
        )
    return (SamplingDraft if sample else ModelDraft)(engine)


@dataclasses.dataclass(frozen=True)
class Speculation:
    """`draft` proposes up to `k` tokens per step (1 to 8)."""

    draft: Draft = NgramDraft()
    k: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 8:
            raise ValueError(f"speculation k={self.k} must lie in 1..8")


@dataclasses.dataclass
class Stats:
    """Per verification forward: how many tokens the draft proposed, how many were kept, and
    how many tokens the forward chose (the accepted ones and the replacement or bonus token;
    the accepted ones alone when the sequence stopped on one)."""

    proposed: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    chosen: list[int] = dataclasses.field(default_factory=list)

    @property
    def forwards(self) -> int:
        return len(self.proposed)

    def add(self, proposed: int, accepted: int, chosen: int) -> None:
        self.proposed.append(proposed)
        self.accepted.append(accepted)
        self.chosen.append(chosen)

    def merge(self, other: Stats) -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.chosen += other.chosen

    def summary(self) -> str:
        proposed, accepted = sum(self.proposed), sum(self.accepted)
        rate = accepted / proposed if proposed else float("nan")
        tokens = sum(self.chosen) / self.forwards if self.forwards else float("nan")
        return (
            f"{self.forwards} verification forwards, {accepted}/{proposed} proposals accepted "
            f"({rate:.2f}), {tokens:.2f} tokens per forward"
        )


def decode(model, decoder, logits, position: int, speculation: Speculation, step_logits, device):
    """The decode loop with speculation: from the prefill's last logits (`logits`), whose
    choice goes to `position`. Fills `step_logits` row per choice; returns Stats."""
    stats = Stats()
    step_logits[0] = logits
    token = decoder.step(logits)

    def keep(row: torch.Tensor) -> None:
        step_logits[len(decoder.tokens)] = row

    while token is not None:
        with profiling.region("verification step"):  # a --profile trace's range per forward
            proposal, dists = proposals(decoder, speculation)
            block = torch.tensor([[token, *proposal]], dtype=torch.long, device=device)
            rows = model(block, block_start(position))[0]  # [1 + len(proposal), vocab]
            before = len(decoder.tokens)
            accepted, token = verify(decoder, rows, proposal, dists, keep)
            stats.add(len(proposal), accepted, len(decoder.tokens) - before)
            position = next_position(position, accepted, block.shape[1])
    return stats


def proposals(decoder, speculation: Speculation) -> tuple[list[int], list | None]:
    """The draft's proposals after the decoder's tokens, with the distributions they were
    drawn from (None: a deterministic draft), no more than the steps left, and with a
    constraint no further than its language allows (the matcher's state rolled back after
    the check); teacher-forced, the forced tokens."""
    remaining = decoder.max_new_tokens - len(decoder.tokens)
    if decoder.forced_tokens is not None:  # teacher forcing: the forced sequence proposes
        done = len(decoder.tokens)
        return list(decoder.forced_tokens[done : done + min(speculation.k, remaining)]), None
    history = [*decoder.prompt, *decoder.tokens]
    proposal, dists = speculation.draft.drafted(history, speculation.k, decoder)
    if decoder.constraint is not None:  # constrained: only the prefix the language allows
        remaining = min(remaining, decoder.constraint.viable(proposal))
    return proposal[:remaining], None if dists is None else dists[:remaining]


def verify(decoder, rows: torch.Tensor, proposal, dists=None, keep=None) -> tuple[int, int | None]:
    """The decoder's choices from a verification forward's rows (row j: after the block's
    first j + 1 tokens), `keep(row)` called with each row it reads; (proposals accepted, the
    token to feed next, or None: the sequence stopped). Row 0 first, then row j + 1 while
    choice j equals proposal j: the first that differs replaces its proposal and ends the
    step; after all of them, the last row's choice is the bonus token. A choice that stops
    the sequence (an end of sequence, a stop string, the last step) still counts its proposal
    accepted when the token it feeds is that proposal (teacher-forced: the forced one, as at
    every step). The choice: the decoder's own (greedy, or a deterministic draft's sampling),
    or with `dists` (the distributions a sampling draft drew the proposals from) the rejection
    sampler's. The generate loop (`decode`) and the serving engine both verify here."""
    accepted, token = 0, None
    sampled = dists is not None and decoder.sampling is not None
    for j in range(rows.shape[0]):
        row = verification_row(rows, j)
        if keep is not None:
            keep(row)
        if sampled and (j < len(proposal) or dists):
            p, position = decoder.distribution(row), len(decoder.history())
            u = sampling.uniform(decoder.seed, position)
            if j < len(proposal):
                u_accept = sampling.uniform(decoder.seed, position, sampling.ACCEPT_DOMAIN)
                choice = rejection_step(p, dists[j], proposal[j], u_accept, u)
            else:
                choice = draw(bonus_distribution(p, dists[-1]), u)
            token = decoder.take(choice)
        else:
            token = decoder.step(row)
        if token is None:  # stopped on this choice: a proposal equal to it was accepted
            kept = j < len(proposal) and verified(decoder.history()[-1], proposal[j], row)
            return accepted + int(kept), None
        if j < len(proposal) and verified(token, proposal[j], row):
            accepted += 1
            continue
        break  # a rejected proposal (its replacement is `token`), or the bonus token
    return accepted, token


# The loop's four decisions, each a seam the speculation mutations patch (test_speculative,
# test_llama's test_a_speculation_bug_fails_the_goldens). `verify` reads the middle two on both
# paths; `block_start` and `next_position` are generate's alone (the serving engine places
# its pieces with ServingEngine._positions and _accepted_end).


def block_start(position: int) -> int:
    """The position of the block's first token (the token just chosen)."""
    return position


def verification_row(rows: torch.Tensor, j: int) -> torch.Tensor:
    """The logits that choose the token after the block's first j + 1 tokens: row j."""
    return rows[j]


def verified(choice: int, proposed: int, row: torch.Tensor) -> bool:
    """A proposal is accepted iff the decoder chose it from its row (greedy: the argmax, the
    first of equal maxima; sampling: its draw with the position's uniform)."""
    return choice == proposed


def next_position(position: int, accepted: int, block: int) -> int:
    """Where the next block starts: after the fed token and the accepted proposals (the
    rejected ones' keys and values are overwritten, never read)."""
    return position + accepted + 1


# --- the rejection sampler's two terms, for a deterministic draft ------------------------


def acceptance(ids: np.ndarray, probs: np.ndarray, x: int) -> float:
    """min(1, p(x) / q(x)) with q the point mass at the proposal x: p(x)."""
    hit = ids == x
    return float(probs[hit].sum()) if hit.any() else 0.0


def residual(ids: np.ndarray, probs: np.ndarray, x: int) -> np.ndarray:
    """max(0, p - q), normalized: p without x (the distribution drawn from on rejection)."""
    rest = np.where(ids == x, 0.0, probs)
    total = rest.sum()
    return rest / total if total > 0 else rest


def emitted(ids: np.ndarray, probs: np.ndarray, x: int) -> np.ndarray:
    """The emitted token's distribution: accept x with `acceptance`, else draw `residual`."""
    a = acceptance(ids, probs, x)
    return np.where(ids == x, a, 0.0) + (1.0 - a) * residual(ids, probs, x)


# --- the rejection sampler, for a draft that samples ---------------------------------------
# A distribution is (kept ids, probabilities), as sampling.processed returns it. Each function
# below is a seam the speculation mutations patch (test_speculative_sampling).


def probability(dist, x: int) -> float:
    """dist's probability of token x (0 where it is not kept)."""
    ids, probs = dist
    hit = ids == x
    return float(probs[hit].sum()) if hit.any() else 0.0


def accept_probability(p, q, x: int) -> float:
    """min(1, p(x) / q(x)) for a proposal x drawn from q (so q(x) > 0)."""
    return min(1.0, probability(p, x) / probability(q, x))


def residual_distribution(p, q):
    """max(0, p - q), normalized, over p's ids: what a rejection draws from. A new array: p
    is the target's, read again. (Where p <= q everywhere they are equal and nothing is ever
    rejected: p.)"""
    ids, probs = p
    q_ids, q_probs = q
    order = np.argsort(q_ids, kind="stable")
    sorted_ids = q_ids[order]
    at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    q_at = np.where(sorted_ids[at] == ids, q_probs[order][at], 0.0)
    rest = np.maximum(probs - q_at, 0.0)
    total = rest.sum()
    return (ids, rest / total) if total > 0 else p


def bonus_distribution(p, q):
    """What the bonus token (after every proposal was accepted) is drawn from: the target's
    last row, p (q: the last proposal's draft distribution, not used)."""
    return p


def draw(dist, u: float) -> int:
    """The token whose cumulative interval, in id order, holds u: the inverse CDF, without
    normalizing (a distribution that does not sum to 1 is drawn as it is, wrongly)."""
    ids, probs = dist
    order = np.argsort(ids, kind="stable")
    index = int(np.searchsorted(np.cumsum(probs[order]), u, side="right"))
    return int(ids[order][min(index, len(ids) - 1)])


def rejection_step(p, q, x: int, u_accept: float, u_residual: float) -> int:
    """The token emitted for proposal x (drawn from q) against the target's p: x if u_accept
    falls below the acceptance probability, else a draw from the residual."""
    if u_accept < accept_probability(p, q, x):
        return x
    return draw(residual_distribution(p, q), u_residual)


def emitted_distribution(p, q) -> dict[int, float]:
    """The exact distribution of rejection_step's token when x is drawn from q: the sum over
    x of q(x) (a(x) at x + (1 - a(x)) residual), from the functions above as they are (each
    rejection's residual computed anew, as the sampler does). Equal to p when they are
    right."""
    emitted: dict[int, float] = {}
    for x, qx in zip(q[0].tolist(), q[1].tolist(), strict=True):
        a = accept_probability(p, q, x)
        emitted[x] = emitted.get(x, 0.0) + qx * a
        r_ids, r_probs = residual_distribution(p, q)
        for t, r in zip(r_ids.tolist(), r_probs.tolist(), strict=True):
            emitted[t] = emitted.get(t, 0.0) + qx * (1.0 - a) * r
    return emitted
