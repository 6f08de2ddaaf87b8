"""The ggml mode's kernels (kernels/ggml_dot.c) and the mode itself (ggml_mode.py).

- The C activation quantizers equal the torch transcriptions of ggml's (ggml_activations.py,
  themselves held to loops of ggml's C) bit for bit, per vec_dot_type, on blocks with exact
  ties, zeros, a negative maximum and equal magnitudes of both signs.
- Each product is the quantized values' dot product: within float32 rounding of a float64
  sum over the same blocks (Q4_1 with ggml's float16 s term, which the check can tell apart).
- Every build (plain C, AVX2, AVX-512, VNNI) computes the same bits, on any thread count:
  products, norms, SwiGLU, and the whole model's logits.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from pipelines.llama3 import Llama3Engine, ggml_activations, ggml_mode, kernel_library, quants
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.model import Transformer, precompute_rope
from pipelines.llama3.packing import RawMatrix
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

TYPES = list(ggml_mode.WEIGHT_CODES)
ISAS = [isa for isa in ("portable", "avx2", "avx512", "vnni") if kernel_library.runnable(isa)]


def _weights(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of `qtype`: any bytes are valid blocks once the float16 scales are
    finite; the scales span several exponents."""
    values, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    scale_fields = 2 if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K) else 1
    scales = (rng.uniform(0.5, 2.0, size=(len(blocks), scale_fields)) * 10.0 ** rng.integers(
        -4, 1, size=(len(blocks), 1)
    )).astype(np.float16)  # fmt: skip
    blocks[:, : 2 * scale_fields] = scales.view(np.uint8).reshape(len(blocks), -1)
    return blocks.reshape(rows, -1)


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 2, size=(rows, 1))
    x = x.astype(np.float32)
    x[0, :32] = 0.0  # a zero block
    x[1] = -np.abs(x[1])  # negative maxima
    ties = np.arange(cols, dtype=np.float32) % 127 + 0.5  # x * 127 / amax lands on .5
    ties[::32] = 127.0
    x[2] = ties
    x[3, :256] = np.arange(256, dtype=np.float32) % 7 - 3.0  # -3 before +3 (Q8_K: the first)
    return torch.from_numpy(x)


def _quantized(lib, qtype, x: torch.Tensor) -> np.ndarray:
    code = ggml_mode.WEIGHT_CODES[qtype]
    rows, cols = x.shape
    out = torch.zeros(rows * lib.ggml_act_row_bytes(code, cols), dtype=torch.uint8)
    lib.ggml_quantize_rows(code, x.data_ptr(), rows, cols, out.data_ptr())
    return out.numpy().reshape(rows, -1)


def _blocks_of(qtype, act: np.ndarray) -> dict[str, np.ndarray]:
    """ggml_dot.c's activation blocks as arrays: d, q (and s, or bsums)."""
    rows = act.shape[0]
    if ggml_mode.VEC_DOT_TYPES[qtype] == "Q8_K":
        blocks = act.reshape(rows, -1, 292)
        return {
            "d": blocks[..., :4].copy().view(np.float32)[..., 0],
            "q": blocks[..., 4:260].view(np.int8),
            "bsums": blocks[..., 260:292].copy().view(np.int16),
        }
    if ggml_mode.VEC_DOT_TYPES[qtype] == "Q8_1":
        blocks = act.reshape(rows, -1, 40)
        return {
            "d": blocks[..., :4].copy().view(np.float32)[..., 0],
            "s": blocks[..., 4:8].copy().view(np.float32)[..., 0],
            "q": blocks[..., 8:].view(np.int8),
        }
    blocks = act.reshape(rows, -1, 36)
    return {
        "d": blocks[..., :4].copy().view(np.float32)[..., 0],
        "q": blocks[..., 4:].view(np.int8),
    }


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_c_quantizers_are_the_torch_transcriptions_bit_for_bit(qtype) -> None:
    x = _activations(8, 512, seed=1)
    got = _blocks_of(qtype, _quantized(ggml_mode.kernels(), qtype, x))
    kind = ggml_mode.VEC_DOT_TYPES[qtype]
    if kind == "Q8_K":
        q, d = ggml_activations.q8_k(x)
        assert np.array_equal(got["bsums"], q.reshape(8, -1, 16, 16).sum(-1).numpy())
    elif kind == "Q8_1":
        q, d, s = ggml_activations.q8_1(x)
        assert got["s"].tobytes() == s.float().reshape(8, -1).numpy().tobytes()
    else:
        q, d = ggml_activations.q8_0(x)
    assert np.array_equal(got["q"], q.numpy())
    assert got["d"].tobytes() == d.float().reshape(8, -1).numpy().tobytes()


