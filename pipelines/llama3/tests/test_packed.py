"""The quantized mode's packed weights: exact packing, kernel products, the engine end to end.

Exactness is checked on every packable tensor of the tiny Q4_K file and SmolLM2 (Q4_1, Q8_0)
and on gguf-py's own Q4_0/Q4_1/Q8_0 quantizations: the kernel library's dequantization of the
packed arrays equals quants.dequantize (the dense path) bit for bit.
"""

import contextlib
import dataclasses
import functools
import hashlib
import os
import pathlib
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine, ggml_mode, kernel_library, packed, packing, quants
from pipelines.llama3.gguf_file import GGUFFile
from pipelines.llama3.model import Attention, RMSNorm
from pipelines.llama3.serving import Request, ServingEngine
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

# Relative to the repository root, where pytest and Bazel's runfiles both start.
Q4_K_FILE = pathlib.Path("max_tests/integration/architectures/llama3/testdata/tiny_llama_q4_k.gguf")

GGUF_PY_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
# The builds this CPU runs, for the tests that loop over every build (one it cannot run is left
# out there, and shows as test_every_build_loop_runs_the_build's skip).
ISAS = [isa for isa in ("portable", "avx2", "avx512", "vnni") if kernel_library.runnable(isa)]


def _runnable_or_skip(isa: str) -> None:
    """Skip, naming the CPU flags it lacks (/proc/cpuinfo), where this CPU cannot run `isa`. A
    skip, not a failure under $GOLDENS_REQUIRED: a CPU without AVX-512 is no missing input."""
    lacks = kernel_library.missing_flags(isa)
    if lacks:
        pytest.skip(f"this CPU cannot run the {isa} kernels: it lacks {' '.join(lacks)}")


def _gguf_py_tensor(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    # Rows of very different magnitudes, so scales and offsets span many exponents.
    values = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-12, 4, size=(rows, 1)))
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def _raw(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> packing.RawMatrix:
    return packing.RawMatrix(_gguf_py_tensor(qtype, rows, cols, seed), qtype, rows, cols)


def _check_exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    dense = quants.dequantize(raw, qtype, shape)
    weight = packing.pack(raw, qtype, shape)
    assert torch.equal(packing.dequantize(weight), dense)


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_gguf_py_quantizations_pack_exactly(qtype: GGMLQuantizationType) -> None:
    _check_exact(_gguf_py_tensor(qtype, 48, 256, 0), qtype, (48, 256))


def test_every_packable_tensor_of_the_q4_k_file_packs_exactly() -> None:
    reader = GGUFFile(Q4_K_FILE)
    checked = 0
    for name, info in reader.tensors.items():
        if packing.can_pack(info.tensor_type, info.shape):
            _check_exact(reader.tensor_data(name), info.tensor_type, info.shape)
            checked += 1
    assert checked >= 7  # the layers' matrices are Q4_K


@pytest.mark.slow
def test_every_smollm2_tensor_packs_exactly() -> None:
    reader = GGUFFile(smollm2_gguf())
    types = set()
    for name, info in reader.tensors.items():
        if packing.can_pack(info.tensor_type, info.shape):
            _check_exact(reader.tensor_data(name), info.tensor_type, info.shape)
            types.add(info.tensor_type)
    assert types == {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}


def _assert_within_rounding(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """y equals x @ dense.T up to float32 summation order, each output on its own scale: within
    1e-5 of the sum of its terms' magnitudes (measured: 2.0e-7 at most, every build and kind).
    _gguf_py_tensor scales its rows by exp(U(-12, 4)): a bound of 1e-5 of the largest output
    would pass 11 of 40 outputs (9 of 24) returned as 0."""
    expected = x @ dense.t()
    assert y.shape == expected.shape
    budget = 1e-5 * (x.abs() @ dense.abs().t()) + 1e-30
    worst = ((y - expected).abs() / budget).max().item()  # NaN (a NaN output) fails as well
    assert worst <= 1.0, f"an output off by {worst:.3g} times its budget"


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows_of_x", [1, 3, 4, 9])
def test_kernel_product_equals_the_dense_product(qtype, rows_of_x: int) -> None:
    """Only the summation order differs: float32 rounding, each output within 1e-5 of the sum
    of its terms' magnitudes."""
    raw = _gguf_py_tensor(qtype, 40, 320, 1)
    dense = quants.dequantize(raw, qtype, (40, 320))
    x = torch.randn(2, rows_of_x, 320, generator=torch.Generator().manual_seed(2))
    y = packed.PackedLinear(packing.pack(raw, qtype, (40, 320)))(x)
    _assert_within_rounding(y, x, dense)


@pytest.mark.parametrize(
    ("isa", "simd"), [("avx2", 256), ("avx512", 512), ("vnni", 512), ("portable", 0)]
)
def test_every_code_path_of_the_kernels_agrees(isa, simd, monkeypatch) -> None:
    """AVX2 (the default), AVX-512 (with VNNI, the ggml mode's build) and plain C, each its
    own library: the same exact weights (dequantized bit for bit), and products equal to the
    dense product up to float32 summation order (the builds sum in different orders: their
    Q4_1 and Q8_0 products differ in the last bits)."""
    _runnable_or_skip(isa)
    monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
    assert kernel_library.library() is kernel_library.load(isa)
    assert kernel_library.load(isa).packed_gemm_simd() == simd
    for qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        raw = _gguf_py_tensor(qtype, 24, 320, 9)
        dense = quants.dequantize(raw, qtype, (24, 320))
        weight = packing.pack(raw, qtype, (24, 320))
        assert torch.equal(packing.dequantize(weight), dense)
        x = torch.randn(6, 320, generator=torch.Generator().manual_seed(3))
        _assert_within_rounding(packed.PackedLinear(weight)(x), x, dense)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "vnni", "portable"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_an_output_has_the_same_bits_in_a_block_of_outputs_and_alone(isa, qtype, monkeypatch):
    """The vector builds finish 16 (AVX-512) or 8 (AVX2) outputs together: their horizontal
    sums in one transposing tree, their offset terms in vector lanes. Each output must keep
    the bits it has when computed alone (a one-row weight: the per-output path, the same
    reduction as the vector's own horizontal sum), in every row of x, past the row tile of 4
    and the last whole block of outputs."""
    _runnable_or_skip(isa)
    monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
    outputs, cols = 37, 320
    raw = _gguf_py_tensor(qtype, outputs, cols, 11)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(12))
    together = packed.PackedLinear(packing.pack(raw, qtype, (outputs, cols)))(x)
    alone = torch.cat(
        [
            packed.PackedLinear(packing.pack(raw[n : n + 1], qtype, (1, cols)))(x)
            for n in range(outputs)
        ],
        dim=1,
    )
    assert torch.equal(together, alone)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "vnni", "portable"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_a_row_has_the_same_bits_alone_and_in_a_tile_of_rows(isa, qtype, monkeypatch):
    """The vector builds compute a decode row (a call of one row, or the last row of a call
    whose rows are one past a tile of 4) and tiles of 2 to 4 rows sharing each group's
    unpacking through packed_gemm.c's rows_vectors, its row count a constant at each call.
    Each row must keep one set of bits either way (pooled head rows and a served batch rely
    on it), with an even and an odd number of groups (the loop takes groups in pairs).
    Planted: the row path summing every group into one accumulator, and full tiles doing so
    (each FAILED on each vector build, int4 and int8)."""
    _runnable_or_skip(isa)
    monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
    for cols in (320, 352):  # 10 and 11 groups
        raw = _gguf_py_tensor(qtype, 21, cols, 13)
        product = packed.PackedLinear(packing.pack(raw, qtype, (21, cols)))
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(14))
        tiled = product(x)  # rows 0-3 one tile, row 4 the row path
        alone = torch.cat([product(x[r : r + 1]) for r in range(5)])
        assert torch.equal(tiled, alone), (qtype.name, cols)


