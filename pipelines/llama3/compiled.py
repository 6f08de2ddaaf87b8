"""The engine's `compiled` execution mode: eager's weights, each block through torch.compile.

`generate` (the contiguous cache) runs each block's whole `forward` as one compiled graph.
A ragged batch over the paged cache (the serving engine) runs a block as two compiled graphs
around its attention: the norm and the rotated queries, keys and values of every row, then the
output projection, the residuals and the feed-forward; between them each piece's attention over
its own context (slots gathered from the block table, a list as long as the batch's pieces)
stays eager, as the eager mode computes it. The graphs take the rows as a dynamic dimension, so
a new batch shape does not compile again.
"""

import pathlib

import torch

from pipelines.llama3.model import PagedBatch, Transformer, TransformerBlock


class CompiledBlock(TransformerBlock):
    """A block whose paged forward is its compiled parts around the eager attention."""

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        xq, xk, xv = self.queries_keys_values(x, cos, sin)
        attended = self.attention.attend_paged(xq, xk, xv, cache_k, cache_v, batch)
        return self.after_attention(x, attended)

    def queries_keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.attention.project(self.attention_norm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        h = x + self.attention.wo(attended)
        return h + self.feed_forward(self.ffn_norm(h))


class CompiledTransformer(Transformer):
    """The compiled mode's model: eager's, with CompiledBlock layers (compile_blocks compiles
    them once the weights are loaded)."""

    block_class = CompiledBlock


def _import_setuptools() -> None:
    """Import setuptools, which torch.compile's C++ builder needs (torch.utils.cpp_extension).

    Bazel leaves files whose names contain a space out of runfiles, and setuptools' vendored
    jaraco.text reads its 'Lorem ipsum.txt' when imported; under `bazel test` or `bazel run`
    that import fails. The text is only a sample string, so a missing copy reads as one.
    """
    read_text = pathlib.Path.read_text

    def tolerant_read_text(path: pathlib.Path, *args, **kwargs) -> str:
        if path.name == "Lorem ipsum.txt" and not path.exists():
            return "Lorem ipsum dolor sit amet."
        return read_text(path, *args, **kwargs)

    pathlib.Path.read_text = tolerant_read_text
    try:
        import setuptools  # noqa: F401
    finally:
        pathlib.Path.read_text = read_text


def compile_blocks(model: CompiledTransformer) -> None:
    """torch.compile each transformer block in place; the layers share one compiled graph
    (same code, parameters as inputs), compiled at the first prefill and the first decode;
    and the two parts of each block's paged forward (CompiledBlock), compiled at the first
    ragged batch.

    Process-wide settings, needed by any engine in this mode: inductor rounds bfloat16
    intermediates where eager rounds them (else it keeps float32 between fused operations and
    bfloat16 results move by ~0.5 in log-probability); and a block that keeps recompiling (a
    process loading many checkpoints) raises instead of silently running eager, which would
    let the compiled mode pass its tests without being exercised.
    """
    # Imported here: torch._dynamo takes seconds to import, which eager and quantized skip.
    import torch._dynamo.config
    import torch._inductor.config

    _import_setuptools()
    torch._inductor.config.emulate_precision_casts = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if not isinstance(model, CompiledTransformer):
        raise TypeError(f"compile_blocks takes a CompiledTransformer, not {type(model).__name__}")
    for layer in model.layers:
        layer.compile(dynamic=True)
        # Bound methods of one function: the layers share its graphs (parameters as inputs).
        layer.queries_keys_values = torch.compile(layer.queries_keys_values, dynamic=True)
        layer.after_attention = torch.compile(layer.after_attention, dynamic=True)
