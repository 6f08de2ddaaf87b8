"""What the kernel tests share: tolerances, random inputs, and a float64 CPU reference.

Each kernel test runs an engine building block on the device under test (the `device` fixture
of max_tests/conftest.py: CUDA, or the CPU under GPU_TEST_DEVICE=cpu) and compares it with the
same computation written out here in float64 on the CPU, from the same rounded inputs.

Tolerances (|device - reference| <= atol + rtol * |reference|), why each is what it is:
  float32: atol 1e-4, rtol 1e-4. TF32 is off (the `device` fixture); what remains is reduction
           order in cuBLAS/SDPA kernels, ~1e-6 relative per op on these sizes; 1e-4 leaves
           headroom and still catches a wrong mask or position (errors of order 1).
  bfloat16: atol 2e-2, rtol 2e-2. Inputs and outputs are rounded to 8 mantissa bits
           (7.8e-3 relative); torch's assert_close uses rtol 1.6e-2 for bf16.
The CPU as the device under test lands well inside both: the same tolerances hold there.

NVFP4 weights are built from raw random blocks rather than by a quantizer, so these tests
depend on no quantizer: any 4 scale bytes (UE4M3) and 32 bytes of nibbles (E2M1) make a valid
block of 64 values, and gguf-py's numpy dequantizer is the reference for what they mean.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pipelines.llama3 import quants
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.model import Attention, precompute_rope

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]

NVFP4 = GGMLQuantizationType.NVFP4
NVFP4_BLOCK_VALUES, NVFP4_BLOCK_BYTES = GGML_QUANT_SIZES[NVFP4]
NVFP4_SCALES = 4  # UE4M3 bytes at the start of a block, one per 16 values
# Scale bytes below 0x20: zero, the subnormals and exponents 1-3, so the values reach 0.70 (scale
# 0.0586 x the largest E2M1 value 12): weights of the size a 64-to-512-wide layer has. Larger
# scales (up to 224 x 12 at 0x7E) are exact too, but would drown the products in the rounding of
# the biggest ones; test_nvfp4_dequantize_gpu covers every scale byte.
NVFP4_MODEST_SCALE_BYTES = 0x20

# One attention layer with grouped-query heads (4 query heads share 2 KV heads) and llama3 rope
# scaling; small enough that the float64 reference is instant.
ATTENTION_CONFIG = LlamaConfig(
    vocab_size=32, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, head_dim=16,
    rope_theta=500000.0, rms_norm_eps=1e-5, context_length=64, tie_word_embeddings=False,
    rope_scaling_type="llama3", rope_scaling_factor=8.0,
)  # fmt: skip
PREFILL, DECODE = 6, 4  # positions prefilled under a causal mask, then decoded one by one


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, what: str):
    """`actual` (any device) within TOLERANCE[dtype] of the float64 CPU `reference`."""
    atol, rtol = TOLERANCE[dtype]
    device = actual.device.type
    actual = actual.detach().double().cpu()
    diff = (actual - reference).abs()
    allowed = atol + rtol * reference.abs()
    worst = float((diff - allowed).max())
    assert worst <= 0, (
        f"{what} ({dtype}): max |{device} - float64 cpu| {float(diff.max()):.3g} exceeds "
        f"atol {atol:g} + rtol {rtol:g}*|ref| by {worst:.3g}"
    )


def engine_dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The engine's dequantization of `raw` on `device`, or a failure naming what is missing.

    Looked up when the test runs, so a type the engine does not read yet fails its own tests
    with the reason instead of breaking the collection of every test in the package.
    """
    if qtype not in quants.SUPPORTED_TYPES:
        pytest.fail(
            f"the engine cannot dequantize {qtype.name}: pipelines.llama3.quants has no "
            f"dequantizer for it (BLOCK_DEQUANTIZERS)"
        )
    return quants.dequantize(raw, qtype, shape, device=device)


def reference_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """gguf-py's numpy dequantization of `raw` [rows, bytes per row], as float64 [rows, cols]."""
    return torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64))


def random_nvfp4_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    """NVFP4 bytes [rows, cols / 64 * 36] of random nibbles and modest random scales."""
    n_blocks = rows * cols // NVFP4_BLOCK_VALUES
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, NVFP4_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :NVFP4_SCALES] = rng.integers(
        0, NVFP4_MODEST_SCALE_BYTES, size=(n_blocks, NVFP4_SCALES), dtype=np.uint8
    )
    return blocks.reshape(rows, -1)


def attention_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each attention projection."""
    q_dim, kv_dim = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {
        "wq": (q_dim, config.dim),
        "wk": (kv_dim, config.dim),
        "wv": (kv_dim, config.dim),
        "wo": (config.dim, q_dim),
    }


def reference_attention(x, wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, cos, sin):
    """Causal grouped-query attention over the whole sequence, float64, no cache."""
    seq = x.shape[0]
    q = (x @ wq.T).view(seq, n_heads, head_dim)
    k = (x @ wk.T).view(seq, n_kv_heads, head_dim)
    v = (x @ wv.T).view(seq, n_kv_heads, head_dim)

    def rope(t):
        half = head_dim // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos[:, None, :] + rotated * sin[:, None, :]

    q, k = rope(q), rope(k)
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, n_heads * head_dim)
    return out @ wo.T


def check_attention(
    device_weights: dict[str, torch.Tensor],
    reference_weights: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    what: str,
) -> None:
    """The engine's Attention on `device` against reference_attention in float64.

    It prefills PREFILL positions with a causal mask, then appends DECODE single positions to
    the KV cache; the reference attends over the whole sequence at once, so a wrong mask, cache
    slot or rope position shows as an error of order 1. `device_weights` (on `device`) are what
    the engine is loaded with, `reference_weights` (float64, CPU) what the reference uses; both
    are rounded to `dtype` once, from their own precision.
    """
    config = ATTENTION_CONFIG
    total = PREFILL + DECODE
    x = torch.randn(total, config.dim, generator=generator(2), dtype=torch.float64)
    attention = Attention(config).to(device, dtype)
    with torch.no_grad():
        for name, w in device_weights.items():
            getattr(attention, name).weight.copy_(w)
    shape = (1, config.n_kv_heads, total, config.head_dim)
    attention.cache_k = torch.zeros(shape, device=device, dtype=dtype)
    attention.cache_v = torch.zeros(shape, device=device, dtype=dtype)
    cos, sin = precompute_rope(config, total, device)

    x_dev = x.to(device, dtype)[None]  # [1, total, dim]
    mask = torch.ones(PREFILL, PREFILL, dtype=torch.bool, device=device).tril()
    with torch.no_grad():
        outputs = [attention(x_dev[:, :PREFILL], 0, cos[:PREFILL], sin[:PREFILL], mask)[0]]
        for pos in range(PREFILL, total):
            step = attention(x_dev[:, pos : pos + 1], pos, cos[pos : pos + 1],
                             sin[pos : pos + 1], None)  # fmt: skip
            outputs.append(step[0])
    actual = torch.cat(outputs)  # [total, dim]

    rounded = {name: w.to(dtype).double() for name, w in reference_weights.items()}
    reference = reference_attention(
        x.to(dtype).double(), rounded["wq"], rounded["wk"], rounded["wv"], rounded["wo"],
        config.n_heads, config.n_kv_heads, config.head_dim, cos.double().cpu(), sin.double().cpu(),
    )  # fmt: skip
    assert_close(actual, reference, dtype, what)
