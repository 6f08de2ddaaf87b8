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
from gguf import GGMLQuantizationType
from torch import nn

from pipelines.llama3 import quants

GROUP = 32
SOURCE = pathlib.Path(__file__).with_name("kernels") / "packed_gemm.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
CACHE_ENV = "LLAMA_GOLDENS_KERNEL_CACHE"

INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
INT8_TYPES = (GGMLQuantizationType.Q8_0,)
PACKABLE_TYPES = frozenset(INT4_TYPES + INT8_TYPES)
PARALLEL_BYTES = 1 << 19  # weight bytes x activation rows from which a product uses threads


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


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels, built on first use (about a second) and cached on disk."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable(
            "mode 'quantized' compiles its kernels with a C compiler, and none was found "
            "(no `cc` on PATH, $CC unset): install gcc, or use mode 'eager'"
        )
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode() + _cpu_features().encode()
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
        command = [compiler, *FLAGS, str(SOURCE), "-o", temporary]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            os.unlink(temporary)
            raise KernelUnavailable(
                f"building {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr[-2000:]}"
            )
        os.replace(temporary, target)  # atomic: a concurrent build gives the same bytes
    # torch is imported first, so the kernels' libgomp.so.1 is torch's: one thread pool.
    lib = ctypes.CDLL(str(target))
    f32, i64 = ctypes.POINTER(ctypes.c_float), ctypes.c_int64
    u8, i8 = ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_int8)
    lib.q4_gemm.argtypes = [f32, i64, i64, u8, f32, i64, f32, f32, ctypes.c_int]
    lib.q8_gemm.argtypes = [f32, i64, i64, i8, f32, i64, f32, ctypes.c_int]
    lib.q4_dequantize.argtypes = [u8, f32, i64, i64, f32]
    lib.q8_dequantize.argtypes = [i8, f32, i64, i64, f32]
    for function in (lib.q4_gemm, lib.q8_gemm, lib.q4_dequantize, lib.q8_dequantize):
        function.restype = None
    return lib


def _pointer(tensor: torch.Tensor, ctype: type) -> ctypes._Pointer:
    return ctypes.cast(tensor.data_ptr(), ctypes.POINTER(ctype))


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

    def permute_rows(self, permute: callable) -> PackedWeight:
        """The same weight with its rows reordered by `permute` ([rows, X] -> [rows, X])."""
        q = permute(self.q.reshape(self.rows, -1)).reshape(self.q.shape)
        scales = permute(self.scales.reshape(self.rows, -1)).reshape(self.scales.shape)
        return dataclasses.replace(self, q=q.contiguous(), scales=scales.contiguous())


