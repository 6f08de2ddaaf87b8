"""Attention with NVFP4-quantized projections on the device under test.

Grouped-query heads, a causal prefill and KV-cache decode steps (gpu_reference.check_attention),
with every projection dequantized from raw random NVFP4 blocks by the engine on the device; the
float64 CPU reference dequantizes the same blocks with gguf-py.
"""

from __future__ import annotations

import pytest

from max_tests.integration.architectures.llama3.gpu_reference import (
    ATTENTION_CONFIG,
    DTYPE_IDS,
    DTYPES,
    NVFP4,
    attention_shapes,
    check_attention,
    engine_dequantize,
    random_nvfp4_rows,
    reference_dequantize,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_llama3_attention_fp4_gpu(dtype, device):
    device_weights, reference_weights = {}, {}
    for seed, (name, shape) in enumerate(attention_shapes(ATTENTION_CONFIG).items(), start=10):
        raw = random_nvfp4_rows(*shape, seed=seed)
        device_weights[name] = engine_dequantize(raw, NVFP4, shape, device)
        reference_weights[name] = reference_dequantize(raw, NVFP4)
    check_attention(device_weights, reference_weights, device, dtype, "NVFP4 GQA attention")
