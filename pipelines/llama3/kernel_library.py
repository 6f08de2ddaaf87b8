"""The C kernels (kernels/packed_gemm.c, kernels/ggml_dot.c): which build runs, and loading it.

Bazel builds the sources four times (kernels/BUILD.bazel), for four instruction sets:

    vnni      AVX-512F/VL/BW and VNNI: ggml_dot.c's integer dot products with dpbusd; the
              ggml mode's default where the CPU has them
    avx512    AVX-512F
    avx2      AVX2 + FMA + F16C: the quantized mode's default wherever the CPU has them
              (faster than the AVX-512 build on this project's AMD EPYC machines: 6.7 vs
              7.4 ms of kernels per SmolLM2 token), and the ggml mode's next choice
    portable  plain C (x86-64's SSE2 baseline): any other CPU

Every build of ggml_dot.c computes the same bits (its header says how); packed_gemm.c's
builds differ in summation order only. $LLAMA_GOLDENS_KERNELS names one build instead; a
name the CPU cannot run (by its /proc/cpuinfo flags) is refused rather than left to crash on
an illegal instruction. Nothing is compiled at run time: the libraries come from the folder
$LLAMA_GOLDENS_KERNEL_DIR names where it is set, else from Bazel's runfiles (a data dependency
of //pipelines/llama3, next to this file), else from the checkout's
bazel-bin/pipelines/llama3/kernels/ (plain pytest, after `./bazelw build
//pipelines/llama3/kernels`). Outside the runfiles, a library whose folder's kernels.sha256
is not the hash of the checkout's sources is refused (_check_fresh).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib

# Imported before any library loads, so the kernels' libgomp.so.1 is torch's: one thread pool.
import torch  # noqa: F401

KERNELS_ENV = "LLAMA_GOLDENS_KERNELS"
DIRECTORY_ENV = "LLAMA_GOLDENS_KERNEL_DIR"
BUILD_COMMAND = "./bazelw build //pipelines/llama3/kernels"

# Each build, the CPU flags it needs, and the vector width it reports (packed_gemm_simd()).
REQUIRED_FLAGS = {
    "vnni": ("avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
SIMD_BITS = {"vnni": 512, "avx512": 512, "avx2": 256, "portable": 0}
DOT_ISA = {"vnni": 2, "avx512": 1, "avx2": 1, "portable": 0}  # ggml_dot_isa()
DEFAULT_ORDER = ("avx2", "portable")  # the first the CPU runs is the default
GGML_ORDER = ("vnni", "avx2", "portable")  # the ggml mode's (integer products: VNNI first)

_HERE = pathlib.Path(__file__).parent
SOURCES = tuple(_HERE / "kernels" / name for name in ("packed_gemm.c", "ggml_dot.c", "half.h"))
# The checkout's Bazel output, for runs outside Bazel (this file is pipelines/llama3/...).
BAZEL_BIN = _HERE.parents[1] / "bazel-bin" / "pipelines" / "llama3" / "kernels"


class KernelUnavailable(RuntimeError):
    """The kernel library cannot be used: not built, or not runnable on this CPU."""


def file_name(isa: str) -> str:
    return f"packed_gemm_{isa}.so"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def missing_flags(isa: str) -> list[str]:
    """The CPU flags the `isa` build needs and this CPU lacks (/proc/cpuinfo), in order."""
    return [flag for flag in REQUIRED_FLAGS[isa] if flag not in cpu_flags()]


def runnable(isa: str) -> bool:
    return not missing_flags(isa)


def chosen(order: tuple[str, ...] = DEFAULT_ORDER) -> str:
    """The build to run: $LLAMA_GOLDENS_KERNELS, else the first of `order` the CPU runs."""
    names = ", ".join(REQUIRED_FLAGS)
    isa = os.environ.get(KERNELS_ENV, "").strip()
    if not isa:
        return next(name for name in order if runnable(name))
    if isa not in REQUIRED_FLAGS:
        raise KernelUnavailable(f"${KERNELS_ENV}={isa!r} is not one of {names} (or unset)")
    if not runnable(isa):
        usable = ", ".join(name for name in REQUIRED_FLAGS if runnable(name))
        raise KernelUnavailable(
            f"${KERNELS_ENV}={isa}: this CPU lacks {' '.join(missing_flags(isa))} (/proc/cpuinfo); "
            f"it runs {usable} (unset ${KERNELS_ENV} for the default)"
        )
    return isa


def library(order: tuple[str, ...] = DEFAULT_ORDER) -> ctypes.CDLL:
    """The chosen build (`chosen(order)`), loaded once per process."""
    return load(chosen(order))


def _locate(isa: str) -> pathlib.Path:
    name = file_name(isa)
    configured = os.environ.get(DIRECTORY_ENV)
    if configured:
        path = pathlib.Path(configured) / name
        if not path.is_file():
            raise KernelUnavailable(
                f"${DIRECTORY_ENV}={configured} holds no {name}: build the kernels with "
                f"`{BUILD_COMMAND}` (they land in bazel-bin/pipelines/llama3/kernels/)"
            )
        _check_fresh(
            path,
            f" (it builds bazel-bin/pipelines/llama3/kernels/; ${DIRECTORY_ENV}={configured} "
            "named this folder)",
        )
        return path
    beside = _HERE / "kernels" / name  # Bazel's runfiles mirror the source tree
    if beside.is_file():
        return beside
    built = BAZEL_BIN / name
    if not built.is_file():
        raise KernelUnavailable(
            f"the quantized and ggml modes need their kernel library {name}, built by Bazel: "
            f"run `{BUILD_COMMAND}` in {BAZEL_BIN.parents[3]} (looked in {beside.parent} and "
            f"{BAZEL_BIN}; ${DIRECTORY_ENV} names another folder), or use mode 'eager'"
        )
    _check_fresh(built)
    return built


def _check_fresh(built: pathlib.Path, hint: str = "") -> None:
    """A library outside the runfiles (bazel-bin's, or the folder $LLAMA_GOLDENS_KERNEL_DIR
    names) built from other versions of the sources is refused: plain pytest would otherwise
    test the old kernels after an edit to a source. The stamp is the folder's kernels.sha256,
    which Bazel writes beside the libraries (kernels/BUILD.bazel, :source_hash): the sha256 of
    SOURCES' bytes, one after the other. A folder without one (libraries built by hand, such
    as a planted bug's) and a tree without the sources are taken as they are."""
    stamp = built.parent / "kernels.sha256"
    if not (all(source.is_file() for source in SOURCES) and stamp.is_file()):
        return
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()
    if stamp.read_text().strip() != digest:
        names = ", ".join(source.name for source in SOURCES)
        raise KernelUnavailable(
            f"{built} was built from other versions of {names}: run `{BUILD_COMMAND}`{hint}"
        )


