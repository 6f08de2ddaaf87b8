"""ggml's activation quantizers (pipelines/llama3/ggml_activations.py), bit for bit against
plain float32 loops written from ggml's C, per code path, on random blocks and on the inputs
where the paths part: exact .5 ties, zero blocks, a negative maximum, and equal magnitudes of
both signs (Q8_K takes the first). Q8_0's reference path is also held to gguf-py's quantizer,
an independent transcription of the same C function."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pipelines.llama3 import ggml_activations as ga

F = np.float32


def _nearest_int(value: np.float32) -> int:
    """ggml's nearest_int: add 1.5 * 2**23 in float32, read the mantissa bits."""
    shifted = np.array([F(value) + F(12582912.0)], dtype=np.float32)
    return int((shifted.view(np.int32)[0] & 0x007FFFFF) - 0x00400000)


def _q8_k_loop(block: np.ndarray) -> tuple[list[int], np.float32]:
    amax, signed_max = F(0), F(0)
    for v in block:
        if abs(v) > amax:
            amax, signed_max = F(abs(v)), F(v)
    if amax == 0:
        return [0] * len(block), F(0)
    iscale = F(F(-127.0) / signed_max)  # one divss in the binary
    q = [min(127, _nearest_int(F(iscale * v))) for v in block]
    return q, F(F(1.0) / iscale)


def _q8_0_loop(block: np.ndarray, path: str) -> tuple[list[int], np.float16]:
    amax = F(max(abs(v) for v in block))
    d = F(amax / F(127.0))
    if path == "x86":  # _mm256_mul_ps, _mm256_round_ps(_MM_ROUND_NEAREST)
        inverse = F(F(127.0) / amax) if amax != 0 else F(0)
        q = [int(np.rint(F(v * inverse))) for v in block]
    else:  # quantize_row_q8_0_ref: roundf
        inverse = F(F(1.0) / d) if d != 0 else F(0)
        q = [int(np.copysign(np.floor(abs(F(v * inverse)) + 0.5), F(v * inverse))) for v in block]
    return q, np.float16(d)


def _blocks(size: int, count: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-4, 3, size=(count, 1))
    blocks = (rng.standard_normal((count, size)) * scales).astype(np.float32)
    blocks[0] = 0.0  # a zero block
    blocks[1] = -np.abs(blocks[1])  # a negative maximum
    blocks[2, :] = np.arange(size, dtype=np.float32) % 7 - 3.0  # -3 comes before +3
    ties = np.arange(size, dtype=np.float32) % 127 + 0.5  # x * id lands on .5 exactly
    ties[0] = 127.0
    blocks[3] = ties
    blocks[4] = -ties
    return blocks


def _assert_q8_k_is_the_loop(blocks: np.ndarray, rows: int) -> None:
    """ga.q8_k of `blocks` (in `rows` rows) equals ggml's loop, block by block, bit for bit."""
    q, d = ga.q8_k(torch.from_numpy(blocks.reshape(rows, -1)))
    q, d = q.reshape(-1, ga.QK_K).numpy(), d.reshape(-1).numpy()
    for i, block in enumerate(blocks):
        expected_q, expected_d = _q8_k_loop(block)
        assert q[i].tolist() == expected_q, f"block {i}"
        assert d[i].tobytes() == np.float32(expected_d).tobytes(), f"block {i}"


def test_q8_k_is_ggml_quantize_row_q8_K_ref_bit_for_bit():
    _assert_q8_k_is_the_loop(_blocks(ga.QK_K), rows=8)


def test_q8_k_takes_the_first_of_equal_magnitudes():
    # Block 2 holds -3 before +3: ggml's iscale is -127/-3, so -3 maps to -127 and +3 to +127;
    # taking +3 would swap every sign. The loop above and the function agree on it.
    block = _blocks(ga.QK_K)[2]
    q, _ = ga.q8_k(torch.from_numpy(block))
    assert q.reshape(-1)[0].item() == -127 and q.reshape(-1)[6].item() == 127


def _assert_q8_0_is_the_loop(blocks: np.ndarray, path: str) -> None:
    """ga.q8_0 of `blocks` (16 rows of them) equals ggml's loop, block by block, bit for bit."""
    q, d = ga.q8_0(torch.from_numpy(blocks.reshape(16, -1)), path=path)
    q, d = q.reshape(-1, ga.QK8_0).numpy(), d.reshape(-1).numpy()
    for i, block in enumerate(blocks):
        expected_q, expected_d = _q8_0_loop(block, path)
        assert q[i].tolist() == expected_q, f"block {i} ({path})"
        assert d[i].tobytes() == expected_d.tobytes(), f"block {i} ({path})"


@pytest.mark.parametrize("path", ["x86", "ref"])
def test_q8_0_is_ggml_bit_for_bit_on_each_path(path):
    _assert_q8_0_is_the_loop(_blocks(ga.QK8_0, count=256), path)


