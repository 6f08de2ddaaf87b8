"""Known bugs, applied to a loaded engine: every tolerance must catch each of them.

A mutation is a small, realistic mistake in a Llama 3 engine. `test_mutations` runs each
against every tolerance entry and `calibrate_tolerances` measures how far each moves the
log-probabilities (the mutation floor that every threshold must stay under).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from harness.llama3 import engine_runs
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.serving import ServingEngine
from pipelines.llama3.tests import pool_mutations


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    overrides: dict  # LlamaConfig fields replaced at load
    patch: Callable[[Llama3Engine], None] | None = None  # applied to the loaded engine (`load`)
    # Whether the bug exists for a checkpoint of this config whose goldens reach this sequence
    # position (a bug from position 4096 on does not exist in a 2k-token golden; dropping rope
    # scaling changes nothing in a file without it). None: always.
    applies: Callable[[LlamaConfig, int], bool] | None = None

    def applies_to(self, config: LlamaConfig, last_position: int) -> bool:
        return self.applies is None or self.applies(config, last_position)


def _nudge_q_weight(engine: Llama3Engine) -> None:
    """+0.05 on row 0 of layer 0's wq, in the input column with the largest attention-norm
    gain: a weight that real inputs exercise (column 0 of SmolLM2 moves its logits ~1e-4,
    at its noise floor; this one ~3e-3)."""
    layer = engine.model.layers[0]
    column = int(torch.argmax(layer.attention_norm.weight.detach().abs()))
    with torch.no_grad():
        layer.attention.wq.weight[0, column] += 0.05


def _shift_kv_cache_position(engine: Llama3Engine) -> None:
    forward = engine.model.forward

    def shifted(tokens, start_pos, *args, **kwargs):
        if tokens.shape[1] == 1:  # a decode step: write and read the cache one slot late
            start_pos += 1
        return forward(tokens, start_pos, *args, **kwargs)

    engine.model.forward = shifted


def _scale_attention(engine: Llama3Engine) -> None:
    for layer in engine.model.layers:
        layer.attention.scale *= 1.01


def _skip_qk_unpermute_for_one_head(engine: Llama3Engine) -> None:
    """Head 0's wq rows stay in llama.cpp's interleaved order (the loader's unpermute_qk
    undone for that head): what a loader that forgets one head would compute."""
    with torch.no_grad():
        for layer in engine.model.layers:
            attention = layer.attention
            rows = attention.wq.weight[: attention.head_dim]  # [head_dim, dim]
            half = attention.head_dim // 2
            # rotate-half layout [x0..x(d/2-1), y0..] -> interleaved [x0, y0, x1, y1, ...]
            interleaved = rows.reshape(2, half, -1).transpose(0, 1).reshape(rows.shape)
            attention.wq.weight[: attention.head_dim] = interleaved.clone()


def _flip_bos(engine: Llama3Engine) -> None:
    """BOS not added where the checkpoint asks for it (Llama 3); added where it does not
    (SmolLM2, whose BOS id is only a chat-turn marker)."""
    tokenizer = engine.tokenizer
    tokenizer.add_bos = not tokenizer.add_bos and tokenizer.bos_id is not None


def _rope_late_from(position: int) -> Callable[[Llama3Engine], None]:
    """RoPE one position late from `position` on: positions p >= position rotate by p - 1
    (an off-by-one that only a table rebuilt past a buffer boundary would make). Planted in
    `setup_rope`, where both paths get their tables (`setup_caches` for generate, the serving
    engine directly), so it reaches a served request as it reaches generate."""

    def patch(engine: Llama3Engine) -> None:
        model = engine.model
        setup = model.setup_rope

        def late_tables(positions: int) -> None:
            before = model.rope_cos
            setup(positions)
            if model.rope_cos is not before and model.rope_len > position:
                for table in (model.rope_cos, model.rope_sin):
                    table[position:] = table[position - 1 : -1].clone()

        model.setup_rope = late_tables

    return patch


def _kv_cache_late_from(position: int) -> Callable[[Llama3Engine], None]:
    """Keys and values of positions >= `position` written one slot late (slot `position`
    never written, the newest key not read), in prefill and decode alike: a paging or
    block-table bug at a block boundary."""

    def patch(engine: Llama3Engine) -> None:
        for layer in engine.model.layers:
            attention = layer.attention

            def late(xk, xv, start_pos, attention=attention):
                bsz, _, seqlen, _ = xk.shape
                end_pos = start_pos + seqlen
                on_time = min(max(position - start_pos, 0), seqlen)  # rows before `position`
                slots = attention.cache_k.shape[2]
                for cache, rows in ((attention.cache_k, xk), (attention.cache_v, xv)):
                    cache[:bsz, :, start_pos : start_pos + on_time] = rows[:, :, :on_time]
                    first = start_pos + on_time + 1
                    n = min(seqlen - on_time, slots - first)
                    cache[:bsz, :, first : first + n] = rows[:, :, on_time : on_time + n]
                return attention.cache_k[:bsz, :, :end_pos], attention.cache_v[:bsz, :, :end_pos]

            attention.update_cache = late

    return patch


def _attention_window(keys: int) -> Callable[[Llama3Engine], None]:
    """Each query sees only the last `keys` keys (itself included): sliding-window attention
    code, right for Mistral, applied to a Llama."""

    def patch(engine: Llama3Engine) -> None:
        def windowed(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor:
            queries = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
            positions = torch.arange(start_pos + seqlen, device=device)[None, :]
            return (positions <= queries) & (positions > queries - keys)

        engine.model.attention_mask = windowed

    return patch


def _scaled_rope(config: LlamaConfig, last_position: int) -> bool:
    return config.rope_freq_factors is not None or config.rope_scaling_type is not None


def _reaches(position: int) -> Callable[[LlamaConfig, int], bool]:
    return lambda config, last_position: last_position >= position


# Llama 3.1's scaling with another factor, computed as Meta's apply_scaling does (the file's
# rope_freqs tensor, which holds factor 8's result, is set aside).
_ROPE_FACTOR_4 = {
    "rope_freq_factors": None,
    "rope_scaling_type": "llama3",
    "rope_scaling_factor": 4.0,
}

MUTATIONS = [
    Mutation("q_weight", "one Q-projection weight +0.05 (layer 0)", {}, _nudge_q_weight),
    Mutation("rope_theta", "rope theta -> 1e4 (Llama 3: 5e5)", {"rope_theta": 1.0e4}),
    Mutation("norm_eps", "RMSNorm epsilon 1e-5 -> 1e-3", {"rms_norm_eps": 1.0e-3}),
    Mutation("kv_position", "KV cache one slot late in decode", {}, _shift_kv_cache_position),
    Mutation("attn_scale", "attention scale x1.01", {}, _scale_attention),
    Mutation("qk_permute", "Q/K unpermute skipped, head 0", {}, _skip_qk_unpermute_for_one_head),
    Mutation("bos", "BOS not added (added where the file has none)", {}, _flip_bos),
    # Bugs only long contexts show (cases.yaml's long cases; test_mutations shows which of
    # them the short cases let through).
    Mutation(
        "rope_late_4096",
        "RoPE one position late from position 4096 on",
        {},
        _rope_late_from(4096),
        _reaches(4097),
    ),
    Mutation(
        "window_1024",
        "attention limited to the last 1024 keys",
        {},
        _attention_window(1024),
        _reaches(1025),
    ),
    Mutation(
        "rope_factor_4",
        "Llama 3.1 rope scaling factor 8 -> 4",
        _ROPE_FACTOR_4,
        applies=_scaled_rope,
    ),
    Mutation(
        "kv_late_2048",
        "KV cache written one slot late from position 2048 on",
        {},
        _kv_cache_late_from(2048),
        _reaches(2049),
    ),
    # At Llama 3.1's original context (8192): a table or cache sized for it, extended wrong.
    Mutation(
        "rope_late_8192",
        "RoPE one position late from position 8192 on",
        {},
        _rope_late_from(8192),
        _reaches(8193),
    ),
    Mutation(
        "kv_late_8192",
        "KV cache written one slot late from position 8192 on",
        {},
        _kv_cache_late_from(8192),
        _reaches(8193),
    ),
    Mutation(
        "rope_scaling_dropped",
        "Llama 3.1 rope scaling dropped (rope_freqs ignored)",
        {"rope_freq_factors": None, "rope_scaling_type": None},
        applies=_scaled_rope,
    ),
]
BY_NAME = {m.name: m for m in MUTATIONS}


# --- serving-path bugs (pipelines/llama3/serving.py): each in the seam it names -------------


def _sees_the_neighbours_key(self, batch, index):
    own = ServingEngine._context_slots(self, batch, index)
    if index == 0:
        return own
    neighbour = batch[index - 1][0]
    return [self._slot(neighbour, 0), *own]


def _block_table_off_by_one(self, seq, position):
    block, offset = divmod(position, self.block_size)
    if offset == 0 and block > 0:
        block -= 1  # a block's first position in the previous block's first slot
    return seq.table[block] * self.block_size + offset


def _rope_late_at_chunk_start(self, seq, start, count):
    positions = list(range(start, start + count))
    if 0 < start < len(seq.request.prompt):  # a prefill chunk after the first
        positions[0] -= 1
    return positions


def _block_hash_of_own_tokens(self, parent, tokens):
    return ServingEngine._block_hash(self, b"", tokens)


def _resumed_without_last_kv(self, seq):
    last = len(seq.fed) - 2  # the last position computed before the preemption
    return [p for p in range(len(seq.fed)) if p != last]


def _decode_written_to_another_sequence(self, seq, position, decoding):
    others = [s for s, _, count in self.batch if s is not seq and count == 1]
    if decoding and others:
        return self._slot(others[0], 0)
    return ServingEngine._write_slot(self, seq, position, decoding)


def _pool_of(pool_class):
    def _new_pool(self, num_blocks):
        return pool_class(self.engine, num_blocks, self.block_size)

    return _new_pool


@dataclasses.dataclass(frozen=True)
class ServingMutation(Mutation):
    """A serving-path bug and the scenario that must catch it (scenarios.py); the solo lane,
    `generate`, never takes that path."""

    scenario: str = ""
    method: str = ""  # the ServingEngine method the bug replaces
    replacement: Callable | None = None

    @property
    def serving_class(self) -> type[ServingEngine]:
        """ServingEngine with the bug: what the scenarios serve through (scenarios.served_runs)."""
        methods = {self.method: self.replacement}
        return type(f"Mutated{ServingEngine.__name__}", (ServingEngine,), methods)


SERVING_MUTATIONS = [
    ServingMutation(
        "cross_sequence_keys",
        "a sequence's attention also sees its neighbour's first key (ragged batch)",
        {},
        scenario="batch",
        method="_context_slots",
        replacement=_sees_the_neighbours_key,
    ),
    ServingMutation(
        "block_table_off_by_one",
        "a block's first position stored in the previous block (paged cache)",
        {},
        scenario="paged",
        method="_slot",
        replacement=_block_table_off_by_one,
    ),
    ServingMutation(
        "rope_chunk_boundary",
        "RoPE one position early at the start of each prefill chunk after the first",
        {},
        scenario="chunked",
        method="_positions",
        replacement=_rope_late_at_chunk_start,
    ),
    ServingMutation(
        "prefix_hash_unchained",
        "prefix blocks keyed by their own tokens only, not their history",
        {},
        scenario="prefix",
        method="_block_hash",
        replacement=_block_hash_of_own_tokens,
    ),
    ServingMutation(
        "resume_without_last_kv",
        "a preempted sequence resumed without its last token's keys and values",
        {},
        scenario="preempt",
        method="_resume_from",
        replacement=_resumed_without_last_kv,
    ),
    ServingMutation(
        "decode_into_other_sequence",
        "a decode token's keys and values written into another sequence's cache",
        {},
        scenario="batch",
        method="_write_slot",
        replacement=_decode_written_to_another_sequence,
    ),
    # Only a pool under pressure reaches these two (pipelines/llama3/tests/pool_mutations.py):
    # no other lane shares a block between running sequences, nor evicts.
    ServingMutation(
        "uncounted_shared_hit",
        "a cache hit on a block a running sequence holds does not count its new reader",
        {},
        scenario="pressure",
        method="_new_pool",
        replacement=_pool_of(pool_mutations.UncountedHit),
    ),
    # An evicted block's hash left findable: a later copy reads another sequence's keys as its
    # prefix. Measured in the pressure lane (tiny float32 eager and Q4_K quantized alike): the
    # first two copies pass, copies 3 to 5 fail 4 cases each. (Its pool skips the eviction
    # counters, so the lane's counters name it too: evictions 0, evicted hashes looked up
    # again 0.)
    ServingMutation(
        "eviction_keeps_the_hash",
        "an evicted block's prefix hash stays in the cache, naming the block's new keys",
        {},
        scenario="pressure",
        method="_new_pool",
        replacement=_pool_of(pool_mutations.EvictionKeepsTheHash),
    ),
]

# Sub-blocks of a layer, each with a mutation confined to it (`in_layer`).
_LAYER_PATCHES: dict[str, Callable[[torch.nn.Module], None]] = {
    "attention norm": lambda layer: layer.attention_norm.weight.mul_(1.01),
    "attention": lambda layer: layer.attention.wo.weight.mul_(1.01),
    "MLP norm": lambda layer: layer.ffn_norm.weight.mul_(1.01),
    "MLP": lambda layer: layer.feed_forward.w2.weight.mul_(1.01),
}


def in_layer(subblock: str, layer: int) -> Mutation:
    """A 1% scale of one sub-block's weight in one layer: a bug whose place is known, so that
    the first diverging layer (localize.py) can be checked against it."""

    def patch(engine: Llama3Engine) -> None:
        with torch.no_grad():
            _LAYER_PATCHES[subblock](engine.model.layers[layer])

    return Mutation(f"{subblock}@{layer}", f"{subblock} weight x1.01 in layer {layer}", {}, patch)


def _scaled_head(model: torch.nn.Module) -> None:
    # A copy: a tied head's weight is the embedding's, which every layer would then see.
    model.output.weight = torch.nn.Parameter(model.output.weight * 1.01, requires_grad=False)


# The sub-blocks after the layers, each with a mutation confined to it (`in_final`).
_FINAL_PATCHES: dict[str, Callable[[torch.nn.Module], None]] = {
    "final norm": lambda model: model.norm.weight.mul_(1.01),
    "LM head": _scaled_head,
}


def in_final(subblock: str) -> Mutation:
    """A 1% scale of the final norm's or the LM head's weight (`in_layer` after the layers)."""

    def patch(engine: Llama3Engine) -> None:
        with torch.no_grad():
            _FINAL_PATCHES[subblock](engine.model)

    return Mutation(subblock, f"{subblock} weight x1.01", {}, patch)


def load(variant: Variant, mutation: Mutation | None) -> Llama3Engine:
    """The variant's engine with `mutation` applied: loaded with its config overrides, then
    patched. None gives the unmutated engine."""
    if mutation is None:
        return engine_runs.load_engine(variant)
    engine = engine_runs.load_engine(variant, overrides=mutation.overrides)
    if mutation.patch is not None:
        mutation.patch(engine)
    return engine
