"""The ggml mode's products against llama.cpp's own CPU code: Debian's libggml-cpu-haswell.so
(libggml0, the version tools/llama_cpp/install.sh pins), called through ctypes.

kernels/ggml_dot.c says that it computes ggml's arithmetic bit for bit, and test_ggml_mode.py
holds it to that claim only indirectly (torch transcriptions of the quantizers, float64 sums
of the products, every build equal to the others). This file compares it with ggml itself, on
seeded random blocks and activations with ggml's edge cases (a zero block, negative maxima,
exact .5 ties, equal magnitudes of both signs, an outlier, float16-subnormal scales):

- the activation quantizers (ggml_quantize_rows) equal ggml's quantize_row_q8_0, q8_1 and
  q8_K: every value, scale and sum;
- every product (ggml_gemm) equals, to the bit, ggml's per-block kernels ggml_vec_dot_q4_0_q8_0,
  q4_1_q8_1, q4_K_q8_K and q8_0_q8_0 on ggml's own quantized activations: every weight type of
  the mode, in the GGUF layout and the pair layout the mode loads Q4_0 and Q4_1 rows into,
  for one activation row (a decode step) and for several (prefill's path, its 4-row groups and
  what is left over), rows of 1, 3, 16 and 17 blocks (a pair layout's odd last block; Q4_K's
  1 and 3) and 37 weight rows (a partial tile and a partial group of rows), on every kernel
  build this CPU runs: the haswell library is ggml's AVX2 code, and the claim is that every
  build (plain C, AVX2, AVX-512, VNNI) computes its bits.

Planted bugs, each built as the four kernel builds and loaded through $LLAMA_GOLDENS_KERNEL_DIR,
and what fails: Q4_K's min terms summed left to right instead of (m0 + m2) + (m1 + m3) (the
Q4_K products, every build); Q4_0's blocks accumulated by a multiply then an add instead of
one FMA (the Q4_0 products, both layouts, every build). test_ggml_mode.py passes both. Also
caught, and by test_ggml_mode.py too: the last row of a partial group of weight rows left out
(every product); VNNI's dpbusd started from 1 (every product of the vnni build); Q8_1's s from
the float16-rounded d (the Q8_1 quantizer, the Q4_1 products); Q8_0 ties rounded away from
zero (the Q8_0 quantizer, the Q4_0 and Q8_0 products).

Skips without the library, naming tools/llama_cpp/install.sh, unless CI_REQUIRE_LLAMA_CPP=1
(.ci/run), which makes that a failure; a libggml0 of another version than the pin fails (its
bits are not the ones ggml_dot.c transcribes).
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pipelines.llama3 import ggml_mode, kernel_library

T = GGMLQuantizationType
REQUIRE_ENV = "CI_REQUIRE_LLAMA_CPP"
# libggml0's folder of CPU backends (the one llama.cpp's tools load; tools/bench/cpu_level.py
# finds the same folder through `llama-bench --version`). haswell: AVX2, FMA, F16C and BMI2,
# the code llama.cpp runs on the AVX2 machines this project is measured on.
BACKEND = pathlib.Path("/usr/lib/x86_64-linux-gnu/ggml/backends0/libggml-cpu-haswell.so")
BACKEND_FLAGS = ("sse4_2", "avx", "f16c", "avx2", "bmi2", "fma")

# Per weight type: ggml's activation quantizer, its block bytes, and ggml's product.
QUANTIZER = {
    T.Q4_0: ("quantize_row_q8_0", 34),
    T.Q4_1: ("quantize_row_q8_1", 36),
    T.Q4_K: ("quantize_row_q8_K", 292),
    T.Q8_0: ("quantize_row_q8_0", 34),
}
PRODUCT = {
    T.Q4_0: "ggml_vec_dot_q4_0_q8_0",
    T.Q4_1: "ggml_vec_dot_q4_1_q8_1",
    T.Q4_K: "ggml_vec_dot_q4_K_q8_K",
    T.Q8_0: "ggml_vec_dot_q8_0_q8_0",
}
# Row lengths: 1, 3, 16 and 17 blocks of 32 values (odd counts end a pair-layout row in one
# GGUF block), 1 and 3 blocks of Q4_K's 256.
COLS = {qtype: (32, 96, 512, 544) for qtype in (T.Q4_0, T.Q4_1, T.Q8_0)} | {T.Q4_K: (256, 768)}
ROWS = 37  # weight rows: two of ggml_dot.c's tiles of 16, then its groups of 4: one, and 1
BATCHES = (1, 5, 7)  # activation rows: dot_rows alone; a group of 4 then 1 row; 4 then 3
LAYOUTS = [(qtype, "gguf") for qtype in ggml_mode.WEIGHT_CODES]
LAYOUTS += [(qtype, "paired") for qtype in ggml_mode.PAIRED_CODES]
ISAS = [isa for isa in ("portable", "avx2", "avx512", "vnni") if kernel_library.runnable(isa)]
VEC_DOT = {"Q8_0": T.Q4_0, "Q8_1": T.Q4_1, "Q8_K": T.Q4_K}  # a weight type of each


def _install_script() -> pathlib.Path:
    """tools/llama_cpp/install.sh, which pins libggml0 (GGML_DEBIAN): Bazel passes its runfiles
    path, plain pytest reads the checkout's."""
    configured = os.environ.get("LLAMA_CPP_INSTALL")
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path(__file__).resolve().parents[3] / "tools" / "llama_cpp" / "install.sh"


