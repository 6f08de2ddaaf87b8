import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import NVFP4, dequantize

from tools.gen_tiny_model import counter_rng, nvfp4
from tools.gen_tiny_model.tests import nvfp4_reference

SUB = nvfp4.SUB_BLOCK
QK = nvfp4.QK_NVFP4


def _sub_blocks(*rows: np.ndarray) -> np.ndarray:
    """Four 16-value sub-blocks -> one 64-value block."""
    return np.concatenate([np.broadcast_to(r, (SUB,)) for r in rows]).astype(np.float32)


def _normal(name: str, shape: tuple[int, ...], std: float = 1.0) -> np.ndarray:
    return counter_rng.normal(5, f"nvfp4-{name}", shape, std).astype(np.float32)


# Scale 1.0 (byte 0x38, decoded d = 0.5): the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives;
# every other value below sits exactly halfway between two grid points.
TIES = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] * 2, np.float32) * np.repeat([1, -1], 8)

BLOCKS = {
    "normal": _normal("normal", (4, QK)),
    "weights": _normal("weights", (4, QK), 0.05),  # scales just above the subnormal range
    "zeros": np.zeros((2, QK), np.float32),
    "constant": np.stack([np.full(QK, 0.37), np.full(QK, -5.0)]).astype(np.float32),
    "subnormal_scales": _normal("subnormal", (4, QK), 0.004),  # amax / 6 < 2^-6
    "below_smallest_scale": _normal("tiny", (2, QK), 1e-5),  # scale byte 0, values read as 0
    "saturated": _normal("huge", (2, QK), 1000.0),  # amax / 6 >= 448
    "exponent_15": np.stack([np.full(QK, 1800.0), np.full(QK, -1530.0)]).astype(np.float32),
    "negative_zero": np.stack(
        [np.full(QK, -0.0), np.where(np.arange(QK) % 2, -0.0, _normal("nz", (QK,)))]
    ).astype(np.float32),
    "ties": np.stack([np.tile(TIES, 4), -np.tile(TIES, 4)]),
    "scale_rounding_midpoints": _sub_blocks(
        np.float32(6 * 1.0625),  # amax / 6 halfway between 1.0 and 1.125: rounds up
        np.float32(6 * 7.5 * 2.0**-9),  # trunc(7.5 + 0.5) = 8 is capped at 7: stays subnormal
        np.float32(6 * 0.5 * 2.0**-9),  # the smallest non-zero scale
        np.float32(6 * 255.9),  # rounds into exponent 15: saturates
    )[None],
    "mixed_sub_blocks": _sub_blocks(
        np.zeros(SUB),
        _normal("mixed-a", (SUB,)),
        _normal("mixed-b", (SUB,), 1e-3),
        _normal("mixed-c", (SUB,), 5000.0),
    )[None],
}


@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_bytes_match_literal_port_of_ggml_reference(case):
    blocks = BLOCKS[case]
    ours = nvfp4.quantize_nvfp4(blocks)
    assert ours.shape == (blocks.shape[0], nvfp4.BLOCK_BYTES)
    for row in range(blocks.shape[0]):
        assert ours[row].tobytes() == nvfp4_reference.quantize_block(blocks[row]), row


def test_hand_computed_block():
    # Scale byte 0x38 (1.0): 6 -> code 7, -6 -> 15, 0.25 and -0.25 tie with 0 -> code 0.
    grid = np.array([6, 4, 3, 2, 1.5, 1, 0.5, 0, -6, -4, -3, -2, -1.5, -1, -0.5, -0.25])
    block = _sub_blocks(grid, np.zeros(SUB), np.full(SUB, 1e-9), np.full(SUB, -1e6))
    ours = nvfp4.quantize_nvfp4(block)
    assert list(ours[:4]) == [0x38, 0x00, 0x00, 0x7E]
    # low nibble: value j, high nibble: value j + 8
    assert list(ours[4:12]) == [0xF7, 0xE6, 0xD5, 0xC4, 0xB3, 0xA2, 0x91, 0x00]
    assert list(ours[12:28]) == [0] * 16
    assert list(ours[28:36]) == [0xFF] * 8  # -1e6 clamps to -6 * 448 = code 15


def test_ties_keep_the_lower_code():
    scales, codes = nvfp4.quantize_sub_blocks(TIES[None])
    assert scales[0] == 0x38
    # 0.25 (between 0 and 0.5) -> 0; 2.5 (between 2 and 3) -> code 4; 5 -> code 6 (4);
    # -0.25 ties between code 0 (+0) and code 9 (-0.5): the lower index, 0.
    assert list(codes[0]) == [7, 0, 1, 2, 3, 4, 5, 6, 15, 0, 9, 10, 11, 12, 13, 14]


def test_zero_sub_block_has_scale_zero_and_code_zero():
    scales, codes = nvfp4.quantize_sub_blocks(np.array([[0.0] * 8 + [-0.0] * 8], np.float32))
    assert scales.tolist() == [0] and codes.tolist() == [[0] * SUB]


