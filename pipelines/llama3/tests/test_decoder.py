"""The one decoder that generate and the serving engine share (pipelines/llama3/decoder.py)."""

from __future__ import annotations

import pytest
import torch

from pipelines.llama3.decoder import Decoder


def _logits(*best: int, vocab: int = 8) -> list[torch.Tensor]:
    """One step's logits per id in `best`, that id the largest."""
    rows = []
    for token in best:
        row = torch.zeros(vocab)
        row[token] = 1.0
        rows.append(row)
    return rows


def _run(decoder: Decoder, steps: list[torch.Tensor]) -> list[int | None]:
    fed = []
    for logits in steps:
        fed.append(decoder.step(logits))
        if fed[-1] is None:
            break
    return fed


def test_greedy_feeds_its_choice_and_stops_after_max_new_tokens() -> None:
    decoder = Decoder(3)
    assert _run(decoder, _logits(5, 2, 7, 1)) == [5, 2, None]
    assert decoder.tokens == [5, 2, 7]


def test_an_end_of_sequence_choice_stops_and_is_kept() -> None:
    decoder = Decoder(6, eos_ids={2})
    assert _run(decoder, _logits(5, 2, 7)) == [5, None]
    assert decoder.tokens == [5, 2]


def test_teacher_forcing_feeds_the_forced_tokens_and_ignores_the_end_of_sequence() -> None:
    decoder = Decoder(99, eos_ids={2}, forced_tokens=[4, 4, 4])
    assert decoder.max_new_tokens == 3  # one step per forced token
    assert _run(decoder, _logits(2, 2, 2, 2)) == [4, 4, None]
    assert decoder.tokens == [2, 2, 2]  # the model's own choice, recorded


def test_equal_maxima_choose_the_first_id() -> None:
    assert Decoder(1).choose(torch.tensor([0.0, 3.0, 3.0])) == 1


def test_no_step_is_refused() -> None:
    with pytest.raises(ValueError, match="max_new_tokens=0 must be at least 1"):
        Decoder(0)