@pytest.mark.parametrize("isa", list(kernel_library.REQUIRED_FLAGS))
def test_every_build_loop_runs_the_build(isa) -> None:
    """The tests that loop over ISAS (decode attention, SwiGLU, the one-call decode steps) run
    each build this CPU runs, and the build reports its instruction set; a build the CPU cannot
    run is this test's skip, naming the flags it lacks, so the report shows what they left
    out."""
    _runnable_or_skip(isa)
    assert isa in ISAS
    lib = kernel_library.load(isa)
    assert lib.packed_gemm_simd() == kernel_library.SIMD_BITS[isa]
    assert lib.ggml_dot_isa() == kernel_library.DOT_ISA[isa]


def test_avx2_is_the_default_where_the_cpu_has_it(monkeypatch) -> None:
    monkeypatch.delenv(kernel_library.KERNELS_ENV, raising=False)
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"}
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset(flags))
    assert kernel_library.chosen() == "avx2"
    assert kernel_library.chosen(kernel_library.GGML_ORDER) == "vnni"
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert kernel_library.chosen(kernel_library.GGML_ORDER) == "avx2"
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "sse2"}))
    assert kernel_library.chosen() == "portable"  # AVX2 without FMA


def test_a_bad_or_unrunnable_choice_names_the_variable_and_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(kernel_library.KERNELS_ENV, "avx1024")
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library.library()
    assert str(error.value) == (
        "$LLAMA_GOLDENS_KERNELS='avx1024' is not one of vnni, avx512, avx2, portable (or unset)"
    )
    monkeypatch.setenv(kernel_library.KERNELS_ENV, "avx512")
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library.library()
    assert str(error.value) == (
        "$LLAMA_GOLDENS_KERNELS=avx512: this CPU lacks avx512f (/proc/cpuinfo); it runs avx2, "
        "portable (unset $LLAMA_GOLDENS_KERNELS for the default)"
    )


def test_under_bazel_the_libraries_come_from_runfiles() -> None:
    """A data dependency of //pipelines/llama3: next to kernel_library.py in the runfiles,
    never a checkout's bazel-bin, which may hold another version."""
    if "TEST_SRCDIR" not in os.environ:
        pytest.skip("outside Bazel")
    path = pathlib.Path(kernel_library.load("portable")._name)
    assert path == kernel_library._HERE / "kernels" / "packed_gemm_portable.so"
    assert path.is_relative_to(os.environ["TEST_SRCDIR"])


