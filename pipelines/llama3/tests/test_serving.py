"""The serving engine against the single-sequence path: same tokens, same logits.

Every request is teacher-forced on `generate`'s own greedy tokens, so both compute the same
positions; the golden tests (test_llama_serving) hold the scenarios to the goldens too.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from pipelines.llama3 import Llama3Engine, ggml_mode, kernel_library, packed, quants, sampling
from pipelines.llama3 import model as model_module
from pipelines.llama3 import serving as serving_module
from pipelines.llama3.constrained import Constraint
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.serving import BlockPool, PoolExhausted, Request, ServingEngine
from pipelines.llama3.tests.pool_mutations import ShortWholePromptCopy
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

TESTDATA = Path(
    os.environ.get("PIPELINES_TESTDATA", "max_tests/integration/architectures/llama3/testdata")
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Why is the sky blue? Because the",
    "Hi",
]
STEPS = 6
# Served vs generate, max |Δ log-prob| where a path is not bitwise (chunks, eager batches).
LOGPROB_ATOL = 2e-4


@pytest.fixture(
    scope="module",
    params=[
        ("tiny_llama.gguf", "eager"),
        ("tiny_llama_q4_k.gguf", "quantized"),
        ("tiny_llama_q4_k.gguf", "ggml"),
    ],
    ids=["eager", "quantized", "ggml"],
)
def served(request):
    """(engine, requests teacher-forced on generate's tokens, generate's outputs)."""
    file_name, mode = request.param
    engine = Llama3Engine.from_gguf(TESTDATA / file_name, mode=mode)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    with torch.inference_mode():
        solo = [engine.generate(p, STEPS, prompt_positions=range(len(p) - 1)) for p in prompts]
    requests = [
        Request(str(i), p, STEPS, s.tokens, tuple(range(len(p) - 1)))
        for i, (p, s) in enumerate(zip(prompts, solo, strict=True))
    ]
    return engine, requests, solo


def _worst(results, requests, solo) -> float:
    """Max |Δ log-prob| of the served requests against generate, steps and prompt positions."""
    worst = 0.0
    for request, reference in zip(requests, solo, strict=True):
        out = results[request.id].output
        assert out.tokens == reference.tokens, request.id
        pairs = [(out.logits, reference.logits)]
        if out.prompt_logits is not None:
            index = [
                request.prompt_positions.index(p) for p in results[request.id].prompt_positions
            ]
            pairs.append((out.prompt_logits, reference.prompt_logits[index]))
        for a, b in pairs:
            delta = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max()
            worst = max(worst, float(delta))
    return worst


def test_one_request_is_bitwise_the_single_sequence_path(served) -> None:
    """Paged cache, gathered keys, the paged decode kernel: the same numbers as generate."""
    engine, requests, solo = served
    for request, reference in zip(requests, solo, strict=True):
        out = ServingEngine(engine, block_size=4).serve([request])[request.id].output
        assert out.tokens == reference.tokens
        assert torch.equal(out.logits, reference.logits)
        assert torch.equal(out.prompt_logits, reference.prompt_logits)


def test_attention_over_scattered_slots_is_the_attention_over_consecutive_ones() -> None:
    """paged_attention reads a context in consecutive slots as a view of the cache and a
    scattered one by a gather (model.slots_of): both see the same keys in the same layout, so
    a piece computes the same bits wherever the pool put its blocks."""
    generator = torch.Generator().manual_seed(7)
    slots, kv_heads, heads, head_dim, count = 64, 2, 6, 8, 3
    cache_k = torch.randn(slots, kv_heads, head_dim, generator=generator)
    cache_v = torch.randn(slots, kv_heads, head_dim, generator=generator)
    q = torch.randn(1, heads, count, head_dim, generator=generator)
    scattered = torch.tensor([40, 41, 42, 43, 8, 9, 10, 11, 60, 61], dtype=torch.long)
    consecutive = torch.arange(20, 20 + len(scattered))
    moved_k, moved_v = cache_k.clone(), cache_v.clone()
    moved_k[consecutive], moved_v[consecutive] = cache_k[scattered], cache_v[scattered]
    assert model_module.slots_of(moved_k, consecutive)._base is moved_k  # a view, no copy
    mask = model_module.attention_mask(count, len(scattered) - count, q.device)
    expected = model_module.paged_attention(q, cache_k, cache_v, scattered, 0.3, mask)
    got = model_module.paged_attention(q, moved_k, moved_v, consecutive, 0.3, mask)
    assert torch.equal(got, expected)
    assert torch.equal(model_module.slots_of(cache_k, scattered), cache_k[scattered])
    # and against attention written out: softmax(q.k * scale) over the causal context
    keys = cache_k[scattered].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    values = cache_v[scattered].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = (q[0] @ keys.transpose(1, 2)) * 0.3
    past = len(scattered) - count
    visible = torch.ones(count, len(scattered), dtype=torch.bool).tril(diagonal=past)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    torch.testing.assert_close(expected[0], weights @ values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"chunk_size": 1},
        {"chunk_size": 3, "block_size": 4},
        {"block_size": 4},
        {"block_size": 16},
    ],
    ids=["batch", "chunk1", "chunk3-block4", "block4", "block16"],
)
def test_a_ragged_batch_gives_every_request_its_own_numbers(served, config) -> None:
    engine, requests, solo = served
    for order in (requests, requests[::-1]):
        results = ServingEngine(engine, **config).serve(order)
        worst = _worst(results, requests, solo)
        # the ggml mode's rows see only their own sequence, in every kernel: bitwise
        assert worst == 0.0 if engine.mode == "ggml" else worst < LOGPROB_ATOL, worst


def test_the_quantized_batch_is_bitwise_where_the_kernels_see_the_same_rows(served) -> None:
    """Whole-prompt prefill and decode through the same kernels: row for row the same in the
    quantized and ggml modes; the eager mode's BLAS rows of another height within the bound."""
    engine, requests, solo = served
    results = ServingEngine(engine).serve(requests)
    worst = _worst(results, requests, solo)
    if engine.mode in ("quantized", "ggml"):
        assert worst == 0.0, worst
    else:
        assert worst < LOGPROB_ATOL, worst


