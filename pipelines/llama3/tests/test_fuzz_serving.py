"""Schedule fuzzing of the serving engine: hypothesis draws whole schedules, and every request
served under them must compute its solo run's numbers.

The golden lanes serve fixed batches through roomy pools: a replay of their scheduler counted
no eviction and no block shared by two live sequences. Here hypothesis (derandomized,
testing/fuzz.py) draws, on a random tiny model (`write_tiny_llama` of
tools/gen_tiny_model/tiny_llama.py, 263 tokens):

- 2 to 8 requests: prompts of 1 to 12 own tokens behind one preamble of up to 24 tokens (most
  behind all of it, so that blocks are shared, cached, evicted and found again), or, for about
  a quarter, an earlier request's prompt cut to its full blocks (a prompt found whole in the
  cache), 1 to 5 new tokens each;
- the step each request arrives at (0 to 10), and for some the step it is cancelled at;
- block size (1, 2, 4 or 8), chunk size (whole prompts, or 1 to 8 tokens), prefix caching on
  or off, a batch limit, and a pool of the fewest blocks the longest request needs plus 0, 1,
  2, 4 or 8, or enough for all (small pools evict cached blocks and preempt sequences).

Each request is teacher-forced through its solo greedy tokens (`Llama3Engine.generate`), so
the check does not hang on near-ties: every step's logits and every prompt position the
request computed equal the solo run's within 1e-4 of its largest |logit| (a batch rounds
otherwise than one row), a cancelled request's steps so far too; and once every request has
finished or been cancelled, no block of the pool is referenced, and no sequence was preempted
in the step that admitted it (`ServingEngine.preempted_on_admission`: an admission leaves the
blocks the running sequences take in its step). A failure prints the schedule
(`Schedule`, a dataclass whose repr is the replayable scenario: `_serve(engine, schedule)`)
and hypothesis's `@reproduce_failure` line; without planted bugs it shrinks to the smallest
schedule that fails.

Five explicit examples run before the drawn ones, whatever the seed: an eviction under prefix
caching (EVICTION_EXAMPLE), a prompt found whole in the cache (WHOLE_PROMPT_EXAMPLE), a
cache hit on blocks a live sequence holds, freed when it ends while the second still reads
them (SHARED_HIT_EXAMPLE), a next turn (an earlier request's prompt and tokens, then more:
`Arrival.continues`) after that request was cancelled in decode (NEXT_TURN_EXAMPLE), and an
admission that must wait for the blocks a running sequence takes (RESERVE_EXAMPLE); the
drawn schedules alone reached the first planted bug below at
example 72 and the last at 112 (and missed the first on 1 of 20 seeds), and the second at 14
in plain pytest but at 108 under Bazel's runner (the same hypothesis, other draws). Planted
scheduler bugs that no golden lane finds (those lanes never evict, never share a block between
live sequences and never cancel), each caught within the first half of the FUZZ_EXAMPLES (150)
examples (the file takes ~10 s on 2 cores):

- eviction that leaves the evicted block's hash in the prefix cache (a later request reads
  another sequence's keys as its prefix);
- a cache hit that does not count its reader (the block is freed, then overwritten, while a
  second live sequence still reads it);
- a cancel that forgets to give its blocks back;
- a prompt found whole in the cache given one position fewer of its last block
  (pool_mutations.ShortWholePromptCopy);
- an admission that leaves none of the blocks the running sequences take in its step (the
  sequence admitted is preempted in that step: RESERVE_EXAMPLE);
- a block published in decode as soon as the token just chosen fills it, one position before
  that token's keys exist (a cancel then leaves it cached; NEXT_TURN_EXAMPLE reads it).

The drawn schedules alone (on a seed of their own) caught the last two at examples 2 and 11.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pipelines.llama3 import Llama3Engine
from pipelines.llama3.serving import Request, ServingEngine, blocks_for
from pipelines.llama3.tests.pool_mutations import (
    EvictionKeepsTheHash,
    ShortWholePromptCopy,
    UncountedHit,
    serving_with,
)
from testing.fuzz import first_failure, fuzz_settings
from tools.gen_tiny_model.tiny_llama import byte_vocab, write_tiny_llama

FUZZ_EXAMPLES = 150
ATOL = 1e-4  # of the solo run's largest |logit|


@dataclasses.dataclass(frozen=True)
class Arrival:
    prompt: tuple[int, ...]
    new_tokens: int
    at: int  # the step it is submitted before
    cancel_at: int | None  # the step it is cancelled before, if still pending
    # a next turn: the prompt of arrival `continues` (earlier) and its solo tokens come before
    # `prompt` (`_prompts`), so its blocks, decode steps' included, are found in the cache
    continues: int | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    arrivals: tuple[Arrival, ...]
    block_size: int
    chunk_size: int | None
    prefix_caching: bool
    max_batch: int | None
    num_blocks: int


@st.composite
def schedules(draw) -> Schedule:
    vocab = len(byte_vocab().tokens)
    token = st.integers(0, vocab - 1)
    preamble = draw(st.lists(token, min_size=0, max_size=24))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    arrivals = []
    for _ in range(draw(st.integers(2, 8))):
        # most requests behind the whole preamble (blocks shared, cached, evicted, found)
        shared = draw(st.sampled_from([len(preamble), len(preamble), draw(st.integers(0, 24))]))
        own = draw(st.lists(token, min_size=1, max_size=12))
        prompt = tuple(preamble[:shared] + own)
        if arrivals and draw(st.integers(0, 3)) == 0:
            # an earlier prompt's full blocks (or all of it, if it has none) as a whole prompt:
            # found whole in the cache once the earlier one has computed them
            earlier = draw(st.sampled_from([a.prompt for a in arrivals]))
            prompt = earlier[: len(earlier) // block_size * block_size] or earlier
        at = draw(st.integers(0, 10))
        cancel = draw(st.one_of(st.none(), st.integers(at, at + 8)))
        new_tokens = draw(st.integers(1, 5))
        arrivals.append(Arrival(prompt, new_tokens, at, cancel))
    needs = [blocks_for(len(a.prompt) + a.new_tokens, block_size) for a in arrivals]
    # from the fewest blocks the longest request needs: a few more (evictions, preemptions)
    # or enough for every request at once
    spare = draw(st.sampled_from([0, 1, 2, 4, 8, sum(needs)]))
    return Schedule(
        arrivals=tuple(arrivals),
        block_size=block_size,
        chunk_size=draw(st.one_of(st.none(), st.integers(1, 8))),
        prefix_caching=draw(st.booleans()),
        max_batch=draw(st.one_of(st.none(), st.integers(1, 4))),
        num_blocks=max(needs) + spare,
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Llama3Engine:
    path = pathlib.Path(tmp_path_factory.mktemp("fuzz_serving")) / "tiny.gguf"
    write_tiny_llama(path, seed=3, n_layers=2)
    return Llama3Engine.from_gguf(path)


_SOLO: dict[tuple[tuple[int, ...], int], object] = {}


def _solo(engine: Llama3Engine, prompt: tuple[int, ...], steps: int):
    key = (prompt, steps)
    if key not in _SOLO:
        positions = range(len(prompt) - 1)
        _SOLO[key] = engine.generate(list(prompt), steps, False, prompt_positions=positions)
    return _SOLO[key]


def _prompts(engine: Llama3Engine, schedule: Schedule) -> list[tuple[int, ...]]:
    """Each arrival's whole prompt: a next turn's (`Arrival.continues`) after the earlier
    prompt and the solo tokens it is forced through."""
    prompts = []
    for a in schedule.arrivals:
        before = ()
        if a.continues is not None:
            earlier = prompts[a.continues]
            steps = schedule.arrivals[a.continues].new_tokens
            before = (*earlier, *_solo(engine, earlier, steps).tokens)
        prompts.append((*before, *a.prompt))
    return prompts


def _serve(
    engine: Llama3Engine, schedule: Schedule, serving_class=ServingEngine, counts=None
) -> list[str]:
    """Serve the schedule; what differs from the solo runs, and blocks left referenced.
    `counts` (a Counter) adds what the schedule exercised."""
    serving = serving_class(
        engine,
        block_size=schedule.block_size,
        num_blocks=schedule.num_blocks,
        chunk_size=schedule.chunk_size,
        max_batch=schedule.max_batch,
        prefix_caching=schedule.prefix_caching,
    )
    requests, prompts = {}, _prompts(engine, schedule)
    for i, a in enumerate(schedule.arrivals):
        solo = _solo(engine, prompts[i], a.new_tokens)
        requests[f"r{i}"] = Request(
            f"r{i}",
            list(prompts[i]),
            a.new_tokens,
            forced_tokens=solo.tokens,
            prompt_positions=tuple(range(len(prompts[i]) - 1)),
        )
    results, step = {}, 0
    last = max(max(a.at, a.cancel_at or 0) for a in schedule.arrivals)
    try:
        while step <= last or serving.pending:
            for i, a in enumerate(schedule.arrivals):
                if a.at == step:
                    serving.submit([requests[f"r{i}"]])
            for i, a in enumerate(schedule.arrivals):
                if a.cancel_at == step and f"r{i}" not in results and a.at <= step:
                    results[f"r{i}"] = serving.cancel(f"r{i}")
            results.update(serving.step())
            step += 1
    except Exception as error:  # a pool that holds the longest request never runs out
        return [f"the schedule raised at step {step}: {error!r}"]
    problems = []
    for i, a in enumerate(schedule.arrivals):
        served, solo = results[f"r{i}"], _solo(engine, prompts[i], a.new_tokens)
        scale = ATOL * max(1.0, float(solo.logits.abs().max()))
        steps = len(served.output.logits)
        if served.finish_reason != "cancelled" and steps != a.new_tokens:
            problems.append(f"r{i}: {steps} steps of {a.new_tokens} ({served.finish_reason})")
        pairs = [(served.output.logits, solo.logits[:steps], "steps")]
        if served.prompt_positions:
            pairs.append(
                (served.output.prompt_logits, solo.prompt_logits[served.prompt_positions], "prompt")
            )
        for ours, theirs, what in pairs:
            delta = float((ours - theirs).abs().max()) if len(ours) else 0.0
            if not delta <= scale:
                problems.append(f"r{i}: {what} logits off the solo run by {delta:.3g}")
    if counts is not None:
        cancelled = [r for r in results.values() if r.finish_reason == "cancelled"]
        counts["cancelled mid-prefill"] += sum(not len(r.output.logits) for r in cancelled)
        counts["cancelled mid-decode"] += sum(bool(len(r.output.logits)) for r in cancelled)
        counts["preemptions"] += serving.preemptions
        counts["prefix cache hits"] += serving.pool.hits
        counts["evictions"] += serving.pool.evictions
        counts["hits on a block a live sequence holds"] += serving.pool.shared_hits
        counts["prompts read whole from the cache"] += serving.pool.whole_prompts
    held = [b for b, refs in enumerate(serving.pool.refs) if refs]
    if held:
        problems.append(f"blocks {held} still referenced after every request ended")
    if serving.preempted_on_admission:  # what an admission's reserve of blocks prevents
        problems.append(
            f"{serving.preempted_on_admission} sequences preempted in the step that admitted them"
        )
    return problems


# A cached block evicted, then freed, while its old hash stays findable only under a planted
# bug: r0's two prompt blocks are cached when it ends; r1 (2 blocks) takes the free block and
# evicts r0's first, which holds r1's last, partial block and is freed when r1 ends; r2 starts
# with r0's prompt, so its lookup of r0's first block must miss. The pool holds 3 blocks, the
# fewest r0 and r2 need, as the strategy draws it; whatever the drawn examples, one evicts.
EVICTION_EXAMPLE = Schedule(
    arrivals=(
        Arrival(prompt=(10, 11, 12, 13), new_tokens=1, at=0, cancel_at=None),
        Arrival(prompt=(20, 21, 22), new_tokens=1, at=1, cancel_at=None),
        Arrival(prompt=(10, 11, 12, 13, 14), new_tokens=1, at=3, cancel_at=None),
    ),
    block_size=2,
    chunk_size=None,
    prefix_caching=True,
    max_batch=None,
    num_blocks=3,
)

# A prompt found whole in the cache (r1 repeats r0's two full blocks, cached since r0 ended):
# its last block is copied to a fresh one before its last position is computed again.
WHOLE_PROMPT_EXAMPLE = Schedule(
    arrivals=(
        Arrival(prompt=(30, 31, 32, 33, 34, 35, 36, 37), new_tokens=1, at=0, cancel_at=None),
        Arrival(prompt=(30, 31, 32, 33, 34, 35, 36, 37), new_tokens=2, at=2, cancel_at=None),
    ),
    block_size=4,
    chunk_size=None,
    prefix_caching=True,
    max_batch=None,
    num_blocks=6,
)

# A hit on blocks a live sequence holds (r1 shares r0's two full blocks while r0 runs); r0
# ends, and r2's prompt needs blocks from a full pool while r1 still reads the shared ones.
SHARED_HIT_EXAMPLE = Schedule(
    arrivals=(
        Arrival(prompt=(40, 41, 42, 43, 44), new_tokens=2, at=0, cancel_at=None),
        Arrival(prompt=(40, 41, 42, 43, 50, 51), new_tokens=6, at=1, cancel_at=None),
        Arrival(prompt=(60, 61, 62, 63, 64, 65), new_tokens=2, at=3, cancel_at=None),
    ),
    block_size=2,
    chunk_size=None,
    prefix_caching=True,
    max_batch=None,
    num_blocks=6,
)


# A next turn after a cancel in decode: r0 (3 prompt tokens, blocks of 2) is cancelled after
# its first step, the token it chose filling its second block (fed, its keys not computed); r1
# is r0's prompt, its 4 solo tokens and one more: it must read r0's first block from the cache,
# not the second.
NEXT_TURN_EXAMPLE = Schedule(
    arrivals=(
        Arrival(prompt=(70, 71, 72), new_tokens=4, at=0, cancel_at=1),
        Arrival(prompt=(73,), new_tokens=2, at=2, cancel_at=None, continues=0),
    ),
    block_size=2,
    chunk_size=None,
    prefix_caching=True,
    max_batch=None,
    num_blocks=6,
)


# An admission beside a running sequence: at step 1, r0 (two blocks of 2) needs a third for its
# decode token, and r1's prompt two; the pool of 4 has two left, so r1 must wait for r0 (were it
# admitted, the step would preempt it at once).
RESERVE_EXAMPLE = Schedule(
    arrivals=(
        Arrival(prompt=(80, 81, 82, 83), new_tokens=4, at=0, cancel_at=None),
        Arrival(prompt=(90, 91, 92, 93), new_tokens=2, at=1, cancel_at=None),
    ),
    block_size=2,
    chunk_size=None,
    prefix_caching=False,
    max_batch=None,
    num_blocks=4,
)


@fuzz_settings(FUZZ_EXAMPLES)
@given(schedule=schedules())
@example(schedule=EVICTION_EXAMPLE)
@example(schedule=WHOLE_PROMPT_EXAMPLE)
@example(schedule=SHARED_HIT_EXAMPLE)
@example(schedule=NEXT_TURN_EXAMPLE)
@example(schedule=RESERVE_EXAMPLE)
def test_every_schedule_serves_the_solo_numbers_and_frees_the_pool(engine, schedule) -> None:
    problems = _serve(engine, schedule)
    assert not problems, f"{schedule}\n" + "\n".join(problems)


# What the drawn schedules must exercise, at least (measured: see the test's output).
# Derandomized, the examples are the same on every run of one runner; Bazel's and plain
# pytest drew other schedules (the uncounted-hit plant was first caught at example 108 under
# Bazel, 14 in plain pytest, with hypothesis 6.170.17 in both), so each planted bug has its
# explicit example above. Measured over the FUZZ_EXAMPLES schedules and the five
# explicit ones (hypothesis 6.170.17): evictions 190, hits on a block a live sequence holds
# 183, prefix cache hits 657, preemptions 216, cancelled mid-prefill 124 and mid-decode 51,
# prompts read whole from the cache 52. Each minimum is half the lower of two figures measured
# with hypothesis 6.155 (136 / 183, 21 / 181, 78 / 652, 87 / 216, 156 / 124, 69 / 50,
# 15 / 51), kept: every count is at least twice its minimum. (Preemptions
# were several times more before admissions stopped taking the blocks running sequences need
# in their step: most were sequences admitted and preempted in the same step. The lookups of
# an admission refused after them are not counted as hits.)
MINIMUMS = {
    "evictions": 68,
    "hits on a block a live sequence holds": 10,
    "prefix cache hits": 39,
    "preemptions": 43,
    "cancelled mid-prefill": 62,
    "cancelled mid-decode": 25,
    "prompts read whole from the cache": 7,
}


def test_the_drawn_schedules_evict_share_preempt_and_cancel(engine, monkeypatch) -> None:
    """The property's own examples, counted: a strategy that stopped drawing small pools,
    shared prefixes or cancellations would pass the property without exercising them."""
    counts = collections.Counter()
    serve = _serve
    monkeypatch.setitem(
        globals(), "_serve", lambda engine, schedule: serve(engine, schedule, counts=counts)
    )
    test_every_schedule_serves_the_solo_numbers_and_frees_the_pool(engine=engine)
    print(dict(counts))
    short = {k: (counts[k], least) for k, least in MINIMUMS.items() if counts[k] < least}
    assert not short, f"counts below their minimums (count, minimum): {short}"


class _AdmissionReservesNothing(ServingEngine):
    """An admission beside running sequences leaves none of the blocks they take this step."""

    def _admit(self, seq, reserve=None):
        return super()._admit(seq, None if reserve is None else 0)


class _PublishesTheBlockItsTokenFills(ServingEngine):
    """In decode, a block is published as soon as the token just chosen fills it, one
    position before that token's keys are computed."""

    def _step(self, seq, logits):
        super()._step(seq, logits)
        while not seq.done and (len(seq.hashes) + 1) * self.block_size <= len(seq.fed):
            key = self._key_of_block(seq, len(seq.hashes))
            self.pool.publish(seq.table[len(seq.hashes)], key)
            seq.hashes.append(key)


