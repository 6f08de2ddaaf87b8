"""Weights that stay 4-bit or 8-bit in memory: the engine's `quantized` execution mode.

GGUF's Q4_0, Q4_1 and Q4_K map exactly onto groupwise int4 (32 values per group, one float32
scale and offset each: w = scale * q + offset), and Q8_0 onto groupwise int8 (w = scale * q).
`pack` turns a tensor's raw blocks into those arrays; `PackedLinear` multiplies float32
activations by them with the C kernels of kernels/packed_gemm.c, which read ~1/7 of the bytes
the dense float32 weights take. `dequantize` gives back the float32 weights, bit-identical to
quants.dequantize (the tests check it on every packable tensor).

Why not torch's own int4 kernels: on the CPU, `_weight_int4pack_mm_for_cpu` is vectorized
for bfloat16 activations and scales only (float32 runs a scalar loop, ~10x slower than the
dense float32 product); bfloat16 activations or scales move SmolLM2's log-probabilities far
past the float32 tolerances. These kernels keep float32 activations and exact scales.

The kernels compile once per machine with the system C compiler (`cc`, or $CC) into
~/.cache/llama-goldens/kernels (or $LLAMA_GOLDENS_KERNEL_CACHE), named by a hash of the
source, the flags and the CPU's features.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pipelines.llama3.model import RMSNorm

GROUP = 32
SOURCE = pathlib.Path(__file__).with_name("kernels") / "packed_gemm.c"
# -mno-avx512f: the AVX2 path, measured faster on this project's AMD EPYC machines (6.7 vs 7.4
# ms of kernels per SmolLM2 token); "-mavx512f" in $LLAMA_GOLDENS_KERNEL_FLAGS turns it back on.
FLAGS = ("-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC", "-std=c11")
CACHE_ENV = "LLAMA_GOLDENS_KERNEL_CACHE"
# Extra compiler flags, e.g. "-mavx512f" for the AVX-512 path or "-mno-avx2" for plain C
# (the tests build each path this way).
EXTRA_FLAGS_ENV = "LLAMA_GOLDENS_KERNEL_FLAGS"

INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
INT8_TYPES = (GGMLQuantizationType.Q8_0,)
PACKABLE_TYPES = frozenset(INT4_TYPES + INT8_TYPES)
# Weight bytes x activation rows from which a product uses threads. Measured on SmolLM2 with
# 2 threads: 1 << 17 gives 117 tok/s, 1 << 19 105, 1 << 15 114 (the pool wakes for nothing).
PARALLEL_BYTES = 1 << 17
# From this many rows (prompt tokens) a product runs dense on the dequantized weights: the
# kernels are made for decode's one row. Short golden prompts (<= 16 tokens) stay packed.
DENSE_ROWS = 64


class KernelUnavailable(RuntimeError):
    """The packed kernels could not be built (no C compiler, or it failed)."""


# --- building and loading the kernels -------------------------------------------------------


def _cache_directory() -> pathlib.Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "llama-goldens" / "kernels"


def _cpu_features() -> str:
    """The CPU's flags line: -march=native code is only reused on a CPU with the same ones."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use (about a second) and cached on disk."""
    return build_library(tuple(os.environ.get(EXTRA_FLAGS_ENV, "").split()))