def _product(
    lib, qtype, w: np.ndarray, x: torch.Tensor, threads: int = 1, code: int | None = None
) -> torch.Tensor:
    """x . w^T by ggml_gemm, w's rows in the layout of `code` (the GGUF type's by default)."""
    rows, cols = w.shape[0], x.shape[1]
    blocks = torch.from_numpy(np.ascontiguousarray(w))
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    code = ggml_mode.WEIGHT_CODES[qtype] if code is None else code
    act = torch.empty(x.shape[0] * lib.ggml_act_row_bytes(code, cols), dtype=torch.uint8)
    lib.ggml_gemm(code, x.data_ptr(), x.shape[0], cols, blocks.data_ptr(), rows, y.data_ptr(),
                  act.data_ptr(), threads)  # fmt: skip
    return y


def _reference(qtype, w: np.ndarray, act: dict, cols: int, fp16_s: bool = True) -> np.ndarray:
    """The products in float64 over the quantized values (Q4_1: ggml's sum of d_w d_a q_w q_a
    plus m_w s_a per block, s as ggml stores it, or unrounded with fp16_s=False)."""
    a = act["q"].astype(np.float64) * act["d"][..., None].astype(np.float64)
    a = a.reshape(a.shape[0], cols)
    if qtype != GGMLQuantizationType.Q4_1:
        dense = quants.dequantize(w.reshape(-1), qtype, (w.shape[0], cols)).double().numpy()
        return a @ dense.T
    blocks = w.reshape(w.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    nibbles = np.concatenate([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], axis=-1)
    scaled = (nibbles * d[..., None]).reshape(w.shape[0], cols)
    s = act["s"] if fp16_s else act["d"] * act["q"].sum(-1)
    return a @ scaled.T + s.astype(np.float64) @ m.T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_product_is_the_quantized_values_dot_product(qtype) -> None:
    lib, cols = ggml_mode.kernels(), 512
    w, x = _weights(qtype, 40, cols, seed=2), _activations(6, cols, seed=3)
    y = _product(lib, qtype, w, x).double().numpy()
    act = _blocks_of(qtype, _quantized(lib, qtype, x))
    expected = _reference(qtype, w, act, cols)
    scale = np.abs(expected).max(axis=1, keepdims=True) + 1e-30
    assert (np.abs(y - expected) / scale).max() <= 2e-6
    if qtype == GGMLQuantizationType.Q4_1:
        # the check tells ggml's float16 s from the exact sum d * sum(q): a kernel that took
        # the exact one would fail it
        plain = _reference(qtype, w, act, cols, fp16_s=False)
        assert (np.abs(plain - expected) / scale).max() > 1e-5


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_build_and_thread_count_computes_the_same_bits(qtype) -> None:
    cols = 512
    w, x = _weights(qtype, 37, cols, seed=4), _activations(5, cols, seed=5)
    first = _product(kernel_library.load(ISAS[0]), qtype, w, x)
    for isa in ISAS:
        for threads in (1, 2, 3):
            y = _product(kernel_library.load(isa), qtype, w, x, threads)
            assert torch.equal(y, first), (isa, threads)
    assert kernel_library.load(ISAS[-1]).ggml_dot_isa() == kernel_library.DOT_ISA[ISAS[-1]]


@pytest.mark.parametrize("qtype", list(ggml_mode.PAIRED_CODES), ids=lambda t: t.name)
def test_rows_repacked_in_pairs_compute_the_gguf_blocks_bits(qtype) -> None:
    """GgmlMatrix repacks Q4_0 and Q4_1 rows two blocks at a time: every build's products on
    them equal the GGUF blocks' to the bit, decode (one row) and prefill (column groups) alike,
    for rows of an odd block count too (the last block kept as it is)."""
    code = ggml_mode.PAIRED_CODES[qtype]
    for cols in (512, 288, 608):  # 16, 9 and 19 blocks
        w = _weights(qtype, 37, cols, seed=12)
        paired = ggml_mode.paired_rows(w, qtype)
        assert paired.shape == w.shape
        assert np.array_equal(ggml_mode.gguf_rows(paired, qtype), w)
        # a planted layout: each pair's blocks swapped (same bytes, another order)
        swapped = ggml_mode.paired_rows(_swap_pairs(w, qtype), qtype)
        for rows in (1, 5, 9):
            x = _activations(max(rows, 4), cols, seed=13 + rows)[:rows].contiguous()
            for isa in ISAS:
                lib = kernel_library.load(isa)
                expected = _product(lib, qtype, w, x)
                for threads in (1, 2):
                    got = _product(lib, qtype, paired, x, threads, code=code)
                    assert torch.equal(got, expected), (isa, cols, rows, threads)
                assert not torch.equal(_product(lib, qtype, swapped, x, code=code), expected)


def _swap_pairs(w: np.ndarray, qtype) -> np.ndarray:
    block_bytes = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}[qtype]
    b = w.reshape(w.shape[0], -1, block_bytes).copy()
    n = b.shape[1] // 2 * 2
    b[:, 0:n:2], b[:, 1:n:2] = b[:, 1:n:2].copy(), b[:, 0:n:2].copy()
    return b.reshape(w.shape)


