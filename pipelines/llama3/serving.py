"""The paths a serving engine takes: many requests at once over a paged KV cache.

`ServingEngine(engine, block_size=16, ...)` serves a list of `Request`s the way vLLM, SGLang or
llama.cpp's server do. It keeps the block pool, the schedule and the prefix cache, and computes
nothing of the transformer: each step is one call of the model's ragged forward
(`Transformer.forward_paged` over a `model.PagedBatch` of the pool), and each sequence's next
token is the decoder's (`decoder.Decoder`, the one `Llama3Engine.generate` uses):

- **Paged KV cache** (`BlockPool`): keys and values live in a pool of fixed-size blocks,
  [layers, blocks, block_size, kv_heads, head_dim]; each sequence has a block table, position p
  lives in slot `table[p // block_size] * block_size + p % block_size`.
- **Continuous batching** (`step`): one forward pass runs the next piece of every running
  sequence, prefill chunks and single decode tokens of different sequences together, ragged:
  their rows are concatenated, never padded. Projections and feed-forward run over all rows;
  attention runs per sequence over the keys its block table names.
- **Chunked prefill**: a prompt enters `chunk_size` tokens per step (None: whole).
- **Prefix caching**: a full block is published under a hash chained on its parent block's
  hash; a new request reuses the longest run of its full blocks already in the pool
  (reference counted; a block nobody uses stays cached and is evicted least recently used).
  The last prompt token is always computed (its logits are the first step's): a prompt found
  whole in the cache, its last block full, takes a copy of that block's other positions into
  a block of its own (`_copy_positions`) and computes only the last one, so a repeated prompt
  costs one row, not a block.
- **Admission**: a waiting request is admitted when the pool, less the blocks the running
  sequences take this step, has room for its first piece.
- **Preemption**: when the pool has no free block for a running sequence, the most recently
  admitted one gives its blocks back and is recomputed later from its tokens (prompt and what
  it was fed), then continues: with the same tokens where its recomputed rows choose them
  (the ggml mode's bit for bit; eager's and quantized's within the serving bound of the
  solo run, 5.7e-5 measured, since a prefill's rows round as a batch).
- **Each mode's kernels read the paged cache**: the quantized mode's attention
  (packed.PackedAttention.forward_paged) runs a decode row through `decode_attention_paged`
  over its block table's slots (bit-identical to the contiguous kernel `generate` uses);
  prefill pieces run SDPA over the gathered keys. A step of decode rows only is one kernel
  call through every layer in the quantized and ggml modes (packed.PackedTransformer's
  forward_paged: `packed_decode_paged`, `ggml_decode_paged`), the same bits as their modules.
- **Speculative decoding per request** (`Request.speculation`): a decode piece is the token
  just chosen and the draft's proposals (`speculative.py`), scored in the same forward as every
  other piece; the one decoder verifies them (the same decisions as `generate`'s); the rejected
  proposals' positions are dropped, their blocks freed, never published to the prefix cache.
- **Teacher forcing per request**: `Request.forced_tokens` feeds the golden's tokens, as
  `Llama3Engine.generate` does; `prompt_positions` returns logits of those prompt positions
  (positions read from the prefix cache are not computed, so not returned).

Each request's result is a `GenerationOutput`, as from `Llama3Engine.generate`. The single
sequence path stays `generate` (its contiguous cache); the golden tests hold both to the same
goldens (their `solo` lane and the serving scenarios). The methods `_slot`, `_write_slot`,
`_positions`, `_context_slots`, `_block_hash`, `_resume_from`, `_new_pool` and
`_copy_positions` are the seams the scenario mutations and the pool's planted bugs replace;
`_accepted_end` and `_free_rejected` those of the speculation tests. CPU and CUDA share this
code (torch operators only); it is tested on the CPU only.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Sequence

import torch

from pipelines.llama3 import constrained, profiling, speculative
from pipelines.llama3.decoder import Decoder
from pipelines.llama3.engine import GenerationOutput, Llama3Engine
from pipelines.llama3.model import PagedBatch
from pipelines.llama3.sampling import SamplerSettings


@dataclasses.dataclass(frozen=True)
class Served:
    """A request's result: what `Llama3Engine.generate` returns, and how it was served."""

    output: GenerationOutput
    prompt_positions: list[int]  # the positions whose logits were computed (not cached)
    cached_prefix: int  # prompt positions read from the prefix cache
    preemptions: int
    # "stop" (an end-of-sequence id or a stop string), "length" (max_new_tokens), or
    # "cancelled" (ServingEngine.cancel: the steps computed before it)
    finish_reason: str = "length"


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    prompt: list[int]
    max_new_tokens: int
    # teacher forcing: fed instead of the greedy choice, one per step (max_new_tokens of them)
    forced_tokens: list[int] | None = None
    prompt_positions: tuple[int, ...] = ()  # prompt positions whose logits to return
    sampling: SamplerSettings | None = None  # None: greedy (decoder.Decoder)
    stop: tuple[str, ...] = ()  # stop strings: the generated text containing one ends it
    ignore_eos: bool = False  # True: the checkpoint's end-of-sequence ids do not stop it
    # speculative decoding: each decode step feeds the draft's proposals after the token just
    # chosen, one forward scores them, the decoder verifies them (speculative.py)
    speculation: speculative.Speculation | None = None
    # constrained decoding: the output held to a JSON schema, regex, choice or grammar, with
    # its own matcher (constrained.py) in the request's decoder
    constraint: constrained.Constraint | None = None
    record_allowed: bool = False  # constrained: return each step's allowed ids (checks only)