def _window(keys: int):
    """A model's attention_mask that lets each query see only the last `keys` keys."""

    def mask(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor:
        queries = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
        positions = torch.arange(start_pos + seqlen, device=device)[None, :]
        return (positions <= queries) & (positions > queries - keys)

    return mask


def _moved_and_followed(engine, requests, solo, servings, bitwise=()) -> None:
    """With what the test planted: generate, teacher-forced on the requests' tokens, moves
    every step's logits from `solo` (the plant reached generate, decode steps included), and
    the served requests, in each of `servings`, follow it (the plant reached them too):
    bitwise in the modes `bitwise` names, else within LOGPROB_ATOL."""
    with torch.inference_mode():
        planted = [
            engine.generate(
                r.prompt, STEPS, forced_tokens=r.forced_tokens, prompt_positions=r.prompt_positions
            )
            for r in requests
        ]
    for request, ours, plain in zip(requests, planted, solo, strict=True):
        moved = (ours.logits - plain.logits).abs().amax(-1)
        assert bool((moved > 1e-3).all()), (request.id, moved)
    for config in servings:
        worst = _worst(ServingEngine(engine, **config).serve(requests), requests, planted)
        assert worst == 0.0 if engine.mode in bitwise else worst < LOGPROB_ATOL, (config, worst)


def test_a_models_attention_mask_reaches_generate_and_every_served_path(
    served, monkeypatch
) -> None:
    """Transformer.attention_mask is where a model's mask is made, on every path: a window of
    one key (each query sees itself) moves every step of generate's logits, decode steps
    included (a kernel that computed plain causal attention would keep them), and the served
    requests, batched, chunked and paged, follow the windowed generate. Windowed rows take
    SDPA in every mode, so the served bound is the eager one."""
    engine, requests, solo = served
    monkeypatch.setattr(engine.model, "attention_mask", _window(1))
    _moved_and_followed(engine, requests, solo, ({}, {"chunk_size": 3, "block_size": 4}))


def test_an_override_of_the_layer_loop_reaches_generate_and_the_served_requests(
    served, monkeypatch
) -> None:
    """Transformer.run_layers is the one layer loop of `forward` and `forward_paged`: an
    override that moves the residual stream by 0.5 after the layers moves every step of
    generate's logits, and the served requests (a decode-only step in the quantized and ggml
    modes' one call included) follow it. Planted, forward_paged looping over the layers
    itself (as it did): the served rows kept their unmoved logits."""
    engine, requests, solo = served
    loop = engine.model.run_layers
    monkeypatch.setattr(engine.model, "run_layers", lambda *args: loop(*args) + 0.5)
    _moved_and_followed(engine, requests, solo, ({},), bitwise=("quantized", "ggml"))


def test_one_norms_epsilon_reaches_every_decode_step_solo_and_served(served, monkeypatch) -> None:
    """The quantized and ggml modes' one call through every layer takes one epsilon for all
    norms (FusedDecode.shared): the feed-forward norm's alone set to 1 must move generate's
    decode steps as it moves its prefill, and the served decode steps must follow it. Planted,
    the call reading the attention norm's epsilon for both (as it did): the decode steps kept
    their unplanted logits."""
    engine, requests, solo = served
    monkeypatch.setattr(engine.model.layers[-1].ffn_norm, "eps", 1.0)
    _moved_and_followed(engine, requests, solo, ({},), bitwise=("quantized", "ggml"))


def test_a_kept_position_is_not_written_again_on_any_path(served) -> None:
    """PagedBatch.fresh: a position kept from before (a preempted sequence's, resumed) keeps
    its keys and values, in a one-row piece beside a prefill (each layer's modules) and in a
    step of one-row pieces only (the quantized and ggml modes' one call through every layer).
    Planted, the quantized mode's kernels writing every decode row (as they did): the
    serving mutation resume_without_last_kv passed it at chunks of 1."""
    engine, _, _ = served
    model, config = engine.model, engine.config
    model.setup_rope(64)
    k = torch.zeros(config.n_layers, 32, config.n_kv_heads, config.head_dim)
    v = torch.zeros_like(k)

    def run(counts, contexts, write, fresh, tokens, positions, outputs) -> None:
        batch = model_module.PagedBatch(
            k=k, v=v, counts=counts, contexts=[torch.tensor(c) for c in contexts],
            write=torch.tensor(write), fresh=torch.tensor(fresh),
        )  # fmt: skip
        with torch.inference_mode():
            model.forward_paged(torch.tensor(tokens), torch.tensor(positions), batch, outputs)

    run([3], [[10, 11, 12]], [10, 11, 12], [True] * 3, [5, 6, 7], [0, 1, 2], [[2]])
    marker = torch.full_like(k[:, 12], 7.0)
    steps = {  # name: the step, and the slot a fresh row of it writes
        "beside a prefill": (([3, 1], [[0, 1, 2], [10, 11, 12]], [0, 1, 2, 12],
                              [True] * 3 + [False], [5, 6, 7, 7], [0, 1, 2, 2], [[2], [3]]), 2),
        "one-row pieces only": (([1, 1], [[0, 1, 2, 3], [10, 11, 12]], [3, 12], [True, False],
                                 [8, 7], [3, 2], [[0], [1]]), 3),
    }  # fmt: skip
    for name, (step, written) in steps.items():
        k[:, 12], v[:, 12] = marker, marker
        k[:, written], v[:, written] = 0.0, 0.0
        run(*step)
        assert torch.equal(k[:, 12], marker) and torch.equal(v[:, 12], marker), name
        assert bool(k[:, written].abs().sum() > 0), f"{name}: its fresh row was not written"


def test_a_pool_too_small_preempts_and_resumed_requests_continue_exactly(served) -> None:
    engine, requests, solo = served
    # Blocks of one position and room for the longest request and one more block: two
    # requests are admitted (each has room for its prompt), and their decode steps run the pool
    # out (an admission never takes the blocks running sequences need in its step).
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    serving = ServingEngine(engine, block_size=1, num_blocks=longest + 1)
    results = serving.serve(requests)
    assert serving.preemptions > 0
    assert sum(r.preemptions for r in results.values()) == serving.preemptions
    worst = _worst(results, requests, solo)
    assert worst == 0.0 if engine.mode == "ggml" else worst < LOGPROB_ATOL, worst


def _pool_state(pool: BlockPool) -> dict:
    """Everything an admission could take, count or reorder in the pool."""
    counters = ("hits", "shared_hits", "refound", "evictions", "whole_prompts")
    return {
        **{name: getattr(pool, name) for name in counters},
        "refs": list(pool.refs),
        "evictable (LRU order)": list(pool.evictable),
        "cached": dict(pool.cached),
        "free": list(pool.free),
    }


def test_a_refused_admission_takes_counts_and_refreshes_nothing(served, monkeypatch) -> None:
    """A refused admission only peeks at the prefix cache (`BlockPool.peek`): for a request
    whose prefix blocks are cached, some held by a running sequence and some left by a
    finished one, a refusal references no block, counts no hit (shared or not) and leaves
    the evictable blocks' LRU order as it was. Planted: an admission that looks its blocks
    up (references, counts, refreshes) before finding no room."""
    engine, requests, _ = served
    running, finished = requests[1].prompt[:9], requests[2].prompt[:9]  # 2 full blocks of 4
    server = ServingEngine(engine, block_size=4, num_blocks=32, prefix_caching=True)

    def admit_refused() -> dict:
        before = _pool_state(server.pool)
        for prompt in (running, finished):
            seq = serving_module._Sequence(Request("late", prompt, 1), 99, list(prompt))
            assert not server._admit(seq, reserve=server.pool.num_blocks)
            assert (seq.table, seq.hashes, seq.computed) == ([], [], 0)
        after = _pool_state(server.pool)
        return {k: (v, after[k]) for k, v in before.items() if v != after[k]}

    server.submit([Request("finished", finished, 1)])
    while "finished" not in server.step():
        pass
    server.submit([Request("running", running, 4)])
    server.step()  # its prompt computed and its full blocks published; still decoding
    assert [s.request.id for s in server.running] == ["running"]
    assert len(server.pool.evictable) == 2 and server.pool.hits == 0
    assert admit_refused() == {}
    monkeypatch.setattr(BlockPool, "peek", BlockPool.lookup)  # planted
    changed = admit_refused()
    assert {"hits", "shared_hits", "refs", "evictable (LRU order)"} <= set(changed), changed


def test_a_request_larger_than_the_pool_is_refused_naming_it(served) -> None:
    engine, requests, _ = served
    with pytest.raises(PoolExhausted, match="request '0' needs more than the pool's 2 blocks"):
        ServingEngine(engine, block_size=2, num_blocks=2).serve([requests[0]])


def test_a_shared_prefix_is_read_from_the_cache_and_changes_nothing(served) -> None:
    engine, requests, solo = served
    first = requests[2]
    sibling = Request("sibling", [*first.prompt[:8], 1, 2, 3], 1)
    serving = ServingEngine(engine, block_size=4, prefix_caching=True, max_batch=1)
    results = serving.serve([sibling, first])
    assert results[first.id].cached_prefix == 8  # two full blocks of the sibling's
    assert serving.pool.hits == 2
    assert results[first.id].prompt_positions == [p for p in first.prompt_positions if p >= 8]
    assert _worst({first.id: results[first.id]}, [first], [solo[2]]) < LOGPROB_ATOL


def test_equal_block_tokens_after_a_different_history_are_not_shared(served) -> None:
    engine, requests, _ = served
    first = requests[2]
    shifted = Request("shifted", [*first.prompt[4:8], 5, 6], 1)  # block 1's tokens at block 0
    sharing = Request("sharing", [*first.prompt[:4], 7, 8], 1)  # block 0 shared
    serving = ServingEngine(engine, block_size=4, prefix_caching=True, max_batch=1)
    results = serving.serve([shifted, sharing, first])
    # Block 0 from `sharing`; block 1 has `shifted`'s first block's tokens, not its history.
    assert results[first.id].cached_prefix == 4


def _whole_prompt_again(served, serving_class: type[ServingEngine]) -> list[str]:
    """A prompt served, then served again: the second time every position but the last is
    read from the cache (its last block copied), and the request still gives generate's
    tokens and logits (bitwise in the ggml mode). What differs, as a list."""
    engine, requests, solo = served
    request, reference = requests[2], solo[2]
    size = len(request.prompt)
    block = next((d for d in range(2, size // 2 + 1) if size % d == 0), size)  # a full last block
    serving = serving_class(engine, block_size=block, prefix_caching=True, max_batch=1)
    serving.serve([request])
    again = dataclasses.replace(request, id="again")
    served_again = serving.serve([again])["again"]
    problems = []
    if served_again.cached_prefix != size - 1 or serving.pool.whole_prompts != 1:
        problems.append(
            f"read {served_again.cached_prefix} of {size} positions from the cache "
            f"({serving.pool.whole_prompts} whole prompts), not {size - 1} (1)"
        )
    if _held(serving):
        problems.append(f"{_held(serving)} blocks held after both finished")
    out = served_again.output
    if out.tokens != reference.tokens:
        problems.append(f"tokens {out.tokens}, generate's {reference.tokens}")
    else:
        worst = _worst({"again": served_again}, [again], [reference])
        if worst > (0.0 if engine.mode == "ggml" else LOGPROB_ATOL):
            problems.append(f"max |Δ log-prob| {worst:.3g} from generate")
    return problems


def test_a_prompt_found_whole_in_the_cache_computes_only_its_last_position(served) -> None:
    assert _whole_prompt_again(served, ServingEngine) == []


def test_a_planted_short_copy_of_a_whole_cached_prompt_fails(served) -> None:
    problems = _whole_prompt_again(served, ShortWholePromptCopy)
    assert any("from generate" in p or "tokens" in p for p in problems), problems


def test_the_pool_counts_references_and_evicts_the_least_recently_used(served) -> None:
    engine, _, _ = served
    pool = BlockPool(engine, num_blocks=2, block_size=4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.allocate() is None
    pool.publish(a, b"a")
    pool.publish(b, b"b")
    pool.release(a)
    pool.release(b)
    assert pool.available() == 2 and pool.lookup(b"a") == a  # a is used again
    pool.release(a)
    assert pool.allocate() == b  # b was used least recently: evicted first
    assert pool.lookup(b"b") is None and pool.lookup(b"a") == a


@pytest.fixture(scope="module")
def eager() -> Llama3Engine:
    """The tiny checkpoint in the eager mode: the scheduler's rules, which no mode changes."""
    return Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf", mode="eager")


def test_an_admission_counts_the_cached_blocks_it_takes_from_the_evictable(eager) -> None:
    """Room for an admission is the pool less the running sequences' reserve and less the
    cached blocks nobody holds that its prefix takes (they leave the evictable ones). Two of a
    finished request's blocks are cached, the same prompt wants one block more: with 8
    available, a reserve of 6 leaves no room, 5 leaves one. Planted, the taken blocks not
    counted: admitted at 6, then preempted in its own step or, copying its last block, no
    free block (a mutation sweep's survivor; only the pressure lane and the fuzz caught it)."""
    prompt = eager.tokenizer.encode("Why is the sky blue? Because the")[:9]
    server = ServingEngine(eager, block_size=4, num_blocks=8, prefix_caching=True)
    server.submit([Request("finished", prompt, 1)])
    while "finished" not in server.step():
        pass
    assert len(server.pool.evictable) == 2 and server.pool.available() == 8

    def again() -> serving_module._Sequence:
        return serving_module._Sequence(Request("again", prompt, 1), 99, list(prompt))

    assert not server._admit(again(), reserve=6)
    assert server._admit(again(), reserve=5)


def test_each_admission_of_a_step_reserves_its_blocks_for_the_next(eager) -> None:
    """Two 8-token prompts, blocks of 4, a pool of 3: the first admitted takes 2 blocks this
    step, so the second (2 more) waits, and no admission is preempted in its own step.
    Planted, the admissions' reserve not accumulated: the second admitted, then preempted at
    once (a mutation sweep's survivor; only the pressure lane and the fuzz caught it)."""
    prompts = [list(range(1, 9)), list(range(11, 19))]
    server = ServingEngine(eager, block_size=4, num_blocks=3)
    server.submit([Request("a", prompts[0], 2), Request("b", prompts[1], 2)])
    server.step()
    assert [s.request.id for s in server.running] == ["a"]
    assert [s.request.id for s in server.waiting] == ["b"]
    assert (server.preemptions, server.preempted_on_admission) == (0, 0)


def test_the_most_recently_admitted_sequence_is_preempted_and_waits_first(eager) -> None:
    """A pool too small for three requests at once preempts the last admitted (the first
    admitted is never preempted), and a preempted sequence waits at the head of the queue,
    before the requests that never ran, its steps so far still reported (`generated`).
    Planted, the first admitted preempted, or the preempted one queued last: the tokens are
    the same, so no golden lane saw either (a mutation sweep's survivors)."""
    texts = ("The capital of France is", "Hi", "Why is the sky blue? Because the")
    requests = [Request(str(i), eager.tokenizer.encode(t), 6) for i, t in enumerate(texts)]
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    serving = ServingEngine(eager, block_size=1, num_blocks=longest + 1)
    results = serving.serve(requests)
    assert serving.preemptions > 0
    assert results["0"].preemptions == 0, {k: r.preemptions for k, r in results.items()}

    server = ServingEngine(eager, block_size=4, num_blocks=64)
    server.submit([Request("a", requests[0].prompt, 4), Request("b", requests[1].prompt, 4)])
    server.step()
    server.submit([Request("c", requests[2].prompt, 4)])
    assert [s.request.id for s in server.running] == ["a", "b"]
    tokens = list(server.generated()["b"][0])
    server._preempt(server.running[-1], server.running, server.waiting)
    assert [s.request.id for s in server.waiting] == ["b", "c"]
    # generated(): every pending request's steps so far, a preempted one's too (the server
    # streams from it); planted, the running ones alone: b missing
    assert set(server.generated()) == {"a", "b", "c"} and server.generated()["b"][0] == tokens


def test_a_block_is_published_when_its_last_position_is_computed(eager) -> None:
    """An 8-token prompt in blocks of 4, one step: its 8 positions computed, both full blocks
    are in the prefix cache, and the same prompt with two tokens more reads all 8 from it.
    Planted, a block published only once a later position is computed: the second block
    never published, every lane still reusing enough to pass (a mutation sweep's survivor)."""
    prompt = eager.tokenizer.encode("Why is the sky blue? Because the")[:8]
    server = ServingEngine(eager, block_size=4, num_blocks=16, prefix_caching=True)
    server.serve([Request("first", prompt, 1)])
    assert len(server.pool.cached) == 2
    again = server.serve([Request("again", [*prompt, 7, 8], 1)])
    assert again["again"].cached_prefix == 8


def test_a_request_that_fills_max_context_exactly_is_served(eager) -> None:
    """max_context bounds the prompt and the new tokens together: exactly filling it is served,
    one token more is refused naming it. Planted, `>=` for `>`: the one that fits refused."""
    prompt = eager.tokenizer.encode("The capital of France is")
    server = ServingEngine(eager, block_size=4, max_context=len(prompt) + 3)
    assert len(server.serve([Request("fits", prompt, 3)])["fits"].output.tokens) == 3
    with pytest.raises(ValueError, match="request 'over': longer than max_context"):
        server.serve([Request("over", prompt, 4)])


def test_without_a_tokenizer_both_paths_stop_at_the_checkpoint_end_of_sequence() -> None:
    """One decoder: a file without a vocabulary stops at its eos_token_id in generate and in
    the serving engine alike (the serving engine once never stopped there)."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    prompt = engine.tokenizer.encode(PROMPTS[0])
    first = engine.generate(prompt, 4, stop_on_eos=False).tokens
    engine.tokenizer = None
    engine.config = dataclasses.replace(engine.config, eos_token_id=first[1])
    assert engine.eos_ids == {first[1]}
    solo = engine.generate(prompt, 4)
    served = ServingEngine(engine).serve([Request("r", prompt, 4)])["r"].output
    assert solo.tokens == served.tokens == first[:2], (solo.tokens, served.tokens, first)
    assert torch.equal(solo.logits, served.logits)


def test_a_request_with_fewer_forced_tokens_than_steps_is_refused_naming_it() -> None:
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    with pytest.raises(ValueError, match="request 'short': 2 forced tokens for max_new_tokens 3"):
        ServingEngine(engine).serve([Request("short", [1, 2], 3, forced_tokens=[5, 6])])


def _compiled_regions(engine: Llama3Engine, requests: list[Request]) -> tuple[int, dict]:
    """How many compiled graphs a serve ran (torch.profiler's "Torch-Compiled Region" events:
    counted as they run, not as they compile), and what it served."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        served = ServingEngine(engine, block_size=4, chunk_size=3).serve(requests)
    regions = sum(e.name.startswith("Torch-Compiled Region") for e in profile.events())
    return regions, served


def test_the_compiled_mode_serves_through_its_compiled_graphs(monkeypatch) -> None:
    """Served in the compiled mode, a ragged batch runs each block as its two compiled parts
    around the eager attention (compiled.CompiledBlock), at every step: the same tokens as the
    compiled `generate`, rows within 1e-4 of it (one graph fuses a block whole, the other two
    around the attention). Planted: the paged forward run eagerly under the compiled mode's
    name (what the serving engine did before it had a compiled paged forward, when it did
    not refuse the mode) runs no compiled graph, which this test tells."""
    from pipelines.llama3 import compiled
    from pipelines.llama3.model import TransformerBlock

    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf", mode="compiled")
    prompts = [list(range(5, 18)), list(range(40, 47))]
    requests = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    regions, served = _compiled_regions(engine, requests)
    layers = len(engine.model.layers)
    steps = 5 + 3  # chunks of 3 over 13 prompt tokens, then 3 decode steps
    assert regions >= 2 * layers * steps, f"{regions} compiled regions in {steps} steps"
    for request, prompt in zip(requests, prompts, strict=True):
        solo = engine.generate(prompt, 4, stop_on_eos=False)
        out = served[request.id].output
        assert out.tokens == solo.tokens
        assert (out.logits - solo.logits).abs().max() <= 1e-4

    monkeypatch.setattr(compiled.CompiledBlock, "forward_paged", TransformerBlock.forward_paged)
    planted, _ = _compiled_regions(engine, requests)
    assert planted == 0, f"the eager paged forward ran {planted} compiled regions"


# Cancellation and limits (issue tracker: serving under pressure): a request that ends early,
# cancelled mid-prefill or mid-decode, or stopped by max tokens, an end-of-sequence id or a stop
# string, gives its blocks back at once and leaves in the prefix cache only blocks whose every
# position it computed. Each check below is proven by the planted engines after it.
CUT_PROMPT = list(range(5, 22))  # 17 tokens: chunks of 3 over blocks of 4
OTHER_PROMPT = list(range(40, 47))


class _KeepsBlocksOnCancel(ServingEngine):
    """A planted bug: cancel takes the request out of the schedule but keeps its blocks."""

    def cancel(self, request_id: str):
        self._release = lambda seq: None
        try:
            return super().cancel(request_id)
        finally:
            del self._release


class _PublishesTheBlockItWasFilling(ServingEngine):
    """A planted bug: a cancelled request publishes the block it had not filled."""

    def cancel(self, request_id: str):
        for seq in self.running:
            if seq.request.id == request_id and seq.computed % self.block_size:
                b = len(seq.hashes)
                self.pool.publish(seq.table[b], self._key_of_block(seq, b))
        return super().cancel(request_id)


class _PublishesTheBlockItsTokenFills(ServingEngine):
    """A planted bug: in decode, a block is published as soon as the token just chosen fills
    it, one position before that token's keys are computed (never, if the request is cancelled
    then)."""

    def _step(self, seq, logits) -> None:
        super()._step(seq, logits)
        while not seq.done and (len(seq.hashes) + 1) * self.block_size <= len(seq.fed):
            b = len(seq.hashes)
            key = self._key_of_block(seq, b)
            self.pool.publish(seq.table[b], key)
            seq.hashes.append(key)


class _PublishesTheBlockItWasFillingOnFinish(ServingEngine):
    """A planted bug: a request that finishes (stop string, end-of-sequence id, max tokens)
    publishes the block it had not filled."""

    def _step(self, seq, logits) -> None:
        super()._step(seq, logits)
        if seq.done and seq.computed % self.block_size:
            b = len(seq.hashes)
            self.pool.publish(seq.table[b], self._key_of_block(seq, b))


def _held(serving: ServingEngine) -> int:
    return sum(1 for refs in serving.pool.refs if refs > 0)


def _cache_problems(serving: ServingEngine, *computed: list[int]) -> list[str]:
    """How the prefix cache differs from the full blocks of `computed` (each sequence's tokens
    whose keys it computed): a cached block not among them, or one of them not cached."""
    size, full = serving.block_size, set()
    for tokens in computed:
        key = b""
        for b in range(len(tokens) // size):
            key = serving._block_hash(key, tokens[b * size : (b + 1) * size])
            full.add(key)
    cached = set(serving.pool.cached)
    problems = []
    if cached - full:
        problems.append(f"{len(cached - full)} cached blocks not full computed ones")
    if full - cached:
        problems.append(f"{len(full - cached)} full computed blocks not cached")
    return problems


def _cancel_mid_prefill(engine, serving_class=ServingEngine) -> list[str]:
    """What goes wrong when 'cut' is cancelled after two chunks of 3 (block 0 full, block 1
    half): the blocks still held, the cache's blocks that are not full computed ones, and
    'other' (served beside it) or a later request reading 'cut's cached block off its solo."""
    serving = serving_class(engine, block_size=4, chunk_size=3, prefix_caching=True)
    serving.submit([Request("cut", CUT_PROMPT, 4), Request("other", OTHER_PROMPT, 3)])
    serving.step()
    serving.step()
    problems = []
    served = serving.cancel("cut")
    if served.finish_reason != "cancelled" or served.output.tokens:
        problems.append(f"cancelled as {served.finish_reason} with {served.output.tokens}")
    (other,) = serving.running
    if _held(serving) != len(other.table):
        problems.append(f"{_held(serving)} blocks held, 'other' holds {len(other.table)}")
    full = {serving._block_hash(b"", p[:4]) for p in (CUT_PROMPT, OTHER_PROMPT)}
    if set(serving.pool.cached) != full:
        problems.append(f"{len(set(serving.pool.cached) - full)} cached blocks not full ones")
    results = {}
    while serving.pending:
        results.update(serving.step())
    if _held(serving):
        problems.append(f"{_held(serving)} blocks held after every request finished")
    again = serving.serve([Request("again", CUT_PROMPT, 4)])["again"]
    problems += _off_solo(
        engine,
        [
            ("other", results["other"].output, OTHER_PROMPT, 3),
            ("again", again.output, CUT_PROMPT, 4),
        ],
    )
    if again.cached_prefix != 4:
        problems.append(f"'again' read {again.cached_prefix} positions from the cache, not 4")
    return problems


def test_a_request_cancelled_mid_prefill_frees_its_blocks_and_caches_only_full_ones() -> None:
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    assert _cancel_mid_prefill(engine) == []
    (kept,) = _cancel_mid_prefill(engine, _KeepsBlocksOnCancel)[:1]
    assert "blocks held" in kept
    partial = _cancel_mid_prefill(engine, _PublishesTheBlockItWasFilling)
    assert any("cached blocks not full ones" in p for p in partial), partial


def _cancel_mid_decode(engine, serving_class=ServingEngine) -> list[str]:
    """What goes wrong when 'cut' is cancelled after three steps, prefix caching on: the token
    its third step chose (fed, its keys not computed) fills its fifth block. Its steps against
    its solo run, the blocks still held, the prefix cache against the full blocks 'cut' and
    'other' computed, 'other' against its solo run, and the next turn (a request of 'cut's
    fed tokens and two more, reading 'cut's blocks from the cache) against its solo run."""
    solo = engine.generate(CUT_PROMPT, 6)
    serving = serving_class(engine, block_size=4, prefix_caching=True)
    serving.submit([Request("cut", CUT_PROMPT, 6), Request("other", OTHER_PROMPT, 8)])
    for _ in range(3):  # the prompts (each request's first step), then two decode steps
        serving.step()
    cut, other = serving.running
    fed = list(cut.fed)
    assert len(fed) == 20 and cut.computed == 19, (len(fed), cut.computed)  # the premise
    problems = []
    served = serving.cancel("cut")
    if served.finish_reason != "cancelled" or served.output.tokens != solo.tokens[:3]:
        problems.append(f"cancelled as {served.finish_reason} with {served.output.tokens}")
    # (a batch of two: eager's batched products round otherwise than one row's, within 1e-4)
    if not (served.output.logits - solo.logits[:3]).abs().max() <= 1e-4:
        problems.append("'cut': its steps' logits off its solo run")
    if _held(serving) != len(other.table):
        problems.append(f"{_held(serving)} blocks held, 'other' holds {len(other.table)}")
    problems += _cache_problems(serving, fed[:-1], other.fed[: other.computed])
    with pytest.raises(KeyError, match="no pending request 'cut'"):
        serving.cancel("cut")
    finished = {}
    while serving.pending:
        finished.update(serving.step())
    if _held(serving):
        problems.append(f"{_held(serving)} blocks held after every request finished")
    follow = [*fed, 42, 43]  # the next turn: 'cut's prompt and its tokens, then more
    after = serving.serve([Request("next", follow, 3)])["next"]
    if after.cached_prefix != 16:
        problems.append(f"'next' read {after.cached_prefix} positions from the cache, not 16")
    problems += _off_solo(
        engine,
        [
            ("other", finished["other"].output, OTHER_PROMPT, 8),
            ("next", after.output, follow, 3),
        ],
    )
    return problems


def _off_solo(engine, served: list[tuple]) -> list[str]:
    """Each served (name, output, prompt, steps) whose tokens differ from its solo run's, or
    whose logits are more than 1e-4 off them (eager's batched products round otherwise)."""
    problems = []
    for name, out, prompt, steps in served:
        solo = engine.generate(prompt, steps)
        delta = float((out.logits - solo.logits).abs().max())
        if out.tokens != solo.tokens or delta > 1e-4:
            problems.append(f"{name}: {out.tokens} vs solo {solo.tokens}, logits off {delta:.3g}")
    return problems


def test_a_request_cancelled_mid_decode_keeps_its_steps_and_caches_only_computed_blocks() -> None:
    """Cancelled as the token it chose fills a block: its steps so far are its solo run's, its
    blocks go back at once, and the block whose last position has no keys yet is not cached:
    the next turn reads 16 positions from the cache and is its solo run within 1e-4. Planted:
    a block published in decode as its token is chosen (the next turn then reads 20 positions,
    the last never computed)."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    assert _cancel_mid_decode(engine) == []
    early = _cancel_mid_decode(engine, _PublishesTheBlockItsTokenFills)
    assert "1 cached blocks not full computed ones" in early, early
    assert "'next' read 20 positions from the cache, not 16" in early, early
    assert any(p.startswith("next: ") for p in early), early


def test_a_stop_string_ends_the_request_where_its_text_first_holds_it() -> None:
    """The stop string is the text the k-th greedy token adds (absent before it): the served
    request stops after that token ("stop"), frees its blocks, and its tokens are generate's
    first k + 1; max_new_tokens ends the same request as "length". With prefix caching on,
    the cache then holds exactly the full blocks each computed (its last token, chosen, is
    never fed). Planted: a finished request that publishes the block it was filling (both
    requests end inside a block: 19 and 21 positions computed)."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    solo = engine.generate(CUT_PROMPT, 8, stop_on_eos=False)
    decode = engine.tokenizer.decode
    for k in range(2, 8):
        before, after = decode(solo.tokens[:k]), decode(solo.tokens[: k + 1])
        added = after[len(before) :] if after.startswith(before) else ""
        if added.strip() and added not in before:
            break
    else:
        pytest.fail(f"no token of {solo.tokens} adds text absent before it")
    requests = [Request("stop", CUT_PROMPT, 8, stop=(added,)), Request("length", CUT_PROMPT, 5)]
    serving = ServingEngine(engine, block_size=4, prefix_caching=True)
    results = serving.serve(requests)
    assert results["stop"].finish_reason == "stop"
    assert results["stop"].output.tokens == solo.tokens[: k + 1]
    assert engine.generate(CUT_PROMPT, 8, stop=(added,)).tokens == solo.tokens[: k + 1]
    assert results["length"].finish_reason == "length"
    assert results["length"].output.tokens == solo.tokens[:5]
    assert _held(serving) == 0
    # the prefix cache holds the full blocks of what each computed (its last token, chosen,
    # was never fed); planted: a finished request publishes the block it was filling
    computed = [[*CUT_PROMPT, *solo.tokens[:k]], [*CUT_PROMPT, *solo.tokens[:4]]]
    assert _cache_problems(serving, *computed) == []
    planted = _PublishesTheBlockItWasFillingOnFinish(engine, block_size=4, prefix_caching=True)
    planted.serve(requests)
    assert _cache_problems(planted, *computed)[:1] == ["2 cached blocks not full computed ones"]
    with pytest.raises(ValueError, match="request 'empty': an empty stop string"):
        serving.serve([Request("empty", CUT_PROMPT, 2, stop=("",))])


def test_forced_tokens_take_one_step_each_on_both_paths_or_are_refused_on_both() -> None:
    """One rule (decoder.Decoder's): as many forced tokens as max_new_tokens run that many
    steps in generate and the serving engine alike; fewer or more are refused by both, naming
    both numbers. (generate once ran len(forced_tokens) steps whatever max_new_tokens said,
    while the serving engine cut the forced tokens to max_new_tokens.)"""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    forced = [7, 8, 9, 10, 11]
    solo = engine.generate(CUT_PROMPT, 5, forced_tokens=forced)
    served = ServingEngine(engine).serve([Request("r", CUT_PROMPT, 5, forced)])["r"]
    assert len(solo.tokens) == len(served.output.tokens) == 5
    assert solo.tokens == served.output.tokens and served.finish_reason == "length"
    for steps in (3, 7):
        message = f"5 forced tokens for max_new_tokens {steps}: teacher forcing feeds one per"
        with pytest.raises(ValueError, match=message):
            engine.generate(CUT_PROMPT, steps, forced_tokens=forced)
        with pytest.raises(ValueError, match=f"request 'r': {message}"):
            ServingEngine(engine).serve([Request("r", CUT_PROMPT, steps, forced)])


@pytest.mark.parametrize(
    "refused",
    [
        Request("bad", OTHER_PROMPT, 4, constraint=Constraint.regex("(")),
        Request("bad", OTHER_PROMPT, 4, constraint=Constraint.choice(["a"]), ignore_eos=True),
        Request("bad", OTHER_PROMPT, 4, forced_tokens=[1, 2]),
    ],
    ids=["constraint_error", "constraint_ignoring_eos", "forced_count"],
)
def test_a_refused_request_queues_no_request_of_its_call(refused) -> None:
    """submit is all or nothing: a request its decoder refuses (a constraint that does not
    compile, a constraint ignoring the end-of-sequence ids, a wrong count of forced tokens)
    refuses the call, naming it, and queues none of its requests, so the next serve() runs
    and gives generate's tokens. (It once queued the requests before the refused one:
    pending stayed 1 and every later serve() was refused.)"""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    serving = ServingEngine(engine, block_size=4)
    ok = Request("ok", CUT_PROMPT, 4)
    with pytest.raises(ValueError, match="request 'bad': "):
        serving.serve([ok, refused])
    assert serving.pending == 0
    with pytest.raises(ValueError, match="request 'bad': "):
        serving.submit([ok, refused])
    assert serving.pending == 0
    served = serving.serve([ok])["ok"]
    assert served.output.tokens == engine.generate(CUT_PROMPT, 4).tokens
    assert all(refs == 0 for refs in serving.pool.refs)


# Seeded sampling on the serving paths: a request's draws are keyed by its seed and the
# position (sampling.uniform), so where a path computes the same logits as generate it must
# draw the same tokens, whatever the batch, its order, the chunks, the blocks, the prefix
# cache, a preemption, or an unseeded batch-mate (the last request).
SAMPLED = [
    SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, seed=1),
    SamplerSettings(temperature=1.5, min_p=0.05, order="llama_cpp", seed=2),
    SamplerSettings(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.2, seed=3),
    SamplerSettings(temperature=1.0),  # unseeded: the system's randomness
]
ALL_PATHS = {
    "batch": {},
    "reversed": {},
    "chunk1": {"chunk_size": 1},
    "chunk3-block4": {"chunk_size": 3, "block_size": 4},
    "block4": {"block_size": 4},
    "prefix": {"block_size": 2, "prefix_caching": True},
    "preempt": {"block_size": 4, "num_blocks": 6},
}
# Where each mode's served logits are bitwise generate's (the docs' serving table): the ggml
# mode everywhere, the quantized mode in whole-prompt batches over any block size, eager for
# one request at a time. Elsewhere the logits move within tolerance and a draw near a
# cumulative-probability boundary may legitimately flip: the draw rule
# (sampling.compare_draws) judges every path, and counts those.
BITWISE_PATHS = {
    "ggml": ["alone", *ALL_PATHS],
    "quantized": ["alone", "batch", "reversed", "block4"],
    "eager": ["alone"],
}


def _sampled_requests(engine) -> list[Request]:
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    return [
        Request(f"s{i}", p, STEPS, sampling=s)
        for i, (p, s) in enumerate(zip(prompts, SAMPLED, strict=True))
    ]


def _solo_draws(engine) -> dict[str, object]:
    """generate's output (tokens, logits) for each seeded request."""
    with torch.inference_mode():
        return {
            r.id: engine.generate(r.prompt, STEPS, sampling=r.sampling)
            for r in _sampled_requests(engine)
            if r.sampling.seed is not None
        }


def _served_draws(engine, path: str) -> dict[str, object]:
    """The served output of each sampled request on `path` (one at a time: "alone")."""
    requests = _sampled_requests(engine)
    with torch.inference_mode():
        if path == "alone":
            served = {}
            for r in requests:
                if r.sampling.seed is not None:
                    served.update(ServingEngine(engine, block_size=4).serve([r]))
        else:
            order = requests[::-1] if path == "reversed" else requests
            served = ServingEngine(engine, **ALL_PATHS[path]).serve(order)
    return {rid: result.output for rid, result in served.items()}


def _sampling_mismatches(engine, path: str, solo: dict[str, object]) -> list[str]:
    """The ids of seeded requests whose served tokens differ from generate's (`solo`)."""
    served = _served_draws(engine, path)
    return [rid for rid, out in solo.items() if served[rid].tokens != out.tokens]


def _draw_verdicts(engine, path: str, solo: dict[str, object], served=None) -> dict[str, list]:
    """The draw rule (sampling.compare_continuations) of each seeded request, served on
    `path` (or its outputs `served`) against generate, within the logits' tolerance
    LOGPROB_ATOL."""
    served = served or _served_draws(engine, path)
    verdicts = {}
    for r in _sampled_requests(engine):
        if r.id in solo:
            verdicts[r.id] = sampling.compare_continuations(
                (solo[r.id].tokens, solo[r.id].logits),
                (served[r.id].tokens, served[r.id].logits),
                r.sampling,
                r.sampling.seed,
                r.prompt,
                sampling.draw_margin(LOGPROB_ATOL, r.sampling),
            )
    return verdicts


def test_a_seeded_request_draws_the_same_tokens_on_every_path(served, capsys) -> None:
    """Every mode on every path: each seeded request's draws against generate's by the draw
    rule (sampling.py): equal, or AMBIGUOUS where the served logits (within LOGPROB_ATOL) put
    the uniform that close to a boundary; never a FAIL. Where a mode's logits are bitwise
    (BITWISE_PATHS) the tokens are generate's, every one."""
    engine, _, _ = served
    solo = _solo_draws(engine)
    with torch.inference_mode():
        greedy = {r.id: engine.generate(r.prompt, STEPS).tokens for r in _sampled_requests(engine)}
    not_greedy = sum(
        a != b for rid in solo for a, b in zip(solo[rid].tokens, greedy[rid], strict=False)
    )
    assert not_greedy > 0, "the sampled tokens are the greedy ones: nothing was drawn"
    lines, failures = [], []
    for path in ["alone", *ALL_PATHS]:
        outputs = _served_draws(engine, path)
        verdicts = _draw_verdicts(engine, path, solo, outputs)
        steps = [v for per_request in verdicts.values() for v in per_request]
        counts = {k: sum(v.verdict == k for v in steps) for k in ("equal", "AMBIGUOUS", "FAIL")}
        lines.append(f"  {path:<14} {counts}")
        failures += [
            f"{path} {rid}: {v.detail}"
            for rid, vs in verdicts.items()
            for v in vs
            if v.verdict == "FAIL"
        ]
        if path in BITWISE_PATHS[engine.mode]:
            drew_other = [rid for rid in solo if outputs[rid].tokens != solo[rid].tokens]
            assert not drew_other, f"{engine.mode} {path}: {drew_other} drew other tokens"
    with capsys.disabled():
        print(f"\ndraw rule, {engine.mode}, seeded requests vs generate:\n" + "\n".join(lines))
    assert not failures, failures


def _share_the_first_seed(monkeypatch) -> None:
    """Planted: every request of a batch draws with the first request's seed."""
    original = ServingEngine._decoder
    first: list = []

    def shared(self, request):
        decoder = original(self, request)
        first.append(first[0] if first else decoder.seed)
        decoder.seed = first[0]
        return decoder

    monkeypatch.setattr(ServingEngine, "_decoder", shared)


def test_one_seed_shared_by_the_batch_fails(monkeypatch) -> None:
    """Planted: every request of a batch draws with the first request's seed (TensorRT-LLM's
    and vLLM's bugs): the seeded requests after the first draw other tokens. The ggml mode,
    whose batch is bitwise: only the seed can move a draw."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama_q4_k.gguf", mode="ggml")
    solo = _solo_draws(engine)
    _share_the_first_seed(monkeypatch)
    assert _sampling_mismatches(engine, "batch", solo) == ["s1", "s2"]


def test_a_shared_seed_fails_the_draw_rule_on_a_path_that_is_not_bitwise(monkeypatch) -> None:
    """Planted: one seed for the batch (as above) where the logits are not bitwise (eager,
    a ragged batch): the rule FAILs it, it does not excuse it as ambiguous."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf", mode="eager")
    solo = _solo_draws(engine)
    _share_the_first_seed(monkeypatch)
    verdicts = _draw_verdicts(engine, "batch", solo)
    failed = sorted(rid for rid, vs in verdicts.items() if vs[-1].verdict == "FAIL")
    assert failed == ["s1", "s2"], {rid: [v.verdict for v in vs] for rid, vs in verdicts.items()}


@pytest.fixture(scope="module")
def pooled_head_files(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints whose LM heads the quantized and ggml modes keep packed, one per packed kind:
    int4 (Q4_K, dim 256, the head tied to the Q4_K embedding as in tiny_llama_q4_k.gguf) and
    int8 (Q8_0, dim 64, a head of its own; testdata holds no Q8_0 file). Both heads have the
    byte vocabulary's 263 rows: 0.4 s to write both, then milliseconds a check, where the
    committed file's 128k-row head takes 1.3 s a check (quantized mode, one thread)."""
    folder = tmp_path_factory.mktemp("pooled_head")
    files = {"Q4_K": folder / "tiny_q4_k.gguf", "Q8_0": folder / "tiny_q8_0.gguf"}
    write_tiny_llama(
        files["Q4_K"], dim=256, ffn_dim=256, tied=True, weight_type=GGMLQuantizationType.Q4_K
    )
    write_tiny_llama(files["Q8_0"], weight_type=GGMLQuantizationType.Q8_0)
    return files


def _moved_pieces(model, threads: int) -> list[int]:
    """The pieces whose rows of a pooled head call (Transformer._piece_logits) differ from the
    piece's own call, on `threads` threads: 70 one-row pieces (pooled up to the switch), one of
    64 rows (at the kernels' dense switch, DENSE_ROWS), then pieces of 1 and 5 rows."""
    h = torch.randn(140, model.config.dim, generator=torch.Generator().manual_seed(0))
    outputs = [[i] for i in range(70)] + [list(range(70, 134)), [134], list(range(135, 140))]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            pooled = model._piece_logits(h, outputs)
            return [
                i
                for i, rows in enumerate(outputs)
                if not torch.equal(pooled[i], model._logits(h[rows]))
            ]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", list(kernel_library.REQUIRED_FLAGS))
@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_pooled_head_rows_keep_each_pieces_bits(
    mode, kind, isa, pooled_head_files, monkeypatch
) -> None:
    """The served head pools the pieces' rows (Transformer._piece_logits): on the quantized
    mode's packed head (PackedLinear) and the ggml mode's (GgmlLinear), int4 and int8, on every
    kernel build this CPU runs (one it cannot run: a skip naming the flags it lacks), each row
    keeps the bits of its piece's own call, on one thread and on two (there a call of 3 to 8
    rows or more, by the head's size, takes the threads; a one-row piece does not). Planted,
    quantized: a head that says any number of rows may be pooled (pool_rows None) sends a
    pooled call past the dense switch to the dense product. Planted, ggml: its head (pool_rows
    None: each row computed alone) given a dense switch at 64 rows. Either way some row moves.
    16 cases: 1.2 s of CPU time in all, the two files written once (0.4 s) included."""
    lacks = kernel_library.missing_flags(isa)
    if lacks:
        pytest.skip(f"this CPU cannot run the {isa} kernels: it lacks {' '.join(lacks)}")
    monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
    model = Llama3Engine.from_gguf(pooled_head_files[kind], mode=mode).model
    head = model.output
    assert type(head) is (packed.PackedLinear if mode == "quantized" else ggml_mode.GgmlLinear)
    assert head._lib is kernel_library.load(isa)
    if mode == "quantized":
        assert head.weight.kind == {"Q4_K": "int4", "Q8_0": "int8"}[kind]
    else:
        assert head.weight.qtype == GGMLQuantizationType[kind]
    for threads in (1, 2):
        assert _moved_pieces(model, threads) == [], threads
    if mode == "quantized":
        monkeypatch.setattr(type(head), "pool_rows", None)
    else:
        weight = head.weight
        dense = quants.dequantize(weight.gguf_blocks(), weight.qtype, (weight.rows, weight.cols))
        ggml_product = type(head)._product

        def dense_past_the_switch(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= packed.DENSE_ROWS:
                return torch.nn.functional.linear(x, dense)
            return ggml_product(self, x)

        monkeypatch.setattr(type(head), "_product", dense_past_the_switch)
    assert _moved_pieces(model, 1) != []


def test_slots_of_is_a_view_of_consecutive_slots_and_a_gather_of_any_other() -> None:
    """model.slots_of: the rows `context` of one layer's cache, in the context's order, a view
    where the slots are consecutive ascending (an empty context: an empty view) and a
    contiguous gather of any other (blocks handed out of order), the same values either way.
    Planted, consecutiveness judged by the context's ends alone: blocks 0, 2, 1, 3 (ends 0
    and 15, 16 slots) took the view of slots 0..15 in order, their keys in the wrong places."""
    cache = torch.randn(32, 2, 4, generator=torch.Generator().manual_seed(3))

    def blocks(*ids: int) -> torch.Tensor:
        return torch.cat([torch.arange(4 * b, 4 * b + 4) for b in ids])

    cases = {  # context: whether it is consecutive
        "in order": (blocks(2, 3, 4), True),
        "one slot": (torch.tensor([9]), True),
        "out of order, ends spanning it": (blocks(0, 2, 1, 3), False),
        "one block moved": (blocks(1, 0, 2, 3), False),
        "reversed": (torch.arange(7, -1, -1), False),
        "empty": (torch.zeros(0, dtype=torch.long), True),
    }
    for name, (context, consecutive) in cases.items():
        got = model_module.slots_of(cache, context)
        assert torch.equal(got, cache[context]), name
        assert got.is_contiguous(), name
        shares = got.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert shares == consecutive, name


class _CountingHead(torch.nn.Module):
    """An LM head that records the rows of each call, pooling up to `pool_rows` rows."""

    def __init__(self, head: torch.nn.Module, pool_rows: int) -> None:
        super().__init__()
        self.head, self.weight, self.pool_rows = head, head.weight, pool_rows
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.head(x)


def test_the_pooled_head_makes_as_few_calls_as_pool_rows_allows(eager, monkeypatch) -> None:
    """Transformer._piece_logits pools the pieces' rows into as few head calls as the head's
    `pool_rows` allows (each pooled call fewer rows than it), a piece of `pool_rows` rows or
    more called alone, a piece asking for no rows given None, and every piece its own rows'
    logits. Planted: the pooled count not reset after a flush (every later piece called
    alone: 6 calls, not 4), the flush at `>` instead of `>=` (a pooled call of 4 rows, on the
    head's other path), an empty piece pooled (an empty tensor, not None), the slice start
    not advanced (every piece of a call given the first piece's rows)."""
    model = eager.model
    head = _CountingHead(model.output, pool_rows=4)
    monkeypatch.setattr(model, "output", head)
    h = torch.randn(11, model.config.dim, generator=torch.Generator().manual_seed(5))
    outputs = [[0], [], [1, 2], [3], [4, 5, 6, 7], [8], [9], [10]]
    with torch.inference_mode():
        logits = model._piece_logits(h, outputs)
        alone = [model._logits(h[rows]) if rows else None for rows in outputs]
    assert head.calls[:4] == [3, 4, 3, 1], head.calls
    assert logits[1] is None
    for piece, (got, expected) in enumerate(zip(logits, alone, strict=True)):
        if expected is not None:
            assert got.shape == expected.shape, piece
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_with_masks_finds_each_pieces_mask_and_whether_all_are_plain(eager, monkeypatch) -> None:
    """Transformer.with_masks gives each piece attention_mask of its rows after its earlier
    positions (None for one query, and for a chunk from position 0), `plain` true only where
    every mask is None or causal, found too for a batch whose masks were given without it;
    unmasked_decode_rows names the rows of unmasked one-row pieces only. Planted: `plain`
    as any() of the pieces (a windowed chunk beside a decode row passed as plain), a batch
    with given masks returned with `plain` unknown, a decode row from a cached position given
    the explicit mask, a chunk from 0 given it, a one-row count dropped from
    unmasked_decode_rows (a prefill from 0 sent to the decode kernels)."""
    model, cpu = eager.model, torch.device("cpu")
    k = torch.zeros(1, 16, 1, 2)
    batch = model_module.PagedBatch(
        k=k, v=k, counts=[1, 3, 2],
        contexts=[torch.arange(5), torch.arange(5, 10), torch.arange(10, 12)],
        write=torch.tensor([4, 7, 8, 9, 10, 11]), fresh=torch.ones(6, dtype=torch.bool),
    )  # fmt: skip
    plain = model.with_masks(batch)
    assert plain.masks[0] is None and plain.masks[2] is None
    assert torch.equal(plain.masks[1], model_module.causal_mask(3, 2, cpu))
    assert plain.plain is True
    assert plain.unmasked_decode_rows().tolist() == [True] + [False] * 5
    window = _window(2)

    def windowed(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor | None:
        return None if seqlen == 1 else window(seqlen, start_pos, device)

    monkeypatch.setattr(model, "attention_mask", windowed)
    got = model.with_masks(batch)
    assert got.masks[0] is None and torch.equal(got.masks[1], window(3, 2, cpu))
    assert got.plain is False
    assert got.unmasked_decode_rows().tolist() == [True] + [False] * 5
    given = model.with_masks(dataclasses.replace(batch, masks=got.masks))
    assert given.masks is got.masks and given.plain is False
    assert model.with_masks(plain) is plain  # masks and plain known: nothing recomputed


def test_setup_caches_grows_each_dimension_alone_and_keeps_the_larger() -> None:
    """Transformer.setup_caches allocates caches for the larger of the asked and the current
    positions and batch, each dimension on its own, does nothing where they are big enough,
    and grows the rope tables with the positions (the shared positions' values unchanged);
    forward serves positions up to max_seq_len exactly and refuses one more. Planted: the
    early return where either dimension fits (a larger batch refused), the positions not
    kept at the larger (a batch grown shrank the caches), the rope tables never regrown, the
    bound of forward at `>=` (the last position refused)."""
    model = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf", mode="eager").model
    config = model.config
    with torch.inference_mode():
        model.setup_caches(16, 1)
        cos16 = model.rope_cos.clone()
        model.setup_caches(8, 2)
        assert (model.max_seq_len, model.max_batch_size) == (16, 2)
        shape = (2, config.n_kv_heads, 16, config.head_dim)
        for layer in model.layers:
            assert layer.attention.cache_k.shape == layer.attention.cache_v.shape == shape
        cache = model.layers[0].attention.cache_k
        model.setup_caches(16, 2)
        assert model.layers[0].attention.cache_k is cache  # big enough: nothing reallocated
        model.setup_caches(40, 1)
        assert (model.max_seq_len, model.max_batch_size) == (40, 2)
        assert model.layers[0].attention.cache_k.shape[:3] == (2, config.n_kv_heads, 40)
        assert model.rope_cos.shape[0] == model.rope_sin.shape[0] == 40
        assert torch.equal(model.rope_cos[:16], cos16)
        tokens = torch.tensor([[5, 6], [7, 8]])
        model.forward(tokens, 0)
        assert model.forward(tokens, 38).shape == (2, 2, config.vocab_size)
        with pytest.raises(ValueError, match="call setup_caches first"):
            model.forward(tokens, 39)