def test_rms_norm_sums_the_squares_in_double_in_order() -> None:
    x = _activations(4, 576, seed=6)
    w = torch.from_numpy(np.random.default_rng(7).uniform(0.5, 1.5, 576).astype(np.float32))
    expected = []
    for row in x.numpy():
        squares = (row * row).astype(np.float64)  # float products, widened
        mean = np.float32(np.cumsum(squares)[-1] / 576)  # a sequential double sum
        scale = np.float32(1.0) / np.sqrt(np.float32(mean + np.float32(1e-5)))
        expected.append((row * scale) * w.numpy())
    for isa in ISAS:
        y = torch.empty_like(x)
        kernel_library.load(isa).ggml_rms_norm(
            x.data_ptr(), w.data_ptr(), 4, 576, 1e-5, y.data_ptr()
        )
        assert y.numpy().tobytes() == np.stack(expected).astype(np.float32).tobytes(), isa


def test_swiglu_is_silu_times_up_and_the_same_on_every_build() -> None:
    gate = torch.linspace(-110.0, 90.0, 4001)  # both saturations of ggml's expf included
    up = torch.linspace(0.5, 2.0, 4001)
    outs = []
    for isa in ISAS:
        out = torch.empty_like(gate)
        kernel_library.load(isa).ggml_swiglu(gate.data_ptr(), up.data_ptr(), 4001, out.data_ptr())
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs)
    expected = (gate.double() * torch.sigmoid(gate.double())) * up.double()
    error = (outs[0].double() - expected).abs() / expected.abs().clamp(min=1e-30)
    assert error[gate > -80].max() < 1e-6  # expf within ~2 ulp, then a division and a product
    # Any float at all, eight lanes at a time in the vector builds and one at a time in the
    # portable build: the same bits (a NaN as a NaN)
    drawn = np.random.default_rng(11).integers(0, 2**32, 1 << 20, dtype=np.uint64)
    gate = torch.from_numpy(drawn.astype(np.uint32).view(np.float32))
    up = torch.ones_like(gate)
    first = None
    for isa in ISAS:
        out = torch.empty_like(gate)
        kernel_library.load(isa).ggml_swiglu(
            gate.data_ptr(), up.data_ptr(), len(gate), out.data_ptr()
        )
        if first is None:
            first = out
        same = (out.view(torch.int32) == first.view(torch.int32)) | (out.isnan() & first.isnan())
        assert bool(same.all()), (isa, gate[~same][:4].tolist())


def _attention(lib, shape, threads: int):
    """ggml_attention on drawn q/k/v rows and caches: (out, rotated qkv, cache_k, cache_v)."""
    seed, seq, n_heads, n_kv, hd, start = shape
    rng = np.random.default_rng(seed)
    width, max_seq = (n_heads + 2 * n_kv) * hd, start + seq + 3
    qkv = torch.from_numpy((rng.standard_normal((seq, width)) * 3).astype(np.float32))
    cos = torch.from_numpy(rng.uniform(-1, 1, (seq, hd)).astype(np.float32))
    sin = torch.from_numpy(rng.uniform(-1, 1, (seq, hd)).astype(np.float32))
    cache_k = torch.from_numpy(rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32))
    cache_v = torch.from_numpy(rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32))
    out = torch.zeros(seq, n_heads * hd)
    lib.ggml_attention(qkv.data_ptr(), seq, cos.data_ptr(), sin.data_ptr(), cache_k.data_ptr(),
                       cache_v.data_ptr(), n_heads, n_kv, hd, max_seq, start, hd**-0.5,
                       out.data_ptr(), threads)  # fmt: skip
    return out, qkv, cache_k, cache_v