def test_a_missing_or_stale_library_says_how_to_build_it(tmp_path, monkeypatch) -> None:
    """Outside Bazel the libraries come from bazel-bin, or from the folder
    $LLAMA_GOLDENS_KERNEL_DIR names: absent, or built from another version of the sources
    (the folder's kernels.sha256), they are refused with the command that builds them."""
    monkeypatch.delenv(kernel_library.DIRECTORY_ENV, raising=False)
    source = tmp_path / "pipelines" / "llama3" / "kernels" / "packed_gemm.c"
    source.parent.mkdir(parents=True)
    source.write_text("int packed_gemm_simd(void) { return 0; }\n")
    other = source.parent / "ggml_dot.c"
    other.write_text("int ggml_dot_isa(void) { return 0; }\n")
    header = source.parent / "half.h"
    header.write_text("/* */\n")
    bazel_bin = tmp_path / "bazel-bin" / "pipelines" / "llama3" / "kernels"
    monkeypatch.setattr(kernel_library, "_HERE", source.parent.parent)
    monkeypatch.setattr(kernel_library, "SOURCES", (source, other, header))
    monkeypatch.setattr(kernel_library, "BAZEL_BIN", bazel_bin)
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library._locate("portable")
    assert f"run `./bazelw build //pipelines/llama3/kernels` in {tmp_path} (" in str(error.value)
    bazel_bin.mkdir(parents=True)
    (bazel_bin / "packed_gemm_portable.so").write_bytes(b"")
    (bazel_bin / "kernels.sha256").write_text("0" * 64 + "\n")
    with pytest.raises(kernel_library.KernelUnavailable, match="other versions of packed_gemm"):
        kernel_library._locate("portable")
    fresh = (
        hashlib.sha256(source.read_bytes() + other.read_bytes() + header.read_bytes()).hexdigest()
        + "\n"
    )
    (bazel_bin / "kernels.sha256").write_text(fresh)
    assert kernel_library._locate("portable") == bazel_bin / "packed_gemm_portable.so"
    monkeypatch.setenv(kernel_library.DIRECTORY_ENV, str(tmp_path))
    with pytest.raises(kernel_library.KernelUnavailable, match="LLAMA_GOLDENS_KERNEL_DIR="):
        kernel_library._locate("portable")
    # A configured folder gets the same check as bazel-bin: a stale stamp is refused, with the
    # build command and the variable that named the folder.
    configured = tmp_path / "configured"
    configured.mkdir()
    (configured / "packed_gemm_portable.so").write_bytes(b"")
    (configured / "kernels.sha256").write_text("0" * 64 + "\n")
    monkeypatch.setenv(kernel_library.DIRECTORY_ENV, str(configured))
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library._locate("portable")
    assert str(error.value) == (
        f"{configured / 'packed_gemm_portable.so'} was built from other versions of "
        "packed_gemm.c, ggml_dot.c, half.h: run `./bazelw build //pipelines/llama3/kernels` (it "
        f"builds bazel-bin/pipelines/llama3/kernels/; $LLAMA_GOLDENS_KERNEL_DIR={configured} "
        "named this folder)"
    )
    (configured / "kernels.sha256").write_text(fresh)
    assert kernel_library._locate("portable") == configured / "packed_gemm_portable.so"
    # Without a stamp (libraries built by hand, a planted bug's) the folder is taken as it is.
    (configured / "kernels.sha256").unlink()
    assert kernel_library._locate("portable") == configured / "packed_gemm_portable.so"


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_threads_split_the_rows_without_changing_a_bit(qtype, monkeypatch) -> None:
    """Each output row is one thread's whole dot product, so any thread count gives the same
    bits. (Tests run on one thread under Bazel, OMP_NUM_THREADS=1: this one asks for more.)"""
    monkeypatch.setattr(packed, "PARALLEL_BYTES", 0)  # thread even a small product
    raw = _gguf_py_tensor(qtype, 72, 320, 4)
    linear = packed.PackedLinear(packing.pack(raw, qtype, (72, 320)))
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(3)
        three = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_fused_projection_splits_into_its_parts() -> None:
    parts = [_raw(GGMLQuantizationType.Q4_1, 32, 64, 3), _raw(GGMLQuantizationType.Q4_0, 16, 64, 4)]
    fused = packed.PackedLinear(packing.pack_rows(parts), (32, 16))
    x = torch.randn(1, 64)
    first, second = fused(x)
    assert torch.equal(first, packed.PackedLinear(packing.pack_rows(parts[:1]))(x))
    assert torch.equal(second, packed.PackedLinear(packing.pack_rows(parts[1:]))(x))


def test_rows_are_taken_in_the_given_order() -> None:
    matrix = _raw(GGMLQuantizationType.Q4_1, 8, 64, 5)
    order = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    reordered = packing.pack_rows([dataclasses.replace(matrix, row_order=order)])
    assert torch.equal(
        packing.dequantize(reordered), packing.dequantize(packing.pack_rows([matrix]))[order]
    )