class _CancelKeepsBlocks(ServingEngine):
    """Cancel takes the request out of the schedule and keeps its blocks."""

    def cancel(self, request_id):
        self._release = lambda seq: None
        try:
            return super().cancel(request_id)
        finally:
            del self._release


@pytest.mark.parametrize(
    ("serving_class", "match"),
    [
        (serving_with(EvictionKeepsTheHash), "logits off the solo run"),
        (serving_with(UncountedHit), "logits off the solo run|still referenced|raised"),
        (_CancelKeepsBlocks, "still referenced|raised"),
        (ShortWholePromptCopy, "logits off the solo run"),
        (_AdmissionReservesNothing, "preempted in the step that admitted them"),
        (_PublishesTheBlockItsTokenFills, "logits off the solo run"),
    ],
    ids=[
        "eviction-keeps-the-hash",
        "uncounted-cache-hit",
        "cancel-keeps-blocks",
        "short-whole-prompt-copy",
        "admission-reserves-nothing",
        "decode-publishes-a-block-early",
    ],
)
def test_a_planted_scheduler_bug_fails_a_drawn_schedule(engine, monkeypatch, serving_class, match):
    monkeypatch.setitem(globals(), "_serve", _planted(serving_class))
    planted = first_failure(
        monkeypatch,
        test_every_schedule_serves_the_solo_numbers_and_frees_the_pool,
        match=match,
        engine=engine,
    )
    print("\n".join(str(e).splitlines()[1] for e in planted.errors))  # what it saw first
    # Not shrinking, hypothesis stops at FUZZ_EXAMPLES, so `first <= FUZZ_EXAMPLES` could not
    # fail: half of them is the margin.
    assert planted.first <= FUZZ_EXAMPLES // 2, f"found only at example {planted.first}"


def _planted(serving_class):
    serve = _serve

    def planted(engine, schedule):
        return serve(engine, schedule, serving_class)

    return planted
