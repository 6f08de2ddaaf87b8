"""NVFP4 weights on the device under test: the engine's dequantization, then the matmul.

The weights are raw random NVFP4 blocks (gpu_reference.py says why no quantizer is involved);
the reference dequantizes them with gguf-py and multiplies in float64 on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from max_tests.integration.architectures.llama3.gpu_reference import (
    DTYPE_IDS,
    DTYPES,
    NVFP4,
    NVFP4_BLOCK_BYTES,
    NVFP4_BLOCK_VALUES,
    NVFP4_SCALES,
    assert_close,
    engine_dequantize,
    generator,
    random_nvfp4_rows,
    reference_dequantize,
)

pytestmark = pytest.mark.gpu


def test_nvfp4_dequantize_gpu(device):
    """Every scale byte and every nibble decode as gguf-py decodes them, bit for bit.

    Both are products of an E2M1 value and a UE4M3 scale, exact in float32, so any difference
    is a wrong table entry or exponent, not rounding. The bytes a quantizer never writes are
    included (0x7F, which ggml reads as a zero scale, and 0x80 and up, whose top bit it ignores):
    the engine must read any file as ggml does.
    """
    n_blocks = 256 // NVFP4_SCALES
    blocks = np.empty((n_blocks, NVFP4_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :NVFP4_SCALES] = np.arange(256, dtype=np.uint8).reshape(n_blocks, NVFP4_SCALES)
    nibble_bytes = NVFP4_BLOCK_BYTES - NVFP4_SCALES
    blocks[:, NVFP4_SCALES:] = (np.arange(n_blocks * nibble_bytes) % 256).reshape(n_blocks, -1)
    reference = reference_dequantize(blocks, NVFP4)
    actual = engine_dequantize(blocks, NVFP4, (n_blocks, NVFP4_BLOCK_VALUES), device)
    assert actual.device.type == device.type
    assert torch.equal(actual.cpu().double(), reference)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_llama3_linear_fp4_gpu(dtype, device):
    """x @ W.T with W dequantized from NVFP4 on the device, against float64 on the CPU."""
    out_features, in_features = 96, 512  # rows of 8 blocks of 64
    raw = random_nvfp4_rows(out_features, in_features, seed=6)
    weight_ref = reference_dequantize(raw, NVFP4)  # [out, in]
    weight_dev = engine_dequantize(raw, NVFP4, (out_features, in_features), device)
    assert torch.equal(weight_dev.cpu().double(), weight_ref)
    x = torch.randn(5, in_features, generator=generator(7), dtype=torch.float64)
    actual = x.to(device, dtype) @ weight_dev.to(dtype).T
    reference = x.to(dtype).double() @ weight_ref.to(dtype).double().T
    assert_close(actual, reference, dtype, "NVFP4 linear")