def can_pack(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    return qtype in PACKABLE_TYPES and len(shape) == 2 and shape[1] % GROUP == 0


def pack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> PackedWeight:
    """Raw GGUF blocks of a [rows, cols] tensor -> PackedWeight (no value is rounded)."""
    rows, cols = shape
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
    groups = rows * cols // GROUP
    if qtype == GGMLQuantizationType.Q8_0:
        blocks = blocks.reshape(groups, 34)
        q = blocks[:, 2:].contiguous().view(torch.int8).reshape(rows, cols)
        scales = quants._f16(blocks, 0).reshape(rows, cols // GROUP)
        return PackedWeight("int8", q, scales, rows, cols)
    if qtype == GGMLQuantizationType.Q4_0:
        blocks = blocks.reshape(groups, 18)
        d = quants._f16(blocks, 0)
        scale_offset, q = torch.cat([d, -8.0 * d], dim=1), blocks[:, 2:]
    elif qtype == GGMLQuantizationType.Q4_1:
        blocks = blocks.reshape(groups, 20)
        scale_offset = torch.cat([quants._f16(blocks, 0), quants._f16(blocks, 2)], dim=1)
        q = blocks[:, 4:]
    elif qtype == GGMLQuantizationType.Q4_K:
        scale_offset, q = _q4_k_groups(blocks.reshape(-1, 144))
    else:
        raise ValueError(f"{qtype.name} has no packed form")
    q = q.contiguous().reshape(rows, cols // GROUP, GROUP // 2)
    return PackedWeight("int4", q, scale_offset.reshape(rows, cols // GROUP, 2), rows, cols)


def _q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks -> per-32 (scale d*sc, offset -dmin*m) and Q4_1-ordered nibbles."""
    n_blocks = blocks.shape[0]
    d, dmin = quants._f16(blocks, 0), quants._f16(blocks, 2)
    sc, mins = quants._q4_k_scales_mins(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(-1, 1)
    offset = -(dmin * mins.float()).reshape(-1, 1)
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high
    chunks = blocks[:, 16:].reshape(n_blocks, 4, 1, 32)
    values = torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(-1, 32)  # [groups, 32]
    q = values[:, :16] | (values[:, 16:] << 4)
    return torch.cat([scale, offset], dim=1), q


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """[rows, cols] float32 through the kernel library's own reading of the packed arrays."""
    out = torch.empty(weight.rows, weight.cols, dtype=torch.float32)
    lib = library()
    if weight.kind == "int4":
        lib.q4_dequantize(
            _pointer(weight.q, ctypes.c_uint8),
            _pointer(weight.scales, ctypes.c_float),
            weight.rows,
            weight.cols,
            _pointer(out, ctypes.c_float),
        )
    else:
        lib.q8_dequantize(
            _pointer(weight.q, ctypes.c_int8),
            _pointer(weight.scales, ctypes.c_float),
            weight.rows,
            weight.cols,
            _pointer(out, ctypes.c_float),
        )
    return out


def concatenate(weights: list[PackedWeight]) -> PackedWeight | None:
    """Row-wise concatenation (a fused projection), or None when the kinds differ."""
    kinds = {w.kind for w in weights}
    if len(kinds) != 1 or len({w.cols for w in weights}) != 1:
        return None
    return PackedWeight(
        kinds.pop(),
        torch.cat([w.q for w in weights]),
        torch.cat([w.scales for w in weights]),
        sum(w.rows for w in weights),
        weights[0].cols,
    )


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
        self._q = _pointer(weight.q, ctypes.c_uint8 if weight.kind == "int4" else ctypes.c_int8)
        self._scales = _pointer(weight.scales, ctypes.c_float)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"packed weights take float32 CPU activations, not {x.dtype}")
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        # Small products run on one thread: waking the pool costs more than it saves there.
        threads = torch.get_num_threads() if rows * self.weight.nbytes >= PARALLEL_BYTES else 1
        if self.weight.kind == "int4":
            sums = torch.empty(rows, self.in_features // GROUP, dtype=torch.float32)
            self._lib.q4_gemm(
                _pointer(x, ctypes.c_float),
                rows,
                self.in_features,
                self._q,
                self._scales,
                self.out_features,
                _pointer(y, ctypes.c_float),
                _pointer(sums, ctypes.c_float),
                threads,
            )
        else:
            self._lib.q8_gemm(
                _pointer(x, ctypes.c_float),
                rows,
                self.in_features,
                self._q,
                self._scales,
                self.out_features,
                _pointer(y, ctypes.c_float),
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


def install(model: nn.Module, weights: dict[str, PackedWeight]) -> None:
    """Put packed weights into a Transformer whose other parameters are loaded.

    wq/wk/wv become one fused `wqkv` and w1/w3 one `w13` when all their parts are packed alike
    (one kernel call and one read of the activations instead of three or two).
    """

    def linear(name: str) -> PackedLinear:
        return PackedLinear(weights[name])

    def fuse(owner: nn.Module, prefix: str, parts: tuple[str, ...], fused: str) -> None:
        names = [f"{prefix}.{part}.weight" for part in parts]
        if not all(name in weights for name in names):
            for part, name in zip(parts, names, strict=True):
                if name in weights:
                    setattr(owner, part, linear(name))
            return
        joined = concatenate([weights[name] for name in names])
        if joined is None:
            for part, name in zip(parts, names, strict=True):
                setattr(owner, part, linear(name))
            return
        setattr(owner, fused, PackedLinear(joined, tuple(weights[n].rows for n in names)))
        for part in parts:
            setattr(owner, part, None)

    for i, layer in enumerate(model.layers):
        fuse(layer.attention, f"layers.{i}.attention", ("wq", "wk", "wv"), "wqkv")
        fuse(layer.feed_forward, f"layers.{i}.feed_forward", ("w1", "w3"), "w13")
        for owner, part, name in (
            (layer.attention, "wo", f"layers.{i}.attention.wo.weight"),
            (layer.feed_forward, "w2", f"layers.{i}.feed_forward.w2.weight"),
        ):
            if name in weights:
                setattr(owner, part, linear(name))
    if "tok_embeddings.weight" in weights:
        model.tok_embeddings = PackedEmbedding(weights["tok_embeddings.weight"])
    head = weights.get("output.weight")
    if head is None and model.config.tie_word_embeddings:
        head = weights.get("tok_embeddings.weight")
    if head is not None:
        model.output = PackedLinear(head)
