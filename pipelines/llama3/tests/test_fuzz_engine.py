"""Property-based tests of the engine over random tiny models, prompts and lengths.

The golden tests pin a handful of fixed checkpoints and prompts; a bug that only shows for some
shapes (one KV head per query head, head dim 2, three layers, a one-token prompt, a sequence
past some position) can slip between them. Here hypothesis draws the model shape (1-3 layers,
hidden size a multiple of 8, query heads dividing it with an even head dim, KV heads dividing
the query heads, MLP width, RoPE theta, Llama 3.1 RoPE scaling on or off, float32 or bfloat16
storage), the weights' seed, and random token sequences (up to 300 drawn tokens after a
filler of up to 5000 positions), and checks three properties:

- the KV-cache decode equals greedy decoding that recomputes every step from scratch
  (recompute.py), tokens and logits within 1e-5 as in test_engine.py;
- one full forward (`forward_logits`) of prompt + tokens equals the per-step logits of
  teacher-forced `generate` (`forced_tokens`): the same sequence run in one batch or step by step;
- every logit is finite, from `forward_logits` and `generate` alike.

Each property runs FUZZ_EXAMPLES (25) examples; a planted run stops at its first failing
example, unshrunk (testing/fuzz.py): 16 s for the file on the 2-core Xeon (101 s shrinking).
The runs use testing/fuzz.py's settings: deterministic (derandomize=True, no example
database), so CI sees the same examples every time; on a failure hypothesis prints the falsifying
example and a `@reproduce_failure(...)` line (print_blob=True) that replays exactly that example.

The `test_planted_*` tests prove each property can fail: each plants one bug with monkeypatch
and asserts the property raises, and that it found the bug within the first half of its
FUZZ_EXAMPLES examples. The decode property has one explicit example besides (LONG_DECODE:
decode steps past position 1000, which few drawn prompts reach).

Checkpoints are written by `write_tiny_llama` (tools/gen_tiny_model/tiny_llama.py, the writer
and weight recipe of the committed tiny checkpoints: their GGUF conventions, Q/K permutation, a
`rope_freqs` tensor; here its 263-token byte-level vocabulary, tied embeddings as the committed
checkpoints have). A file takes milliseconds. The properties
feed token ids directly; no text is tokenized. Each distinct model is written once per session.
"""

import dataclasses
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import example, given
from hypothesis import strategies as st

from pipelines.llama3 import Llama3Engine
from pipelines.llama3 import model as model_module
from pipelines.llama3.model import Transformer
from pipelines.llama3.tests.recompute import greedy_decode_without_cache
from testing.fuzz import first_failure, fuzz_settings
from tools.gen_tiny_model.tiny_llama import byte_vocab, write_tiny_llama

FUZZ_EXAMPLES = 25

# The bound test_engine.py puts on cached against recomputed logits (bitwise equal in practice).
DECODE_ATOL = 1e-5
# One full forward against teacher-forced steps: the kernels see different row counts (n rows
# at once vs one row per step), which rounds differently. Measured over 150 random models of
# this file's shapes: at most 2.8e-6 of the largest |logit| (logits reach ~50 here), so 1e-5 of
# it; the planted bug below moves logits by whole units.
FORWARD_RTOL_OF_MAX = 1e-5

TOKENS = byte_vocab().tokens
# Config overrides that switch Llama 3.1 RoPE scaling off although the file has rope_freqs
# (every file here has the tensor).
NO_ROPE_SCALING = {"rope_freq_factors": None, "rope_scaling_type": None}
STORAGE = {"float32": GGMLQuantizationType.F32, "bfloat16": GGMLQuantizationType.BF16}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One random model: its shape, storage, weight seed and whether RoPE scaling is on."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    dim: int
    ffn_dim: int
    rope_theta: float
    storage: str  # a key of STORAGE
    seed: int
    rope_scaling: bool


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    """Shapes under gen_tiny_model's rules: hidden % 8 == 0, n_heads | hidden with an even
    head dim, n_kv_heads | n_heads."""
    hidden = draw(st.sampled_from([8, 16, 24, 32, 48, 64]))
    n_heads = draw(st.sampled_from([h for h in range(1, hidden + 1) if hidden % (2 * h) == 0]))
    n_kv_heads = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    return ModelSpec(
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        dim=hidden,
        ffn_dim=draw(st.sampled_from([8, 32, 4 * hidden])),
        rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
        storage=draw(st.sampled_from(list(STORAGE))),
        seed=draw(st.integers(0, 2)),
        rope_scaling=draw(st.booleans()),
    )