# (seed, queries, heads, kv heads, head dim, cached positions): a decode row and prefill
# chunks; KV groups of 1, 3 (SmolLM2), 4 (Llama 3) and 5; head dims 64 and 128 (the AVX-512
# builds' several-heads value loops), 136 (no vector path), 12 and 40; partial key tiles; a
# context long enough that a group's heads are scored in two turns (ATTN_SCORES)
ATTENTION_SHAPES = [
    (1, 1, 9, 3, 64, 200), (2, 37, 9, 3, 64, 11), (3, 13, 1, 1, 16, 0), (4, 7, 4, 2, 12, 3),
    (5, 9, 2, 1, 136, 2), (6, 33, 8, 8, 128, 5), (7, 3, 4, 2, 40, 1), (8, 9, 8, 2, 128, 30),
    (9, 6, 5, 1, 64, 7), (10, 4, 3, 1, 128, 90), (11, 2, 9, 3, 64, 25000),
]  # fmt: skip


def test_attention_is_the_same_on_every_build_and_is_softmax_attention() -> None:
    first = {
        shape: _attention(kernel_library.load(ISAS[0]), shape, 1) for shape in ATTENTION_SHAPES
    }
    for isa in ISAS:
        for shape in ATTENTION_SHAPES:
            for threads in (1, 2):
                got = _attention(kernel_library.load(isa), shape, threads)
                assert all(torch.equal(a, b) for a, b in zip(got, first[shape], strict=True)), (
                    isa, shape, threads,
                )  # fmt: skip
    for shape in ATTENTION_SHAPES:  # softmax(q k^T / sqrt(hd)) v in float64, from the results
        _, seq, n_heads, n_kv, hd, start = shape
        out, qkv, cache_k, cache_v = (t.double() for t in first[shape])
        q = qkv[:, : n_heads * hd].reshape(seq, n_heads, hd)
        assert torch.equal(
            cache_k[:, start : start + seq].float(),
            qkv[:, n_heads * hd : (n_heads + n_kv) * hd]
            .reshape(seq, n_kv, hd)
            .transpose(0, 1)
            .float(),
        )
        for h in range(n_heads):
            keys, values = cache_k[h // (n_heads // n_kv)], cache_v[h // (n_heads // n_kv)]
            for i in range(seq):
                scores = keys[: start + i + 1] @ q[i, h] * hd**-0.5
                expected = torch.softmax(scores, 0) @ values[: start + i + 1]
                assert (out[i, h * hd : (h + 1) * hd] - expected).abs().max() < 1e-5


def test_the_rope_tables_are_the_same_on_every_build() -> None:
    """The tables through 8,400 positions (what a long case adds besides attention), with and
    without rope factors: the same bits from every build (test_same_bits holds the default
    build's to the correctly rounded values)."""
    factors = torch.linspace(1.0, 8.0, 32)
    tables = []
    for isa in ISAS:
        for freq in (None, factors):
            cos, sin = torch.empty(8400, 64), torch.empty(8400, 64)
            ptr = None if freq is None else freq.data_ptr()
            lib = kernel_library.load(isa)
            assert lib.ggml_rope_tables(8400, 64, 5e5, ptr, cos.data_ptr(), sin.data_ptr()) == 0
            tables.append((cos, sin))
    for index, (cos, sin) in enumerate(tables):  # each against the first build's, alike
        assert torch.equal(cos, tables[index % 2][0]) and torch.equal(sin, tables[index % 2][1])


def test_the_rope_tables_refuse_angles_their_reduction_cannot_take() -> None:
    """Past 2^26 rad the range reduction is no longer exact: refused, nothing written."""
    cos, sin = torch.full((1, 2), 7.0), torch.full((1, 2), 7.0)
    for isa in ISAS:
        lib = kernel_library.load(isa)
        assert lib.ggml_rope_tables(2**26 + 2, 2, 1e4, None, cos.data_ptr(), sin.data_ptr()) == -1
        assert lib.ggml_rope_tables(1, 2, 1e4, None, cos.data_ptr(), sin.data_ptr()) == 0
        assert cos.tolist() == [[1.0, 1.0]] and sin.tolist() == [[0.0, 0.0]]
        cos.fill_(7.0)


def test_matrices_keep_the_engines_row_order_and_refuse_other_types() -> None:
    w = _weights(GGMLQuantizationType.Q8_0, 8, 64, seed=8)
    order = torch.tensor([3, 1, 2, 0, 7, 6, 5, 4])
    matrix = ggml_mode.GgmlMatrix([RawMatrix(w, GGMLQuantizationType.Q8_0, 8, 64, order)])
    assert np.array_equal(matrix.gguf_blocks(), w[order.numpy()])
    with pytest.raises(ValueError, match="no Q6_K products"):
        raw = np.zeros((8, 210), dtype=np.uint8)
        ggml_mode.GgmlMatrix([RawMatrix(raw, GGMLQuantizationType.Q6_K, 8, 256)])


@pytest.fixture(scope="module")
def q8_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ggml") / "tiny_q8_0.gguf"
    write_tiny_llama(path, dim=256, ffn_dim=512, weight_type=GGMLQuantizationType.Q8_0)
    return path


def test_the_models_logits_are_the_same_on_every_build(q8_checkpoint, monkeypatch) -> None:
    """Prefill and decode, teacher-forced, of a tiny Q8_0 file: bit for bit on every build,
    so the mode's goldens hold on any CPU; and not the quantized mode's numbers (8-bit
    activations move them)."""
    ids, forced = [5, 17, 200, 33, 260, 7], [9, 12, 40]
    outputs = []
    for isa in ISAS:
        monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
        engine = Llama3Engine.from_gguf(q8_checkpoint, mode="ggml")
        outputs.append(engine.generate(ids, 3, forced_tokens=forced, prompt_positions=[1, 3]))
    for out in outputs[1:]:
        assert torch.equal(out.logits, outputs[0].logits)
        assert torch.equal(out.prompt_logits, outputs[0].prompt_logits)
    monkeypatch.delenv(kernel_library.KERNELS_ENV)
    quantized = Llama3Engine.from_gguf(q8_checkpoint, mode="quantized")
    plain = quantized.generate(ids, 3, forced_tokens=forced, prompt_positions=[1, 3])
    moved = (plain.logits - outputs[0].logits).abs().max().item()
    spread = outputs[0].logits.std().item()
    # the activations' 8 bits move a logit by a few hundredths of the logits' spread (0.07
    # here), and no more: a wrong block scale or a lost block moves it by about the spread
    assert 1e-5 * spread < moved < 0.15 * spread


def test_on_a_float_file_the_ggml_mode_is_eager(tmp_path) -> None:
    """README.md:146 ("on float files it is eager"; ggml_mode.install: "a float file: the
    model stays exactly eager's"): a float32 file in the ggml mode runs eager's model class,
    no ggml product, and eager's logits bit for bit. Planted: from_gguf choosing
    GgmlTransformer by mode alone (`elif mode in ("quantized", "ggml")`: ggml's rope angles on
    a float file)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    engine = Llama3Engine.from_gguf(path, mode="ggml")
    assert type(engine.model) is Transformer
    assert not any(isinstance(m, ggml_mode.GgmlLinear) for m in engine.model.modules())
    eager = Llama3Engine.from_gguf(path)
    ids = list(range(1, 40))
    assert torch.equal(engine.forward_logits(ids), eager.forward_logits(ids))


def test_fused_parts_of_another_type_or_width_are_refused() -> None:
    """GgmlMatrix's promise: fused parts share the weight type and the column count, else a
    ValueError. Q4_0 and Q4_K rows of 256 columns have the same bytes (144), so nothing else
    would notice: planted, the check without its type test fuses them silently (the Q4_K rows
    read as Q4_0 blocks) and passed every other fast test."""
    q4_0 = _weights(GGMLQuantizationType.Q4_0, 8, 256, seed=30)
    q4_k = _weights(GGMLQuantizationType.Q4_K, 8, 256, seed=31)
    assert q4_0.shape == q4_k.shape
    with pytest.raises(ValueError, match="share the weight type"):
        ggml_mode.GgmlMatrix(
            [RawMatrix(q4_0, GGMLQuantizationType.Q4_0, 8, 256),
             RawMatrix(q4_k, GGMLQuantizationType.Q4_K, 8, 256)]
        )  # fmt: skip
    narrow = _weights(GGMLQuantizationType.Q8_0, 8, 64, seed=32)
    wide = _weights(GGMLQuantizationType.Q8_0, 8, 128, seed=33)
    with pytest.raises(ValueError, match="share the weight type and the column count"):
        ggml_mode.GgmlMatrix(
            [RawMatrix(narrow, GGMLQuantizationType.Q8_0, 8, 64),
             RawMatrix(wide, GGMLQuantizationType.Q8_0, 8, 128)]
        )  # fmt: skip


def test_a_file_mixing_weight_types_in_fused_parts_runs_each_part_as_its_own_product(
    tmp_path,
) -> None:
    """A file whose q/k/v mix Q4_K and Q4_0 (wv) and whose gate/up mix Q4_K and Q8_0 (up), as
    `llama-quantize --tensor-type` writes them. The quantized mode loaded it; the ggml mode
    refused it (its int4 parts were fused, and GgmlMatrix refuses two types). Now each layer
    keeps ggml's attention and SwiGLU with a GgmlParts product (each part its own GgmlLinear,
    as llama.cpp runs a product per tensor), no one-call decode step applies, and the logits
    are eager's but for the 8-bit activations (within 0.15 of their spread, as for a Q8_0
    file above). Planted, each FAILED here: the parts concatenated in reverse order (the
    logits off by about their spread); FusedDecode.applies not looking at wqkv (the kernel
    table reads a GgmlParts as one matrix)."""
    path = tmp_path / "mixed.gguf"
    types = {}
    for i in range(2):
        types[f"blk.{i}.attn_v.weight"] = GGMLQuantizationType.Q4_0
        types[f"blk.{i}.ffn_up.weight"] = GGMLQuantizationType.Q8_0
    write_tiny_llama(
        path, dim=256, ffn_dim=512, weight_type=GGMLQuantizationType.Q4_K, tensor_types=types
    )
    ggml = Llama3Engine.from_gguf(path, mode="ggml")
    for layer in ggml.model.layers:
        assert type(layer.attention) is ggml_mode.GgmlAttention
        assert type(layer.feed_forward) is ggml_mode.GgmlFeedForward
        assert [p.weight.qtype for p in layer.attention.wqkv.parts] == [
            GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0
        ]  # fmt: skip
        assert [p.weight.qtype for p in layer.feed_forward.w13.parts] == [
            GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0
        ]  # fmt: skip
    assert not ggml_mode.FusedDecode.applies(ggml.model)
    assert ggml.model.fused_decode is None
    ids, forced = [5, 17, 200, 33, 260, 7], [9, 12, 40]
    ran = ggml.generate(ids, 3, forced_tokens=forced, prompt_positions=[1, 3])
    eager = Llama3Engine.from_gguf(path, mode="eager")
    plain = eager.generate(ids, 3, forced_tokens=forced, prompt_positions=[1, 3])
    spread = plain.logits.std().item()
    assert (ran.logits - plain.logits).abs().max().item() < 0.15 * spread
    assert (ran.prompt_logits - plain.prompt_logits).abs().max().item() < 0.15 * spread


def _rope_config(**scaling) -> LlamaConfig:
    plain = LlamaConfig(vocab_size=256, dim=512, n_layers=1, n_heads=4, n_kv_heads=1,
                        ffn_dim=512, head_dim=128, rope_theta=5e5, rms_norm_eps=1e-5,
                        context_length=8192, tie_word_embeddings=True)  # fmt: skip
    return dataclasses.replace(plain, **scaling)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_freq_factors": tuple(torch.linspace(1.0, 8.0, 64).tolist())},
        {"rope_scaling_type": "llama3", "rope_scaling_factor": 8.0},
        {"rope_scaling_type": "linear", "rope_scaling_factor": 4.0},
    ],
    ids=["rope_freqs", "llama3", "linear"],
)
def test_the_rope_tables_scale_the_frequencies_as_the_model_does(scaling) -> None:
    """rope_tables' promise: the file's rope_freqs factors, or without them the ones Llama
    3.1's (or linear) scaling implies, divide the frequencies as model.py's tables do: the
    two tables within 1e-3 through 2,048 positions (they differ by ggml's angles, 2.4e-4
    here), while the scaling moves them by more than 0.1. The rope tables' other tests run no
    scaled config (test_same_bits' holds a file's rope_freqs, but no Llama 3.1 scaling without
    them): planted, the factors inverted (scaled / plain: a Llama 3.1 model's long wavelengths
    sped up 64 times) passed every fast test and test_same_bits' table check, and the file's
    factors ignored every fast one; each is off by 2 here."""
    config, positions = _rope_config(**scaling), 2048
    cos, sin = ggml_mode.rope_tables(config, positions, torch.device("cpu"))
    model_cos, model_sin = precompute_rope(config, positions, torch.device("cpu"))
    assert (cos - model_cos).abs().max() < 1e-3 and (sin - model_sin).abs().max() < 1e-3
    plain_cos, _ = ggml_mode.rope_tables(_rope_config(), positions, torch.device("cpu"))
    assert (cos - plain_cos).abs().max() > 0.1  # the scaling is seen


def test_the_one_call_decode_step_reads_each_products_weight_type(tmp_path) -> None:
    """FusedDecode's promise ("the same functions, in the same order, as this mode's modules,
    so the same bits") on a model whose products are not all of one type: a tiny Q4_K file
    with each layer's wo requantized to Q4_0 and w2 to Q4_1 (Q4_0's rows have Q4_K's bytes,
    Q4_1's more). Every test file is of one type per model, where a table entry's type code
    taken from another product changes nothing: planted, fill giving w2 w13's code (or wo
    wqkv's) passed every fast test; here the one-call step's tokens and logits then part from
    the modules'."""
    path = tmp_path / "tiny_q4_k.gguf"
    weights = write_tiny_llama(path, dim=256, ffn_dim=512, weight_type=GGMLQuantizationType.Q4_K)
    engine = Llama3Engine.from_gguf(path, mode="ggml")
    for i, layer in enumerate(engine.model.layers):
        for owner, name, tensor, qtype in (
            (layer.attention, "wo", f"blk.{i}.attn_output.weight", GGMLQuantizationType.Q4_0),
            (layer.feed_forward, "w2", f"blk.{i}.ffn_down.weight", GGMLQuantizationType.Q4_1),
        ):
            w = weights[tensor].astype(np.float32)
            raw = RawMatrix(quantize(w, qtype), qtype, *w.shape)
            setattr(owner, name, ggml_mode.ggml_linear([raw]))
    assert ggml_mode.FusedDecode.applies(engine.model)

    def run(fused):
        engine.model.fused_decode = fused
        out = engine.generate([1, 17, 99, 5, 42, 7], 12, stop_on_eos=False)
        return out.tokens, out.logits

    modules_tokens, modules_logits = run(None)
    fused_tokens, fused_logits = run(ggml_mode.FusedDecode(engine.model))
    assert fused_tokens == modules_tokens
    assert torch.equal(fused_logits, modules_logits)


