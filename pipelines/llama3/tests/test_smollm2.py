"""The real-weights lane: SmolLM2-135M-Instruct Q4_1 against transformers on the same GGUF.

Slow (seconds per test on 2 cores): loads the engine twice and transformers once.
"""

import os
import pathlib

import pytest
import torch

from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.tests.recompute import greedy_decode_without_cache
from testing import gguf_reader

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
PARITY_PROMPT = "The quick brown fox jumps over the lazy dog. Then it runs into the forest and"


@pytest.fixture(scope="module")
def engine() -> Llama3Engine:
    return Llama3Engine.from_gguf(smollm2_gguf())


@pytest.fixture(scope="module")
def transformers_model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    gguf_reader.install()  # transformers parses the vocabulary: 4.5x faster
    folder = tmp_path_factory.mktemp("smollm2")
    link = folder / smollm2_gguf().name
    link.symlink_to(pathlib.Path(smollm2_gguf()).resolve())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=link.name, dtype=torch.float32)
    return model.eval()


def test_capital_of_france_is_paris(engine: Llama3Engine) -> None:
    ids = engine.tokenizer.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]
    out = engine.generate(ids, 2)
    assert engine.tokenizer.decode(out.tokens).startswith(" Paris")


def test_tokenizer_splits_digits_like_smollm(engine: Llama3Engine) -> None:
    ids = engine.tokenizer.encode("in 2024", add_bos=False)
    assert [engine.tokenizer.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4"]
    assert engine.tokenizer.encode("<|im_start|>user", add_bos=False)[0] == 1


def test_logits_match_transformers_on_16_tokens(engine: Llama3Engine, transformers_model) -> None:
    ids = engine.tokenizer.encode(PARITY_PROMPT)[:16]
    assert len(ids) == 16
    ours = engine.forward_logits(ids)
    with torch.inference_mode():
        theirs = transformers_model(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max() <= 2e-3


def test_greedy_tokens_match_transformers_for_32_steps(
    engine: Llama3Engine, transformers_model
) -> None:
    ids = engine.tokenizer.encode("The capital of France is")
    ours = engine.generate(ids, 32, stop_on_eos=False).tokens
    # transformers' greedy choice after each of our prefixes; equal at every step means its own
    # greedy run is the same sequence (and one forward is much faster than generate()).
    with torch.inference_mode():
        logits = transformers_model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1 :]
    assert logits.argmax(-1).tolist() == ours


def test_kv_cache_decode_equals_recomputation(engine: Llama3Engine) -> None:
    ids = engine.tokenizer.encode("The capital of France is")
    cached = engine.generate(ids, 32, stop_on_eos=False)
    recomputed = greedy_decode_without_cache(engine, ids, 32)
    assert cached.tokens == recomputed.tokens
    # Bitwise equal in practice (6.4e-5 before recompute used the cached run's row groups).
    assert (cached.logits - recomputed.logits).abs().max() <= 1e-5


def test_bfloat16_agrees_with_float32_on_top1(engine: Llama3Engine) -> None:
    bf16 = Llama3Engine.from_gguf(smollm2_gguf(), dtype=torch.bfloat16)
    agree = total = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        greedy = engine.generate(ids, 16, stop_on_eos=False)
        # Teacher-forced on the float32 tokens, so one early flip does not derail the rest.
        logits = bf16.forward_logits(ids + greedy.tokens[:-1])[len(ids) - 1 :]
        agree += int((logits.argmax(-1) == torch.tensor(greedy.tokens)).sum())
        total += len(greedy.tokens)
    assert agree / total >= 0.95


def test_a_self_draft_keeps_the_tokens_and_is_accepted_as_deep_as_it_is(capsys) -> None:
    """Self-speculation (speculative.self_draft): SmolLM2's first layers and its head propose,
    the whole model verifies. The tokens are decoding's without speculation whatever the
    draft; a draft of all 30 layers is the model itself and is accepted almost always (the
    draft's cache and positions are right), the first 4 layers hardly ever (an untrained early
    exit: measured 1 to 2% for 2 to 12 layers, 14% for 24)."""
    from pipelines.llama3.speculative import Speculation, self_draft

    target = Llama3Engine.from_gguf(smollm2_gguf(), mode="quantized")
    prompt = target.tokenizer.encode("The capital of France is")
    reference = target.generate(prompt, 24, stop_on_eos=False)
    rates = {}
    for layers in (4, 30):
        draft = self_draft(smollm2_gguf(), layers, mode="quantized")
        out = target.generate(prompt, 24, stop_on_eos=False, speculation=Speculation(draft, 4))
        assert out.tokens == reference.tokens, layers
        rates[layers] = sum(out.speculation.accepted) / sum(out.speculation.proposed)
        with capsys.disabled():
            print(f"\nSmolLM2 self-draft of {layers} layers: {out.speculation.summary()}")
    assert rates[30] > 0.9, rates