def _unavailable(message: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} (${REQUIRE_ENV}=1: the comparison with llama.cpp must run)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def ggml() -> ctypes.CDLL:
    """Debian's haswell CPU backend, initialized, with the signatures used here."""
    if not BACKEND.is_file():
        _unavailable(f"{BACKEND} is not installed: run tools/llama_cpp/install.sh")
    missing = [flag for flag in BACKEND_FLAGS if flag not in kernel_library.cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {' '.join(missing)}: it cannot run {BACKEND.name}")
    if shutil.which("dpkg-query"):
        found = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "libggml0"], capture_output=True, text=True
        ).stdout.strip()
        script = _install_script()
        (pinned,) = re.findall(r'^GGML_DEBIAN="([^"]+)"', script.read_text(), re.MULTILINE)
        if found and found != pinned:
            pytest.fail(
                f"libggml0 is {found}; ggml_dot.c transcribes {pinned} (GGML_DEBIAN in "
                f"{script}): run tools/llama_cpp/install.sh, which installs it"
            )
    lib = ctypes.CDLL(str(BACKEND))
    lib.ggml_cpu_init()
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    for name, _ in QUANTIZER.values():
        getattr(lib, name).argtypes = [ptr, ptr, ctypes.c_int64]
        getattr(lib, name).restype = None
    for name in PRODUCT.values():
        # (n, s, bs, vx, bx, vy, by, nrc): with nrc = 1, s = one weight row . one activation row
        getattr(lib, name).argtypes = [ctypes.c_int, ptr, size, ptr, size, ptr, size, ctypes.c_int]
        getattr(lib, name).restype = None
    return lib