def test_a_batch_of_two_sequences_gives_each_its_own_logits(q8_checkpoint) -> None:
    """GgmlAttention's promise: its kernel computes one sequence; a batch takes
    PackedAttention's path. Two sequences prefilled and decoded together through the model
    give each the logits it gets alone (within 1e-3 of their spread: another attention's
    summation order). No fast test ran a batch: planted, `bsz == 1` dropped from forward's
    test sent the batch to the kernel, which filled the second sequence's rows with another
    computation (off by about 5 times the spread) and passed every fast test."""
    model = Llama3Engine.from_gguf(q8_checkpoint, mode="ggml").model
    rows, steps = [[5, 17, 200, 33, 260, 7], [9, 12, 40, 1, 2, 3]], [11, 13]
    alone = []
    with torch.no_grad():
        for row, step in zip(rows, steps, strict=True):
            model.setup_caches(8, 1)
            prefill = model.forward(torch.tensor([row]), 0)[0]
            alone.append(torch.cat([prefill, model.forward(torch.tensor([[step]]), 6)[0]]))
        model.setup_caches(8, 2)
        prefill = model.forward(torch.tensor(rows), 0)
        both = torch.cat([prefill, model.forward(torch.tensor([[s] for s in steps]), 6)], dim=1)
    for i in range(2):
        spread = alone[i].std().item()
        assert (both[i] - alone[i]).abs().max().item() < 1e-3 * spread, i


