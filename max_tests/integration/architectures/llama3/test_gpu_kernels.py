"""The engine's building blocks on CUDA against a float64 CPU reference written out here.

Tolerances (|cuda - reference| <= atol + rtol * |reference|), why each is what it is:
  float32: atol 1e-4, rtol 1e-4. TF32 is switched off; what remains is reduction order in
           cuBLAS/SDPA kernels, ~1e-6 relative per op on these sizes; 1e-4 leaves headroom
           and still catches a wrong mask or position (errors of order 1).
  bfloat16: atol 2e-2, rtol 2e-2. Inputs and outputs are rounded to 8 mantissa bits
           (7.8e-3 relative); torch's assert_close uses rtol 1.6e-2 for bf16.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.model import Attention, RMSNorm, precompute_rope
from pipelines.llama3.quants import dequantize as engine_dequantize

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, what: str):
    atol, rtol = TOLERANCE[dtype]
    actual = actual.detach().double().cpu()
    diff = (actual - reference).abs()
    allowed = atol + rtol * reference.abs()
    worst = float((diff - allowed).max())
    assert worst <= 0, (
        f"{what} ({dtype}): max |cuda - float64 cpu| {float(diff.max()):.3g} exceeds "
        f"atol {atol:g} + rtol {rtol:g}*|ref| by {worst:.3g}"
    )


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rms_norm_gpu(dtype):
    dim, eps = 576, 1e-5
    x = torch.randn(2, 7, dim, generator=_generator(0), dtype=torch.float64) * 3
    weight = torch.rand(dim, generator=_generator(1), dtype=torch.float64) + 0.5
    norm = RMSNorm(dim, eps).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    # The reference sees the same rounded inputs the GPU sees.
    x_in, w_in = x.to(dtype).double(), weight.to(dtype).double()
    reference = w_in * x_in / torch.sqrt(x_in.pow(2).mean(-1, keepdim=True) + eps)
    _assert_close(norm(x.to("cuda", dtype)), reference, dtype, "RMSNorm")


def _reference_attention(x, wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, cos, sin):
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_llama3_attention_gpu(dtype):
    """Prefill 6 positions with a causal mask, then append 4 decode steps to the KV cache."""
    config = LlamaConfig(
        vocab_size=32, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, head_dim=16,
        rope_theta=500000.0, rms_norm_eps=1e-5, context_length=64, tie_word_embeddings=False,
        rope_scaling_type="llama3", rope_scaling_factor=8.0,
    )  # fmt: skip
    prefill, decode = 6, 4
    total = prefill + decode
    g = _generator(2)
    x = torch.randn(total, config.dim, generator=g, dtype=torch.float64)
    weights = {
        name: torch.randn(rows, config.dim if name != "wo" else rows, generator=g,
                          dtype=torch.float64) / math.sqrt(config.dim)
        for name, rows in (("wq", 64), ("wk", 32), ("wv", 32), ("wo", 64))
    }  # fmt: skip
    attention = Attention(config).to("cuda", dtype)
    with torch.no_grad():
        for name, w in weights.items():
            getattr(attention, name).weight.copy_(w)
    shape = (1, config.n_kv_heads, total, config.head_dim)
    attention.cache_k = torch.zeros(shape, device="cuda", dtype=dtype)
    attention.cache_v = torch.zeros(shape, device="cuda", dtype=dtype)
    cos, sin = precompute_rope(config, total, torch.device("cuda"))

    x_dev = x.to("cuda", dtype)[None]  # [1, total, dim]
    mask = torch.ones(prefill, prefill, dtype=torch.bool, device="cuda").tril()
    outputs = [attention(x_dev[:, :prefill], 0, cos[:prefill], sin[:prefill], mask)[0]]
    for pos in range(prefill, total):
        step = attention(x_dev[:, pos : pos + 1], pos, cos[pos : pos + 1], sin[pos : pos + 1], None)
        outputs.append(step[0])
    actual = torch.cat(outputs)  # [total, dim]

    rounded = {name: w.to(dtype).double() for name, w in weights.items()}
    reference = _reference_attention(
        x.to(dtype).double(), rounded["wq"], rounded["wk"], rounded["wv"], rounded["wo"],
        config.n_heads, config.n_kv_heads, config.head_dim, cos.double().cpu(), sin.double().cpu(),
    )  # fmt: skip
    _assert_close(actual, reference, dtype, "GQA attention, prefill + KV-cache decode")


def _random_q4_k_blocks(n_blocks: int, seed: int) -> np.ndarray:
    """Valid Q4_K blocks: any bytes are, once d and dmin are finite, modest float16 values."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    scales = np.stack([rng.uniform(1e-3, 2e-2, n_blocks), rng.uniform(1e-3, 1e-2, n_blocks)], 1)
    blocks[:, :4] = scales.astype(np.float16).view(np.uint8).reshape(n_blocks, 4)
    return blocks


def test_llama3_linear_q4k_gpu():
    """Q4_K dequantization and the matmul on CUDA against gguf-py's numpy dequantizer."""
    out_features, in_features = 96, 512  # rows of 2 super-blocks of 256
    blocks = _random_q4_k_blocks(out_features * in_features // 256, seed=3)
    raw = blocks.reshape(out_features, -1)
    weight_ref = torch.from_numpy(
        gguf_dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float64)
    )  # [out, in]
    weight_gpu = engine_dequantize(raw, GGMLQuantizationType.Q4_K, (out_features, in_features),
                                   device="cuda")  # fmt: skip
    # Dequantization is exact integer-times-scale math: bit-identical on both devices.
    assert torch.equal(weight_gpu.cpu().double(), weight_ref)
    x = torch.randn(5, in_features, generator=_generator(4), dtype=torch.float64)
    actual = x.to("cuda", torch.float32) @ weight_gpu.T
    _assert_close(actual, x.float().double() @ weight_ref.T, torch.float32, "Q4_K linear")
