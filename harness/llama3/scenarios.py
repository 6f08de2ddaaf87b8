"""The serving scenarios of the golden tests: the same golden cases, served the ways a serving
engine serves them (pipelines/llama3/serving.py), held to the same goldens and tolerances.

- `solo`: one case at a time through `Llama3Engine.generate` (its contiguous cache): today's
  test_llama.
- `batch`: all cases of a golden in one ragged batch, in their order and reversed, and split
  into two batches one after the other.
- `chunked`: prefill in chunks of 1, 3, and 5 over blocks of 4 (the long cases: 512 and 1000,
  and 1, 3 and 16 over a window of 512 positions: `windowed`), so prompts cross chunk
  boundaries and chunks cross block boundaries;
  all cases batched; and decode in speculative verification chunks (`spec4`: the forced
  tokens proposed 4 at a time, each decode piece 5 positions).
- `paged`: blocks of 4 and 16 positions (long cases: 16 and 64), so cases cross block
  boundaries.
- `prefix`: each case served after two sibling requests, one sharing its first blocks (read
  from the prefix cache) and one holding its second block's tokens at the start (equal block
  tokens after another history must not be shared). Prompt positions inside the cached prefix
  are not computed again by the case: the sibling that wrote those blocks computed them (the
  same tokens, the same history), and its rows stand in the case's run, so they are compared
  too (the verdict says how many).
- `preempt`: all cases batched in a pool too small for them: sequences are preempted and
  recomputed.
- `pressure`: every case served PRESSURE_COPIES times (at least 18 requests), the copies
  arriving in waves two steps apart while the earlier ones run, with prefix caching, prefill
  in chunks of 8 beside other sequences' decode tokens, through a pool of the longest
  request's blocks + 10: later copies are admitted beside running ones and read blocks that
  those hold, cached blocks are evicted and their hashes looked up again, sequences are
  preempted (+ 2, the preempt lane's pool, admits no copy while another runs: no block is
  shared live). Every copy's rows are
  judged (prompt positions a copy read from the cache: the rows of the copy that computed
  them), and the lane's counters (`Served.counters`) must each reach PRESSURE_MINIMUMS and
  stay within PRESSURE_MAXIMUMS (no sequence preempted in the step that admitted it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import torch

from goldens import schema
from goldens.engines.base import forced_inputs
from goldens.record import CaseSpec
from harness.llama3 import constrained_goldens
from harness.llama3.engine_runs import Run
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.engine import GenerationOutput
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.serving import Request, ServingEngine, blocks_for
from pipelines.llama3.speculative import NgramDraft, Speculation

SCENARIOS = ("solo", "batch", "chunked", "paged", "prefix", "preempt", "pressure")
# The scenarios the long cases (thousands of positions) run: where their length matters.
LONG_SCENARIOS = ("solo", "chunked", "paged", "prefix")


@dataclasses.dataclass(frozen=True)
class Serving:
    """One way to serve a golden's cases."""

    name: str
    block_size: int = 16
    chunk_size: int | None = None
    order: str = "as given"  # as given | reversed | split
    prefix: bool = False
    tight_pool: bool = False
    # > 0: chunks of `chunk_size` only over this many prompt positions ending at WINDOW_END (or
    # the prompt's end), the rest of the prompt in one piece before and after
    window: int = 0
    copies: int = 1  # > 1: each case served this many times, in waves (`pressure`)
    speculate: int = 0  # > 0: speculative decoding, K proposals per decode piece


# `preempt` with many requests (the sampling lanes'): the pool holds this fraction of what they
# need at once.
TIGHT_POOL_SHARE = 5

# The pressure lane: copies of every case (enough for 18 requests in flight), and what its
# counters must reach (each at least once: measured on the tiny files' short cases, float32,
# eager: see the lane's printed counters).
PRESSURE_COPIES = 3
PRESSURE_WAVE_STEPS = 2  # steps between waves
PRESSURE_EXTRA_BLOCKS = 8  # beyond the tight pool's (largest case's blocks + 2)
PRESSURE_IN_FLIGHT = 16  # submitted and not finished: waiting or running
PRESSURE_RUNNING = 4  # admitted at once, holding their blocks (measured 8 on every tiny file)
PRESSURE_MINIMUMS = {
    "evictions": 1,
    "hits on blocks a running sequence holds": 1,
    "evicted hashes looked up again": 1,
    "prompts read whole from the cache": 1,
    "preemptions": 1,
    "steps mixing prefill and decode rows": 1,
}
# ... and what they must not pass: an admission leaves the blocks the running sequences take
# in its step (serving.py's `_step_sequences`), so no sequence is preempted in the step that
# admitted it (without that reserve: 109 of the lane's 131 preemptions, tiny float32, eager).
PRESSURE_MAXIMUMS = {"preemptions in the step that admitted the sequence": 0}