# --- ggml_attention's arithmetic, transcribed: every rounding as ggml_dot.c writes it ----------
F32 = np.float32


def _f32(exact: Fraction) -> np.float32:
    """`exact` rounded once to float32, to nearest, ties to even."""
    near = F32(float(exact))
    around = (np.nextafter(near, F32(-np.inf)), near, np.nextafter(near, F32(np.inf)))
    return min(around, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))


def _fmaf(a, b, c) -> np.float32:
    """C's fmaf: a * b + c rounded once (exactly, through fractions)."""
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _hex32(text: str) -> np.float32:
    value = F32(float.fromhex(text))
    assert float(value) == float.fromhex(text)
    return value


# ggml_expf's constants: log2(e), ln 2 (low part, high part), the polynomial's c5 .. c1
_EXPF_HEX = (
    "0x1.715476p+0", "0x1.7f7d1cp-20", "0x1.62e4p-1", "0x1.0e4020p-7",
    "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1",
)  # fmt: skip
_EXPF = [_hex32(t) for t in _EXPF_HEX]


def _ggml_expf(x: np.float32) -> np.float32:
    """ggml_dot.c's ggml_expf where |n| <= 126 (softmax's shifted scores here)."""
    log2e, ln2_lo, ln2_hi, c5, c4, c3, c2, c1 = _EXPF
    shift = F32(12582912.0)  # 0x1.8p23
    z = _fmaf(x, log2e, shift)
    n = F32(z - shift)
    assert abs(n) <= 126
    b = _fmaf(-n, ln2_lo, _fmaf(-n, ln2_hi, x))
    bits = ((int(z.view(np.uint32)) << 23) + 0x3F800000) & 0xFFFFFFFF
    k = np.uint32(bits).view(F32)
    u = F32(b * b)
    j = _fmaf(_fmaf(_fmaf(c5, b, c4), u, _fmaf(c3, b, c2)), u, F32(c1 * b))
    return _fmaf(j, k, k)


