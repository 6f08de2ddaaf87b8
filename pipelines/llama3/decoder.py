"""The decode step: which token a sequence takes next, and when it stops.

One place for the choice that `Llama3Engine.generate` and the serving engine
(`serving.ServingEngine`) both make after each forward pass, after Meta's llama3
`generation.py` (its `sample_top_p`/argmax and `stop_tokens`):

- **greedy**: the step's token is the argmax of its logits (the first of equal maxima);
- **teacher forcing**: with `forced_tokens`, step i feeds forced_tokens[i] to the next step
  instead of the choice, and no end-of-sequence id stops it: the logits of every step follow
  the sequence being checked, while `tokens` keeps the model's own choice;
- **stop conditions**: `max_new_tokens` steps, or a choice among `eos_ids` (the checkpoint's:
  `Llama3Engine.eos_ids`).

A sampler plugs in at `choose`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch


@dataclasses.dataclass
class Decoder:
    """One sequence's decode state: `step(logits)` per forward pass, until it returns None."""

    max_new_tokens: int
    eos_ids: Collection[int] = frozenset()
    forced_tokens: Sequence[int] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # the choice of each step

    def __post_init__(self) -> None:
        if self.forced_tokens is not None:
            # teacher forcing runs the forced sequence to its end: no early stop
            self.max_new_tokens, self.eos_ids = len(self.forced_tokens), frozenset()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")

    def choose(self, logits: torch.Tensor) -> int:
        """This step's token from its logits [vocab]: greedy."""
        return int(torch.argmax(logits))

    def step(self, logits: torch.Tensor) -> int | None:
        """Record this step's choice; the token to feed the next step, or None: stop."""
        token = self.choose(logits)
        self.tokens.append(token)
        step = len(self.tokens) - 1
        if step == self.max_new_tokens - 1:
            return None
        if self.forced_tokens is not None:
            return self.forced_tokens[step]
        return None if token in self.eos_ids else token