def _weights(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF blocks [rows, row bytes]: any bytes are valid blocks once the float16
    scales (and minimums) are finite; theirs span five decades."""
    values, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    fields = 2 if qtype in (T.Q4_1, T.Q4_K) else 1
    scales = rng.uniform(0.5, 2.0, size=(len(blocks), fields))
    scales *= 10.0 ** rng.integers(-4, 1, size=(len(blocks), 1))
    blocks[:, : 2 * fields] = scales.astype(np.float16).view(np.uint8).reshape(len(blocks), -1)
    return blocks.reshape(rows, -1)


def _activations(cols: int, seed: int) -> np.ndarray:
    """Seven float32 rows [7, cols], each with an edge case of ggml's quantizers."""
    rng, rows = np.random.default_rng(seed), max(BATCHES)
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 2, size=(rows, 1))
    x[0, :32] = 0.0  # a zero block
    x[1] = -np.abs(x[1])  # negative maxima
    ties = np.arange(cols) % 127 + 0.5  # x * 127 / amax lands on .5
    ties[::32] = 127.0
    x[2] = ties
    x[3] = np.arange(cols) % 7 - 3.0  # -3 before +3 in each block (Q8_K takes the first)
    x[4] *= 10.0 ** rng.uniform(-8, -4, size=cols // 32).repeat(32)  # float16-subnormal d
    x[5, 7::64] *= 500.0  # an outlier per 64 values: the others on a coarse grid
    return np.ascontiguousarray(x.astype(np.float32))


def _engine_blocks(qtype: GGMLQuantizationType, act: np.ndarray) -> dict[str, np.ndarray]:
    """ggml_dot.c's activation blocks (float32 scales) as arrays: d, q, and s or bsums."""
    rows = act.shape[0]
    if qtype == T.Q4_K:  # Q8_K: ggml's own layout
        return {"bytes": act}
    size = 40 if qtype == T.Q4_1 else 36
    blocks = act.reshape(rows, -1, size)
    out = {"d": blocks[..., 0:4].copy().view(np.float32), "q": blocks[..., size - 32 :]}
    if qtype == T.Q4_1:
        out["s"] = blocks[..., 4:8].copy().view(np.float32)
    return out


def _float16(pairs: np.ndarray) -> np.ndarray:
    """Byte pairs [..., 2] read as float16, widened exactly to float32 [..., 1]."""
    return pairs.copy().view(np.float16).astype(np.float32)


def _ggml_blocks(qtype: GGMLQuantizationType, act: np.ndarray) -> dict[str, np.ndarray]:
    """ggml's activation blocks (float16 scales) as the same arrays, scales in float32."""
    rows = act.shape[0]
    if qtype == T.Q4_K:
        return {"bytes": act}
    size = QUANTIZER[qtype][1]
    blocks = act.reshape(rows, -1, size)
    out = {"d": _float16(blocks[..., 0:2]), "q": blocks[..., size - 32 :]}
    if qtype == T.Q4_1:
        out["s"] = _float16(blocks[..., 2:4])
    return out


def _ggml_quantized(ggml, qtype: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row for the weight type, row by row: [rows, block row bytes]."""
    name, size = QUANTIZER[qtype]
    rows, cols = x.shape
    out = np.zeros((rows, cols // GGML_QUANT_SIZES[qtype][0] * size), dtype=np.uint8)
    for m in range(rows):
        getattr(ggml, name)(x[m].ctypes.data, out[m].ctypes.data, cols)
    return out


@functools.cache
def _reference(ggml, qtype: GGMLQuantizationType, cols: int):
    """(weights, activations, ggml's products [7, ROWS]) for one row length."""
    w, x = _weights(qtype, ROWS, cols, seed=cols), _activations(cols, seed=cols + 1)
    act = _ggml_quantized(ggml, qtype, x)
    dot = getattr(ggml, PRODUCT[qtype])
    y = np.zeros((x.shape[0], ROWS), dtype=np.float32)
    out = ctypes.c_float()
    for m in range(x.shape[0]):
        for n in range(ROWS):
            dot(cols, ctypes.addressof(out), 0, w[n].ctypes.data, 0, act[m].ctypes.data, 0, 1)
            y[m, n] = out.value
    return w, x, y


def test_every_weight_type_of_the_mode_is_compared() -> None:
    assert set(QUANTIZER) == set(PRODUCT) == set(COLS) == set(ggml_mode.WEIGHT_CODES)
    assert {VEC_DOT[kind] for kind in set(ggml_mode.VEC_DOT_TYPES.values())} <= set(QUANTIZER)
    assert ISAS  # at least the portable build


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", sorted(VEC_DOT))
def test_the_activation_quantizers_are_ggmls_bit_for_bit(ggml, kind, isa) -> None:
    lib, qtype = kernel_library.load(isa), VEC_DOT[kind]
    code = ggml_mode.WEIGHT_CODES[qtype]
    for cols in COLS[qtype]:
        x = _activations(cols, seed=cols + 1)
        act = torch.zeros(x.shape[0] * lib.ggml_act_row_bytes(code, cols), dtype=torch.uint8)
        lib.ggml_quantize_rows(code, x.ctypes.data, x.shape[0], cols, act.data_ptr())
        ours = _engine_blocks(qtype, act.numpy().reshape(x.shape[0], -1))
        theirs = _ggml_blocks(qtype, _ggml_quantized(ggml, qtype, x))
        for field, want in theirs.items():
            differ = np.argwhere(ours[field].view(np.uint8) != want.view(np.uint8))
            assert len(differ) == 0, (
                f"{kind} {field}, {cols} values a row: {len(differ)} bytes differ from ggml's, "
                f"the first in row {differ[0][0]} (row 0 zero, 1 negative, 2 ties, 3 -3..3, "
                "4 subnormal scales, 5 outliers)"
            )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("qtype", "layout"), LAYOUTS, ids=[f"{qtype.name}-{layout}" for qtype, layout in LAYOUTS]
)
def test_each_product_is_ggmls_bit_for_bit(ggml, qtype, layout, isa) -> None:
    lib = kernel_library.load(isa)
    for cols in COLS[qtype]:
        w, x, want = _reference(ggml, qtype, cols)
        if layout == "paired":
            w, code = ggml_mode.paired_rows(w, qtype), ggml_mode.PAIRED_CODES[qtype]
        else:
            code = ggml_mode.WEIGHT_CODES[qtype]
        blocks = torch.from_numpy(np.ascontiguousarray(w))
        for batch in BATCHES:
            y = torch.zeros(batch, ROWS, dtype=torch.float32)
            act = torch.zeros(batch * lib.ggml_act_row_bytes(code, cols), dtype=torch.uint8)
            lib.ggml_gemm(code, x[:batch].ctypes.data, batch, cols, blocks.data_ptr(), ROWS,
                          y.data_ptr(), act.data_ptr(), 1)  # fmt: skip
            got = y.numpy()
            differ = np.argwhere(got.view(np.int32) != want[:batch].view(np.int32))
            if len(differ):
                m, n = differ[0]
                pytest.fail(
                    f"{qtype.name} ({layout} layout), {cols} values a row, {batch} activation "
                    f"rows: {len(differ)} of {got.size} outputs differ from ggml's, the first "
                    f"[{m}, {n}]: {float(got[m, n]):.9g} against ggml's {float(want[m, n]):.9g}"
                )