def _dot_lanes(a: np.ndarray, b: np.ndarray) -> np.float32:
    """dot_lanes: eight lanes of fmaf in order, summed as hsum_float_8."""
    lane = [F32(0.0)] * 8
    for i in range(0, len(a), 8):
        lane = [_fmaf(a[i + k], b[i + k], lane[k]) for k in range(8)]
    r = [F32(lane[k + 4] + lane[k]) for k in range(4)]
    return F32(F32(r[0] + r[2]) + F32(r[1] + r[3]))


def _ggml_decode_row(qkv, cos, sin, cache_k, cache_v, n_heads, n_kv, start, scale):
    """ggml_attention for one row at position `start`, transcribed: (rotated qkv, caches, out)."""
    qkv, cache_k, cache_v = qkv.copy(), cache_k.copy(), cache_v.copy()
    hd = cos.shape[0]
    heads = qkv.reshape(-1, hd)  # a view: rotated in place
    for x in heads[: n_heads + n_kv]:
        for d in range(hd // 2):
            a, b = x[d], x[d + hd // 2]
            x[d] = _fmaf(a, cos[d], -F32(b * sin[d]))
            x[d + hd // 2] = _fmaf(a, sin[d + hd // 2], F32(b * cos[d + hd // 2]))
    cache_k[:, start] = heads[n_heads : n_heads + n_kv]
    cache_v[:, start] = heads[n_heads + n_kv :]
    out = np.zeros((n_heads, hd), F32)
    for h in range(n_heads):
        keys, values = cache_k[h // (n_heads // n_kv)], cache_v[h // (n_heads // n_kv)]
        scores = [F32(_dot_lanes(heads[h], keys[j]) * scale) for j in range(start + 1)]
        peak = max(scores)
        p = [_ggml_expf(F32(s - peak)) for s in scores]
        total = 0.0  # double, in order
        for value in p:
            total += float(value)
        inv = F32(1.0 / total)  # (float)(1 / sum)
        for j in range(start + 1):
            pj = F32(p[j] * inv)
            out[h] = [_fmaf(pj, values[j, d], out[h, d]) for d in range(hd)]
    return qkv, cache_k, cache_v, out.reshape(-1)


def test_a_decode_rows_attention_is_ggmls_arithmetic_bit_for_bit() -> None:
    """ggml_attention's header promises each rounding: the rotation x0' = fma(x0, cos, -(x1
    sin)), x1' = fma(x0, sin, x1 cos); scores over eight fmaf lanes summed as hsum_float_8,
    times the scale; softmax by ggml_expf, the sum in double in order, each probability times
    (float)(1 / sum); out = one fmaf per key in order. A Python transcription with exact fmaf
    (fractions) gives the bits, and every build must give them: four KV heads of SmolLM2's
    group of three query heads at head dim 64 (the AVX-512 builds' three-heads value loop),
    seven keys (a tile of four scores, then three alone). Twelve heads: the planted factor
    below moves about a quarter of the heads' (float)(1 / sum). The attention test above
    compares the builds with each other and the output with float64 softmax attention within
    1e-5: it passes the factor planted as 1.0f / (float)sum on every build, and failed the
    rotation planted as two roundings (a * c - b * s) by 2e-8 (1.0023e-5); both fail here."""
    rng = np.random.default_rng(21)
    n_heads, n_kv, hd, start = 12, 4, 64, 6
    qkv = (rng.standard_normal((n_heads + 2 * n_kv) * hd) * 2).astype(F32)
    angles = np.tile(rng.uniform(0.0, 6.0, hd // 2), 2)
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    cache_k = rng.standard_normal((n_kv, start + 2, hd)).astype(F32)
    cache_v = rng.standard_normal((n_kv, start + 2, hd)).astype(F32)
    scale = F32(hd**-0.5)
    expected = _ggml_decode_row(qkv, cos, sin, cache_k, cache_v, n_heads, n_kv, start, scale)
    for isa in ISAS:
        got = [torch.from_numpy(t.copy()) for t in (qkv, cache_k, cache_v)]
        out = torch.zeros(n_heads * hd)
        kernel_library.load(isa).ggml_attention(
            got[0].data_ptr(), 1, torch.from_numpy(cos).data_ptr(),
            torch.from_numpy(sin).data_ptr(), got[1].data_ptr(), got[2].data_ptr(), n_heads,
            n_kv, hd, start + 2, start, float(scale), out.data_ptr(), 1,
        )  # fmt: skip
        for name, mine, theirs in zip(
            ("qkv", "cache_k", "cache_v", "out"), [*got, out], expected, strict=True
        ):
            assert mine.numpy().view(np.uint32).tolist() == theirs.view(np.uint32).tolist(), (
                isa,
                name,
            )
