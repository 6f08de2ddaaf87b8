"""The engine's `ggml` execution mode: llama.cpp's CPU numerics for quantized checkpoints.

The quantized mode multiplies float32 activations by exactly dequantized weights; llama.cpp
does not. Before every product with Q4_0, Q4_1, Q4_K or Q8_0 weights, ggml quantizes the
activation row to 8 bits (the weight type's `vec_dot_type`: Q8_0, Q8_1 or Q8_K) and takes
integer dot products per block, so its log-probabilities on those files differ from the
float goldens by 0.4 to 2.3: another program. This mode computes that program, on the GGUF
blocks as the file stores them, in kernels/ggml_dot.c (whose header gives each rule):

    GgmlLinear       y = x . W^T: x quantized per row as ggml does, integer block dots,
                     float accumulation in the order of ggml's AVX2 vec_dot kernels
    GgmlRMSNorm      RMSNorm with ggml's double sum of squares
    GgmlFeedForward  SwiGLU with ggml's SiLU (its AVX2 expf algorithm, lane by lane)

Everything else is the quantized mode's (packed.py: the fused q/k/v and gate/up products,
the one-call decode attention, the embedding lookups). Every kernel build computes the same
bits (AVX2, AVX-512 VNNI, plain C), so this mode's goldens hold on any x86 CPU; the
attention (softmax, rope: torch's and packed_gemm.c's float32 code) is not ggml's, which is
where llama.cpp still differs (docs/goldens.md, "The ggml mode").

Float weights (F32, BF16) and NVFP4 stay float, as in the quantized mode: ggml's
vec_dot_type for F32 is F32, and this mode transcribes no other.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pipelines.llama3 import packed
from pipelines.llama3.kernel_library import GGML_ORDER, library
from pipelines.llama3.packing import RawMatrix

# kernels/ggml_dot.c's weight codes, and the activations ggml quantizes for each
WEIGHT_CODES = {
    GGMLQuantizationType.Q4_0: 0,
    GGMLQuantizationType.Q4_1: 1,
    GGMLQuantizationType.Q4_K: 2,
    GGMLQuantizationType.Q8_0: 3,
}
VEC_DOT_TYPES = {
    GGMLQuantizationType.Q4_0: "Q8_0",
    GGMLQuantizationType.Q4_1: "Q8_1",
    GGMLQuantizationType.Q4_K: "Q8_K",
    GGMLQuantizationType.Q8_0: "Q8_0",
}
# Weight bytes x activation rows from which a product uses threads (as packed.PARALLEL_BYTES)
PARALLEL_BYTES = 1 << 17


def kernels():
    """The kernel build this mode runs (VNNI first: kernel_library.GGML_ORDER)."""
    return library(GGML_ORDER)


class GgmlMatrix:
    """A [rows, cols] matrix as GGUF blocks, rows in the engine's order: `blocks` uint8
    [rows, row bytes] (the parts' rows one after the other, each part's row_order applied)."""

    # Where and in what it computes: the model reads these as it would a dense weight's.
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, parts: list[RawMatrix]) -> None:
        qtype, cols = parts[0].qtype, parts[0].cols
        if any(p.qtype != qtype or p.cols != cols for p in parts):
            raise ValueError("fused parts must share the weight type and the column count")
        if qtype not in WEIGHT_CODES:
            raise ValueError(f"the ggml mode has no {qtype.name} products")
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = cols // block_values * block_bytes
        rows = []
        for part in parts:
            raw = np.ascontiguousarray(part.raw).view(np.uint8).reshape(part.rows, row_bytes)
            if part.row_order is not None:
                raw = raw[part.row_order.numpy()]
            rows.append(raw)
        self.blocks = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows)))
        self.qtype, self.code = qtype, WEIGHT_CODES[qtype]
        self.rows, self.cols = self.blocks.shape[0], cols

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class GgmlLinear(nn.Module):
    """y = x . W^T as ggml computes it; x float32 [..., cols] on the CPU. `splits` cuts the
    output into several tensors (a fused gate/up projection)."""

    def __init__(self, weight: GgmlMatrix, splits: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.splits = splits
        self.in_features, self.out_features = weight.cols, weight.rows
        self._lib = kernels()
        self._w = weight.blocks.data_ptr()
        self._row_bytes = self._lib.ggml_act_row_bytes(weight.code, weight.cols)
        self._act = torch.empty(0, dtype=torch.uint8)  # the quantized activations, kept

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the ggml mode takes float32 CPU activations, not {x.dtype}")
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        rows = x.shape[0]
        if self._act.numel() < rows * self._row_bytes:
            self._act = torch.empty(rows * self._row_bytes, dtype=torch.uint8)
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads() if rows * self.weight.nbytes >= PARALLEL_BYTES else 1
        self._lib.ggml_gemm(
            self.weight.code,
            x.data_ptr(),
            rows,
            self.in_features,
            self._w,
            self.out_features,
            y.data_ptr(),
            self._act.data_ptr(),
            threads,
        )
        y = y.reshape(*leading, self.out_features)
        return y if self.splits is None else y.split(self.splits, dim=-1)


def ggml_linear(parts: list[RawMatrix], splits: tuple[int, ...] | None = None) -> GgmlLinear:
    return GgmlLinear(GgmlMatrix(parts), splits)


class GgmlRMSNorm(packed.KernelRMSNorm):
    """RMSNorm as ggml computes it (kernels/ggml_dot.c: ggml_rms_norm) for float32 CPU rows."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._lib = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        if not (usable and x.is_contiguous() and self.weight.is_contiguous()):
            return super().forward(x)
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.ggml_rms_norm(
            x.data_ptr(), self.weight.data_ptr(), x.numel() // dim, dim, self.eps, y.data_ptr()
        )
        return y


class GgmlFeedForward(packed.PackedFeedForward):
    """The fused gate/up product, then SwiGLU with ggml's SiLU (ggml_swiglu_rows)."""

    def __init__(self, dim: int, hidden_dim: int, w13: GgmlLinear, w2: nn.Module) -> None:
        super().__init__(dim, hidden_dim, w13, w2)
        self._lib = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13 = self.w13
        splits, w13.splits = w13.splits, None
        try:
            gate_up = w13(x)  # [..., 2 * hidden], gate then up
        finally:
            w13.splits = splits
        hidden = splits[0]
        leading = gate_up.shape[:-1]
        out = torch.empty(*leading, hidden, dtype=torch.float32)
        self._lib.ggml_swiglu_rows(
            gate_up.data_ptr(), gate_up.numel() // (2 * hidden), hidden, out.data_ptr()
        )
        return self.w2(out)


def install(model: nn.Module, matrices: dict[str, RawMatrix]) -> None:
    """The quantized mode's structure (packed.install) with this mode's products, norms and
    SwiGLU. A matrix of a type without a ggml product here raises (none reach it: the loader
    keeps only Q4_0, Q4_1, Q4_K and Q8_0 as raw blocks)."""
    unknown = sorted({m.qtype.name for m in matrices.values()} - {t.name for t in WEIGHT_CODES})
    if unknown:
        raise ValueError(f"the ggml mode has no products for {', '.join(unknown)} weights")
    packed.install(
        model, matrices, linear=ggml_linear, norm=GgmlRMSNorm, feed_forward=GgmlFeedForward
    )
