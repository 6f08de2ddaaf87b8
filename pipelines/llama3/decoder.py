"""The decode step: which token a sequence takes next, and when it stops.

One place for the choice that `Llama3Engine.generate` and the serving engine
(`serving.ServingEngine`) both make after each forward pass, after Meta's llama3
`generation.py` (its `sample_top_p`/argmax and `stop_tokens`):

- **greedy**: the step's token is the argmax of its logits (the first of equal maxima);
- **sampling**: with `sampling` (sampling.SamplerSettings), the token drawn from the step's
  processed distribution by the counter-based generator at the token's position, keyed by
  the request's seed (or one of the system's, drawn here); the penalties' history is the
  prompt and the tokens fed so far;
- **teacher forcing**: with `forced_tokens`, step i feeds forced_tokens[i] to the next step
  instead of the choice, and no end-of-sequence id stops it: the logits of every step follow
  the sequence being checked, while `tokens` keeps the model's own choice; there are exactly
  `max_new_tokens` forced tokens (another count is refused, naming both);
- **constraints**: with `constraint` (constrained.Matcher: a JSON schema, regex, choice or
  grammar), every token outside the language gets logit -inf before the choice (greedy or
  sampled: the distribution restricted and renormalized), end-of-sequence ids only where the
  text is a member; the matcher takes each fed token (a forced one too, which must be in the
  language); with `record_allowed`, `allowed` keeps each step's allowed ids (a numpy array
  of up to the vocabulary's size a step: for checks, not for serving);
- **stop conditions**: `max_new_tokens` steps (`finish_reason` "length"), a choice among
  `eos_ids` (the checkpoint's: `Llama3Engine.eos_ids`), or a choice after which the generated
  text (`detokenize` of the tokens so far) contains one of `stop_strings` (both "stop"); the
  token that ends the sequence is kept in `tokens`, as OpenAI's servers count it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

import torch

from pipelines.llama3 import constrained
from pipelines.llama3 import sampling as sampling_lib


@dataclasses.dataclass
class Decoder:
    """One sequence's decode state: `step(logits)` per forward pass, until it returns None."""

    max_new_tokens: int
    eos_ids: Collection[int] = frozenset()
    forced_tokens: Sequence[int] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # the choice of each step
    sampling: sampling_lib.SamplerSettings | None = None  # None: greedy
    prompt: Sequence[int] = ()  # the request's prompt: penalties' history, draw positions
    seed: int | None = None  # the draws' key: the settings' seed, else the system's
    stop_strings: Sequence[str] = ()  # text that ends the sequence once generated
    detokenize: Callable[[list[int]], str] | None = None  # tokens -> text, for stop_strings
    finish_reason: str | None = None  # once stopped: "length" or "stop"
    constraint: constrained.Matcher | None = None  # the request's language, if any
    record_allowed: bool = False  # constrained: keep each step's allowed ids in `allowed`
    allowed: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stop_strings and self.detokenize is None:
            raise ValueError("stop strings need the checkpoint's tokenizer to read the text")
        if any(not stop for stop in self.stop_strings):
            raise ValueError("an empty stop string would stop every sequence at once")
        if self.sampling is not None and self.seed is None:
            seed = self.sampling.seed
            self.seed = sampling_lib.system_seed() if seed is None else seed
        if self.forced_tokens is not None:
            # teacher forcing runs the forced sequence to its end (no early stop): one step per
            # forced token, the same rule for generate and the serving engine
            if len(self.forced_tokens) != self.max_new_tokens:
                raise ValueError(
                    f"{len(self.forced_tokens)} forced tokens for max_new_tokens "
                    f"{self.max_new_tokens}: teacher forcing feeds one per step, so give "
                    "as many forced tokens as steps"
                )
            self.eos_ids, self.stop_strings = frozenset(), ()
        if self.constraint is not None and self.forced_tokens is None and not self.eos_ids:
            raise ValueError(
                "a constrained sequence ends with an end-of-sequence id once its text is "
                "complete: it cannot ignore them (ignore_eos / stop_on_eos=False)"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")

    def history(self) -> list[int]:
        """The prompt and the tokens fed so far: the penalties' history; its length is the
        position of this step's token (where its uniforms are drawn)."""
        step = len(self.tokens)
        fed = self.tokens if self.forced_tokens is None else self.forced_tokens[:step]
        return [*self.prompt, *fed]

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the choice is made from: constrained, -inf outside the language."""
        if self.constraint is None:
            return logits
        mask = self.constraint.mask(logits.shape[-1]).to(logits.device)
        return constrained.apply_mask(logits, mask)

    def distribution(self, logits: torch.Tensor) -> tuple:
        """(kept ids, probabilities): the processed distribution this step draws from."""
        return sampling_lib.processed(self.masked(logits), self.sampling, self.history())

    def choose(self, logits: torch.Tensor) -> int:
        """This step's token from its logits [vocab]: greedy, or drawn at its position."""
        logits = self.masked(logits)
        if self.sampling is None:
            return int(torch.argmax(logits))
        history = self.history()
        return sampling_lib.sample(logits, self.sampling, self.seed, history, len(history))

    def step(self, logits: torch.Tensor) -> int | None:
        """Record this step's choice; the token to feed the next step, or None: stop."""
        return self.take(self.choose(logits))

    def take(self, token: int) -> int | None:
        """Record `token` as this step's choice (made by `choose`, or by speculative
        decoding's rejection sampler); the token to feed the next step, or None: stop."""
        self.tokens.append(token)
        step = len(self.tokens) - 1
        if self.constraint is not None:
            fed = token if self.forced_tokens is None else self.forced_tokens[step]
            if self.record_allowed:
                # the ids this step's mask allowed (masked(): the same seam)
                self.allowed.append(constrained.allowed_ids(self.constraint))
            self.constraint.consume(fed)
        if self.forced_tokens is not None:
            if step == self.max_new_tokens - 1:
                self.finish_reason = "length"
                return None
            return self.forced_tokens[step]
        if token in self.eos_ids or self._stop_string_seen():
            self.finish_reason = "stop"
            return None
        if step == self.max_new_tokens - 1:
            self.finish_reason = "length"
            return None
        return token

    def _stop_string_seen(self) -> bool:
        if not self.stop_strings:
            return False
        # the whole text each step: a stop string may span tokens, and one seen earlier would
        # have stopped the sequence then
        text = self.detokenize(self.tokens)
        return any(stop in text for stop in self.stop_strings)
