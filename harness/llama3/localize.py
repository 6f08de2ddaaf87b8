"""The first layer and sub-block where the engine and transformers part ways.

A failure against the torch goldens says that the engine's outputs moved, not where. Here both
models run the same tokens (a golden case's prompt followed by its tokens) and every sub-block
output is recorded at every position: per layer the attention norm, the attention (after its
output projection), the MLP norm and the MLP; then the final norm and the LM head. The engine
runs as the golden test runs it, prefill then one decode step per token with its KV cache, so a
decode-only bug shows at the first decode position; transformers runs the whole sequence once.

Outputs are captured with torch forward hooks (`register_forward_hook`), registered only for
this run and removed after it: the engine carries no instrumentation code and pays nothing when
no one is looking. Sub-blocks are compared in execution order; the first whose relative
difference max |engine - reference| / max |reference| exceeds RELATIVE_TOLERANCE[dtype] at some
position is the first diverging one. Measured on the committed checkpoints (the first golden
case, every sub-block, worst position), the two implementations disagree by 4.2e-7
(tiny float32), 1.0e-6 (tiny q4_k), 8.5e-6 (SmolLM2 q4_1) and 0 in bfloat16's layers (2.5e-7 at
its float32 head); the weakest known bug moves its sub-block by 8.6e-5 (SmolLM2, one Q weight
+0.05) and 8.9e-3 (tiny bfloat16, norm epsilon). Hence 3e-5 for float32 computation (the
quantized encodings run in float32) and 5e-3, just over one bfloat16 rounding, for bfloat16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from pipelines.llama3 import Llama3Engine

RELATIVE_TOLERANCE = {torch.float32: 3e-5, torch.bfloat16: 5e-3}
SUBBLOCKS = ("attention norm", "attention", "MLP norm", "MLP")
FINAL = ("final norm", "LM head")


@dataclasses.dataclass(frozen=True)
class Divergence:
    layer: int | None  # None for the final norm and the LM head
    subblock: str
    position: int  # the first token position over the tolerance
    relative_error: float  # the sub-block's worst position
    tolerance: float

    def describe(self) -> str:
        where = f"layer {self.layer}, {self.subblock}" if self.layer is not None else self.subblock
        return (
            f"first diverging layer: {where} (max |engine - transformers| / max |transformers| "
            f"{self.relative_error:.3g} > {self.tolerance:g}, from position {self.position})"
        )


Point = tuple[int | None, str]


def engine_points(engine: Llama3Engine) -> list[tuple[Point, torch.nn.Module]]:
    model = engine.model
    points: list[tuple[Point, torch.nn.Module]] = []
    for i, layer in enumerate(model.layers):
        modules = (layer.attention_norm, layer.attention, layer.ffn_norm, layer.feed_forward)
        points += [((i, name), module) for name, module in zip(SUBBLOCKS, modules, strict=True)]
    return [*points, ((None, FINAL[0]), model.norm), ((None, FINAL[1]), model.output)]


def reference_points(model) -> list[tuple[Point, torch.nn.Module]]:
    """The same sub-blocks in transformers' LlamaForCausalLM, layers only (see `_final`)."""
    points: list[tuple[Point, torch.nn.Module]] = []
    for i, layer in enumerate(model.model.layers):
        modules = (
            layer.input_layernorm,
            layer.self_attn,
            layer.post_attention_layernorm,
            layer.mlp,
        )
        points += [((i, name), module) for name, module in zip(SUBBLOCKS, modules, strict=True)]
    return points


def _final(model, hidden: torch.Tensor) -> dict[Point, torch.Tensor]:
    """transformers' final norm and LM head over the last layer's output, in float32, as the
    torch goldens compute them (testdata/run_torch_llama.py) and the engine does."""
    norm = model.model.norm
    x = hidden.float()
    normed = norm.weight.float().cpu() * (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    )
    logits = normed @ model.lm_head.weight.float().cpu().T
    return {(None, FINAL[0]): normed, (None, FINAL[1]): logits}


@contextlib.contextmanager
def _recording(points: list[tuple[Point, torch.nn.Module]]) -> Iterator[dict[Point, list]]:
    """Each point's outputs, one [seq, features] float32 tensor per call, while inside."""
    outputs: dict[Point, list[torch.Tensor]] = {point: [] for point, _ in points}

    def hook(point: Point) -> Callable:
        def record(module, inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output  # attention: (out, w)
            outputs[point].append(tensor.detach()[0].float().cpu())

        return record

    handles = [module.register_forward_hook(hook(point)) for point, module in points]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def engine_outputs(engine: Llama3Engine, input_ids: list[int], tokens: list[int]) -> dict:
    """Every sub-block's output at every position, the engine run as the golden test runs it.

    A `compiled` engine runs its blocks eagerly here (hooks do not fire inside a compiled
    graph): a divergence that only the compiled graphs have is then reported as none.
    """
    # The hooks are on the modules; a mode's one-call decode step (packed.PackedTransformer's
    # fused_decode, the same bits) bypasses them, so the decode steps run module by module.
    fused = getattr(engine.model, "fused_decode", None)
    try:
        if fused is not None:
            engine.model.fused_decode = None
        with _recording(engine_points(engine)) as outputs, torch.compiler.set_stance("force_eager"):
            engine.generate(input_ids, len(tokens), forced_tokens=tokens)
    finally:
        if fused is not None:
            engine.model.fused_decode = fused
    return {point: torch.cat(calls) for point, calls in outputs.items()}


@torch.inference_mode()
def reference_outputs(model, sequence: list[int]) -> dict:
    """The same for transformers over the whole sequence in one forward pass (its model without
    the head: the final norm and head are recomputed in float32 by `_final`)."""
    device = next(model.parameters()).device
    norm_inputs: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_hook(
        lambda module, inputs, output: norm_inputs.append(inputs[0].detach()[0].float().cpu())
    )
    try:
        with _recording(reference_points(model)) as outputs:
            model.model(torch.tensor([sequence], device=device), use_cache=False)
    finally:
        handle.remove()
    layers = {point: torch.cat(calls) for point, calls in outputs.items()}
    return layers | _final(model, norm_inputs[0])


def _relative_errors(engine: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per position: max |engine - reference| / max |reference| (positions aligned at the end:
    the engine's final norm and head see only the positions whose logits it needs)."""
    reference = reference[-engine.shape[0] :]
    scale = reference.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    return (engine - reference).abs().amax(dim=-1) / scale


def first_divergence(
    engine: Llama3Engine, model, input_ids: list[int], tokens: list[int]
) -> Divergence | None:
    """The first sub-block, in execution order, over the tolerance; None when none is."""
    ours = engine_outputs(engine, input_ids, tokens)
    positions = next(iter(ours.values())).shape[0]  # the engine feeds the last token to no step
    theirs = reference_outputs(model, [*input_ids, *tokens][:positions])
    tolerance = RELATIVE_TOLERANCE[engine.dtype]
    for point, _ in engine_points(engine):
        errors = _relative_errors(ours[point], theirs[point])
        over = torch.nonzero(errors > tolerance)
        if len(over):
            layer, subblock = point
            position = positions - len(errors) + int(over[0, 0])
            return Divergence(layer, subblock, position, float(errors.max()), tolerance)
    return None
