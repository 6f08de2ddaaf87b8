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
