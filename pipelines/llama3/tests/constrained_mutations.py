"""Planted constrained-decoding bugs, each a function that patches one through `monkeypatch`
(pytest's, or its `context()`): test_constrained's checks catch each one (its matrix), and the
constrained goldens catch those a golden can see (test_llama_sampling).
"""

from __future__ import annotations

import numpy as np
import torch

from pipelines.llama3 import constrained, sampling, serving, speculative
from pipelines.llama3.decoder import Decoder


def _eos_early(monkeypatch) -> None:
    real = constrained.allowed_ids

    def allowed_ids(matcher):
        return np.union1d(real(matcher), matcher.vocabulary.eos_ids)

    monkeypatch.setattr(constrained, "allowed_ids", allowed_ids)


def _eos_never(monkeypatch) -> None:
    real = constrained.allowed_ids

    def allowed_ids(matcher):
        ids = real(matcher)
        kept = np.setdiff1d(ids, matcher.vocabulary.eos_ids)
        return kept if len(kept) else ids  # a mask with nothing left would error at once

    monkeypatch.setattr(constrained, "allowed_ids", allowed_ids)


def _off_by_one(monkeypatch) -> None:
    real = constrained.allowed_ids
    monkeypatch.setattr(constrained, "allowed_ids", lambda matcher: real(matcher) + 1)


def _mask_after_sampling(monkeypatch) -> None:
    """Draw from the unmasked distribution, then mend a refused draw to the masked argmax."""
    real_choose = Decoder.choose

    def choose(self, logits):
        if self.constraint is None or self.sampling is None:
            return real_choose(self, logits)
        history = self.history()
        token = sampling.sample(logits, self.sampling, self.seed, history, len(history))
        if token in set(self.constraint.allowed().tolist()):
            return token
        return int(torch.argmax(self.masked(logits)))

    monkeypatch.setattr(Decoder, "choose", choose)


def _shared_mask(monkeypatch) -> None:
    """Every request of a batch gets the first request's matcher."""
    real, first = constrained.matcher, []

    def matcher(constraint, tokenizer):
        if constraint is None:
            return None
        if not first:
            first.append(real(constraint, tokenizer))
        return first[0]

    monkeypatch.setattr(constrained, "matcher", matcher)


def _no_rollback(monkeypatch) -> None:
    monkeypatch.setattr(constrained, "rollback_proposals", lambda matcher, taken: None)


def _served_proposals_kept(monkeypatch) -> None:
    """The serving engine's proposals are not rolled back out of the matcher (generate's are):
    a divergence of the served path that only a constrained, speculating serving sees."""
    real = serving.ServingEngine._propose

    def _propose(self, seq):
        rollback = constrained.rollback_proposals
        constrained.rollback_proposals = lambda matcher, taken: None
        try:
            return real(self, seq)
        finally:
            constrained.rollback_proposals = rollback

    monkeypatch.setattr(serving.ServingEngine, "_propose", _propose)


def _draft_unmasked(monkeypatch) -> None:
    """The draft proposes from its unmasked distribution (the verification still masks)."""
    monkeypatch.setattr(
        speculative.ModelDraft, "_masked_run", lambda self, h, k, d, choose: self._run(h, k, choose)
    )


MUTATIONS = {
    "eos_before_complete": _eos_early,
    "eos_never": _eos_never,
    "one_id_off": _off_by_one,
    "mask_after_sampling": _mask_after_sampling,
    "another_requests_mask": _shared_mask,
    "state_not_rolled_back": _no_rollback,
    "served_proposals_kept": _served_proposals_kept,
    "draft_unmasked": _draft_unmasked,
}