def test_the_two_q8_0_paths_part_on_ties():
    ties = torch.from_numpy(_blocks(ga.QK8_0, count=256)[3])
    x86, _ = ga.q8_0(ties, path="x86")
    ref, _ = ga.q8_0(ties, path="ref")
    assert (x86 != ref).any()  # half to even against half away from zero


def test_q8_0_ref_is_gguf_pys_quantizer():
    blocks = _blocks(ga.QK8_0, count=256)
    q, d = ga.q8_0(torch.from_numpy(blocks), path="ref")
    packed = quantize(blocks, GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert packed[:, :2].tobytes() == d.numpy().reshape(-1).tobytes()
    assert packed[:, 2:].view(np.int8).tolist() == q.numpy().reshape(-1, ga.QK8_0).tolist()


def test_q8_k_takes_the_first_not_the_last_of_equal_magnitudes():
    """The module's promise "the first, on ties", where first and last differ in sign: blocks
    whose largest magnitude comes twice, once of each sign, in either order, at the block's
    ends and inside it. Block 2 above holds -3 both first and last, so it cannot tell them
    apart: planted, q8_k taking the last of equals (a `>=` in the C loop's comparison) passed
    every other test here and in test_ggml_mode.py; it negates q and d of each block here."""
    rng = np.random.default_rng(3)
    blocks = rng.uniform(-2.5, 2.5, (4, ga.QK_K)).astype(np.float32)
    firsts = [(0, 255, -3.0), (0, 255, 3.0), (17, 200, -3.0), (5, 9, 3.0)]  # first, last, sign
    for row, (first, last, value) in enumerate(firsts):
        blocks[row, first], blocks[row, last] = value, -value
    q, d = ga.q8_k(torch.from_numpy(blocks))
    q, d = q.reshape(-1, ga.QK_K).numpy(), d.reshape(-1).numpy()
    for i, block in enumerate(blocks):
        expected_q, expected_d = _q8_k_loop(block)
        assert q[i].tolist() == expected_q, f"block {i}"
        assert d[i].tobytes() == np.float32(expected_d).tobytes(), f"block {i}"
        # the first is ggml's signed maximum: it maps to -127, the last to +127
        assert (q[i, firsts[i][0]], q[i, firsts[i][1]]) == (-127, 127), f"block {i}"


def _near_ties(size: int, count: int, inverse, seed: int) -> np.ndarray:
    """Blocks whose values sit on, or one float32 step beside, x * inverse(amax) = k + 0.5:
    where a scale 1 ulp off moves q. Value 0 of each block is its (positive) maximum amax."""
    rng = np.random.default_rng(seed)
    amax = (rng.uniform(1.0, 2.0, count) * 10.0 ** rng.integers(-3, 3, count)).astype(F)
    blocks = np.empty((count, size), F)
    for i, a in enumerate(amax):
        x = ((rng.integers(0, 127, size - 1) + F(0.5)) / inverse(a)).astype(F)
        step = rng.integers(-1, 2, size - 1)
        x = np.where(step > 0, np.nextafter(x, F(np.inf)), x)
        x = np.where(step < 0, np.nextafter(x, F(-np.inf)), x)
        sign = np.where(rng.random(size - 1) < 0.5, F(1.0), F(-1.0))
        blocks[i, 0], blocks[i, 1:] = a, np.minimum(x, a) * sign
    return blocks


@pytest.mark.parametrize("path", ["x86", "ref"])
def test_q8_0_scales_are_correctly_rounded_divisions_on_near_ties(path):
    """The x86 path's id = 127 / amax and d = amax / 127 (the ref path's id = 1 / d) are one
    correctly rounded float32 division each, as C's: on values whose x * id lands within a
    float32 step of k + 0.5, a scale 1 ulp off moves q. The random blocks above rarely land
    there. Planted and passing every other test here and in test_ggml_mode.py, failing this:
    x86's inverse as `127.0 / amax` (torch multiplies by the reciprocal: _div's reason; 122 of
    512 blocks), and d as `amax * (1.0 / 127.0)` (the ref path; 25 of 512 blocks)."""
    if path == "x86":
        blocks = _near_ties(ga.QK8_0, 512, lambda a: F(F(127.0) / a), seed=5)
    else:
        blocks = _near_ties(ga.QK8_0, 512, lambda a: F(F(1.0) / F(a / F(127.0))), seed=6)
    _assert_q8_0_is_the_loop(blocks, path)


def test_q8_k_scales_are_correctly_rounded_divisions_on_near_ties():
    """Q8_K's iscale = -127 / max and d = 1 / iscale, one correctly rounded division each, on
    values whose iscale * x lands within a float32 step of k + 0.5 (as the Q8_0 test above).
    Planted: _div as `numerator / denominator` (torch's reciprocal product) fails here."""
    _assert_q8_k_is_the_loop(_near_ties(ga.QK_K, 64, lambda a: F(F(-127.0) / a), seed=7), rows=4)
