"""Attention and the Q4_K linear on the device under test against a float64 CPU reference.

The reference, the inputs and the tolerances (and why each is what it is) are in
gpu_reference.py, shared with the RMSNorm and NVFP4 tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from max_tests.integration.architectures.llama3.gpu_reference import (
    ATTENTION_CONFIG,
    DTYPE_IDS,
    DTYPES,
    assert_close,
    attention_shapes,
    check_attention,
    engine_dequantize,
    generator,
    reference_dequantize,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_llama3_attention_gpu(dtype, device):
    """Prefill with a causal mask, then KV-cache decode, with random float weights."""
    g = generator(5)
    weights = {
        name: torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(shape[1])
        for name, shape in attention_shapes(ATTENTION_CONFIG).items()
    }
    device_weights = {name: w.to(device) for name, w in weights.items()}
    check_attention(device_weights, weights, device, dtype, "GQA attention, prefill + decode")


def _random_q4_k_blocks(n_blocks: int, seed: int) -> np.ndarray:
    """Valid Q4_K blocks: any bytes are, once d and dmin are finite, modest float16 values."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    scales = np.stack([rng.uniform(1e-3, 2e-2, n_blocks), rng.uniform(1e-3, 1e-2, n_blocks)], 1)
    blocks[:, :4] = scales.astype(np.float16).view(np.uint8).reshape(n_blocks, 4)
    return blocks


def test_llama3_linear_q4k_gpu(device):
    """Q4_K dequantization and the matmul on the device against gguf-py's numpy dequantizer."""
    out_features, in_features = 96, 512  # rows of 2 super-blocks of 256
    blocks = _random_q4_k_blocks(out_features * in_features // 256, seed=3)
    raw = blocks.reshape(out_features, -1)
    weight_ref = reference_dequantize(raw, GGMLQuantizationType.Q4_K)  # [out, in]
    weight_dev = engine_dequantize(raw, GGMLQuantizationType.Q4_K, (out_features, in_features),
                                   device)  # fmt: skip
    # Dequantization is exact integer-times-scale math: bit-identical on every device.
    assert torch.equal(weight_dev.cpu().double(), weight_ref)
    x = torch.randn(5, in_features, generator=generator(4), dtype=torch.float64)
    actual = x.to(device, torch.float32) @ weight_dev.T
    assert_close(actual, x.float().double() @ weight_ref.T, torch.float32, "Q4_K linear")