@functools.cache
def build_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels compiled with FLAGS + `extra_flags` (cached in memory and on disk)."""
    flags = (*FLAGS, *extra_flags)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable(
            "mode 'quantized' compiles its kernels with a C compiler, and none was found "
            "(no `cc` on PATH, $CC unset): install gcc, or use mode 'eager'"
        )
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((compiler, *flags)).encode() + _cpu_features().encode()
    ).hexdigest()[:16]
    directory = _cache_directory()
    target = directory / f"packed_gemm-{key}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            directory = pathlib.Path(tempfile.gettempdir())
            target = directory / target.name
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=target.name, suffix=".tmp")
        os.close(fd)
        command = [compiler, *flags, str(SOURCE), "-o", temporary, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            os.unlink(temporary)
            raise KernelUnavailable(
                f"building {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr[-2000:]}"
            )
        os.replace(temporary, target)  # atomic: a concurrent build gives the same bytes
    # torch is imported first, so the kernels' libgomp.so.1 is torch's: one thread pool.
    lib = ctypes.CDLL(str(target))
    # Arrays go as plain addresses (tensor.data_ptr()): converting an int is a tenth of the
    # cost of a typed ctypes pointer, and a decode step makes a few hundred calls. Every
    # caller checks dtype and contiguity first.
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.q8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.q4_dequantize.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.q8_dequantize.argtypes = [ptr, ptr, i64, i64, ptr]
    for name in ("pack_q4_0", "pack_q4_1", "pack_q4_k", "pack_q8_0"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr]
    lib.rms_norm.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.decode_attention.argtypes += [ctypes.c_float, ptr, ptr]
    functions = (
        "q4_gemm",
        "q8_gemm",
        "q4_dequantize",
        "q8_dequantize",
        "rms_norm",
        "decode_attention",
        *_PACKERS.values(),
    )
    for name in functions:
        getattr(lib, name).restype = None
    return lib


# --- packing GGUF blocks ----------------------------------------------------------------------


@dataclasses.dataclass
class PackedWeight:
    """A [rows, cols] weight in groups of 32 along cols.

    int4: q [rows, cols / 32, 16] uint8 (byte j: value j low nibble, value j + 16 high),
          scales [rows, cols / 32, 2] float32 (scale, offset).
    int8: q [rows, cols] int8, scales [rows, cols / 32] float32.
    """

    kind: str  # "int4" | "int8"
    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    cols: int

    # Where and in what it computes: the model reads these as it would a dense weight's.
    dtype = torch.float32
    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * 4


def can_pack(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    return qtype in PACKABLE_TYPES and len(shape) == 2 and shape[1] % GROUP == 0


@dataclasses.dataclass
class RawMatrix:
    """A GGUF matrix's raw blocks, to be packed; `row_order[r]` is the file row that becomes
    row r (llama.cpp's permuted wq/wk), None for the file's order."""

    raw: np.ndarray
    qtype: GGMLQuantizationType
    rows: int
    cols: int
    row_order: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "int8" if self.qtype in INT8_TYPES else "int4"

    def scales_finite(self) -> bool:
        """Whether every float16 scale (and min) in the blocks is finite."""
        # Read as the fields' bit patterns in place (every block size is even, every offset
        # too): a float16 is inf or NaN exactly when its 5 exponent bits are all ones.
        block_bytes = GGML_QUANT_SIZES[self.qtype][1]
        words = np.asarray(self.raw).view(np.uint8).reshape(-1).view(np.uint16)
        blocks = words.reshape(-1, block_bytes // 2)
        exponent = np.uint16(0x7C00)
        return not any(
            bool(((blocks[:, o // 2] & exponent) == exponent).any())
            for o in _SCALE_OFFSETS[self.qtype]
        )


_SCALE_OFFSETS = {  # byte offsets of each block's float16 scale fields
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
}
_PACKERS = {
    GGMLQuantizationType.Q4_0: "pack_q4_0",
    GGMLQuantizationType.Q4_1: "pack_q4_1",
    GGMLQuantizationType.Q4_K: "pack_q4_k",
    GGMLQuantizationType.Q8_0: "pack_q8_0",
}


def pack_rows(parts: list[RawMatrix]) -> PackedWeight:
    """The parts' rows one after the other (a fused projection when several), packed into one
    buffer in a single pass by the kernel library; no value is rounded."""
    kind, cols = parts[0].kind, parts[0].cols
    if any(p.kind != kind or p.cols != cols for p in parts):
        raise ValueError("fused parts must share the packed kind and the column count")
    rows = sum(p.rows for p in parts)
    groups = cols // GROUP
    if kind == "int4":
        q = torch.empty(rows, groups, GROUP // 2, dtype=torch.uint8)
        scales = torch.empty(rows, groups, 2, dtype=torch.float32)
    else:
        q = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, groups, dtype=torch.float32)
    lib, start = library(), 0
    for part in parts:
        raw = torch.from_numpy(np.ascontiguousarray(part.raw).view(np.uint8).reshape(-1))
        order = None if part.row_order is None else part.row_order.to(torch.int64).contiguous()
        getattr(lib, _PACKERS[part.qtype])(
            raw.data_ptr(),
            raw.numel() // part.rows,
            None if order is None else order.data_ptr(),
            part.rows,
            cols,
            q[start].data_ptr(),
            scales[start].data_ptr(),
        )
        start += part.rows
    return PackedWeight(kind, q, scales, rows, cols)


def pack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF blocks of a [rows, cols] tensor -> PackedWeight."""
    if not can_pack(qtype, shape):
        raise ValueError(f"{qtype.name} {shape} has no packed form")
    return pack_rows([RawMatrix(raw, qtype, *shape)])


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """[rows, cols] float32 through the kernel library's own reading of the packed arrays."""
    out = torch.empty(weight.rows, weight.cols, dtype=torch.float32)
    lib = library()
    if weight.kind == "int4":
        lib.q4_dequantize(
            weight.q.data_ptr(),
            weight.scales.data_ptr(),
            weight.rows,
            weight.cols,
            out.data_ptr(),
        )
    else:
        lib.q8_dequantize(
            weight.q.data_ptr(),
            weight.scales.data_ptr(),
            weight.rows,
            weight.cols,
            out.data_ptr(),
        )
    return out


# --- modules ----------------------------------------------------------------------------------


class PackedLinear(nn.Module):
    """y = x . W^T with W packed; x float32 [..., cols] on the CPU. `splits` cuts the output
    into several tensors (a fused QKV or gate/up projection)."""

    def __init__(self, weight: PackedWeight, splits: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.splits = splits
        self.in_features, self.out_features = weight.cols, weight.rows
        self._lib = library()
        self._q = weight.q.data_ptr()
        self._scales = weight.scales.data_ptr()
        self._sums = torch.empty(0, dtype=torch.float32)  # the kernel's scratch, kept

    def _scratch(self, size: int) -> torch.Tensor:
        """The kernel's per-call scratch (group sums of x), allocated once per largest size."""
        if self._sums.numel() < size:
            self._sums = torch.empty(size, dtype=torch.float32)
        return self._sums

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"packed weights take float32 CPU activations, not {x.dtype}")
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        rows = x.shape[0]
        if rows >= DENSE_ROWS:
            # A long prefill: the kernels stream the packed weights once per row, so at M rows
            # they read M times the weights (a 2k-token SmolLM2 prompt took 40 s against 6 s in
            # eager). Dequantized once (bit-identical to eager's weights), BLAS reads them once.
            y = F.linear(x, dequantize(self.weight)).reshape(*leading, self.out_features)
            return y if self.splits is None else y.split(self.splits, dim=-1)
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        # Small products run on one thread: waking the pool costs more than it saves there.
        threads = torch.get_num_threads() if rows * self.weight.nbytes >= PARALLEL_BYTES else 1
        if self.weight.kind == "int4":
            sums = self._scratch(rows * (self.in_features // GROUP))
            self._lib.q4_gemm(
                x.data_ptr(),
                rows,
                self.in_features,
                self._q,
                self._scales,
                self.out_features,
                y.data_ptr(),
                sums.data_ptr(),
                threads,
            )
        else:
            self._lib.q8_gemm(
                x.data_ptr(),
                rows,
                self.in_features,
                self._q,
                self._scales,
                self.out_features,
                y.data_ptr(),
                threads,
            )
        y = y.reshape(*leading, self.out_features)
        return y if self.splits is None else y.split(self.splits, dim=-1)


class PackedEmbedding(nn.Module):
    """Embedding rows read from packed weights (only the looked-up rows are dequantized)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        q, scales = w.q[tokens], w.scales[tokens]
        if w.kind == "int8":
            return scales.repeat_interleave(GROUP, dim=-1) * q.float()
        values = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # [..., groups, 32]
        out = torch.addcmul(scales[..., 1:], scales[..., :1], values)
        return out.reshape(*tokens.shape, w.cols)


class KernelRMSNorm(RMSNorm):
    """RMSNorm in one kernel call for float32 CPU rows; anything else as RMSNorm does.

    The quantized mode's norms: same weight and eps, same arithmetic as torch's float32
    rms_norm up to the summation order of the mean of squares.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._lib = library()

    @classmethod
    def of(cls, norm: RMSNorm) -> KernelRMSNorm:
        """`norm` with this forward, sharing its weight."""
        kernel = cls(norm.weight.shape[0], norm.eps)
        kernel.weight = norm.weight
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        if not (usable and x.is_contiguous() and self.weight.is_contiguous()):
            return super().forward(x)
        y = torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.rms_norm(
            x.data_ptr(),
            self.weight.data_ptr(),
            x.numel() // dim,
            dim,
            self.eps,
            y.data_ptr(),
        )
        return y


class DecodeAttention:
    """One decode step of an Attention whose q, k and v come from one packed product: the
    rotation, the cache writes and grouped-query attention over the cache in one kernel call
    (`decode_attention` in the kernels) instead of about ten torch operators per layer.

    Set as `Attention.decode_step` by `install`; the attention calls it for one new position of
    one sequence and keeps the general path (SDPA) for prefill, batches and anything else.
    The result differs from SDPA's in summation order only; the rotation is bit-identical.
    """

    def __init__(self) -> None:
        self._lib = library()
        self._scores = torch.empty(0, dtype=torch.float32)

    def __call__(
        self,
        attention: nn.Module,
        x: torch.Tensor,
        start_pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        cache_k, cache_v = attention.cache_k, attention.cache_v
        tables = cos.dtype == sin.dtype == cache_k.dtype == cache_v.dtype == torch.float32
        if not (tables and cos.is_contiguous() and sin.is_contiguous()):
            return None
        if not (cache_k.is_contiguous() and cache_v.is_contiguous()):
            return None
        qkv = attention.wqkv(x)  # [1, 1, (n_heads + 2 n_kv_heads) * head_dim], our own tensor
        if self._scores.numel() < start_pos + 1:
            self._scores = torch.empty(cache_k.shape[2], dtype=torch.float32)
        out = torch.empty(1, 1, attention.n_heads * attention.head_dim, dtype=torch.float32)
        self._lib.decode_attention(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cache_k.data_ptr(),
            cache_v.data_ptr(),
            attention.n_heads,
            attention.n_kv_heads,
            attention.head_dim,
            cache_k.shape[2],
            start_pos,
            attention.scale,
            self._scores.data_ptr(),
            out.data_ptr(),
        )
        return out


def install(model: nn.Module, matrices: dict[str, RawMatrix]) -> None:
    """Pack `matrices` (parameter name -> RawMatrix) into a Transformer whose other
    parameters are loaded.

    wq/wk/wv become one fused `wqkv` and w1/w3 one `w13` when all their parts are packable
    alike (one kernel call and one read of the activations instead of three or two).
    """

    def fuse(owner: nn.Module, prefix: str, parts: tuple[str, ...], fused: str = "") -> None:
        names = [f"{prefix}.{part}.weight" for part in parts]
        present = [matrices.get(name) for name in names]
        if fused and all(present) and len({(m.kind, m.cols) for m in present}) == 1:
            # q, k, v stay one tensor (the attention splits it); gate and up are split here.
            splits = None if fused == "wqkv" else tuple(m.rows for m in present)
            setattr(owner, fused, PackedLinear(pack_rows(present), splits))
            for part in parts:
                setattr(owner, part, None)
            return
        for part, matrix in zip(parts, present, strict=True):
            if matrix is not None:
                setattr(owner, part, PackedLinear(pack_rows([matrix])))

    if not matrices:
        return  # nothing packed (a float file): the model stays exactly the eager one
    float_norms = (
        model.norm.weight.dtype == torch.float32 and model.norm.weight.device.type == "cpu"
    )
    if float_norms:
        model.norm = KernelRMSNorm.of(model.norm)
    for i, layer in enumerate(model.layers):
        if float_norms:
            layer.attention_norm = KernelRMSNorm.of(layer.attention_norm)
            layer.ffn_norm = KernelRMSNorm.of(layer.ffn_norm)
        fuse(layer.attention, f"layers.{i}.attention", ("wq", "wk", "wv"), "wqkv")
        if layer.attention.wqkv is not None:
            layer.attention.decode_step = DecodeAttention()
        fuse(layer.feed_forward, f"layers.{i}.feed_forward", ("w1", "w3"), "w13")
        fuse(layer.attention, f"layers.{i}.attention", ("wo",))
        fuse(layer.feed_forward, f"layers.{i}.feed_forward", ("w2",))
    embedding = None
    if "tok_embeddings.weight" in matrices:
        embedding = pack_rows([matrices["tok_embeddings.weight"]])
        model.tok_embeddings = PackedEmbedding(embedding)
    if "output.weight" in matrices:
        model.output = PackedLinear(pack_rows([matrices["output.weight"]]))
    elif embedding is not None and model.config.tie_word_embeddings:
        model.output = PackedLinear(embedding)