def test_int4_and_int8_parts_are_not_fused() -> None:
    parts = [_raw(GGMLQuantizationType.Q4_0, 8, 64, 6), _raw(GGMLQuantizationType.Q8_0, 8, 64, 7)]
    with pytest.raises(ValueError, match="fused parts must share"):
        packing.pack_rows(parts)


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_a_non_finite_scale_is_found(qtype: GGMLQuantizationType) -> None:
    matrix = _raw(qtype, 4, 64, 8)
    assert matrix.scales_finite()
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    for offset in packing._SCALE_OFFSETS[qtype]:
        for value, finite in ((np.inf, False), (-np.inf, False), (np.nan, False), (-65504, True)):
            blocks = matrix.raw.view(np.uint8).reshape(-1, block_bytes).copy()
            blocks[5, offset : offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
            changed = dataclasses.replace(matrix, raw=blocks)
            assert changed.scales_finite() == finite, (offset, value)


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_the_dense_rows(qtype: GGMLQuantizationType) -> None:
    raw = _gguf_py_tensor(qtype, 20, 96, 8)
    dense = quants.dequantize(raw, qtype, (20, 96))
    tokens = torch.tensor([[3, 0, 19, 3]])
    rows = packed.PackedEmbedding(packing.pack(raw, qtype, (20, 96)))(tokens)
    assert torch.equal(rows, dense[tokens])


def test_quantized_engine_follows_eager_on_the_q4_k_file() -> None:
    path = Q4_K_FILE
    eager = Llama3Engine.from_gguf(path)
    quantized = Llama3Engine.from_gguf(path, mode="quantized")
    assert isinstance(quantized.model.layers[0].attention, packed.PackedAttention)  # fused
    assert isinstance(quantized.model.layers[0].feed_forward, packed.PackedFeedForward)
    assert quantized.weight_bytes_per_token < eager.weight_bytes_per_token / 3
    prompt = [1, 17, 99, 5, 42, 7]
    a = eager.generate(prompt, 24, stop_on_eos=False)
    b = quantized.generate(prompt, 24, stop_on_eos=False)
    assert a.tokens == b.tokens
    assert (a.logits - b.logits).abs().max() <= 1e-3


def test_decode_attention_follows_the_general_path() -> None:
    """The quantized mode's decode step (one kernel for RoPE, cache writes and grouped-query
    attention) against the same engine on torch's operators (SDPA): the caches hold the same
    bits (the rotation rounds as apply_rotary_emb does), the logits differ by summation order
    only, and the greedy tokens agree."""
    kernels = Llama3Engine.from_gguf(Q4_K_FILE, mode="quantized")
    general = Llama3Engine.from_gguf(Q4_K_FILE, mode="quantized")
    model = general.model
    model.fused_decode = None  # its decode steps through the modules (the kernels' own: below)
    assert model.config.n_heads > model.config.n_kv_heads  # grouped-query attention
    for layer in model.layers:
        assert isinstance(layer.attention, packed.PackedAttention)
        # Attention's own forward: SDPA on the same fused product, for every step.
        layer.attention.forward = functools.partial(Attention.forward, layer.attention)
    prompt = [1, 17, 99, 5, 42, 7]
    a = kernels.generate(prompt, 24, stop_on_eos=False)
    b = general.generate(prompt, 24, stop_on_eos=False)
    assert a.tokens == b.tokens
    assert (a.logits - b.logits).abs().max() <= 1e-5 * b.logits.abs().max()
    used = len(prompt) + 23  # positions written (the last token is never fed back)
    for mine, theirs in zip(kernels.model.layers, model.layers, strict=True):
        for cache in ("cache_k", "cache_v"):
            written = getattr(mine.attention, cache)[:, :, :used]
            assert torch.equal(written, getattr(theirs.attention, cache)[:, :, :used])


@pytest.fixture(scope="module")
def fused_files(tmp_path_factory) -> list[pathlib.Path]:
    """Tiny checkpoints of each packable kind: Q4_0, Q8_0 and Q4_1 written here (dim 64, an
    untied head of the same type), and the committed Q4_K file, whose head is tied to its Q4_K
    embedding (the quantized mode packs it, int4, as it packs the layers)."""
    folder = tmp_path_factory.mktemp("fused")
    files = []
    for qtype in GGUF_PY_TYPES:
        files.append(folder / f"tiny_{qtype.name}.gguf")
        write_tiny_llama(files[-1], dim=64, weight_type=qtype)
    return [*files, Q4_K_FILE]


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """torch on `count` threads, then back to what it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _runs(engine: Llama3Engine, fused) -> tuple:
    """Tokens and logits of a 20-step greedy generation, decoded by `fused` (None: module by
    module), on one thread and on two: the two the same, bit for bit (each output row is one
    thread's, so the thread count moves no bit)."""
    engine.model.fused_decode, runs = fused, []
    for count in (1, 2):
        with _threads(count):
            out = engine.generate([1, 17, 99, 5, 42, 7], 20, stop_on_eos=False)
        runs.append((out.tokens, out.logits.numpy().tobytes()))
    assert runs[0] == runs[1], "one thread and two threads give other tokens or logits"
    return tuple(runs)


def _one_call_on_every_build(mode, fused_files, monkeypatch, outputs) -> None:
    """On every runnable kernel build and packable file: `outputs(engine, fused)` (tokens and
    logits) of the one-call step equal to the modules' (fused None), bit for bit, its attention
    on one thread and on the threads (attention_work 0: one task per row and KV group from the
    first position); the ggml mode's the same on every build."""
    first_build = {}
    for isa in ISAS:
        monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
        for path in fused_files:
            engine = Llama3Engine.from_gguf(path, mode=mode)
            fused = engine.model.fused_decode  # taken before `outputs` unsets it
            assert fused is not None, (isa, path.name)
            modules = outputs(engine, None)
            assert outputs(engine, fused) == modules, (isa, path.name)
            fused.attention_work = 0
            assert outputs(engine, fused) == modules, (isa, path.name, "threaded attention")
            if mode == "ggml":
                assert first_build.setdefault(path, modules) == modules, (isa, path.name)
    monkeypatch.delenv(kernel_library.KERNELS_ENV)


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_the_one_call_decode_step_computes_the_modules_bits(mode, fused_files, monkeypatch) -> None:
    """model.fused_decode (one kernel call through every layer) against the same engine's
    modules: the same tokens and logits, bit for bit, on every packable kind, thread count
    and kernel build (the ggml mode's the same on every build, too). The check fails on a
    planted break: layer 0's table entry given its attention norm in place of its MLP norm."""
    _one_call_on_every_build(mode, fused_files, monkeypatch, _runs)

    class SwappedNorms(packed.FusedDecode if mode == "quantized" else ggml_mode.FusedDecode):
        def fill(self, entry, layer) -> None:
            super().fill(entry, layer)
            if layer is self.model.layers[0]:
                entry.ffn_norm = layer.attention_norm.weight.data_ptr()

    for path in fused_files:
        engine = Llama3Engine.from_gguf(path, mode=mode)
        fused = engine.model.fused_decode
        expected_class = packed.FusedDecode if mode == "quantized" else ggml_mode.FusedDecode
        assert type(fused) is expected_class, path.name  # every layer is the mode's
        modules = _runs(engine, None)
        assert _runs(engine, SwappedNorms(engine.model)) != modules, path.name
    # The step reads the norms' epsilon and the attention scale from the modules: a bug planted
    # there (ggml_mutations' norm_eps, softmax_scale) is computed by the one call as well.
    for module in engine.model.modules():
        if isinstance(module, packed.KernelRMSNorm):
            module.eps *= 10
        if isinstance(module, packed.PackedAttention):
            module.scale *= 1.001
    planted = _runs(engine, None)
    assert planted != modules and _runs(engine, fused) == planted


def _served(engine: Llama3Engine, fused, threads: int = 1) -> dict:
    """Five requests of different lengths served together (steps of several decode rows), by
    `fused` (None: module by module), on `threads` threads: each one's tokens and logits."""
    engine.model.fused_decode = fused
    requests = [
        Request(f"r{i}", [1, 17, 99, 5, 42, 7][: 2 + i], max_new_tokens=6 + 2 * i) for i in range(5)
    ]
    with _threads(threads):
        served = ServingEngine(engine, block_size=4).serve(requests)
    return {r: (s.output.tokens, s.output.logits.numpy().tobytes()) for r, s in served.items()}


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_a_serving_step_of_decode_rows_computes_the_modules_bits(
    mode, fused_files, monkeypatch
) -> None:
    """A serving step of decode rows only in one call (packed_decode_paged, ggml_decode_paged)
    against the modules' steps: the same tokens and logits, bit for bit, on every kernel build
    (the ggml mode's the same on every build), and on two threads, a task per row and KV group
    on each (the default build). Planted: a row's context without its first slot (the kernel
    reads what it is given) fails the check."""
    _one_call_on_every_build(mode, fused_files, monkeypatch, _served)
    for path in fused_files:
        engine = Llama3Engine.from_gguf(path, mode=mode)
        fused = engine.model.fused_decode
        modules = _served(engine, None)
        fused.attention_work = 0  # the rows' attention tasks spread over the threads
        assert _served(engine, fused, threads=2) == modules, (path.name, "two threads")
        fused.attention_work = type(fused).attention_work

        class FirstKeyDropped(type(fused)):
            def decode_paged(self, h, cos, sin, batch, shared):
                contexts = [c[1:] if len(c) > 1 else c for c in batch.contexts]
                return super().decode_paged(
                    h, cos, sin, dataclasses.replace(batch, contexts=contexts), shared
                )

        assert _served(engine, FirstKeyDropped(engine.model)) != modules, path.name


def test_a_layer_of_another_kind_turns_the_one_call_decode_step_off(fused_files) -> None:
    engine = Llama3Engine.from_gguf(fused_files[0], mode="quantized")
    assert packed.FusedDecode.applies(engine.model)
    engine.model.layers[-1].ffn_norm = RMSNorm(engine.config.dim, engine.config.rms_norm_eps)
    assert not packed.FusedDecode.applies(engine.model)
    for mode in ("quantized", "ggml"):  # no layers (a self-draft of 0): no step to fuse
        empty = Llama3Engine.from_gguf(fused_files[0], mode=mode, overrides={"n_layers": 0})
        assert empty.model.fused_decode is None
        assert len(empty.generate([1, 2, 3], 3, stop_on_eos=False).tokens) == 3


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_one_layers_scale_or_epsilon_sends_the_decode_step_to_the_modules(mode, fused_files):
    """The one call takes one epsilon and one attention scale for every layer
    (FusedDecode.shared); where one layer's differs, here the last of two layers', the step is
    the modules': shared() None, and generate's and the served decode steps the bits of
    fused_decode None. Planted, shared() comparing layer 0 alone (the tiny served checkpoints
    have one layer, where the last layer is the first): the decode steps took layer 0's value
    for both layers, and test_serving's epsilon test still passed."""
    plants = {
        "attention scale": lambda layer: setattr(
            layer.attention, "scale", layer.attention.scale * 1.5
        ),
        "attention norm epsilon": lambda layer: setattr(layer.attention_norm, "eps", 1.0),
    }
    for name, plant in plants.items():
        engine = Llama3Engine.from_gguf(fused_files[0], mode=mode)
        fused = engine.model.fused_decode
        plant(engine.model.layers[-1])
        assert fused.shared() is None, name
        assert _runs(engine, fused) == _runs(engine, None), name
        assert _served(engine, fused) == _served(engine, None), name


def test_swiglu_is_silu_times_up_and_the_same_on_every_build() -> None:
    """The quantized mode's SwiGLU (swiglu_rows, the C library's expf): within 1e-6 of the
    float64 value (expf within an ulp, then a division and a product), the same bits on every
    kernel build."""
    gate = torch.linspace(-110.0, 90.0, 4002)
    up = torch.linspace(0.5, 2.0, 4002)
    gate_up = torch.stack([gate[:2001], up[:2001], gate[2001:], up[2001:]]).reshape(2, 4002)
    outs = []
    for isa in ISAS:
        out = torch.empty(2, 2001)
        kernel_library.load(isa).swiglu_rows(gate_up.data_ptr(), 2, 2001, out.data_ptr())
        outs.append(out.reshape(-1))
    assert all(torch.equal(out, outs[0]) for out in outs)
    expected = (gate.double() * torch.sigmoid(gate.double())) * up.double()
    error = (outs[0].double() - expected).abs() / expected.abs().clamp(min=1e-30)
    assert error[gate > -80].max() < 1e-6


# (heads, kv heads, head dim, positions): SmolLM2's group of 3 at 64 and Llama 3's 4 at 128
# (the vector builds' grouped paths: eight keys' scores at once, outputs held in registers),
# one KV head per query head, head dims 8, 16 and 40 (the scalar paths), a group past
# GROUP_HEADS (16), and context lengths off a multiple of 8.
ATTENTION_SHAPES = [(9, 3, 64, 1030), (32, 8, 128, 77), (4, 4, 16, 9), (8, 1, 40, 8)]
ATTENTION_SHAPES += [(6, 2, 8, 1), (34, 2, 64, 21)]


def _attention_inputs(shape) -> tuple[torch.Tensor, ...]:
    """Seeded decode attention inputs of `shape`: qkv, cos, sin, the paged cache's slots of the
    positions, and keys and values [positions + 4, kv heads, head dim] (paged: slots index the
    first dimension; contiguous: the first `positions` rows, transposed)."""
    heads, kv, hd, positions = shape
    g = torch.Generator().manual_seed(positions)
    qkv = torch.randn((heads + 2 * kv) * hd, generator=g) * 3
    cos, sin = torch.rand(hd, generator=g), torch.rand(hd, generator=g)
    slots = torch.randperm(positions + 4, generator=g)[:positions].to(torch.int64)
    keys = torch.randn(positions + 4, kv, hd, generator=g)
    values = torch.randn(positions + 4, kv, hd, generator=g)
    return qkv, cos, sin, slots, keys, values


def _decode_attention(lib, shape, paged: bool, nudge: bool = False) -> bytes:
    """decode_attention (contiguous) or decode_attention_paged on seeded inputs: the output and
    both caches' bytes; `nudge` moves one cached key by one ulp."""
    heads, kv, hd, positions = shape
    qkv, cos, sin, slots, keys, values = _attention_inputs(shape)
    if not paged:
        keys, values = keys[:positions].transpose(0, 1).contiguous(), values[:positions]
        values = values.transpose(0, 1).contiguous()
    if nudge:  # position 0's first key value, of KV head 0 (read, not written: positions > 1)
        first = keys[slots[0], 0] if paged else keys[0, 0]
        first[0] = torch.nextafter(first[0], torch.tensor(10.0))
    scores, out = torch.empty(positions), torch.empty(heads * hd)
    args = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr())
    if paged:
        lib.decode_attention_paged(
            *args, heads, kv, hd, slots.data_ptr(), positions - 1, 0.125,
            scores.data_ptr(), out.data_ptr(), 1,
        )  # fmt: skip
    else:
        lib.decode_attention(
            *args, heads, kv, hd, positions, positions - 1, 0.125, scores.data_ptr(),
            out.data_ptr(),
        )  # fmt: skip
    return out.numpy().tobytes() + keys.numpy().tobytes() + values.numpy().tobytes()


def _reference_attention(shape, paged: bool) -> torch.Tensor:
    """The output decode_attention computes on _attention_inputs, in float64: the q and k heads
    rotated as rotate_heads does (rotate half, cos and sin of the new position), the new key and
    value at the last position, then softmax(q . K^T * 0.125) V over each query head's KV head
    (heads / kv heads query heads per KV head)."""
    heads, kv, hd, positions = shape
    qkv, cos, sin, slots, keys, values = _attention_inputs(shape)
    qkv, cos, sin, keys, values = (t.double() for t in (qkv, cos, sin, keys, values))
    x, half = qkv.reshape(heads + 2 * kv, hd), hd // 2
    a, b = x[: heads + kv, :half], x[: heads + kv, half:]
    rotated = torch.cat([a * cos[:half] - b * sin[:half], b * cos[half:] + a * sin[half:]], -1)
    order = slots if paged else torch.arange(positions)
    k, v = keys[order], values[order]  # [positions, kv, hd]
    k[-1], v[-1] = rotated[heads:], x[heads + kv :]
    group = heads // kv
    k = k.transpose(0, 1).repeat_interleave(group, 0)  # [heads, positions, hd]
    v = v.transpose(0, 1).repeat_interleave(group, 0)
    weights = torch.softmax(torch.einsum("hd,htd->ht", rotated[:heads], k) * 0.125, -1)
    return torch.einsum("ht,htd->hd", weights, v).reshape(-1)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_attention_is_the_same_on_every_build(paged) -> None:
    """The quantized mode's decode attention: the vector builds compute a KV head's query heads
    side by side, eight keys' scores at once and the outputs in registers, the portable build
    one value at a time; every build gives the portable build's bytes (output and caches), on
    every shape. A cached key moved by one ulp moves them (the check can fail). The code every
    build shares (the rotation, one head at a time past GROUP_HEADS, the scalar head dims) has
    its own reference: the portable output is within 1e-5 of the largest float64 value
    (measured: 1.7e-6 at most)."""
    for shape in ATTENTION_SHAPES:
        portable = _decode_attention(kernel_library.load("portable"), shape, paged)
        for isa in ISAS:
            assert _decode_attention(kernel_library.load(isa), shape, paged) == portable, (
                isa,
                shape,
            )
        heads, _, hd, _ = shape
        out = torch.frombuffer(bytearray(portable[: heads * hd * 4]), dtype=torch.float32)
        expected = _reference_attention(shape, paged)
        assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), shape
        if shape[3] > 1:
            nudged = _decode_attention(kernel_library.load(ISAS[-1]), shape, paged, True)
            assert nudged != portable, shape


