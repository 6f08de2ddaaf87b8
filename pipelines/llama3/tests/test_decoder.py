"""The one decoder that generate and the serving engine share (pipelines/llama3/decoder.py)."""

from __future__ import annotations

import pytest
import torch

from pipelines.llama3 import sampling
from pipelines.llama3.decoder import Decoder
from pipelines.llama3.sampling import SamplerSettings


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
    decoder = Decoder(3, eos_ids={2}, forced_tokens=[4, 4, 4])
    assert _run(decoder, _logits(2, 2, 2, 2)) == [4, 4, None]
    assert decoder.tokens == [2, 2, 2]  # the model's own choice, recorded
    # one step per forced token: another count is refused (generate ran len(forced) steps
    # and the serving engine max_new_tokens before)
    with pytest.raises(ValueError, match="3 forced tokens for max_new_tokens 99"):
        Decoder(99, eos_ids={2}, forced_tokens=[4, 4, 4])


def test_a_stop_string_stops_at_the_token_that_completes_it_and_says_why() -> None:
    """Letters a..h as tokens: "cd" spans two tokens and stops at the second ("stop"), with
    the token kept; without it max_new_tokens ends the run ("length"); teacher forcing runs
    to its end whatever the text holds."""
    letters = "abcdefgh"

    def detokenize(ids):
        return "".join(letters[i] for i in ids)

    stopped = Decoder(6, stop_strings=("cd",), detokenize=detokenize)
    assert _run(stopped, _logits(1, 2, 3, 4)) == [1, 2, None]
    assert (stopped.tokens, stopped.finish_reason) == ([1, 2, 3], "stop")
    plain = Decoder(2, stop_strings=("zz",), detokenize=detokenize)
    assert _run(plain, _logits(2, 3)) == [2, None]
    assert plain.finish_reason == "length"
    forced = Decoder(3, forced_tokens=[2, 3, 4], stop_strings=("cd",), detokenize=detokenize)
    assert _run(forced, _logits(2, 3, 4)) == [2, 3, None]
    assert forced.finish_reason == "length"
    eos = Decoder(4, eos_ids={5})
    assert _run(eos, _logits(1, 5)) == [1, None]
    assert eos.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop strings need the checkpoint's tokenizer"):
        Decoder(4, stop_strings=("cd",))


def test_an_end_of_sequence_or_stop_string_on_the_last_step_says_stop() -> None:
    """The last step's choice ends the run either way; an end-of-sequence id or a completed
    stop string there is still "stop" (an OpenAI client reads finish_reason), "length" only
    where neither. Planted, the step count checked first: "length" for both, and the tokens
    unchanged, so no golden lane saw it (a mutation sweep's survivor)."""
    letters = "abcdefgh"
    eos = Decoder(2, eos_ids={5})
    assert _run(eos, _logits(1, 5)) == [1, None]
    assert (eos.tokens, eos.finish_reason) == ([1, 5], "stop")
    stopped = Decoder(
        2, stop_strings=("bc",), detokenize=lambda ids: "".join(letters[i] for i in ids)
    )
    assert _run(stopped, _logits(1, 2)) == [1, None]
    assert (stopped.tokens, stopped.finish_reason) == ([1, 2], "stop")
    plain = Decoder(2, eos_ids={5})
    assert _run(plain, _logits(1, 2)) == [1, None]
    assert plain.finish_reason == "length"


def test_equal_maxima_choose_the_first_id() -> None:
    assert Decoder(1).choose(torch.tensor([0.0, 3.0, 3.0])) == 1


def test_no_step_is_refused() -> None:
    with pytest.raises(ValueError, match="max_new_tokens=0 must be at least 1"):
        Decoder(0)


def _sampled(seed: int | None, prompt=(1, 2), forced=None, steps: int = 12) -> Decoder:
    settings = SamplerSettings(temperature=1.0, seed=seed, repetition_penalty=1.2)
    decoder = Decoder(steps, forced_tokens=forced, sampling=settings, prompt=list(prompt))
    flat = torch.zeros(64)
    for _ in range(decoder.max_new_tokens):
        decoder.step(flat)
    return decoder


def test_a_seed_gives_the_same_draws_and_another_seed_others() -> None:
    assert _sampled(5).tokens == _sampled(5).tokens
    assert _sampled(5).tokens != _sampled(6).tokens


def test_a_draw_is_keyed_by_its_position_not_by_the_step() -> None:
    """The same step after a longer prompt is another position: another uniform."""
    assert _sampled(5, prompt=(1, 2)).tokens != _sampled(5, prompt=(1, 2, 3)).tokens
    decoder = _sampled(5, prompt=(1, 2), steps=1)
    position = 2  # the first drawn token follows the two prompt tokens
    u = float(sampling.uniform(5, position))
    ids, probs = sampling.processed(torch.zeros(64), decoder.sampling, [1, 2])
    assert decoder.tokens == [int(sampling.pick(ids, probs, u))]


def test_seed_zero_is_a_seed() -> None:
    """SamplerSettings(seed=0) is a valid seed: its draws are the same on every run. Planted,
    `seed or system_seed()` (0 taken for no seed): the draws changed from run to run, and the
    goldens' seeds (11 to 16) never saw it (a mutation sweep's survivor)."""
    runs = [_sampled(0) for _ in range(3)]
    assert {d.seed for d in runs} == {0}
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].tokens != _sampled(1).tokens


def test_an_unseeded_request_draws_its_seed_from_the_system() -> None:
    seeds = {_sampled(None, steps=1).seed for _ in range(4)}
    assert len(seeds) == 4  # 64 random bits each: equal seeds have chance 6/2^64


def test_teacher_forcing_penalizes_the_forced_history() -> None:
    """The penalties' history is what was fed: the prompt and the forced tokens, not the draws.
    Tokens 3 and 7 lead every row (logit 6; the rest 0): the forced 3s push 3 down (repetition
    1.5, presence 2, frequency 1 per time seen), so a correct decoder draws 7 at nearly every
    step, where a history of the model's own draws penalizes 7 instead, and the prompt alone
    penalizes neither (planted, each: the draws differ)."""
    settings = SamplerSettings(
        temperature=1.0,
        seed=5,
        repetition_penalty=1.5,
        presence_penalty=2.0,
        frequency_penalty=1.0,
    )
    prompt, forced = [1, 2], [3] * 8
    row = torch.zeros(16)
    row[3] = row[7] = 6.0
    for seed in (5, 6, 7):
        decoder = Decoder(8, forced_tokens=forced, sampling=settings, prompt=prompt, seed=seed)
        for _ in range(decoder.max_new_tokens):
            decoder.step(row)
        expected = []
        for step in range(len(forced)):
            history = [*prompt, *forced[:step]]
            ids, probs = sampling.processed(row, settings, history)
            u = float(sampling.uniform(seed, len(history)))
            expected.append(int(sampling.pick(ids, probs, u)))
        assert decoder.tokens == expected, seed
        assert expected[1:].count(7) >= 6, expected  # the penalties bite