def blocks_for(positions: int, block_size: int) -> int:
    """How many blocks `positions` keys take."""
    return -(-positions // block_size)


class PoolExhausted(RuntimeError):
    """A single sequence needs more blocks than the whole pool holds."""


class BlockPool:
    """Fixed-size KV blocks with reference counts and a prefix cache (hash -> block)."""

    def __init__(self, engine: Llama3Engine, num_blocks: int, block_size: int) -> None:
        config = engine.config
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.v = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> its prefix hash
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        # what the pool went through, for the lanes that must exercise it
        self.hits = 0  # prefix cache hits
        self.shared_hits = 0  # ... on a block a running sequence holds (shared while live)
        self.evictions = 0  # cached blocks taken for new keys
        self.evicted: set[bytes] = set()  # the hashes evicted so far
        self.refound = 0  # lookups of an evicted hash (a miss: the prefix is computed again)
        self.whole_prompts = 0  # prompts read whole but their last position (a block copied)

    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int | None:
        """A block for new keys: a free one, else the least recently used cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            key = self.hash_of.pop(block)
            del self.cached[key]
            self.evicted.add(key)
            self.evictions += 1
        else:
            return None
        self.refs[block] = 1
        return block

    def peek(self, key: bytes) -> int | None:
        """The cached block of this prefix hash, or None: nothing referenced or counted."""
        return self.cached.get(key)

    def lookup(self, key: bytes) -> int | None:
        """The cached block of this prefix hash, now referenced once more; None if absent."""
        block = self.cached.get(key)
        if block is None:
            self.refound += key in self.evicted
            return None
        if self.refs[block] == 0:
            del self.evictable[block]
        else:
            self.shared_hits += 1
        self.refs[block] += 1
        self.hits += 1
        return block

    def publish(self, block: int, key: bytes) -> None:
        """Make a full block findable by its prefix hash (the first block with a hash keeps it)."""
        if key not in self.cached and block not in self.hash_of:
            self.cached[key] = block
            self.hash_of[block] = key

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None  # kept for later hits until evicted
            else:
                self.free.append(block)


@dataclasses.dataclass
class _Sequence:
    request: Request
    order: int  # admission order: the last admitted is preempted first
    fed: list[int]  # tokens whose keys are computed or pending: prompt, then fed tokens
    computed: int = 0  # positions of `fed` whose keys are in the pool
    table: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its full blocks
    decoder: Decoder | None = None  # the next token and the stop (set by `serve`)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    prompt_logits: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    cached_prefix: int = 0  # prompt positions read from the prefix cache
    preemptions: int = 0
    skip: set[int] = dataclasses.field(default_factory=set)  # positions not recomputed
    done: bool = False
    # `_slot` of positions 0.. under the block table `slots_of` (the same list object: a new
    # table, after a preemption, starts it again; appended blocks move no earlier position)
    slots: list[int] = dataclasses.field(default_factory=list)
    slots_of: list[int] | None = None
    submitted: float = 0.0  # time.perf_counter() at submit
    proposal: list[int] = dataclasses.field(default_factory=list)  # this step's draft tokens
    dists: list | None = None  # what a sampling draft drew them from (None: deterministic)
    stats: speculative.Stats | None = None  # with speculation: proposals and acceptances
    admitted_at: int = -1  # ServingEngine.steps when it was last admitted


class ServingEngine:
    """Serves requests with continuous batching over a paged KV cache (module docstring)."""

    def __init__(
        self,
        engine: Llama3Engine,
        block_size: int = 16,
        num_blocks: int | None = None,
        chunk_size: int | None = None,
        max_batch: int | None = None,
        prefix_caching: bool = False,
        max_context: int = 16384,
    ) -> None:
        if block_size < 1 or (chunk_size is not None and chunk_size < 1):
            raise ValueError(f"block_size {block_size} and chunk_size {chunk_size} must be >= 1")
        self.engine, self.model = engine, engine.model
        self.num_blocks = num_blocks  # None: enough for every request of a `serve` at once
        self.pool: BlockPool | None = None
        self.block_size, self.chunk_size, self.max_batch = block_size, chunk_size, max_batch
        self.prefix_caching = prefix_caching
        self.model.setup_rope(max_context)
        self.max_context = max_context
        self.preemptions = 0
        self.steps = 0
        # steps whose forward ran a piece starting inside its prompt beside one starting past
        # it (a step of prompt pieces only, or of generated tokens only, is not counted)
        self.mixed_steps = 0
        # preemptions of a sequence in the step that admitted it: what the admission reserve
        # (`_step_sequences`) exists to prevent; 0 while it holds
        self.preempted_on_admission = 0
        self.batch: list[tuple[_Sequence, int, int]] = []
        self.waiting: collections.deque[_Sequence] = collections.deque()  # in arrival order
        self.running: list[_Sequence] = []
        self._order = 0  # admission order of the next request (the last is preempted first)

    # --- the seams the scenario mutations replace --------------------------------------------

    def _slot(self, seq: _Sequence, position: int) -> int:
        """Where position `position` of `seq` lives in the pool's flattened slots."""
        return seq.table[position // self.block_size] * self.block_size + position % self.block_size

    def _write_slot(self, seq: _Sequence, position: int, decoding: bool) -> int:
        """Where the keys and values of a new position go: its own slot."""
        return self._slot(seq, position)

    def _positions(self, seq: _Sequence, start: int, count: int) -> list[int]:
        """The sequence positions of a piece of `count` tokens from `start` (its RoPE angles)."""
        return list(range(start, start + count))

    def _context_slots(self, batch: list[tuple[_Sequence, int, int]], index: int) -> list[int]:
        """The slots whose keys sequence `index` of the batch attends to: its own positions."""
        seq, start, count = batch[index]
        if seq.slots_of is not seq.table:
            seq.slots, seq.slots_of = [], seq.table
        # each position's slot asked of `_slot` once per table, not once per step: a chunk of
        # one token deep in an 8k prompt asked for 8k slots a step
        seq.slots += [self._slot(seq, p) for p in range(len(seq.slots), start + count)]
        return seq.slots[: start + count]

    def _block_hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """A full block's prefix hash: chained on its parent's, so equal tokens after a
        different history never share a block."""
        return hashlib.sha256(parent + b"|" + ",".join(map(str, tokens)).encode()).digest()

    def _new_pool(self, num_blocks: int) -> BlockPool:
        """The block pool (made at the first submit)."""
        return BlockPool(self.engine, num_blocks, self.block_size)

    def _resume_from(self, seq: _Sequence) -> list[int]:
        """The positions a preempted sequence recomputes when it is admitted again: all."""
        return list(range(len(seq.fed)))

    def _copy_positions(self, source: int, copy: int, count: int) -> None:
        """Every layer's keys and values of block `source`'s first `count` positions into
        block `copy` (a prompt found whole in the cache: all of its last block but the last
        position, which the request computes)."""
        pool = self.pool
        pool.k[:, copy, :count] = pool.k[:, source, :count]
        pool.v[:, copy, :count] = pool.v[:, source, :count]

    # --- serving ---------------------------------------------------------------------------

    @torch.inference_mode()
    def serve(self, requests: Sequence[Request]) -> dict[str, Served]:
        """Every request to completion; requests beyond `max_batch` wait for a place. The
        pool (and its prefix cache) lives on across calls."""
        if self.pending:
            raise ValueError(
                f"serve() runs its own requests to completion; {self.pending} submitted ones "
                "are pending: step() them to completion, or cancel() them, first"
            )
        start = time.perf_counter()
        self.submit(requests)
        finished: dict[str, _Sequence] = {}
        try:
            while self.waiting or self.running:
                with profiling.region("serving step"):
                    stepped = self._step_sequences()
                finished.update((seq.request.id, seq) for seq in stepped)
        except BaseException:
            for seq in [*self.running, *self.waiting]:  # nothing left behind for a next call
                self._release(seq)
            self.running.clear()
            self.waiting.clear()
            raise
        seconds = time.perf_counter() - start
        return {r.id: self._output(finished[r.id], seconds) for r in requests}

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests behind those waiting; `step` serves them. The first call sizes the
        pool (`num_blocks`, else enough for these requests at once). All or nothing: a request
        refused (by the checks, or by its decoder: its constraint, its forced tokens) refuses
        the whole call, and none of its requests is queued."""
        self._check(requests)
        ids = collections.Counter(r.id for r in requests)
        ids.update(seq.request.id for seq in [*self.waiting, *self.running])
        clash = sorted(i for i, n in ids.items() if n > 1)
        if clash:
            raise ValueError(f"request ids {clash} are not unique among the pending requests")
        decoders = []
        for r in requests:  # every request's decoder before any request is queued
            try:
                decoders.append(self._decoder(r))
            except ValueError as error:  # e.g. constrained.ConstraintError: named, type kept
                error.args = (f"request {r.id!r}: {error}", *error.args[1:])
                raise
        if self.pool is None:
            lengths = [len(r.prompt) + r.max_new_tokens for r in requests]
            needed = sum(blocks_for(n, self.block_size) for n in lengths)
            self.pool = self._new_pool(self.num_blocks or needed + 1)
        now = time.perf_counter()
        for r, decoder in zip(requests, decoders, strict=True):
            seq = _Sequence(r, self._order, list(r.prompt), decoder=decoder, submitted=now)
            seq.stats = speculative.Stats() if r.speculation is not None else None
            self.waiting.append(seq)
            self._order += 1

    @torch.inference_mode()
    def step(self) -> dict[str, Served]:
        """One scheduler step (admissions, one forward over every running sequence's piece);
        the requests it finished, by id. Nothing pending: nothing done."""
        with profiling.region("serving step"):
            stepped = self._step_sequences()
        return {
            seq.request.id: self._output(seq, time.perf_counter() - seq.submitted)
            for seq in stepped
        }

    def cancel(self, request_id: str) -> Served:
        """Stop a waiting or running request now: its blocks go back to the pool at once (the
        full blocks it published stay in the prefix cache, as any finished request's do; a
        block it was filling was never published). Its steps so far, `finish_reason`
        "cancelled"."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request.id == request_id:
                    queue.remove(seq)
                    self._release(seq)
                    seq.decoder.finish_reason = "cancelled"
                    return self._output(seq, time.perf_counter() - seq.submitted)
        raise KeyError(f"no pending request {request_id!r} (finished, cancelled or never sent)")

    def generated(self) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
        """Each pending request's steps so far, by id: its tokens and each step's logits
        (the lists themselves, read between steps; a streaming server sends what is new)."""
        return {
            seq.request.id: (seq.decoder.tokens, seq.logits)
            for seq in [*self.running, *self.waiting]
        }

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished or cancelled."""
        return len(self.waiting) + len(self.running)

    def _step_sequences(self) -> list[_Sequence]:
        waiting, running = self.waiting, self.running
        if not (waiting or running):
            return []
        # Blocks the running sequences take this step: an admission may not take them (it
        # would be preempted at once, and its prefix lookups wasted).
        reserve = sum(self._blocks_wanted(seq) for seq in running)
        while waiting and (self.max_batch is None or len(running) < self.max_batch):
            if not self._admit(waiting[0], reserve if running else None):
                break
            reserve += self._blocks_wanted(waiting[0])
            running.append(waiting.popleft())
        if not running:
            raise PoolExhausted(
                f"request {waiting[0].request.id!r} needs more than the pool's "
                f"{self.pool.num_blocks} blocks of {self.block_size}"
            )
        pieces = self._schedule(running, waiting)
        if pieces:
            with profiling.region("serving forward"):
                self._forward(pieces)
        done = [s for s in running if s.done]
        for seq in done:
            running.remove(seq)
            self._release(seq)
        return done

    def _decoder(self, request: Request) -> Decoder:
        """The request's decoder: the checkpoint's end-of-sequence ids, as generate's; its
        rules are generate's (one step per forced token, a constraint needs the ids)."""
        tokenizer = self.engine.tokenizer
        return Decoder(
            request.max_new_tokens,
            frozenset() if request.ignore_eos else self.engine.eos_ids,
            request.forced_tokens,
            sampling=request.sampling,
            prompt=request.prompt,
            stop_strings=request.stop,
            detokenize=None if tokenizer is None else tokenizer.decode,
            constraint=constrained.matcher(request.constraint, tokenizer),
            record_allowed=request.record_allowed,
        )

    def _check(self, requests: Sequence[Request]) -> None:
        vocab = self.engine.config.vocab_size
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"request {r.id!r}: empty prompt or max_new_tokens < 1")
            if any(not 0 <= t < vocab for t in [*r.prompt, *(r.forced_tokens or [])]):
                raise ValueError(f"request {r.id!r}: token ids outside the vocabulary")
            if any(not 0 <= p < len(r.prompt) - 1 for p in r.prompt_positions):
                raise ValueError(f"request {r.id!r}: prompt positions outside the prompt")
            if r.stop and self.engine.tokenizer is None:
                raise ValueError(
                    f"request {r.id!r}: stop strings need the checkpoint's tokenizer, and "
                    "this one has none: stop by max_new_tokens or end-of-sequence ids"
                )
            if any(not stop for stop in r.stop):
                raise ValueError(f"request {r.id!r}: an empty stop string")
            if len(r.prompt) + r.max_new_tokens > self.max_context:
                raise ValueError(f"request {r.id!r}: longer than max_context {self.max_context}")

    def _blocks_wanted(self, seq: _Sequence) -> int:
        """The blocks `seq`'s next piece needs beyond its block table."""
        end = seq.computed + self._chunk(seq.computed, len(seq.fed) - seq.computed)
        return max(0, blocks_for(end, self.block_size) - len(seq.table))

    def _admit(self, seq: _Sequence, reserve: int | None = None) -> bool:
        """Give `seq` its cached prefix blocks (prefix caching); False when the pool, less the
        `reserve` blocks the running sequences take this step, has no room for its first
        piece (None: nothing is running, one block will do)."""
        recompute = self._resume_from(seq) if seq.preemptions else None
        pool = self.pool
        missed = None  # the first prefix block's key that is not cached
        peeked = []  # the cached blocks of seq.hashes (empty on arrival and after preemption)
        last = None  # the key of the prompt's full last block, cached: copied but one position
        last_block = None  # that cached block
        if self.prefix_caching and not seq.preemptions:
            # At least the last prompt token is computed: its logits are the first step's.
            full = (len(seq.fed) - 1) // self.block_size
            for b in range(full):
                key = self._key_of_block(seq, b)  # chained on seq.hashes[b - 1]
                block = pool.peek(key)
                if block is None:
                    missed = key
                    break
                seq.hashes.append(key)
                peeked.append(block)
            if missed is None and len(seq.fed) == (full + 1) * self.block_size:
                key = self._key_of_block(seq, full)
                last_block = pool.peek(key)
                if last_block is not None:
                    last = key
        # Decided before anything is taken: a refused admission references and counts nothing.
        # A cached block nobody holds leaves the evictable ones when it is taken (the copied
        # one too, until its positions are copied: the copy's block must not evict it).
        sources = peeked + ([last_block] if last is not None else [])
        taken = sum(pool.refs[block] == 0 for block in set(sources))
        seq.table, seq.computed = peeked, len(peeked) * self.block_size
        if last is not None:
            seq.computed = len(seq.fed) - 1  # its piece: the last token, in the copy's block
        room = pool.available() - taken - (reserve or 0)
        if room < (1 if reserve is None else max(1, self._blocks_wanted(seq))):
            seq.hashes.clear()
            seq.table, seq.computed = [], 0
            return False
        seq.table = [pool.lookup(key) for key in seq.hashes]
        if missed is not None:
            pool.lookup(missed)  # a miss, counted (an evicted hash looked up again)
        if last is not None:
            source = pool.lookup(last)  # held while copied
            copy = pool.allocate()  # room was checked: a free block, or another cached one
            self._copy_positions(source, copy, self.block_size - 1)
            pool.release(source)
            seq.table.append(copy)
            pool.whole_prompts += 1
        seq.cached_prefix = seq.computed
        seq.admitted_at = self.steps  # the step's forward, after its admissions, adds 1
        if recompute is not None:
            seq.skip = set(range(len(seq.fed))) - set(recompute)
        return True

    def _chunk(self, computed: int, remaining: int) -> int:
        """How many of a sequence's `remaining` fed tokens, after its first `computed`, this
        step computes: `chunk_size` of them at most (a decode step: the one new token)."""
        return remaining if self.chunk_size is None else min(self.chunk_size, remaining)

    def _schedule(
        self, running: list[_Sequence], waiting: collections.deque
    ) -> list[tuple[_Sequence, int, int]]:
        """This step's pieces (seq, start, count), blocks allocated; preempts the last
        admitted sequences while the pool runs out."""
        pieces = []
        for seq in list(running):
            if seq not in running:
                continue
            count = self._chunk(seq.computed, len(seq.fed) - seq.computed)
            if seq.request.speculation is not None and len(seq.fed) - seq.computed == 1:
                seq.proposal, seq.dists = self._propose(seq)
                count += len(seq.proposal)
            end = seq.computed + count
            while len(seq.table) * self.block_size < end:
                block = self.pool.allocate()
                if block is not None:
                    seq.table.append(block)
                    continue
                victim = max(running, key=lambda s: s.order)
                self._preempt(victim, running, waiting)
                pieces = [p for p in pieces if p[0] is not victim]
                if victim is seq:
                    break
            if seq in running:
                pieces.append((seq, seq.computed, count))
        return pieces

    def _preempt(self, seq: _Sequence, running: list[_Sequence], waiting: collections.deque):
        """Free `seq`'s blocks; it waits at the head of the queue and is recomputed."""
        if len(running) == 1:
            raise PoolExhausted(
                f"request {seq.request.id!r} needs more than the pool's {self.pool.num_blocks} "
                f"blocks of {self.block_size}"
            )
        running.remove(seq)
        self._release(seq)
        seq.hashes, seq.computed, seq.proposal, seq.dists = [], 0, [], None
        seq.preemptions += 1
        self.preemptions += 1
        self.preempted_on_admission += seq.admitted_at == self.steps
        waiting.appendleft(seq)

    def _release(self, seq: _Sequence) -> None:
        """Give back `seq`'s blocks (cached ones stay findable until evicted)."""
        for block in seq.table:
            self.pool.release(block)
        seq.table = []

    def _key_of_block(self, seq: _Sequence, b: int) -> bytes:
        """The prefix hash of `seq`'s full block `b`, chained on block b - 1's (in seq.hashes)."""
        parent = seq.hashes[b - 1] if b else b""
        return self._block_hash(parent, seq.fed[b * self.block_size : (b + 1) * self.block_size])

    def _forward(self, pieces: list[tuple[_Sequence, int, int]]) -> None:
        """One forward pass of the model over every piece's tokens, ragged
        (Transformer.forward_paged over the pool); then each sequence's step."""
        self.batch = pieces  # this step's pieces, for the seams
        pool, device = self.pool, self.engine.device
        tokens, positions, slots = [], [], []
        for seq, start, count in pieces:
            tokens += [*seq.fed, *seq.proposal][start : start + count]
            positions += self._positions(seq, start, count)
            slots += [self._write_slot(seq, p, count == 1) for p in range(start, start + count)]
        fresh = [not s for seq, start, count in pieces for s in self._skipped(seq, start, count)]
        batch = PagedBatch(
            k=pool.k.view(pool.k.shape[0], -1, *pool.k.shape[3:]),
            v=pool.v.view(pool.v.shape[0], -1, *pool.v.shape[3:]),
            counts=[count for _, _, count in pieces],
            contexts=[
                torch.tensor(self._context_slots(pieces, i), dtype=torch.long, device=device)
                for i in range(len(pieces))
            ],
            write=torch.tensor(slots, dtype=torch.long, device=device),
            fresh=torch.tensor(fresh, dtype=torch.bool),
        )
        outputs, wanted, offset = [], [], 0
        for seq, start, count in pieces:
            wanted.append(
                [
                    p
                    for p in seq.request.prompt_positions
                    if start <= p < start + count and p not in seq.prompt_logits
                ]
            )
            last = start + count == len(seq.fed) + len(seq.proposal)
            rows = range(count - 1 - len(seq.proposal), count) if last else []
            outputs.append([offset + p - start for p in wanted[-1]] + [offset + r for r in rows])
            offset += count
        prefill = [start < len(seq.request.prompt) for seq, start, _ in pieces]
        self.mixed_steps += any(prefill) and not all(prefill)
        logits = self.model.forward_paged(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            batch,
            outputs,
        )
        for (seq, start, count), positions_wanted, piece_logits in zip(
            pieces, wanted, logits, strict=True
        ):
            for j, p in enumerate(positions_wanted):
                seq.prompt_logits[p] = piece_logits[j].cpu()
            if seq.proposal:
                self._verify(seq, start, piece_logits[len(positions_wanted) :])
                self._publish_full_blocks(seq)
                continue
            seq.computed = start + count
            self._publish_full_blocks(seq)
            if start + count == len(seq.fed):
                self._step(seq, piece_logits[-1].cpu())
        self.steps += 1

    def _skipped(self, seq: _Sequence, start: int, count: int) -> list[bool]:
        return [p in seq.skip for p in range(start, start + count)]

    def _publish_full_blocks(self, seq: _Sequence) -> None:
        if not self.prefix_caching:
            return
        while (len(seq.hashes) + 1) * self.block_size <= seq.computed:
            key = self._key_of_block(seq, len(seq.hashes))
            self.pool.publish(seq.table[len(seq.hashes)], key)
            seq.hashes.append(key)

    def _step(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """The logits after the last fed token: one generated step (decoder.Decoder, as
        `Llama3Engine.generate` decodes)."""
        seq.logits.append(logits)
        token = seq.decoder.step(logits)
        if token is None:
            seq.done = True
        else:
            seq.fed.append(token)

    def _propose(self, seq: _Sequence) -> tuple[list[int], list | None]:
        """The draft's proposals after the token just chosen (teacher-forced: the forced
        tokens), no more than the steps left, and what a sampling draft drew them from."""
        return speculative.proposals(seq.decoder, seq.request.speculation)

    def _verify(self, seq: _Sequence, start: int, rows: torch.Tensor) -> None:
        """A speculative piece's rows, verified by speculative.verify (the decisions of
        `generate`); the rejected proposals' keys are dropped: the sequence's computed
        positions end after the accepted ones, and blocks that hold nothing else go back to
        the pool."""
        proposal, seq.proposal = seq.proposal, []
        dists, seq.dists = seq.dists, None
        before = len(seq.decoder.tokens)
        accepted, token = speculative.verify(
            seq.decoder, rows.cpu(), proposal, dists, seq.logits.append
        )
        seq.done = token is None
        seq.stats.add(len(proposal), accepted, len(seq.decoder.tokens) - before)
        seq.fed += proposal[:accepted]
        seq.computed = self._accepted_end(start, accepted, len(proposal))
        if not seq.done:
            seq.fed.append(token)
        self._free_rejected(seq)

    def _free_rejected(self, seq: _Sequence) -> None:
        """Give back the blocks past the sequence's computed positions (they held only
        rejected proposals' keys; the next piece allocates again what it needs)."""
        keep = blocks_for(seq.computed, self.block_size)
        for block in seq.table[keep:]:
            self.pool.release(block)
        del seq.table[keep:]
        del seq.slots[keep * self.block_size :]

    def _accepted_end(self, start: int, accepted: int, proposed: int) -> int:
        """The positions computed after a speculative piece from `start`: the fed token and
        the accepted proposals (the rejected ones' keys are never read, their blocks freed)."""
        return start + 1 + accepted

    def _output(self, seq: _Sequence, seconds: float) -> Served:
        positions = [p for p in seq.request.prompt_positions if p in seq.prompt_logits]
        prompt_logits = (
            torch.stack([seq.prompt_logits[p] for p in positions]) if positions else None
        )
        vocab = self.engine.config.vocab_size
        logits = torch.stack(seq.logits) if seq.logits else torch.empty(0, vocab)
        output = GenerationOutput(
            seq.decoder.tokens,
            logits,
            seconds,
            0.0,
            prompt_logits,
            speculation=seq.stats,
            allowed=seq.decoder.allowed if seq.request.record_allowed else None,
        )
        reason = seq.decoder.finish_reason or "cancelled"
        return Served(output, positions, seq.cached_prefix, seq.preemptions, reason)
