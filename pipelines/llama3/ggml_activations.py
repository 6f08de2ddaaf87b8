"""ggml's activation quantization: what llama.cpp's CPU backend does to the input of a matmul
with quantized weights, transcribed so this engine can compute the same numbers.

ggml converts the float32 activations of every matmul to its weight type's `vec_dot_type`
before an integer dot product: Q8_K (256-value blocks) for Q4_K and Q6_K weights, Q8_0
(32-value blocks) for Q4_0 and Q8_0, Q8_1 for Q4_1. The dot product of a weight block with
a quantized activation block equals, up to float rounding of the sums, the float dot product
with the dequantized activations, so `fake_quantize` (quantize, then dequantize) in front of
each linear gives this engine ggml's numerics for that product.

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
bit. This module keeps the torch form: the reference transcription, and `install` (a forward
pre-hook in front of the eager mode's linears, the first step toward that mode).

Measured against Debian's llama-server 0.7.0 on the tiny Q4_K checkpoint: with Q8_K
activations in front of every Q4_K product (the tied head included), this engine agrees with
llama.cpp to 1.3e-5 .. 1.75e-5 on the short golden cases, where it differs by 1.54 without
them (test_llama_cpp). `install` covers Q4_K weights only.
"""

from __future__ import annotations

import torch
from torch import nn

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


def fake_quantize(x: torch.Tensor, vec_dot_type: str) -> torch.Tensor:
    """`x` quantized to `vec_dot_type` (Q8_K or Q8_0) and dequantized, in x's dtype."""
    if vec_dot_type == "Q8_K":
        q, d = q8_k(x)
    elif vec_dot_type == "Q8_0":
        q, d = q8_0(x)
    else:
        raise ValueError(f"no transcription of ggml's {vec_dot_type} activations")
    return (q.float() * d.float()).reshape(x.shape).to(x.dtype)


VEC_DOT_TYPE = {"Q4_K": "Q8_K"}  # weight type -> its activations (the validated ones)


def install(linears: dict[str, nn.Module], weight_types: dict[str, str]) -> int:
    """A forward pre-hook on each linear (by its GGUF tensor name) whose weight type has a
    transcribed vec_dot_type, quantizing its input as ggml does; returns how many. Float
    weights keep float activations, as in ggml."""
    installed = 0
    for name, module in linears.items():
        kind = weight_types[name]
        if kind in ("F32", "F16", "BF16"):
            continue
        if kind not in VEC_DOT_TYPE:
            raise ValueError(f"{name}: ggml activations for {kind} weights are not transcribed")
        vec_dot_type = VEC_DOT_TYPE[kind]
        module.register_forward_pre_hook(
            lambda _module, inputs, t=vec_dot_type: (fake_quantize(inputs[0], t), *inputs[1:])
        )
        installed += 1
    return installed


def model_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The engine's linears of a Transformer (eager mode) by GGUF tensor name; the head is
    the token embedding's when the checkpoint ties them (no output.weight)."""
    names = {
        "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
        "w1": "ffn_gate", "w2": "ffn_down", "w3": "ffn_up",
    }  # fmt: skip
    linears = {}
    for i, layer in enumerate(model.layers):
        for owner in (layer.attention, layer.feed_forward):
            for attr, tensor in names.items():
                if hasattr(owner, attr):
                    linears[f"blk.{i}.{tensor}.weight"] = getattr(owner, attr)
    linears["output.weight"] = model.output
    return linears