token_ids = st.integers(0, len(TOKENS) - 1)
# Prompts of up to 300 drawn tokens after a filler of up to 5000 positions, so that the
# properties reach positions where rope bands, cache blocks and buffers turn (the filler is
# a fixed token pattern: drawing thousands of tokens would make hypothesis slow). Hypothesis
# draws a wide range's low end far more often than its high end: 4 of the 25 drawn decodes go
# past position 1000, so the decode property has an explicit example that does (LONG_DECODE).
MAX_OFFSET = 5000
LONG_OFFSET = 1000


def filler(offset: int) -> list[int]:
    return [(7 * i + 3) % len(TOKENS) for i in range(offset)]


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    offset = draw(st.one_of(st.just(0), st.integers(0, MAX_OFFSET)))
    drawn = draw(st.lists(token_ids, min_size=1, max_size=300))
    return filler(offset) + drawn


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run this module's tiny models on one thread. Their matmuls are far below the size where
    torch splits work between threads, but with 2 threads on 2 shared, busy cores each kernel
    call still waits on the other thread's spin-up and finish: measured 10-100 times slower
    (0.5-4 s per example instead of 15 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Llama3Engine]:
    """spec -> a fresh float32 engine of that model. Each model is written once per session;
    every example loads its own engine (milliseconds), so no KV cache, RoPE table or planted
    bug carries over from one example or test to the next."""
    folder = tmp_path_factory.mktemp("fuzz_checkpoints")
    written: dict[ModelSpec, pathlib.Path] = {}

    def engine(spec: ModelSpec) -> Llama3Engine:
        if spec not in written:
            written[spec] = folder / f"model_{len(written)}.gguf"
            head_dim = spec.dim // spec.n_heads
            write_tiny_llama(
                written[spec],
                seed=spec.seed,
                dim=spec.dim,
                n_layers=spec.n_layers,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                ffn_dim=spec.ffn_dim,
                tied=True,
                rope_theta=spec.rope_theta,
                context_length=131072,
                # Divisors of the frequencies from 1 to 8, Llama 3.1's range: the tensor turns
                # the file's rope scaling on (test_gguf_loader checks how it is read).
                rope_freqs=np.linspace(1.0, 8.0, head_dim // 2),
                weight_type=STORAGE[spec.storage],
            )
        overrides = None if spec.rope_scaling else NO_ROPE_SCALING
        return Llama3Engine.from_gguf(written[spec], overrides=overrides)

    return engine


# Each check fails through one assertion, so that hypothesis sees one bug per plant, not one
# per assertion line (it shrinks and reports each distinct failure separately).


def check_decode_equals_recomputation(
    engine: Llama3Engine, prompt: list[int], max_new_tokens: int
) -> None:
    cached = engine.generate(prompt, max_new_tokens, stop_on_eos=False)
    recomputed = greedy_decode_without_cache(engine, prompt, max_new_tokens)
    assert cached.logits.shape == (max_new_tokens, len(TOKENS))
    max_diff = float((cached.logits - recomputed.logits).abs().max())
    assert cached.tokens == recomputed.tokens and max_diff <= DECODE_ATOL, (
        f"cached decode {cached.tokens} vs recomputed {recomputed.tokens}, "
        f"max |logit difference| {max_diff:.3g} (bound {DECODE_ATOL})"
    )


def check_forward_equals_teacher_forced_steps(
    engine: Llama3Engine, prompt: list[int], forced: list[int]
) -> None:
    stepped = engine.generate(prompt, max_new_tokens=len(forced), forced_tokens=forced)
    # Row i of the steps follows prompt + forced[:i]; the full forward's row len(prompt) - 1 + i
    # sees the same prefix.
    full = engine.forward_logits(prompt + forced[:-1])[len(prompt) - 1 :]
    atol = FORWARD_RTOL_OF_MAX * float(full.abs().max())
    torch.testing.assert_close(stepped.logits, full, atol=atol, rtol=0)


def check_logits_are_finite(engine: Llama3Engine, prompt: list[int], max_new_tokens: int) -> None:
    full = engine.forward_logits(prompt)
    generated = engine.generate(prompt, max_new_tokens, stop_on_eos=False)
    full_rows = torch.isfinite(full).all(dim=-1).tolist()
    step_rows = torch.isfinite(generated.logits).all(dim=-1).tolist()
    assert all(full_rows) and all(step_rows), (
        f"rows with finite logits: full forward {full_rows}, decode steps {step_rows}"
    )


# Decode steps past position 1000 on a model with grouped KV heads and RoPE scaling, on
# every run whatever the drawn examples.
LONG_DECODE = dict(
    spec=ModelSpec(
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        dim=32,
        ffn_dim=32,
        rope_theta=500000.0,
        storage="float32",
        seed=0,
        rope_scaling=True,
    ),
    prompt=[*filler(LONG_OFFSET + 200), 5, 17, 99],
    max_new_tokens=4,
)


@fuzz_settings(FUZZ_EXAMPLES)
@given(spec=model_specs(), prompt=prompts(), max_new_tokens=st.integers(1, 12))
@example(**LONG_DECODE)
def test_kv_cache_decode_equals_recomputation(
    engines: Callable[..., Llama3Engine],
    spec: ModelSpec,
    prompt: list[int],
    max_new_tokens: int,
) -> None:
    check_decode_equals_recomputation(engines(spec), prompt, max_new_tokens)


@fuzz_settings(FUZZ_EXAMPLES)
@given(spec=model_specs(), prompt=prompts(), forced=st.lists(token_ids, min_size=1, max_size=12))
def test_full_forward_equals_teacher_forced_steps(
    engines: Callable[..., Llama3Engine],
    spec: ModelSpec,
    prompt: list[int],
    forced: list[int],
) -> None:
    check_forward_equals_teacher_forced_steps(engines(spec), prompt, forced)


@fuzz_settings(FUZZ_EXAMPLES)
@given(spec=model_specs(), prompt=prompts(), max_new_tokens=st.integers(1, 12))
def test_logits_are_finite(
    engines: Callable[..., Llama3Engine],
    spec: ModelSpec,
    prompt: list[int],
    max_new_tokens: int,
) -> None:
    check_logits_are_finite(engines(spec), prompt, max_new_tokens)


def _assert_property_fails(
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
    prop: Callable[..., None],
    engines: Callable[..., Llama3Engine],
    match: str,
) -> None:
    """Run a property with a planted bug: it fails within the first half of its FUZZ_EXAMPLES
    examples, with its own check's message `match`. (Not shrinking, hypothesis stops at
    FUZZ_EXAMPLES: `first <= FUZZ_EXAMPLES` could not fail; the half is a margin, so a
    strategy that drifts away from a bug fails here before the bug is missed.)"""
    planted = first_failure(monkeypatch, prop, match=match, engines=engines)
    assert planted.first <= FUZZ_EXAMPLES // 2, f"found only at example {planted.first}"
    record_property("first_failing_example", planted.first)
    record_property("examples_run", planted.calls)


def test_planted_kv_cache_shift_fails_decode_property(
    engines: Callable[..., Llama3Engine],
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    """Decode steps write and read the KV cache one slot late (mutations.py's kv_position)."""
    forward = Transformer.forward

    def shifted(self: Transformer, tokens: torch.Tensor, start_pos: int, **kwargs: Any):
        return forward(self, tokens, start_pos + (tokens.shape[1] == 1), **kwargs)

    monkeypatch.setattr(Transformer, "forward", shifted)
    _assert_property_fails(
        monkeypatch,
        record_property,
        test_kv_cache_decode_equals_recomputation,
        engines,
        match="cached decode .* vs recomputed",
    )


def test_planted_kv_cache_late_from_position_1000_fails_decode_property(
    engines: Callable[..., Llama3Engine],
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    """Decode steps from position 1000 on write and read the KV cache one slot late: only
    sequences past position 1000 see it (the long positions the prompts reach)."""
    forward = Transformer.forward

    def late(self: Transformer, tokens: torch.Tensor, start_pos: int, **kwargs: Any):
        shift = tokens.shape[1] == 1 and start_pos >= 1000
        return forward(self, tokens, start_pos + shift, **kwargs)

    monkeypatch.setattr(Transformer, "forward", late)
    _assert_property_fails(
        monkeypatch,
        record_property,
        test_kv_cache_decode_equals_recomputation,
        engines,
        match="cached decode .* vs recomputed",
    )


def test_planted_non_causal_prefill_fails_forward_property(
    engines: Callable[..., Llama3Engine],
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    """A multi-token forward attends to later positions too (the causal mask lost)."""

    def see_everything(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor:
        return torch.ones(seqlen, start_pos + seqlen, dtype=torch.bool, device=device)

    monkeypatch.setattr(model_module, "attention_mask", see_everything)
    _assert_property_fails(
        monkeypatch,
        record_property,
        test_full_forward_equals_teacher_forced_steps,
        engines,
        match="Tensor-likes are not close",  # torch.testing.assert_close's message
    )


def test_planted_nan_rope_tail_fails_finite_property(
    engines: Callable[..., Llama3Engine],
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    """RoPE tables hold NaN from position 8 on (as if rows past some length were never
    written): only sequences longer than 8 positions see it."""
    precompute_rope = model_module.precompute_rope

    def nan_tail(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = precompute_rope(*args)
        cos[8:] = float("nan")
        return cos, sin

    monkeypatch.setattr(model_module, "precompute_rope", nan_tail)
    _assert_property_fails(
        monkeypatch, record_property, test_logits_are_finite, engines, match="rows with finite"
    )
