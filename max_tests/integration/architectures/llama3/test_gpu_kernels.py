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
    NVFP4,
    NVFP4_BLOCK_BYTES,
    NVFP4_SCALES,
    assert_close,
    attention_shapes,
    check_attention,
    engine_dequantize,
    generator,
    random_nvfp4_rows,
    reference_dequantize,
)
from pipelines.llama3 import quants
from pipelines.llama3.model import precompute_rope

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


# The tolerances gpu_reference.py's docstring documents (and argues for), written out here
# rather than imported, so that a loosened TOLERANCE cannot vouch for itself.
DOCUMENTED_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_assert_close_holds_the_documented_tolerance(dtype, device):
    """assert_close accepts |actual - ref| up to atol + rtol * |ref| and fails one element past it.

    Every kernel test ends in assert_close, and no other test ever sees it fail: a check that
    took the min instead of the max of the excess, or a float32 tolerance loosened to 1e-2 (which
    lets a KV cache stored in bfloat16 pass the float32 attention tests), would pass every
    kernel. Catches both plants in gpu_reference.py.
    """
    atol, rtol = DOCUMENTED_TOLERANCE[dtype]
    reference = torch.tensor([0.0, 1.0, -3.0, 100.0], dtype=torch.float64)
    allowed = atol + rtol * reference.abs()
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    assert_close((reference + 0.9 * signs * allowed).to(device), reference, dtype, "inside")
    for i in range(len(reference)):
        actual = reference + 0.9 * signs * allowed
        actual[i] = reference[i] + 1.1 * signs[i] * allowed[i]
        with pytest.raises(AssertionError, match="exceeds"):
            assert_close(actual.to(device), reference, dtype, f"element {i} outside")


def _meta_llama3_rope_inverse_frequencies(config) -> list[float]:
    """Meta's apply_scaling (llama3 rope scaling), in float64, from the config's parameters."""
    factor, low, high = (config.rope_scaling_factor, config.rope_low_freq_factor,
                         config.rope_high_freq_factor)  # fmt: skip
    old_context = config.rope_original_context_length
    inverse_frequencies = []
    for i in range(0, config.head_dim, 2):
        freq = config.rope_theta ** (-i / config.head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            inverse_frequencies.append(freq)
        elif wavelen > old_context / low:
            inverse_frequencies.append(freq / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            inverse_frequencies.append((1 - smooth) * freq / factor + smooth * freq)
    return inverse_frequencies


def test_llama3_rope_tables_gpu(device):
    """precompute_rope on the device: cos and sin [positions, head_dim] of position x frequency.

    check_attention hands the reference the engine's own rope tables (so that both rotate by
    the same float32 angles), so a wrong table is wrong on both sides and no attention test
    can see it: swapped cos and sin, or a wrong llama3 frequency scaling. Here the tables are
    held to Meta's formula written out in float64. precompute_rope has a branch per device
    kind (on the CPU it computes on one thread), so this runs on the device under test: on a
    GPU it covers the GPU's branch. Catches cos and sin swapped in precompute_rope. 256
    positions keep the float32 angles' rounding (< 2e-5) inside the float32 tolerance; the 8
    frequencies of ATTENTION_CONFIG span all three of the scaling's cases.
    """
    config, positions = ATTENTION_CONFIG, 256
    inverse = torch.tensor(_meta_llama3_rope_inverse_frequencies(config), dtype=torch.float64)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inverse)
    angles = torch.cat([angles, angles], dim=-1)  # both halves of a head share a frequency
    cos, sin = precompute_rope(config, positions, device)
    assert cos.device.type == sin.device.type == device.type
    assert cos.shape == sin.shape == (positions, config.head_dim)
    assert_close(cos, angles.cos(), torch.float32, "rope cos table")
    assert_close(sin, angles.sin(), torch.float32, "rope sin table")


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, NVFP4], ids=["q4_k", "nvfp4"])
def test_dequantize_unpacks_on_the_device_gpu(qtype, device):
    """quants.dequantize moves the packed bytes to `device` and unpacks them there.

    Its docstring promises that a GPU does the unpacking; the result must live on the device.
    On a GPU the other tests would crash or assert on a CPU result; on the CPU, where every
    tensor is on the CPU anyway, they cannot tell. So on the CPU a non-CPU device is stood in
    for by `meta` (shapes and dtypes, no values: hence check_finite=False): its every operation
    goes through device dispatch as CUDA's does. Catches the bytes left on the CPU
    (`packed.to(device)` dropped), the device path taken only on the CPU (the chunked CPU loop
    then builds the result on the CPU), and NVFP4's value table built on the CPU.
    """
    target = device if device.type != "cpu" else torch.device("meta")
    rows, cols = 4, 512
    if qtype == NVFP4:
        raw = random_nvfp4_rows(rows, cols, seed=8)
    else:
        raw = _random_q4_k_blocks(rows * cols // 256, seed=8).reshape(rows, -1)
    values = quants.dequantize(raw, qtype, (rows, cols), device=target, check_finite=False)
    assert (values.device.type, values.device.index or 0) == (target.type, target.index or 0)
    assert values.shape == (rows, cols) and values.dtype == torch.float32


def test_random_nvfp4_rows_are_modest_and_span_the_scales():
    """random_nvfp4_rows: scale bytes below 0x20, both subnormal (< 0x08) and normal ones, and
    values reaching 0.5 (gpu_reference.py: "the values reach 0.70"), never past 0.71.

    The NVFP4 linear and attention tests hold tolerances of products of these weights; with
    only subnormal scales (values below 0.09) every product shrinks toward atol and the tests
    lose most of their power while passing. Catches NVFP4_MODEST_SCALE_BYTES set to 0x08.
    """
    raw = random_nvfp4_rows(96, 512, seed=6)
    scales = raw.reshape(-1, NVFP4_BLOCK_BYTES)[:, :NVFP4_SCALES]
    assert int(scales.max()) < 0x20
    assert (scales < 0x08).any() and (scales >= 0x08).any()
    largest = float(reference_dequantize(raw, NVFP4).abs().max())
    assert 0.5 <= largest <= 0.71
