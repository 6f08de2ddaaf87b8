"""ggml's activation quantization: what llama.cpp's CPU backend does to the input of a matmul
with quantized weights, transcribed so this engine can compute the same numbers.

ggml converts the float32 activations of every matmul to its weight type's `vec_dot_type`
before an integer dot product: Q8_K (256-value blocks) for Q4_K and Q6_K weights, Q8_0
(32-value blocks) for Q4_0 and Q8_0, Q8_1 for Q4_1, then takes integer dot products of the
blocks.

Transcribed from ggml's C (pipelines/llama3/tests/test_ggml_activations.py holds each against
a plain float32 loop of the C code, one per code path):

  q8_k      quantize_row_q8_K_ref (x86 has no other): the signed value of largest
            magnitude (the first, on ties) sets iscale = -127 / max, one float32 division
            (Debian's libggml-base 0.27.0 disassembles to `divss` of -127 by max, then mulps
            and the 1.5 * 2^23 add: no FMA, no reciprocal); q = nearest_int(iscale * x) (round
            half to even), at most 127; d = 1 / iscale, float32.
  q8_0      the x86 SIMD path (AVX2, AVX-512: what llama.cpp runs on these machines):
            amax over the block, d = amax / 127 stored float16, id = 127 / amax,
            q = round half to even of x * id; `path="ref"` is quantize_row_q8_0_ref
            (id = 1 / d, rounding half away from zero), gguf-py's quantizer.
  q8_1      Q8_0's x86 d and q, and s = float16(d * sum q) with d before its rounding
            (the icelake build's quantize_row_q8_1 disassembles to exactly that).

The `ggml` execution mode (ggml_mode.py) computes the same quantizers in C
(kernels/ggml_dot.c); pipelines/llama3/tests/test_ggml_mode.py holds the two equal bit for
bit. This module is the torch form: the reference transcription.
"""

from __future__ import annotations

import torch

QK_K = 256
QK8_0 = 32


def _div(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator correctly rounded, as C's float division: torch computes
    `scalar / tensor` on long tensors as a multiplication by the reciprocal (1 ulp off)."""
    return torch.full_like(denominator, numerator) / denominator


def q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., n // 256, 256], d float32 [..., n // 256, 1]) of float32 `x` [..., n]."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QK_K)
    first_max = blocks.abs().argmax(-1, keepdim=True)  # torch.argmax: the first of equals
    signed_max = blocks.gather(-1, first_max)
    zero = signed_max == 0
    iscale = torch.where(zero, 0.0, _div(-127.0, torch.where(zero, 1.0, signed_max)))
    q = torch.round(iscale * blocks).clamp(max=127)  # torch.round: half to even
    d = torch.where(zero, 0.0, _div(1.0, torch.where(zero, 1.0, iscale)))
    return q.to(torch.int8), d


def q8_0(x: torch.Tensor, path: str = "x86") -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., n // 32, 32], d float16 [..., n // 32, 1]) of float32 `x` [..., n]."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)
    zero = amax == 0
    if path == "x86":
        inverse = torch.where(zero, 0.0, _div(127.0, torch.where(zero, 1.0, amax)))
        q = torch.round(blocks * inverse)
    elif path == "ref":
        inverse = torch.where(zero, 0.0, _div(1.0, torch.where(zero, 1.0, d)))
        scaled = blocks * inverse
        q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: half away from 0
    else:
        raise ValueError(f"path {path!r} is not x86 or ref")
    return q.to(torch.int8), d.to(torch.float16)


def q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [..., n // 32, 32], d float16, s float16 [..., n // 32, 1]) of float32 `x`."""
    blocks = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    q, d16 = q8_0(x)
    d = blocks.abs().amax(-1, keepdim=True) / torch.full_like(d16, 127.0, dtype=torch.float32)
    s = d * q.to(torch.int32).sum(-1, keepdim=True).float()
    return q, d16, s.to(torch.float16)
