"""The engine's `compiled` execution mode: eager's weights, each block through torch.compile."""

import pathlib

from pipelines.llama3.model import Transformer


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


def compile_blocks(model: Transformer) -> None:
    """torch.compile each transformer block in place; the layers share one compiled graph
    (same code, parameters as inputs), compiled at the first prefill and the first decode.

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
    for layer in model.layers:
        layer.compile(dynamic=True)
