"""Each torch dequantizer is bit-identical to gguf-py's numpy reference on random blocks."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pipelines.llama3 import quants

QUANTIZABLE = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


def _random_k_blocks(
    qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator
) -> np.ndarray:
    """Random k-quant bytes with finite float16 scales (gguf-py has no Q4_K/Q6_K quantizer)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scale_offsets = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}[qtype]
    for offset in scale_offsets:
        scales = (rng.random(n_blocks) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_types_match_gguf_py_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 256)).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(packed, qtype)
    actual = quants.dequantize(packed, qtype, expected.shape)
    assert torch.equal(actual, torch.from_numpy(expected))
    assert np.abs(expected - values).max() < 0.5  # and the round trip is a real approximation


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda t: t.name
)
def test_k_quants_match_gguf_py_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    blocks = _random_k_blocks(qtype, 12, np.random.default_rng(1))
    expected = gguf.quants.dequantize(blocks, qtype)  # [12, 256]
    actual = quants.dequantize(blocks, qtype, expected.shape)
    assert torch.equal(actual, torch.from_numpy(expected))


def test_chunked_cpu_path_matches_whole_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quants, "CPU_CHUNK_BLOCKS", 3)
    blocks = _random_k_blocks(GGMLQuantizationType.Q6_K, 10, np.random.default_rng(2))
    expected = gguf.quants.dequantize(blocks, GGMLQuantizationType.Q6_K)
    assert torch.equal(
        quants.dequantize(blocks, GGMLQuantizationType.Q6_K, expected.shape),
        torch.from_numpy(expected),
    )


@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16],
    ids=lambda t: t.name,
)
def test_float_types_match_gguf_py(qtype: GGMLQuantizationType) -> None:
    values = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    stored = values if qtype == GGMLQuantizationType.F32 else gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(stored, qtype)
    actual = quants.dequantize(stored, qtype, (4, 64))
    assert actual.dtype == torch.float32
    assert torch.equal(actual, torch.from_numpy(np.asarray(expected, dtype=np.float32)))


def test_nan_scale_is_reported_as_non_finite() -> None:
    packed = gguf.quants.quantize(np.ones((1, 32), dtype=np.float32), GGMLQuantizationType.Q8_0)
    packed[0, :2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    with pytest.raises(quants.NonFiniteError):
        quants.dequantize(packed, GGMLQuantizationType.Q8_0, (1, 32))


def test_unsupported_type_is_refused() -> None:
    with pytest.raises(ValueError, match="Q5_K"):
        quants.dequantize(np.zeros((1, 176), np.uint8), GGMLQuantizationType.Q5_K, (1, 256))


def _nvfp4_blocks_covering_every_byte(rng: np.random.Generator) -> np.ndarray:
    """Random NVFP4 blocks in which each scale byte 0..255 and each code byte 0..255 (so every
    nibble in both halves) occurs, in every scale slot and code position, among random ones."""
    every = np.arange(256, dtype=np.uint8)
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType.NVFP4]
    covering = np.stack([np.roll(every, shift) for shift in range(type_size)], axis=1)
    random = rng.integers(0, 256, size=(64, type_size), dtype=np.uint8)
    return np.concatenate([covering, random])


def test_nvfp4_matches_gguf_py_bit_for_bit_on_every_scale_and_code_byte() -> None:
    blocks = _nvfp4_blocks_covering_every_byte(np.random.default_rng(4))
    expected = gguf.quants.dequantize(blocks, GGMLQuantizationType.NVFP4)  # [320, 64]
    actual = quants.dequantize(blocks, GGMLQuantizationType.NVFP4, expected.shape)
    # bits, not values: a scale byte of 0 or 0x7F times a negative code is -0.0 in both
    assert torch.equal(actual.view(torch.int32), torch.from_numpy(expected).view(torch.int32))
    assert (np.signbit(expected) & (expected == 0)).any()


def test_nvfp4_scale_bytes_decode_to_half_their_ue4m3_value() -> None:
    # one block per scale byte, every code 1 (kvalue 1): each value is the decoded half-scale
    blocks = np.zeros((256, 36), dtype=np.uint8)
    blocks[:, :4] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, 4:] = 0x11
    scales = quants.dequantize(blocks, GGMLQuantizationType.NVFP4, (256, 64))[:, 0].tolist()
    assert scales[0x00] == 0 and scales[0x7F] == 0  # zero, and E4M3's NaN read as zero
    assert scales[0x01] == 2.0**-10  # smallest subnormal: 1 * 2^-9 / 2
    assert scales[0x08] == 2.0**-7  # smallest normal: 2^-6 / 2
    assert scales[0x38] == 0.5 and scales[0x39] == 0.5625  # 1.0 and 1.125, halved
    assert scales[0x7E] == 224.0  # 448 / 2
    assert scales[0xB8] == 0.5 and scales[0xFF] == 240.0  # bit 7 is ignored (0xFF is not NaN)


def test_f32_result_owns_its_memory_unless_copy_is_false_on_a_writable_array() -> None:
    """dequantize's contract: the result owns its memory, except F32 on the CPU with
    copy=False over a writable array, which is a view of it. Catches the clone condition
    `copy or not writeable` turned into `copy and not writeable` (a default call then aliases
    the caller's array, e.g. a copy-on-write map of the file)."""
    raw = np.arange(8, dtype=np.float32)
    owned = quants.dequantize(raw, GGMLQuantizationType.F32, (2, 4))
    view = quants.dequantize(raw, GGMLQuantizationType.F32, (2, 4), copy=False)
    read_only = raw.copy()
    read_only.flags.writeable = False
    from_read_only = quants.dequantize(read_only, GGMLQuantizationType.F32, (8,), copy=False)
    raw[0] = 100.0
    assert owned[0, 0].item() == 0.0 and view[0, 0].item() == 100.0
    assert from_read_only.data_ptr() != read_only.ctypes.data
    assert from_read_only.tolist() == list(range(8))


@pytest.mark.parametrize(
    ("qtype", "bad"),
    [
        (GGMLQuantizationType.F32, np.nan),
        (GGMLQuantizationType.F16, np.inf),
        (GGMLQuantizationType.BF16, -np.inf),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_non_finite_float_tensor_is_reported(qtype: GGMLQuantizationType, bad: float) -> None:
    """NonFiniteError for NaN or infinity holds for float tensors too, not only quantized
    blocks. Catches the check dropped from the float path."""
    values = np.ones((2, 32), dtype=np.float32)
    values[1, 7] = bad
    stored = values if qtype == GGMLQuantizationType.F32 else gguf.quants.quantize(values, qtype)
    with pytest.raises(quants.NonFiniteError):
        quants.dequantize(stored, qtype, (2, 32))


def test_check_finite_false_returns_non_finite_values_unchecked() -> None:
    """check_finite=False skips the check (the caller checked the bytes before): a NaN scale
    comes back as NaN values instead of an error. Catches the flag ignored on the block path."""
    packed = gguf.quants.quantize(np.ones((2, 32), dtype=np.float32), GGMLQuantizationType.Q8_0)
    packed[1, :2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    values = quants.dequantize(packed, GGMLQuantizationType.Q8_0, (2, 32), check_finite=False)
    expected_first = gguf.quants.dequantize(packed[:1], GGMLQuantizationType.Q8_0)[0]
    assert torch.isnan(values[1]).all()
    assert torch.equal(values[0], torch.from_numpy(expected_first))
    floats = np.array([1.0, np.inf], dtype=np.float32)
    assert (
        quants.dequantize(floats, GGMLQuantizationType.F32, (2,), check_finite=False)[1] == np.inf
    )