def test_kernel_rms_norm_equals_torch_up_to_summation_order() -> None:
    kernel = packed.KernelRMSNorm(576, 1e-5)
    kernel.weight.data = torch.randn(576, generator=torch.Generator().manual_seed(6))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(7)) * 40
    expected = torch.nn.functional.rms_norm(x, (576,), kernel.weight, kernel.eps)
    assert (kernel(x) - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_quantized_mode_keeps_float_files_dense(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    engine = Llama3Engine.from_gguf(path, mode="quantized")
    assert not any(isinstance(m, packed.PackedLinear) for m in engine.model.modules())
    eager = Llama3Engine.from_gguf(path)
    assert torch.equal(engine.forward_logits([1, 2, 3]), eager.forward_logits([1, 2, 3]))


def test_an_unknown_mode_is_refused(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    with pytest.raises(ValueError, match="mode 'fast' is not one of eager, compiled, quantized"):
        Llama3Engine.from_gguf(path, mode="fast")


@pytest.mark.slow
def test_smollm2_quantized_greedy_32_tokens_equal_eager() -> None:
    eager = Llama3Engine.from_gguf(smollm2_gguf())
    quantized = Llama3Engine.from_gguf(smollm2_gguf(), mode="quantized")
    ids = eager.tokenizer.encode("The capital of France is")
    a = eager.generate(ids, 32, stop_on_eos=False)
    b = quantized.generate(ids, 32, stop_on_eos=False)
    assert a.tokens == b.tokens
    # The README's "reads 111 MB a token": the Q4_1 and Q8_0 matrices packed (int4 with a
    # float32 scale and offset per 32 weights, int8 with a float32 scale), the tied Q8_0 head
    # included: 79,626,240 bytes of int4 and 31,850,496 of int8.
    assert quantized.weight_bytes_per_token == 111_476_736
    assert quantized.weight_bytes_per_token < eager.weight_bytes_per_token / 4


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_a_prefill_of_64_rows_or_more_runs_dense_on_the_dequantized_weights(qtype) -> None:
    """README.md:145 ("a prefill of 64 or more tokens runs dense on the dequantized weights",
    packed.DENSE_ROWS): 64 rows make no kernel call and give F.linear's bits on the weights
    dequantized as eager's; 63 rows make one kernel call. Planted: `rows > DENSE_ROWS`,
    DENSE_ROWS = 128 (a long prompt back on the row-by-row kernels: 40 s for SmolLM2's 2k)."""
    raw = _gguf_py_tensor(qtype, 24, 320, 8)
    linear = packed.PackedLinear(packing.pack(raw, qtype, (24, 320)))
    calls, lib = [], linear._lib

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(lib, name)

    linear._lib = Counting()
    dense = quants.dequantize(raw, qtype, (24, 320))
    x = torch.randn(2, 32, 320, generator=torch.Generator().manual_seed(9))
    assert torch.equal(linear(x), torch.nn.functional.linear(x, dense))
    assert calls == []
    linear(x.reshape(64, 320)[:63])
    assert calls == ["q8_gemm" if qtype == GGMLQuantizationType.Q8_0 else "q4_gemm"]


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_bfloat16_compute_stays_as_in_eager(mode, tmp_path) -> None:
    """README.md:145 ("Other tensor types, CUDA and bfloat16 compute stay as in eager"): on a
    Q4_0 file in bfloat16 the packed modes keep no packed product and compute eager's bits.
    Planted: from_gguf's keep_packed without `dtype == torch.float32` (the packed products
    then meet bfloat16 activations and raise)."""
    path = tmp_path / "tiny_q4_0.gguf"
    write_tiny_llama(path, weight_type=GGMLQuantizationType.Q4_0)
    engine = Llama3Engine.from_gguf(path, dtype=torch.bfloat16, mode=mode)
    products = (packed.PackedLinear, ggml_mode.GgmlLinear)
    assert not any(isinstance(m, products) for m in engine.model.modules())
    eager = Llama3Engine.from_gguf(path, dtype=torch.bfloat16)
    assert torch.equal(engine.forward_logits([1, 2, 3]), eager.forward_logits([1, 2, 3]))


class _DecodeWrittenOverItsLastKey(ServingEngine):
    """A decode row's keys and values written over its own previous position's (a serving bug
    of the kind the serving lane plants): the row's write slot is then not the last slot of
    its context, the one case where the two differ."""

    def _write_slot(self, seq, position: int, decoding: bool) -> int:
        if decoding and position > 0:
            return self._slot(seq, position - 1)
        return super()._write_slot(seq, position, decoding)


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_the_one_call_serving_step_reads_a_rows_new_keys_at_its_write_slot(mode, fused_files):
    """packed_decode_paged reads row r over its context's slots with its own position's slot
    replaced by write[r] (where its new keys and values go), as the modules' decode_paged
    (PackedAttention.forward_paged: slots[-1] = batch.write); ggml_decode_paged attends over
    the row's new keys and copies them to write[r]. A serving bug can move the write slot
    (here: over the row's previous position), and the one call must then still compute the
    modules' bits, or the bug would show one way on the one-call path and another on the
    modules'. (A write into another row's context in the same step is another matter: the
    quantized one call stores every row's keys before any row attends, the modules row by
    row.) Normal serving writes each row at its context's last
    slot, where no other test looks. Planted, packed_gemm.c decode_rows without the row_slots
    replacement (the row reads its context's last slot, which was never written): the tokens
    and logits move, in the quantized mode."""
    engine = Llama3Engine.from_gguf(fused_files[0], mode=mode)
    fused = engine.model.fused_decode
    requests = [
        Request(f"r{i}", [1, 17, 99, 5, 42, 7][: 2 + i], max_new_tokens=6 + 2 * i) for i in range(5)
    ]

    def served(step, serving_class=_DecodeWrittenOverItsLastKey) -> dict:
        engine.model.fused_decode = step
        results = serving_class(engine, block_size=4).serve(requests)
        return {r: (s.output.tokens, s.output.logits.numpy().tobytes()) for r, s in results.items()}

    modules = served(None)
    assert modules != served(None, ServingEngine)  # the moved write slot changes the numbers
    assert served(fused) == modules


# Promises of packing.py and packed.py that the mutation sweep (helper 1) found unchecked.


def test_a_non_finite_q4_k_scale_or_min_is_found() -> None:
    """RawMatrix.scales_finite reads both float16 fields of a Q4_K block, its scale d (byte 0)
    and its min dmin (byte 2): an infinite or NaN one in either is found, -65504 is finite.
    (gguf-py cannot quantize Q4_K, so test_a_non_finite_scale_is_found leaves it out; this uses
    the committed Q4_K file's blocks.) Planted: _SCALE_OFFSETS[Q4_K] = (0,) (a NaN min then
    reaches the packed weights unreported)."""
    reader = GGUFFile(Q4_K_FILE)
    name = "blk.0.attn_k.weight"
    info = reader.tensors[name]
    assert info.tensor_type == GGMLQuantizationType.Q4_K
    matrix = packing.RawMatrix(reader.tensor_data(name), info.tensor_type, *info.shape)
    assert matrix.scales_finite()
    block_bytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1]
    for offset in (0, 2):
        for value, finite in ((np.inf, False), (-np.inf, False), (np.nan, False), (-65504, True)):
            blocks = np.asarray(matrix.raw).view(np.uint8).reshape(-1, block_bytes).copy()
            blocks[5, offset : offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
            changed = dataclasses.replace(matrix, raw=blocks)
            assert changed.scales_finite() == finite, (offset, value)


def test_parts_of_other_widths_are_not_fused() -> None:
    """pack_rows refuses parts of different column counts as it refuses other kinds ("fused
    parts must share the packed kind and the column count"): one buffer has one row width.
    Planted: the check on the kind alone (the second part's rows then packed at the first's
    width, into a buffer sized for it)."""
    parts = [_raw(GGMLQuantizationType.Q4_0, 8, 64, 6), _raw(GGMLQuantizationType.Q4_1, 8, 96, 7)]
    with pytest.raises(ValueError, match="fused parts must share"):
        packing.pack_rows(parts)
    with pytest.raises(ValueError, match="fused parts must share"):
        packing.pack_rows(parts[::-1])


def test_a_tensor_without_a_packed_form_is_refused() -> None:
    """packing.pack refuses what can_pack refuses, with a ValueError naming the type and the
    shape: a float16 matrix, a Q8_0 vector. Planted: pack without its can_pack check (a
    KeyError from the kernel table, or a vector packed as a matrix)."""
    half = np.zeros((4, 64), dtype=np.float16)
    with pytest.raises(ValueError, match=r"^F16 \(4, 64\) has no packed form$"):
        packing.pack(half, GGMLQuantizationType.F16, (4, 64))
    vector = _gguf_py_tensor(GGMLQuantizationType.Q8_0, 1, 64, 3).reshape(-1)
    with pytest.raises(ValueError, match=r"^Q8_0 \(64,\) has no packed form$"):
        packing.pack(vector, GGMLQuantizationType.Q8_0, (64,))


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_packed_bytes_are_6_bits_an_int4_weight_and_9_an_int8(qtype) -> None:
    """packed.py's docstring: per 32 weights int4 keeps 16 bytes of nibbles and a float32
    scale and offset (6 bits a weight), int8 32 bytes and a float32 scale (9 bits);
    PackedWeight.nbytes (weight_bytes_per_token, the threads' choice) counts exactly those.
    Planted: nbytes counting the scales one byte each (only the slow SmolLM2 test saw it)."""
    rows, cols = 48, 256
    weight = packing.pack(_gguf_py_tensor(qtype, rows, cols, 2), qtype, (rows, cols))
    bits = 9 if qtype == GGMLQuantizationType.Q8_0 else 6
    assert weight.kind == ("int8" if bits == 9 else "int4")
    assert weight.nbytes == rows * cols * bits // 8


def test_a_product_uses_threads_from_parallel_rows_rows() -> None:
    """RowProduct.parallel_rows is the fewest rows whose product uses threads (rows x weight
    bytes >= PARALLEL_BYTES): that many rows get torch's threads, one row fewer one thread.
    Planted: `rows > self.parallel_rows` (the threshold's own row count on one thread)."""
    raw = _gguf_py_tensor(GGMLQuantizationType.Q4_0, 72, 320, 4)
    linear = packed.PackedLinear(packing.pack(raw, GGMLQuantizationType.Q4_0, (72, 320)))
    rows = linear.parallel_rows
    assert rows * linear.weight.nbytes >= packed.PARALLEL_BYTES
    assert (rows - 1) * linear.weight.nbytes < packed.PARALLEL_BYTES
    assert 1 < rows < packed.DENSE_ROWS  # both calls below take the kernel
    threads, lib = [], linear._lib

    class Recording:
        def __getattr__(self, name):
            function = getattr(lib, name)
            if name != "q4_gemm":
                return function

            def call(*args):
                threads.append(args[-1])
                return function(*args)

            return call

    linear._lib = Recording()
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(5))
    with _threads(2):
        linear(x[: rows - 1])
        linear(x)
    assert threads == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_packed_products_refuse_activations_other_than_float32(dtype) -> None:
    """RowProduct.unsplit: the kernels read float32 rows, so other activations are refused
    with a ValueError naming their dtype, never handed to the kernel as bytes to misread.
    Planted: the check on the device alone (float64 rows read as twice as many floats)."""
    raw = _gguf_py_tensor(GGMLQuantizationType.Q4_1, 8, 64, 5)
    linear = packed.PackedLinear(packing.pack(raw, GGMLQuantizationType.Q4_1, (8, 64)))
    x = torch.randn(2, 64, dtype=torch.float64).to(dtype)
    with pytest.raises(ValueError, match=f"take float32 CPU activations, not {dtype}"):
        linear(x)


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_a_subclass_of_a_layers_module_turns_the_one_call_decode_step_off(mode, fused_files):
    """FusedDecode.applies takes exactly the mode's classes (`type(part) is kind`): a subclass
    of any of a layer's modules (how a planted bug or a variant computes otherwise) turns the
    one call off, so that the modules, which the call would bypass, run. Planted:
    isinstance(part, kind) (a subclass of a norm, product, attention or feed-forward then
    bypassed by the one call)."""
    engine = Llama3Engine.from_gguf(fused_files[0], mode=mode)
    model = engine.model
    step = type(model.fused_decode)
    assert step.applies(model)
    layer = model.layers[-1]
    parts = {
        "attention": layer.attention,
        "wo": layer.attention.wo,
        "feed_forward": layer.feed_forward,
        "w2": layer.feed_forward.w2,
        "attention_norm": layer.attention_norm,
        "ffn_norm": layer.ffn_norm,
    }
    for name, part in parts.items():
        original = type(part)
        part.__class__ = type(f"Planted{original.__name__}", (original,), {})
        try:
            assert not step.applies(model), name
        finally:
            part.__class__ = original
        assert step.applies(model), name


def test_every_float32_norm_of_the_quantized_mode_is_a_kernel_norm() -> None:
    """install: "Float32 CPU norms become KernelRMSNorm", the final norm as well as each
    layer's two, each sharing the loaded norm's weight (the kernel's rms_norm, not torch's:
    the mode's logits are the kernel's bits). Planted: install leaving model.norm as it was."""
    quantized = Llama3Engine.from_gguf(Q4_K_FILE, mode="quantized").model
    eager = Llama3Engine.from_gguf(Q4_K_FILE).model
    pairs = [(quantized.norm, eager.norm)]
    for mine, theirs in zip(quantized.layers, eager.layers, strict=True):
        pairs += [(mine.attention_norm, theirs.attention_norm), (mine.ffn_norm, theirs.ffn_norm)]
    x = torch.randn(3, quantized.config.dim, generator=torch.Generator().manual_seed(7))
    for norm, loaded in pairs:
        assert type(norm) is packed.KernelRMSNorm
        assert torch.equal(norm.weight, loaded.weight) and norm.eps == loaded.eps
        kernel = packed.KernelRMSNorm.of(loaded)
        assert torch.equal(norm(x), kernel(x))


def test_a_tied_head_shares_the_embeddings_packed_weight() -> None:
    """install: a head tied to a packed embedding is a PackedLinear on the lookups' packed
    copy, shared ("the lookups' packed copy, shared"): one copy of the packed matrix in
    memory (the committed Q4_K file's 128k x 256 head: 24.6 MB more otherwise), its logits
    those of the embedding's rows. Planted: the head packed again from the raw blocks."""
    model = Llama3Engine.from_gguf(Q4_K_FILE, mode="quantized").model
    assert model.config.tie_word_embeddings
    assert type(model.output) is packed.PackedLinear
    assert model.output.weight is model.tok_embeddings.weight
    x = torch.randn(1, model.config.dim, generator=torch.Generator().manual_seed(8))
    assert torch.equal(model.output(x), packed.PackedLinear(model.tok_embeddings.weight)(x))


def test_a_batch_of_two_sequences_decodes_each_as_alone() -> None:
    """PackedAttention's one-call decode step and PackedTransformer's one call through every
    layer take one sequence's step; a batch's decode step (two sequences, one position each)
    takes Attention's path, and each row's logits are the sequence's own, computed alone
    (within 1e-5 of the largest logit: SDPA against the kernel; measured 9.5e-7 at most, every
    build). Planted: PackedAttention.forward or run_layers taking the one-sequence step for
    any batch size (`x.shape[1] == 1`: the second row got the first row's attention, or no
    layers at all)."""
    engine = Llama3Engine.from_gguf(Q4_K_FILE, mode="quantized")
    model = engine.model
    assert model.fused_decode is not None
    prompts, steps = [[1, 17, 99, 5], [42, 7, 3, 11]], [[8], [9]]
    model.setup_caches(16, 2)
    with torch.inference_mode():
        model.forward(torch.tensor(prompts), 0)
        batch = model.forward(torch.tensor(steps), 4)
        alone = []
        for prompt, step in zip(prompts, steps, strict=True):
            model.forward(torch.tensor([prompt]), 0)
            alone.append(model.forward(torch.tensor([step]), 4)[0])
    for row, expected in enumerate(alone):
        error = (batch[row] - expected).abs().max()
        assert error <= 1e-5 * expected.abs().max(), (row, error.item())
    assert not torch.allclose(alone[0], alone[1])  # two rows that would show a mix-up