SERVINGS = {
    "batch": (
        Serving("batch"),
        Serving("reversed", order="reversed"),
        Serving("split", order="split"),
    ),
    "chunked": (
        Serving("chunk1", chunk_size=1),
        Serving("chunk3", chunk_size=3),
        # chunks of 5 over blocks of 4: a chunk ends inside a block and the next one fills it
        # (the short prompts are at most 16 ids: chunks of 16 were one piece, as `batch`)
        Serving("chunk5-block4", block_size=4, chunk_size=5),
        # decode in verification chunks: teacher-forced, the forced tokens are the proposals
        # (all accepted), so each decode piece scores K + 1 positions at once
        Serving("spec4", speculate=4),
    ),
    "paged": (Serving("block4", block_size=4), Serving("block16", block_size=16)),
    "prefix": (Serving("prefix", block_size=2, prefix=True),),
    "preempt": (Serving("preempt", block_size=4, tight_pool=True),),
    "pressure": (
        Serving(
            "pressure",
            block_size=4,
            chunk_size=8,
            prefix=True,
            tight_pool=True,
            copies=PRESSURE_COPIES,
        ),
    ),
}
LONG_SERVINGS = {
    "chunked": (Serving("chunk512", chunk_size=512), Serving("chunk1000", chunk_size=1000)),
    "paged": (
        Serving("block16", block_size=16, chunk_size=2048),
        Serving("block64", block_size=64),
    ),
    "prefix": (Serving("prefix", block_size=64, prefix=True, chunk_size=2048),),
}
# Where a long prompt meets small chunks: chunks of 1, 3 and 16 over the 512 positions before
# WINDOW_END (tiny long_8k: 2304 .. 2815, where bfloat16 in chunks of 1 moved position 2560 by
# 0.087), or over the last 16th of a prompt that ends sooner (SmolLM2's 2,138 tokens: its last
# 133, 30 layers a row), the rest in one piece each side.
WINDOW_END = 2816
WINDOW_SHARE = 16  # a prompt ending before WINDOW_END gets a window of a 16th of it at most
LONG_SERVINGS["chunked"] += tuple(
    Serving(f"chunk{size}@window", chunk_size=size, window=512) for size in (1, 3, 16)
)


