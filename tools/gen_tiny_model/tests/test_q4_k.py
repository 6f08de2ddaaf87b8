import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tools.gen_tiny_model import counter_rng
from tools.gen_tiny_model.q4_k import BLOCK_BYTES, QK_K, quantize_q4_k
from tools.gen_tiny_model.tests import q4_k_reference

# llama.cpp tests/test-quantize-fns.cpp: MAX_QUANTIZATION_TOTAL_ERROR = 0.002 on
# 0.1 + 2*cos(i) for 32*128 values, measured as sqrt(sum of squared errors) / n.
LLAMA_CPP_MAX_TOTAL_ERROR = 0.002


def _llama_cpp_test_data(n: int = 32 * 128) -> np.ndarray:
    return (0.1 + 2 * np.cos(np.arange(n, dtype=np.float32))).astype(np.float32)


def test_round_trip_error_within_llama_cpp_bound():
    data = _llama_cpp_test_data()
    restored = dequantize(quantize_q4_k(data), GGMLQuantizationType.Q4_K)
    total_error = np.sqrt(np.sum((data.astype(np.float64) - restored) ** 2)) / data.size
    assert total_error < LLAMA_CPP_MAX_TOTAL_ERROR


def test_round_trip_of_uniform_weights_stays_within_a_sixteenth_of_the_range():
    data = counter_rng.uniform(7, "q4k-uniform", 64 * QK_K).astype(np.float32) * 2 - 1
    restored = dequantize(quantize_q4_k(data.reshape(8, -1)), GGMLQuantizationType.Q4_K)
    rmse = np.sqrt(np.mean((data.reshape(8, -1) - restored) ** 2))
    # 4-bit levels over a sub-block range of ~2 give a step of ~0.13: RMSE ~ step / sqrt(12).
    assert rmse < 2 / 15 / np.sqrt(12) * 1.1


@pytest.mark.parametrize(
    "case",
    ["normal", "cosine", "zeros", "constant_negative", "all_positive", "tiny", "outlier"],
)
def test_bytes_match_literal_port_of_llama_cpp(case):
    normal = counter_rng.normal(3, f"q4k-{case}", (2, QK_K))
    block = {
        "normal": normal,
        "cosine": _llama_cpp_test_data(2 * QK_K).reshape(2, QK_K),
        "zeros": np.zeros((2, QK_K), np.float32),
        "constant_negative": np.full((2, QK_K), -0.37, np.float32),
        "all_positive": np.abs(normal) + 0.5,
        "tiny": normal * np.float32(1e-6),
        "outlier": np.where(np.arange(QK_K) % 32 == 7, np.float32(50), normal * 0.01),
    }[case].astype(np.float32)
    ours = quantize_q4_k(block)
    for row in range(block.shape[0]):
        assert ours[row].tobytes() == q4_k_reference.quantize_block(block[row])


def test_layout_is_144_bytes_per_256_values_and_gguf_reads_it():
    weights = counter_rng.normal(1, "q4k-layout", (3, 2 * QK_K), 0.05)
    blocks = quantize_q4_k(weights)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (3, 2 * BLOCK_BYTES)
    restored = dequantize(blocks, GGMLQuantizationType.Q4_K)
    assert restored.shape == weights.shape
    assert np.abs(restored - weights).max() < 0.05 * 4 / 15


def test_rows_not_multiple_of_256_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 100), np.float32))
