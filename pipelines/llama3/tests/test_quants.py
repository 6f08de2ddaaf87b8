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