def _ue4m3_sweep() -> np.ndarray:
    """Every UE4M3 value, the midpoints between neighbours and one ulp either side, random
    magnitudes over the whole range, and a stride through all float32 bit patterns up to 500."""
    values = nvfp4.ue4m3_to_fp32(np.arange(0x7F, dtype=np.uint8)) * np.float32(2)
    midpoints = (values[:-1] + values[1:]) / np.float32(2)
    points = np.concatenate([values, midpoints])
    around = np.concatenate(
        [points, np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(1e9))]
    )
    magnitudes = np.exp2(counter_rng.uniform(5, "ue4m3", 20000) * 24 - 14).astype(np.float32)
    strided = np.arange(0, np.float32(500).view(np.uint32), 997, dtype=np.uint32).view(np.float32)
    specials = np.array(
        [0, -0.0, -1, 448, 449, 1e9, np.inf, np.nan, 2.0**-6, 2.0**-10, 2.0**-11], np.float32
    )
    return np.concatenate([around, magnitudes, strided, specials]).astype(np.float32)


def test_scale_encoder_matches_literal_port_on_every_boundary():
    sweep = _ue4m3_sweep()[:60000]  # the boundaries and random magnitudes (the scalar port is slow)
    expected = [nvfp4_reference.fp32_to_ue4m3(v) for v in sweep]
    assert nvfp4.fp32_to_ue4m3(sweep).tolist() == expected


def test_scale_encoder_matches_gguf_py():
    sweep = _ue4m3_sweep()
    finite = sweep[np.isfinite(sweep)]  # gguf-py's version is undefined on NaN
    assert np.array_equal(nvfp4.fp32_to_ue4m3(finite), NVFP4.fp32_to_ue4m3(finite))


@pytest.mark.parametrize(
    ("value", "byte"),
    [
        (1.0, 0x38),
        (1.0625, 0x39),  # halfway between 1.0 and 1.125: rounds up
        (np.nextafter(np.float32(1.0625), np.float32(0)), 0x38),
        (2.0**-6, 0x08),  # the smallest normal
        (7.5 * 2.0**-9, 0x07),  # would round to 2^-6, capped at the largest subnormal
        (0.5 * 2.0**-9, 0x01),  # trunc(0.5 + 0.5) = 1
        (0.49 * 2.0**-9, 0x00),
        (240.0, 0x77),  # the largest value with exponent field 14
        (256.0, 0x7E),  # exponent field 15 always saturates
        (448.0, 0x7E),
        (1e9, 0x7E),
        (-1.0, 0x00),
        (-0.0, 0x00),
        (np.nan, 0x00),
    ],
)
def test_scale_encoder_values(value, byte):
    assert int(nvfp4.fp32_to_ue4m3(np.float32(value))) == byte
    assert nvfp4_reference.fp32_to_ue4m3(np.float32(value)) == byte


def test_scale_decoder_matches_gguf_py_and_literal_port_on_all_bytes():
    codes = np.arange(256, dtype=np.uint8)
    ours = nvfp4.ue4m3_to_fp32(codes)
    assert ours.dtype == np.float32
    assert ours.tobytes() == NVFP4.ue4m3_to_fp32(codes).astype(np.float32).tobytes()
    assert ours.tolist() == [float(nvfp4_reference.ue4m3_to_fp32(int(c))) for c in codes]
    assert ours[0x7F] == 0 and ours[0x7E] == 224 and ours[0x38] == 0.5 and ours[3] == 3 * 2.0**-10


def test_round_trip_through_gguf_py_stays_within_one_e2m1_step_of_the_scale():
    """With a normal scale s = 2d, the grid's widest gap (4s to 6s) bounds the error by s; a
    scale rounded down by up to 1/16 leaves the top value at most 6s/16 above 6s."""
    weights = _normal("round-trip", (8, 4 * QK))
    blocks = nvfp4.quantize_nvfp4(weights)
    restored = dequantize(blocks, GGMLQuantizationType.NVFP4)
    assert restored.shape == weights.shape
    scale_bytes = blocks.reshape(-1, nvfp4.BLOCK_BYTES)[:, : nvfp4.SUB_BLOCKS].reshape(-1)
    step = 2 * NVFP4.ue4m3_to_fp32(scale_bytes)  # the true E2M1 scale of each sub-block
    assert (scale_bytes >= 0x08).all()  # every scale is normal for unit-normal weights
    errors = np.abs(restored - weights).reshape(-1, SUB).max(axis=1)
    assert (errors <= step).all()
    amax = np.abs(weights).reshape(-1, SUB).max(axis=1)
    assert (errors <= amax / 6 * (1 + 1 / 16)).all()
    rmse = np.sqrt(np.mean((restored - weights) ** 2))
    assert 0.05 < rmse < 0.15  # 4-bit E2M1 on a unit normal: about 0.1


def test_layout_is_36_bytes_per_64_values_as_gguf_declares():
    assert GGML_QUANT_SIZES[GGMLQuantizationType.NVFP4] == (QK, nvfp4.BLOCK_BYTES)
    weights = _normal("layout", (3, 2, 2 * QK))
    blocks = nvfp4.quantize_nvfp4(weights)
    assert blocks.dtype == np.uint8 and blocks.shape == (3, 2, 2 * nvfp4.BLOCK_BYTES)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.zeros((2, 100), np.float32), "multiple of 64"),
        (np.float32(1.0), "multiple of 64"),
        (np.full((1, 64), np.inf, np.float32), "NaN or infinite"),
    ],
)
def test_invalid_input_is_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        nvfp4.quantize_nvfp4(weights)
