"""Known bugs of the ggml mode, each planted into a loaded engine: the ggml goldens must catch
every one (test_ggml_mutations.py), as they catch the checkpoint mutations
(checkpoint_mutations.py) that any engine sees.

Each one is a plausible slip in a port of llama.cpp's numerics: float activations where ggml
quantizes them, this engine's own rope tables where ggml multiplies its angles up, a norm's
epsilon ten times too large, a softmax scale off by 0.1%.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch.nn.functional as F

from pipelines.llama3 import Llama3Engine, ggml_mode, quants
from pipelines.llama3.model import Transformer


def _float_activations(engine: Llama3Engine) -> None:
    """Every product on exactly dequantized weights, the activations left in float32."""
    for module in engine.model.modules():
        if isinstance(module, ggml_mode.GgmlLinear):
            matrix = module.weight
            dense = quants.dequantize(
                matrix.gguf_blocks().reshape(-1), matrix.qtype, (matrix.rows, matrix.cols)
            )

            module._product = lambda x, dense=dense: F.linear(x, dense)


def _model_rope(engine: Llama3Engine) -> None:
    """model.py's rope tables (each angle once in float32) instead of ggml's."""
    engine.model.rope_tables = types.MethodType(Transformer.rope_tables, engine.model)
    engine.model.max_seq_len = engine.model.rope_len = 0  # the next setup makes them again


def _norm_eps(engine: Llama3Engine) -> None:
    for module in engine.model.modules():
        if isinstance(module, ggml_mode.GgmlRMSNorm):
            module.eps *= 10


def _softmax_scale(engine: Llama3Engine) -> None:
    for module in engine.model.modules():
        if isinstance(module, ggml_mode.GgmlAttention):
            module.scale *= 1.001


@dataclasses.dataclass(frozen=True)
class GgmlMutation:
    name: str
    what: str
    plant: Callable[[Llama3Engine], None]

    def apply(self, engine: Llama3Engine) -> Llama3Engine:
        """`engine` with the bug; the one-call decode step stays where it computes it too (it
        reads the norms' epsilon, the attention scale and the rope tables from the modules)."""
        self.plant(engine)
        if self.name == "float_activations":
            engine.model.fused_decode = None  # planted in the products the one call bypasses
        return engine


MUTATIONS = (
    GgmlMutation("float_activations", "float32 activations, no 8 bits", _float_activations),
    GgmlMutation("model_rope", "this engine's rope tables, not ggml's angles", _model_rope),
    GgmlMutation("norm_eps", "RMSNorm epsilon x10", _norm_eps),
    GgmlMutation("softmax_scale", "attention scale x1.001", _softmax_scale),
)  # fmt: skip
BY_NAME = {m.name: m for m in MUTATIONS}
