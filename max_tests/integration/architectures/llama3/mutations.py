"""Known bugs, applied to a loaded engine: every tolerance must catch each of them.

A mutation is a small, realistic mistake in a Llama 3 engine. `test_mutations` runs each
against every tolerance entry and `calibrate_tolerances` measures how far each moves the
log-probabilities (the mutation floor that every threshold must stay under).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from max_tests.integration.architectures.llama3 import golden_run
from max_tests.integration.architectures.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    overrides: dict  # LlamaConfig fields replaced at load
    patch: Callable[[Llama3Engine], None] | None = None  # applied to the loaded engine (`load`)


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


MUTATIONS = [
    Mutation("q_weight", "one Q-projection weight +0.05 (layer 0)", {}, _nudge_q_weight),
    Mutation("rope_theta", "rope theta -> 1e4 (Llama 3: 5e5)", {"rope_theta": 1.0e4}),
    Mutation("norm_eps", "RMSNorm epsilon 1e-5 -> 1e-3", {"rms_norm_eps": 1.0e-3}),
    Mutation("kv_position", "KV cache one slot late in decode", {}, _shift_kv_cache_position),
    Mutation("attn_scale", "attention scale x1.01", {}, _scale_attention),
    Mutation("qk_permute", "Q/K unpermute skipped, head 0", {}, _skip_qk_unpermute_for_one_head),
    Mutation("bos", "BOS not added (added where the file has none)", {}, _flip_bos),
]
BY_NAME = {m.name: m for m in MUTATIONS}

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


def load(variant: Variant, mutation: Mutation | None) -> Llama3Engine:
    """The variant's engine with `mutation` applied: loaded with its config overrides, then
    patched. None gives the unmutated engine."""
    if mutation is None:
        return golden_run.load_engine(variant)
    engine = golden_run.load_engine(variant, overrides=mutation.overrides)
    if mutation.patch is not None:
        mutation.patch(engine)
    return engine
