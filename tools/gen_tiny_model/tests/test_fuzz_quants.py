"""Property-based checks of the Q4_K quantizer and of the engine's dequantizers.

`tools/gen_tiny_model/q4_k.py` writes the Q4_K checkpoints and `pipelines/llama3/quants.py`
reads every GGML type the engine supports; both claim to match llama.cpp's layout and gguf-py's
numpy code bit for bit. Fixed test vectors only cover the blocks someone thought of, so these
properties run hypothesis over blocks mixing arbitrary float32 values with zeros, constant
blocks, sparse blocks (one value plus outliers), float16-max magnitudes and subnormals.

Every test is deterministic (testing/fuzz.py's settings: `derandomize=True`, no example
database). Examples per test: Q4_K against gguf-py 60, Q4_K round-trip bound 60, Q4_K bytes
against the literal llama.cpp port 40 (it runs the C loops in Python), Q8_0 80, the other gguf-py
quantizers (Q4_0, Q4_1, F16, BF16) 40 each, raw block bytes 60 per type. A failure prints
`@reproduce_failure(...)` (`print_blob=True`): pasting that decorator onto the test replays the
failing example.

The `test_planted_*` tests prove each property can fail: each plants one bug with monkeypatch,
calls the hypothesis test directly and expects it to raise; it prints after how many examples
the first failure came.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pipelines.llama3 import quants
from testing.fuzz import ADD_DIGEST, first_failure, fuzz_settings
from tools.gen_tiny_model import q4_k
from tools.gen_tiny_model.tests import q4_k_reference

# Inputs stay within float16's range: Q4_K and Q8_0 store their scales as float16, so values
# far beyond it overflow the scale to infinity in llama.cpp as well; no format bound holds there.
LIMIT = float(np.finfo(np.float16).max)
SPECIAL_VALUES = [
    0.0,
    -0.0,
    LIMIT,
    -LIMIT,
    65000.0,
    1.0,
    -1.0,
    float(np.finfo(np.float32).smallest_subnormal),  # float32 subnormals
    -1e-40,
    float(np.finfo(np.float16).smallest_subnormal),  # float16 subnormals: scales that underflow
    float(np.finfo(np.float16).tiny),
]
_values = st.floats(
    min_value=-LIMIT, max_value=LIMIT, allow_nan=False, allow_infinity=False, width=32
) | st.sampled_from(SPECIAL_VALUES)


def blocks(block_size: int, max_blocks: int = 3) -> st.SearchStrategy[np.ndarray]:
    """float32 [n_blocks, block_size]: arbitrary, sparse (a fill value plus a few others),
    constant (every value the same, zero included), or Gaussian like real weights, at a drawn
    scale (hypothesis draws the seed, so this stays deterministic and shrinkable)."""

    def shaped(n_blocks: int) -> st.SearchStrategy[np.ndarray]:
        shape = (n_blocks, block_size)
        return st.one_of(
            arrays(np.float32, shape, elements=_values),
            arrays(np.float32, shape, elements=_values, fill=_values),
            _values.map(lambda v: np.full(shape, v, np.float32)),
            st.builds(_gaussian, st.just(shape), st.integers(0, 2**32 - 1), _values),
        )

    return st.integers(1, max_blocks).flatmap(shaped)


def _gaussian(shape: tuple[int, int], seed: int, scale: float) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return np.clip(values, -LIMIT, LIMIT).astype(np.float32)


def assert_bit_identical(actual: torch.Tensor, expected: np.ndarray) -> None:
    """Same shape and the same float32 bits (any NaN matches any NaN: payloads are not data)."""
    actual = actual.numpy()
    expected = np.asarray(expected, dtype=np.float32)
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    np.testing.assert_array_equal(actual.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def q4_k_grid(packed: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per value of [n_blocks, 144] Q4_K bytes: the sub-block step `d * scale`, the offset
    `dmin * min`, and the super-block's d and dmin (all float64 [n_blocks, 256])."""
    d = packed[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = packed[:, 2:4].copy().view(np.float16).astype(np.float64)
    scales = packed[:, 4:16].reshape(-1, 3, 4)
    low, mid, high = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = np.concatenate([low & 63, (high & 15) | ((low >> 2) & 0x30)], axis=1)
    mn = np.concatenate([mid & 63, (high >> 4) | ((mid >> 2) & 0x30)], axis=1)
    per_value = lambda a: np.repeat(a, q4_k.SUB_BLOCK, axis=1)  # noqa: E731
    step, offset = per_value(d * sc), per_value(dmin * mn)
    return step, offset, np.broadcast_to(d, step.shape), np.broadcast_to(dmin, step.shape)


def _fp16_rounding(value: np.ndarray) -> np.ndarray:
    """The most a float32 scale of about `value` can move when stored as float16."""
    return np.maximum(float(np.finfo(np.float16).smallest_subnormal) / 2, value * 2.0**-11)


def _slack(*values: np.ndarray) -> np.ndarray:
    """Two float32 ulps of the largest magnitude involved: the dequantizers round in float32."""
    return 2 * np.spacing(np.max(np.abs(np.stack(values)), axis=0).astype(np.float32))


# -- Q4_K: this repository's quantizer, read back by gguf-py and by the engine ------------


@fuzz_settings(60)
@given(blocks(q4_k.QK_K))
def test_q4_k_dequantizers_agree_bit_for_bit(weights: np.ndarray) -> None:
    packed = q4_k.quantize_q4_k(weights)
    expected = gguf.quants.dequantize(packed, GGMLQuantizationType.Q4_K)
    assert_bit_identical(
        quants.dequantize(packed, GGMLQuantizationType.Q4_K, weights.shape), expected
    )


@fuzz_settings(60)
@given(blocks(q4_k.QK_K))
def test_q4_k_round_trip_within_format_bound(weights: np.ndarray) -> None:
    """The error bound, derived from how a Q4_K value is stored.

    A value x of sub-block j is read back as x' = step_j * q - offset_j with q in 0..15, where
    step_j = d * scale_j and offset_j = dmin * min_j come from 6-bit integers and the float16 d
    and dmin. The quantizer picks q against these stored numbers, so:

    1. x inside its sub-block's grid [-offset_j, 15 step_j - offset_j]: x' is the nearest level,
       |x - x'| <= step_j / 2.
    2. x outside it: x' is the grid's end, and the overshoot is bounded by how the grid was
       chosen: llama.cpp's search tries grids down to 15/16 of the sub-block's range
       (iscale up to (15 - 1 + 20 * 0.1) / range), so up to range / 16 may lie outside; the
       6-bit rounding of the scale moves the top level by at most 15 * d / 2 and of the min by
       dmin / 2; float16 rounding of d and dmin moves the levels by at most 15 * 63 and 63
       times their own rounding (d and dmin underflow to 0 for subnormal inputs).

    Both sides allow two float32 ulps, the rounding of the dequantizers' float32 arithmetic.
    """
    x = weights.astype(np.float64)
    packed = q4_k.quantize_q4_k(weights)
    restored = quants.dequantize(packed, GGMLQuantizationType.Q4_K, weights.shape)
    x_restored = restored.numpy().astype(np.float64)
    step, offset, d, dmin = q4_k_grid(packed)
    slack = _slack(x, x_restored)
    lowest, highest = -offset, 15 * step - offset
    inside = (x >= lowest) & (x <= highest)
    error = np.abs(x - x_restored)
    assert np.all(error[inside] <= step[inside] / 2 + slack[inside])
    # Outside the grid the value is read back as the nearer end of the grid.
    end = np.where(x < lowest, lowest, highest)
    assert np.all(np.abs(x_restored - end)[~inside] <= slack[~inside])
    sub_blocks = x.reshape(x.shape[0], q4_k.SUB_BLOCKS, q4_k.SUB_BLOCK)
    value_range = np.repeat(
        sub_blocks.max(axis=2) - np.minimum(sub_blocks.min(axis=2), 0), q4_k.SUB_BLOCK, axis=1
    )
    overshoot_bound = (
        value_range / 16
        + 7.5 * d
        + dmin / 2
        + 15 * 63 * _fp16_rounding(d)
        + 63 * _fp16_rounding(dmin)
        + slack
    )
    overshoot = np.abs(x - end)
    assert np.all(overshoot[~inside] <= overshoot_bound[~inside])


SMALLEST_DEFINED = 1e-30


@fuzz_settings(40)
@given(blocks(q4_k.QK_K, max_blocks=1))
def test_q4_k_bytes_match_literal_llama_cpp_port(weights: np.ndarray) -> None:
    """q4_k_reference.py transcribes llama.cpp's quantize_row_q4_K_ref statement by statement
    (slow: 40 examples); the vectorized quantizer must write the same 144 bytes.

    Only where llama.cpp is defined: magnitudes below about 1e-35 (float32 subnormals and the
    smallest normals) make its `15 / (max - min)` or `63 / max_scale` overflow to infinity, and
    C's nearest_int of infinity is undefined (the Python port raises OverflowError). Nonzero
    values and sub-block spans are kept above 1e-30 here; the other properties cover the rest.
    """
    sub_blocks = weights.reshape(q4_k.SUB_BLOCKS, q4_k.SUB_BLOCK)
    spans = sub_blocks.max(axis=1) - np.minimum(sub_blocks.min(axis=1), 0)
    magnitudes = np.abs(weights)
    assume(np.all((magnitudes == 0) | (magnitudes >= SMALLEST_DEFINED)))
    assume(np.all((spans == 0) | (spans >= SMALLEST_DEFINED)))
    assert q4_k.quantize_q4_k(weights)[0].tobytes() == q4_k_reference.quantize_block(weights[0])


# -- Q8_0: gguf-py's quantizer, read back by gguf-py and by the engine ---------------------


@fuzz_settings(80)
@given(blocks(32, max_blocks=8))
def test_q8_0_round_trip_and_dequantizers_agree(weights: np.ndarray) -> None:
    """Q8_0 stores d = max|x| / 127 as float16 and q = round(x / d) as int8, so
    |x - q * fp16(d)| <= d / 2 + 127 * |d - fp16(d)| (plus float32 rounding)."""
    packed = gguf.quants.quantize(weights, GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(packed, GGMLQuantizationType.Q8_0)
    restored = quants.dequantize(packed, GGMLQuantizationType.Q8_0, weights.shape)
    assert_bit_identical(restored, expected)
    x = weights.astype(np.float64)
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    stored_d = packed[:, :2].copy().view(np.float16).astype(np.float64)
    bound = d / 2 + 127 * np.abs(d - stored_d) + _slack(x, expected)
    assert np.all(np.abs(x - restored.numpy()) <= bound)


# -- every other type with a gguf-py quantizer, and raw bytes of every block type ----------

OTHER_QUANTIZABLE = [
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
]


@pytest.mark.parametrize("qtype", OTHER_QUANTIZABLE, ids=lambda t: t.name)
@fuzz_settings(40)
@given(weights=blocks(32, max_blocks=8))
def test_gguf_py_quantized_types_dequantize_alike(
    qtype: GGMLQuantizationType, weights: np.ndarray
) -> None:
    packed = gguf.quants.quantize(weights, qtype)
    expected = gguf.quants.dequantize(packed, qtype)
    assert_bit_identical(quants.dequantize(packed, qtype, weights.shape), expected)


@pytest.mark.parametrize("qtype", sorted(quants.BLOCK_DEQUANTIZERS), ids=lambda t: t.name)
@fuzz_settings(60)
@given(data=st.data())
def test_raw_blocks_dequantize_alike(qtype: GGMLQuantizationType, data: st.DataObject) -> None:
    """Arbitrary block bytes, so scales also take float16 subnormals, infinities and NaNs
    (Q4_K and Q6_K have no gguf-py quantizer; bytes reach every bit of their layouts)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = data.draw(st.integers(1, 3))
    raw = data.draw(arrays(np.uint8, (n_blocks, type_size)))
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, qtype)
    assert_bit_identical(quants.BLOCK_DEQUANTIZERS[qtype](torch.from_numpy(raw)), expected)


# -- each property fails on a planted bug --------------------------------------------------


def test_planted_q4_k_scale_bug_breaks_bit_identity(monkeypatch) -> None:
    """The engine's Q4_K dequantizer loses the two high bits of sub-blocks 4-7's scales."""
    unpack = quants._q4_k_scales_mins

    def lossy(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sc, mins = unpack(scales)
        sc[:, 4:] &= 0x0F
        return sc, mins

    monkeypatch.setattr(quants, "_q4_k_scales_mins", lossy)
    first_failure(monkeypatch, test_q4_k_dequantizers_agree_bit_for_bit)


def test_planted_six_bit_rounding_bug_breaks_round_trip_bound(monkeypatch) -> None:
    """The quantizer stores every 6-bit scale and min one level too low."""
    six_bit = q4_k._six_bit
    monkeypatch.setattr(
        q4_k, "_six_bit", lambda v, inv: np.maximum(six_bit(v, inv).astype(np.int16) - 1, 0)
    )
    first_failure(monkeypatch, test_q4_k_round_trip_within_format_bound)


def test_planted_search_grid_bug_breaks_reference_bytes(monkeypatch) -> None:
    """A slightly different candidate grid (rdelta 0.11, not 0.1): round trips stay good, only
    the byte comparison with llama.cpp can tell."""
    monkeypatch.setattr(q4_k, "_RDELTA", np.float32(0.11))
    first_failure(monkeypatch, test_q4_k_bytes_match_literal_llama_cpp_port)


def test_planted_q8_0_off_by_one_breaks_round_trip(monkeypatch) -> None:
    """gguf-py's Q8_0 quantizer divides by 128 instead of 127: q = 128 wraps to -128 in int8.
    Both dequantizers still agree, so only the round-trip bound catches it."""

    def off_by_one(cls, blocks: np.ndarray) -> np.ndarray:
        d = np.abs(blocks).max(axis=1, keepdims=True) / 128
        with np.errstate(divide="ignore"):
            inverse = np.where(d == 0, 0, 1 / d)
        qs = np.rint(blocks * inverse).astype(np.int64).astype(np.int8)
        return np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=1)

    monkeypatch.setattr(gguf.quants.Q8_0, "quantize_blocks", classmethod(off_by_one))
    first_failure(monkeypatch, test_q8_0_round_trip_and_dequantizers_agree)


def test_planted_bf16_read_as_float16_breaks_bit_identity(monkeypatch) -> None:
    monkeypatch.setitem(quants.FLOAT_TYPES, GGMLQuantizationType.BF16, torch.float16)
    first_failure(
        monkeypatch, test_gguf_py_quantized_types_dequantize_alike, qtype=GGMLQuantizationType.BF16
    )


def test_planted_q4_1_sign_bug_breaks_raw_block_identity(monkeypatch) -> None:
    """Q4_1 subtracts its min instead of adding it."""

    def minus_min(blocks: torch.Tensor) -> torch.Tensor:
        d, m = quants._f16(blocks, 0), quants._f16(blocks, 2)
        return d * quants._nibbles(blocks[:, 4:]).float() - m

    monkeypatch.setitem(quants.BLOCK_DEQUANTIZERS, GGMLQuantizationType.Q4_1, minus_min)
    first_failure(monkeypatch, test_raw_blocks_dequantize_alike, qtype=GGMLQuantizationType.Q4_1)


def test_a_planted_run_draws_the_same_examples_whatever_parametrization_ran_before(
    monkeypatch,
) -> None:
    """hypothesis's pytest plugin seeds each parametrization of a parametrized property with its
    node id, set on the inner test they share: a planted run of the raw-blocks property took
    the digest of whichever parametrization had run last (none under -k), so its examples, and
    the example a plant was caught at, depended on what ran before. first_failure drops it.
    Recorded here: the first ten raw Q4_1 inputs of three planted runs, after each digest."""
    qtype = GGMLQuantizationType.Q4_1
    inner = test_raw_blocks_dequantize_alike.hypothesis.inner_test
    dequantize = quants.BLOCK_DEQUANTIZERS[qtype]
    node = "tools/gen_tiny_model/tests/test_fuzz_quants.py::test_raw_blocks_dequantize_alike"

    def drawn_after(digest: bytes | None) -> list[bytes]:
        seen: list[bytes] = []

        def recording(raw: torch.Tensor) -> torch.Tensor:
            seen.append(raw.numpy().tobytes())
            if len(seen) >= 10:  # the tenth example, and hypothesis's replay of it
                raise AssertionError("planted: the tenth example fails")
            return dequantize(raw)

        with monkeypatch.context() as patch:
            if digest is None:
                patch.delattr(inner, ADD_DIGEST, raising=False)
            else:
                patch.setattr(inner, ADD_DIGEST, digest, raising=False)
            patch.setitem(quants.BLOCK_DEQUANTIZERS, qtype, recording)
            planted = first_failure(
                patch, test_raw_blocks_dequantize_alike, match="tenth", qtype=qtype
            )
        assert (planted.first, planted.calls, len(seen)) == (10, 11, 11)
        assert seen[10] == seen[9]
        return seen[:10]

    after_q8_0 = drawn_after(f"{node}[Q8_0]".encode())
    after_q4_k = drawn_after(f"{node}[Q4_K]".encode())
    alone = drawn_after(None)
    # The comparison discriminates: the inputs are not one repeated block (7 distinct of 10
    # measured, hypothesis 6.170.17; with the digest copied, the runs after Q8_0's and Q4_K's
    # parametrizations differed from the third input on).
    assert len(set(alone)) >= 5, len(set(alone))
    assert after_q8_0 == after_q4_k == alone