_PACKERS = ("pack_q4_0", "pack_q4_1", "pack_q4_k", "pack_q8_0")


@functools.cache
def load(isa: str) -> ctypes.CDLL:
    """The `isa` build ("vnni", "avx512", "avx2" or "portable"), with its functions'
    signatures; refused unless the library reports the instruction sets of `isa`."""
    if isa not in REQUIRED_FLAGS:
        raise KernelUnavailable(f"no kernel build {isa!r} (one of {', '.join(REQUIRED_FLAGS)})")
    path = _locate(isa)
    lib = ctypes.CDLL(str(path))
    reported = (lib.packed_gemm_simd(), lib.ggml_dot_isa())
    if reported != (SIMD_BITS[isa], DOT_ISA[isa]):
        raise KernelUnavailable(
            f"{path} reports {reported[0]}-bit vectors and dot products of level "
            f"{reported[1]}, not {isa}'s {SIMD_BITS[isa]} and {DOT_ISA[isa]}: run "
            f"`{BUILD_COMMAND}`"
        )
    # Arrays go as plain addresses (tensor.data_ptr()): converting an int is a tenth of the
    # cost of a typed ctypes pointer, and a decode step makes a few hundred calls. Every
    # caller checks dtype and contiguity first.
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.q8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.q4_dequantize.argtypes = [ptr, ptr, i64, i64, ptr]
    lib.q8_dequantize.argtypes = [ptr, ptr, i64, i64, ptr]
    for name in _PACKERS:
        getattr(lib, name).argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr]
    lib.rms_norm.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.decode_attention.argtypes += [ctypes.c_float, ptr, ptr]
    lib.decode_attention_paged.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64]
    lib.decode_attention_paged.argtypes += [ctypes.c_float, ptr, ptr, ctypes.c_int]
    lib.ggml_act_row_bytes.argtypes = [ctypes.c_int, i64]
    lib.ggml_act_row_bytes.restype = i64
    lib.ggml_quantize_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.ggml_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.ggml_rms_norm.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    lib.ggml_swiglu.argtypes = [ptr, ptr, i64, ptr]
    lib.ggml_swiglu_rows.argtypes = [ptr, i64, i64, ptr]
    lib.ggml_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.ggml_attention.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
    lib.ggml_rope_tables.restype = ctypes.c_int
    lib.ggml_rope_tables.argtypes = [i64, i64, ctypes.c_float, ptr, ptr, ptr]
    lib.ggml_rope_pow.restype = ctypes.c_float
    lib.ggml_rope_pow.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.ggml_rope_sin_cos.argtypes = [ptr, i64, ptr, ptr]
    lib.ggml_layer_bytes.restype = i64
    lib.swiglu_rows.argtypes = [ptr, i64, i64, ptr]
    lib.packed_layer_bytes.argtypes = []
    lib.packed_layer_bytes.restype = i64
    lib.packed_decode_layers.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.packed_decode_layers.argtypes += [ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.packed_decode_layers.argtypes += [i64]
    lib.packed_decode_layers.restype = ctypes.c_int
    lib.ggml_layer_bytes.argtypes = []
    lib.ggml_decode_layers.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.ggml_decode_layers.argtypes += [ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.ggml_decode_layers.argtypes += [i64]
    lib.ggml_decode_layers.restype = ctypes.c_int
    for name in ("packed_decode_paged", "ggml_decode_paged"):  # one signature
        function = getattr(lib, name)
        function.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
        function.argtypes += [ptr, ptr, i64, ptr, ptr, ctypes.c_float, ctypes.c_float]
        function.argtypes += [ctypes.c_int, i64]
        function.restype = ctypes.c_int
    functions = (
        "q4_gemm",
        "q8_gemm",
        "q4_dequantize",
        "q8_dequantize",
        "rms_norm",
        "decode_attention",
        "decode_attention_paged",
        "swiglu_rows",
        "ggml_quantize_rows",
        "ggml_gemm",
        "ggml_rms_norm",
        "ggml_swiglu",
        "ggml_swiglu_rows",
        "ggml_attention",
        "ggml_rope_sin_cos",
        *_PACKERS,
    )
    for name in functions:
        getattr(lib, name).restype = None
    return lib
