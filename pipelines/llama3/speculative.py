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

Sampling: the drafts here are deterministic (a proposal x is a point mass q = 1 at x), for which
rejection sampling accepts x with probability min(1, p(x) / q(x)) = p(x) and on rejection draws
from the residual max(0, p - q), normalized: p without x. The decoder's draw with the position's
uniform u realizes exactly that: it accepts iff its draw pick(p, u) is x (probability p(x)), and
its draw is otherwise distributed as the residual (`acceptance` and `residual` below are the two
terms; `emitted` combines them, equal to p: test_speculative). So the emitted tokens are the
target's distribution, and the same tokens as sampling without speculation, draw for draw.

Drafts: `NgramDraft` (prompt lookup, model-free): the tokens that followed the most recent
earlier occurrence of the history's last n tokens (n from `max_n` down to 1); `ModelDraft`:
another engine's greedy tokens, its KV cache kept across steps (`self_draft`: the target
checkpoint's first layers and its head, loaded as a model of its own). Teacher-forced
(`forced_tokens`), the forced sequence is the draft: the decoder feeds every forced token, so
every proposal is accepted and each block is a verification forward over the sequence being
checked, which is how the golden lanes hold speculation to the goldens (test_llama_speculative).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class NgramDraft:
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


class ModelDraft:
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
            proposal = [int(torch.argmax(logits))]
            for i in range(k - 1):
                token = torch.tensor([[proposal[-1]]], dtype=torch.long, device=device)
                proposal.append(int(torch.argmax(model(token, len(history) + i)[0, -1])))
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


def self_draft(path, layers: int, mode: str = "eager") -> ModelDraft:
    """The checkpoint's first `layers` layers, its final norm and its head, as a draft (0: the
    embedding straight into the head)."""
    from pipelines.llama3.engine import Llama3Engine  # engine.py imports this module

    return ModelDraft(Llama3Engine.from_gguf(path, mode=mode, overrides={"n_layers": layers}))


@dataclasses.dataclass(frozen=True)
class Speculation:
    """`draft` proposes up to `k` tokens per step (1 to 8)."""

    draft: NgramDraft | ModelDraft = NgramDraft()
    k: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 8:
            raise ValueError(f"speculation k={self.k} must lie in 1..8")


@dataclasses.dataclass
class Stats:
    """Per verification forward: how many tokens the draft proposed and how many were kept."""

    proposed: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)

    @property
    def forwards(self) -> int:
        return len(self.proposed)

    def summary(self) -> str:
        proposed, accepted = sum(self.proposed), sum(self.accepted)
        rate = accepted / proposed if proposed else float("nan")
        tokens = (accepted + self.forwards) / self.forwards if self.forwards else float("nan")
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
    while token is not None:
        remaining = decoder.max_new_tokens - len(decoder.tokens)
        if decoder.forced_tokens is not None:  # teacher forcing: the forced sequence proposes
            done = len(decoder.tokens)
            proposal = list(decoder.forced_tokens[done : done + speculation.k])
        else:
            history = [*decoder.prompt, *decoder.tokens]
            proposal = speculation.draft.propose(history, speculation.k)
        proposal = proposal[:remaining]
        block = torch.tensor([[token, *proposal]], dtype=torch.long, device=device)
        rows = model(block, block_start(position))[0]  # [1 + len(proposal), vocab]
        accepted = 0
        for j in range(rows.shape[0]):
            row = verification_row(rows, j)
            step_logits[len(decoder.tokens)] = row
            token = decoder.step(row)
            if token is None:
                break
            if j < len(proposal) and verified(token, proposal[j], row):
                accepted += 1
                continue
            break  # a rejected proposal (its replacement is `token`), or the bonus token
        stats.proposed.append(len(proposal))
        stats.accepted.append(accepted)
        position = next_position(position, accepted, block.shape[1])
    return stats


# The loop's four decisions, each a seam the speculation mutations patch (test_speculative,
# test_llama's test_a_speculation_bug_fails_the_goldens).


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