def servings(scenario: str, lane: str) -> tuple[Serving, ...]:
    """The servings of a scenario in a lane ("long": the long cases' own sizes)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    table = LONG_SERVINGS if lane == "long" else SERVINGS
    return table.get(scenario, ())


def serving_engine(
    engine: Llama3Engine, base: type[ServingEngine], window: int = 0, **config
) -> ServingEngine:
    """A `base` (ServingEngine, or a serving mutation's class) over the engine; with
    `window`, its chunks confined to that window (`windowed`)."""
    return (windowed(base, window) if window else base)(engine, **config)


def window_positions(length: int, window: int) -> range:
    """The positions a `window` serving computes in small chunks, of a prompt of `length`
    positions (`windowed`): the `window` before WINDOW_END, or the last WINDOW_SHARE-th at
    most of a prompt that ends sooner."""
    end = min(WINDOW_END, length)
    size = window if end == WINDOW_END else min(window, end // WINDOW_SHARE)
    return range(max(0, end - size), end)


def windowed(base: type[ServingEngine], window: int) -> type[ServingEngine]:
    """`base` whose prefill takes chunks of `chunk_size` only over the `window` positions
    ending at WINDOW_END (or at the prompt's end, if sooner, and then over a WINDOW_SHARE-th of
    the prompt at most): one piece up to the window, the chunks, one piece after it."""

    def _chunk(self, computed: int, remaining: int) -> int:
        where = window_positions(computed + remaining, window)
        start, end = where.start, where.stop
        if remaining == 1 or self.chunk_size is None:
            return base._chunk(self, computed, remaining)
        if computed < start:
            return start - computed
        if computed < end:
            return min(self.chunk_size, end - computed)
        return remaining

    return type(f"Windowed{base.__name__}", (base,), {"_chunk": _chunk})


@dataclasses.dataclass(frozen=True)
class Served:
    runs: list[Run]
    cached_positions: int  # golden prompt positions read from the prefix cache (the sibling's rows)
    preemptions: int
    cache_hits: int  # blocks the requests read from the prefix cache
    copies: list[list[Run]] = dataclasses.field(default_factory=list)  # pressure: copy 1, 2, ...
    counters: dict[str, int] = dataclasses.field(default_factory=dict)  # pressure: what it did
    verified: int = 0  # speculation: proposals verified (scored in a decode piece)


class PathNotTaken(AssertionError):
    """A serving did not take the path its scenario exists for (no prefix-cache hit in
    `prefix`, no preemption in `preempt`): its verdict would prove nothing about that path."""


class BlocksHeld(AssertionError):
    """A serving kept blocks of the pool after every request it served had finished."""


def _serve(server: ServingEngine, requests: list[Request]) -> dict:
    """`server.serve(requests)`, then every block of the pool given back: free, or cached and
    evictable (a finished request holds none; a leak would starve the next requests)."""
    results = server.serve(requests)
    _check_pool_given_back(server, [r.id for r in requests])
    return results


def _check_pool_given_back(server: ServingEngine, served: list[str]) -> None:
    pool = server.pool
    held = [b for b in range(pool.num_blocks) if pool.refs[b]]
    if held or pool.available() != pool.num_blocks:
        raise BlocksHeld(
            f"{type(server).__name__}: {len(held)} of {pool.num_blocks} blocks still held after "
            f"serving {served} to completion (blocks {held[:8]})"
        )


def served_runs(
    engine: Llama3Engine,
    golden: schema.Golden,
    serving: Serving,
    serving_class: type[ServingEngine] = ServingEngine,
) -> Served:
    """Every case of `golden` teacher-forced through a `serving_class` as `serving` says."""
    requests = [_request(engine, case) for case in golden.cases]
    if serving.speculate:
        speculation = Speculation(NgramDraft(), serving.speculate)
        requests = [dataclasses.replace(r, speculation=speculation) for r in requests]
    max_context = max(len(r.prompt) + r.max_new_tokens for r in requests) + 8
    config = dict(
        block_size=serving.block_size,
        chunk_size=serving.chunk_size,
        prefix_caching=serving.prefix,
        max_context=max_context,
        window=serving.window,
    )
    if serving.tight_pool:
        lengths = [len(r.prompt) + r.max_new_tokens for r in requests]
        config["num_blocks"] = max(blocks_for(n, serving.block_size) for n in lengths) + 2
    results = {}
    if serving.copies > 1:
        return _pressure(engine, golden, requests, serving, serving_class, config)
    if serving.prefix:
        # One pool for every case and its siblings: the cache the case reads is theirs.
        blocks = _prefix_pool(requests, serving)
        server = serving_engine(engine, serving_class, max_batch=1, num_blocks=blocks, **config)
        for request in requests:
            family = [*_siblings(request, serving.block_size, engine.config.vocab_size), request]
            served = _serve(server, family)
            results[request.id] = _with_siblings_rows(served, request)
    elif serving.order == "split":
        blocks = _all_blocks(requests, serving)
        server = serving_engine(engine, serving_class, **config, num_blocks=blocks)
        half = len(requests) // 2
        results.update(_serve(server, requests[:half]))
        results.update(_serve(server, requests[half:]))
    else:
        server = serving_engine(engine, serving_class, **config)
        order = requests[::-1] if serving.order == "reversed" else requests
        results = _serve(server, order)
    runs, cached, preemptions = _runs(golden, requests, results)
    verified = sum(
        sum(r.output.speculation.proposed) for r in results.values() if r.output.speculation
    )
    return Served(runs, cached, preemptions, server.pool.hits, verified=verified)


def _runs(golden: schema.Golden, requests: list[Request], results: dict):
    """The served results of `requests` (one per case, in order) as runs; the golden prompt
    positions read from the prefix cache, and the preemptions, summed."""
    runs, cached, preemptions = [], 0, 0
    for case, request in zip(golden.cases, requests, strict=True):
        served = results[request.id]
        out = served.output
        spec = CaseSpec(case.id, case.prompt, len(case.steps), len(case.steps[0].topk_ids))
        prompt_logits = None if out.prompt_logits is None else out.prompt_logits.numpy()
        runs.append(
            Run(
                spec,
                request.prompt,
                list(out.tokens),
                out.logits.numpy(),
                out.prefill_seconds,
                list(served.prompt_positions),
                prompt_logits,
            )
        )
        cached += sum(p < served.cached_prefix for p in served.prompt_positions)
        preemptions += served.preemptions
    return runs, cached, preemptions


def _copy(request: Request, k: int) -> Request:
    return dataclasses.replace(request, id=request.id if k == 0 else f"{request.id}/copy{k}")


def _pressure(engine, golden, requests, serving, serving_class, config) -> Served:
    """`pressure` (module docstring): the copies of every case in waves, one tight pool."""
    copies = max(serving.copies, -(-(PRESSURE_IN_FLIGHT + 2) // len(requests)))
    waves = [[_copy(r, k) for r in requests] for k in range(copies)]
    if not serving.tight_pool:  # room for every copy at once (what the lane must not be)
        config = {**config, "num_blocks": copies * _all_blocks(requests, serving)}
    else:  # the largest case's blocks and a few more: copies admitted beside running ones
        config = {**config, "num_blocks": config["num_blocks"] + PRESSURE_EXTRA_BLOCKS}
    server = serving_engine(engine, serving_class, **config)
    results, step, in_flight, running = {}, 0, 0, 0
    while waves or server.pending:
        if waves and step % PRESSURE_WAVE_STEPS == 0:
            server.submit(waves.pop(0))
        in_flight = max(in_flight, server.pending)  # submitted, not finished: waiting or running
        results.update(server.step())
        running = max(running, len(server.running))  # admitted and holding their blocks
        step += 1
    _check_pool_given_back(server, list(results))
    for request in requests:  # rows a copy read from the cache: the copy's that computed them
        ids = [_copy(request, k).id for k in range(copies)]
        for request_id in ids:
            results[request_id] = _with_rows_of(results, request_id, ids, request)
    runs, cached, preemptions = _runs(golden, requests, results)
    others = [_runs(golden, [_copy(r, k) for r in requests], results)[0] for k in range(1, copies)]
    pool = server.pool
    counters = {
        "requests in flight at once": in_flight,
        "requests running at once": running,
        "evictions": pool.evictions,
        "hits on blocks a running sequence holds": pool.shared_hits,
        "evicted hashes looked up again": pool.refound,
        "prompts read whole from the cache": pool.whole_prompts,
        "preemptions": server.preemptions,
        "steps mixing prefill and decode rows": server.mixed_steps,
        "preemptions in the step that admitted the sequence": server.preempted_on_admission,
    }
    return Served(runs, cached, preemptions, pool.hits, others, counters)


def sampled_served(
    engine: Llama3Engine,
    golden: schema.Golden,
    serving: Serving,
    serving_class: type[ServingEngine] = ServingEngine,
) -> dict[tuple[str, str], GenerationOutput]:
    """Each case's seeded continuation under each of its samplers (its sampling goldens), and
    each of its constrained continuations (greedy and seeded: its constrained goldens, with
    every step's allowed ids), all served together as `serving` says (served_outputs: in
    `prefix`, in turns over the prompts, so that a prompt's later requests read its blocks
    from the cache), keyed (case, sampler) and as constrained_goldens.keys says."""
    keyed = {}
    for case in golden.cases:
        for sampled in case.sampling:
            settings = SamplerSettings(**sampled.settings)
            request_id = f"{case.id}/{sampled.sampler}"
            prompt = list(case.input_ids)
            keyed[(case.id, sampled.sampler)] = Request(
                request_id, prompt, len(sampled.tokens), sampling=settings
            )
    for key, case, entry, seeded in constrained_goldens.requests(golden):
        keyed[key] = Request(
            "/".join(key),
            list(case.input_ids),
            len(entry.sampled.tokens if seeded else entry.steps),
            sampling=SamplerSettings(**entry.sampled.settings) if seeded else None,
            constraint=constrained_goldens.constraint_of(entry),
            record_allowed=True,
        )
    if not keyed:
        return {}
    keys = {request.id: key for key, request in keyed.items()}
    results = served_outputs(engine, list(keyed.values()), serving, serving_class)
    return {keys[request_id]: output for request_id, output in results.items()}


def served_outputs(
    engine: Llama3Engine,
    requests: list[Request],
    serving: Serving,
    serving_class: type[ServingEngine] = ServingEngine,
) -> dict[str, GenerationOutput]:
    """`requests` served together as `serving` says, their outputs by request id. A serving
    that does not take its scenario's path raises PathNotTaken: `prefix` without a cache hit
    for each request whose prompt an earlier request cached, `preempt` without a preemption."""
    config = dict(
        block_size=serving.block_size,
        chunk_size=serving.chunk_size,
        prefix_caching=serving.prefix,
        max_context=max(len(r.prompt) + r.max_new_tokens for r in requests) + 8,
        window=serving.window,
    )
    if serving.tight_pool:
        # a fifth of the blocks the requests need at once (at least the largest one's + 2):
        # a few run together and preempt each other, where the largest + 2 would run them
        # nearly one at a time (SmolLM2's 36 sampled requests: 149 steps, 44 this way)
        lengths = [len(r.prompt) + r.max_new_tokens for r in requests]
        blocks = [blocks_for(n, serving.block_size) for n in lengths]
        config["num_blocks"] = max(max(blocks) + 2, sum(blocks) // TIGHT_POOL_SHARE)
    if serving.prefix:
        # As many requests at a time as there are prompts, taken in turns over the prompts:
        # a prompt's later requests read its blocks from the cache, held by its running
        # request or left by a finished one, beside the other prompts' requests.
        by_prompt: dict[tuple, list[Request]] = {}
        for request in requests:
            by_prompt.setdefault(tuple(request.prompt), []).append(request)
        turns = [r for group in itertools.zip_longest(*by_prompt.values()) for r in group if r]
        blocks = _all_blocks(requests, serving)
        server = serving_engine(
            engine, serving_class, max_batch=len(by_prompt), num_blocks=blocks, **config
        )
        results = _serve(server, turns)
        reuses = len(requests) - len(by_prompt)
        if reuses and server.pool.hits < reuses:
            raise PathNotTaken(
                f"{serving.name}: {server.pool.hits} prefix-cache hits for {reuses} requests "
                "whose prompt an earlier request had cached: the prefix cache was not read"
            )
    elif serving.order == "split":
        server = serving_engine(
            engine, serving_class, **config, num_blocks=_all_blocks(requests, serving)
        )
        half = len(requests) // 2
        results = {**_serve(server, requests[:half]), **_serve(server, requests[half:])}
    else:
        server = serving_engine(engine, serving_class, **config)
        results = _serve(server, requests[::-1] if serving.order == "reversed" else requests)
        if serving.tight_pool and len(requests) > 1 and not server.preemptions:
            raise PathNotTaken(f"{serving.name}: no request was preempted in its tight pool")
    return {request_id: served.output for request_id, served in results.items()}


def _request(engine: Llama3Engine, case: schema.Case) -> Request:
    """The case as a served request: what forced_run feeds generate (forced_inputs)."""
    input_ids, positions = forced_inputs(case, engine.tokenizer.encode(case.prompt))
    return Request(case.id, input_ids, len(case.steps), list(case.token_ids), tuple(positions))


def _siblings(request: Request, block_size: int, vocab: int) -> list[Request]:
    """The requests served before a case in `prefix`: one holding the case's second block's
    tokens at its start (another history), then one sharing the case's full blocks."""
    prompt, full = request.prompt, (len(request.prompt) - 1) // block_size
    other = [(t + 1) % vocab for t in prompt[-3:]]  # differs from what follows the blocks
    siblings = []
    if full >= 2:
        shifted = [*prompt[block_size : 2 * block_size], *other]
        siblings.append(Request(f"{request.id}/shifted", shifted, 1))
    if full >= 1:
        shared = full * block_size
        positions = tuple(p for p in request.prompt_positions if p < shared)
        sharing = [*prompt[:shared], *other]
        siblings.append(Request(f"{request.id}/sharing", sharing, 1, prompt_positions=positions))
    return siblings


def _with_siblings_rows(served: dict, request: Request):
    """The case's result with the prompt rows it read from the prefix cache taken from the
    sibling that computed them (`/sharing`: the case's tokens up to its shared blocks), in the
    order of the case's prompt_positions; a position neither computed stays out, and the
    comparison fails it as missing."""
    own, sibling = served[request.id], served.get(f"{request.id}/sharing")
    if sibling is None or not sibling.prompt_positions:
        return own
    rows = {}
    for source in (sibling, own):  # the case's own rows win where both computed one
        if source.output.prompt_logits is not None:
            rows.update(zip(source.prompt_positions, source.output.prompt_logits, strict=True))
    positions = [p for p in request.prompt_positions if p in rows]
    logits = torch.stack([rows[p] for p in positions]) if positions else None
    output = dataclasses.replace(own.output, prompt_logits=logits)
    return dataclasses.replace(own, output=output, prompt_positions=positions)


def _with_rows_of(results: dict, request_id: str, ids: list[str], request: Request):
    """`request_id`'s result with each prompt row it did not compute (read from the prefix
    cache) taken from the first of `ids` that computed it: the same tokens, the same history."""
    rows = {}
    for source in [results[request_id], *(results[i] for i in ids)]:
        if source.output.prompt_logits is not None:
            for p, row in zip(source.prompt_positions, source.output.prompt_logits, strict=True):
                rows.setdefault(p, row)
    own = results[request_id]
    positions = [p for p in request.prompt_positions if p in rows]
    logits = torch.stack([rows[p] for p in positions]) if positions else None
    output = dataclasses.replace(own.output, prompt_logits=logits)
    return dataclasses.replace(own, output=output, prompt_positions=positions)


def _prefix_pool(requests: list[Request], serving: Serving) -> int:
    """Blocks for every case and its siblings at once: nothing is evicted during the run."""
    return 3 * _all_blocks(requests, serving)


def _all_blocks(requests: list[Request], serving: Serving) -> int:
    # + 3: a sibling's own tokens after the blocks it shares
    lengths = [len(r.prompt) + r.max_new_tokens + 3 for r in requests]
    return sum(blocks_for(n, serving.block_size) for n in lengths) + 1


def max_logprob_delta(runs: list[Run], solo: list[Run]) -> float:
    """Max |Δ log-prob| between served and solo runs of the same cases (steps and the prompt
    positions both computed): 0.0 is bitwise the same distribution. A non-finite difference
    (a NaN or +inf logit, whose row's log-probs are all NaN; an id at -inf on one side only)
    is inf, past every bound: Python's max(worst, nan) keeps worst, so a NaN served row
    scored 0.0, bitwise. An id at -inf on both sides (ruled out by a constraint in both) has
    the same log-prob there, a difference of 0."""
    by_id = {run.spec.id: run for run in solo}
    worst = 0.0
    for run in runs:
        other = by_id[run.spec.id]
        pairs = [(run.logits, other.logits)]
        rows = other.prompt_logits if other.positions else []
        theirs = dict(zip(other.positions, rows, strict=True))
        pairs += [
            (run.prompt_logits[i][None], theirs[p][None])
            for i, p in enumerate(run.positions)
            if p in theirs
        ]
        for a, b in pairs:
            worst = max(worst, _row_gap(a, b))
    return worst


def _row_gap(served: np.ndarray, alone: np.ndarray) -> float:
    """max |Δ log-prob| of two [rows, vocab] logits, in float64, from their rows that differ
    (a row with the same bits has the same log-probs: 0). Δ_i = (a_i - b_i) - (lse(a) - lse(b)),
    so a row's worst is its largest or smallest a - b against the shift of the log-sum-exps:
    two passes fewer over the vocabulary than log-softmaxes compared element by element, the
    same value to rounding (1e-15). An id at -inf on both sides has a - b NaN, which fmax and
    fmin skip (the same log-prob there); a NaN or +inf logit makes its row's log-sum-exp NaN,
    and an id at -inf on one side a - b infinite: inf either way."""
    rows = (served != alone).any(axis=-1)
    if not rows.any():
        return 0.0
    if not rows.all():
        served, alone = served[rows], alone[rows]
    a, b = served.astype(np.float64), alone.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN
        shift = _logsumexp(a) - _logsumexp(b)
        a -= b
        gaps = np.fmax(np.fmax.reduce(a, axis=-1) - shift, shift - np.fmin.reduce(a, axis=-1))
        gap = float(gaps.max())
    return gap if math.isfinite(gap) else math.inf


def _logsumexp(rows: np.ndarray) -> np.ndarray:
    top = rows.max(axis=-1)
    shifted = rows - top[:, None]
    np.exp(shifted, out=shifted)
    return top + np.log(shifted.sum(axis=-1))
