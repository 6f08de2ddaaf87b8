"""What computes the same bits on every machine, so that its goldens are bitwise facts:

- every kernel build the CPU runs (portable C, AVX2, AVX-512, VNNI) and thread counts 1 and 2
  give the same logits, prompt log-probs and tokens, on tiny Q4_K and SmolLM2 Q4_1 (each
  checkpoint's short golden cases, run as the goldens run them);
- so does every ATen kernel level the CPU runs (`ATEN_CPU_CAPABILITY`, read once at start-up:
  a child process per level) and oneDNN's (`ONEDNN_MAX_CPU_ISA`), for the ggml mode and for
  tiny bfloat16 in eager (its attention in float32, rounded once);
- the rope tables need no libm: every entry is the correctly rounded cos and sin of its float
  angle (kernels/ggml_dot.c computes them in double precision with +, -, * and / alone), for
  the checkpoints' theta, head size and rope factors at 8,400 positions.

Each check is shown able to fail by a planted break: 1% of a table's entries moved by 1 ulp
(what another libm's roundings do: glibc's cosf, which llama.cpp calls, rounds about 1% of
these angles otherwise, printed) is reported by the table check, and the same run with such
tables has another fingerprint.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from goldens.record import case_specs
from harness.llama3 import engine_runs
from harness.llama3.variants import GGML_ENCODINGS, variants
from pipelines.llama3 import ggml_mode, kernel_library
from pipelines.llama3.model import rope_inverse_frequencies

VARIANTS = [v for v in variants() if v.encoding in GGML_ENCODINGS and v.model != "llama3_1"]
ISAS = [isa for isa in ("portable", "avx2", "avx512", "vnni") if kernel_library.runnable(isa)]
CPU_FLAGS = pathlib.Path("/proc/cpuinfo").read_text().split()
ATEN_LEVELS = [
    level
    for level, flag in (("default", ""), ("avx2", "avx2"), ("avx512", "avx512f"))
    if not flag or flag in CPU_FLAGS
]
POSITIONS = 8400  # beyond the long cases' 8,323 tokens


def _available(variant):
    if variant.path is None:
        pytest.fail(f"the ggml bit-identity check needs {variant.unavailable_reason}")
    return variant


def fingerprint(variant, isa: str | None = None, threads: int = 1, mode: str = "ggml") -> str:
    """sha256 of the short golden cases' runs in `mode`: their tokens, logits and prompt
    log-prob rows, as bytes."""
    previous_threads = torch.get_num_threads()
    previous_isa = os.environ.get(kernel_library.KERNELS_ENV)
    try:
        if isa is not None:
            os.environ[kernel_library.KERNELS_ENV] = isa
        torch.set_num_threads(threads)
        engine = engine_runs.load_engine(variant, "cpu", mode=mode)
        runs = [engine_runs.run_case(engine, s) for s in case_specs(variant.model) if not s.long]
    finally:
        torch.set_num_threads(previous_threads)
        if previous_isa is None:
            os.environ.pop(kernel_library.KERNELS_ENV, None)
        else:
            os.environ[kernel_library.KERNELS_ENV] = previous_isa
    digest = hashlib.sha256()
    for run in runs:
        digest.update(np.asarray(run.tokens, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(run.logits, dtype=np.float32).tobytes())
        digest.update(np.ascontiguousarray(run.prompt_logits, dtype=np.float32).tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.test_id)
def test_every_build_and_thread_count_gives_the_same_bits(variant) -> None:
    _available(variant)
    prints = {(isa, t): fingerprint(variant, isa, t) for isa in ISAS for t in (1, 2)}
    assert len(set(prints.values())) == 1, prints
    assert len(ISAS) >= 2, f"only {ISAS} run here: nothing compared"


# What runs under every kernel level: the ggml mode on its checkpoints, and tiny bfloat16 in
# eager (attention in float32, rounded once: docs/goldens.md, "Every CPU").
LEVEL_RUNS = [(v, "ggml") for v in VARIANTS] + [
    (v, "eager") for v in variants("tinyllama") if v.encoding == "bfloat16"
]
# Each level's environment and what runs under it: ATen's levels (its own kernels: all three
# runs) but the one this process runs, and oneDNN's (bfloat16 matmuls: the bfloat16 run; the
# ggml mode's products are its own kernels).
LEVELS = [({"ATEN_CPU_CAPABILITY": level}, "all") for level in ATEN_LEVELS] + [
    ({"ONEDNN_MAX_CPU_ISA": isa}, "eager")
    for isa, flag in (("AVX2", "avx2"), ("SSE41", ""))
    if not flag or flag in CPU_FLAGS
]
RUNS_ENV = "SAME_BITS_RUNS"  # the child's selection of LEVEL_RUNS: "all" or a mode

_CHILD = """
import os
from max_tests.integration.architectures.llama3 import test_same_bits as t
for v, mode in t.LEVEL_RUNS:
    if os.environ[t.RUNS_ENV] in ("all", mode):
        print(f"{v.test_id}-{mode}", t.fingerprint(v, mode=mode))
"""


def test_every_kernel_level_gives_the_same_bits() -> None:
    """One child process per ATen or oneDNN level (each is read once, at start-up)."""
    for variant, _ in LEVEL_RUNS:
        _available(variant)
    expected = {f"{v.test_id}-{mode}": fingerprint(v, mode=mode) for v, mode in LEVEL_RUNS}
    assert len(expected) == 3
    here = torch.backends.cpu.get_cpu_capability().lower()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for level, runs in LEVELS:
        if level.get("ATEN_CPU_CAPABILITY") == here:
            continue  # `expected` is that level's
        child = subprocess.run(
            [sys.executable, "-c", _CHILD],
            env={**env, **level, RUNS_ENV: runs},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        got = dict(line.split() for line in child.stdout.splitlines() if line.strip())
        wanted = {k: v for k, v in expected.items() if runs == "all" or k.endswith(f"-{runs}")}
        assert got == wanted, (level, got, wanted)


def _angles(config, positions: int = POSITIONS) -> np.ndarray:
    """The float32 angles of ggml_rope_tables, [positions, head_dim / 2]: p * theta_scale^i
    multiplied up pair by pair (theta_scale correctly rounded: checked below), divided by the
    rope factors."""
    half = config.head_dim // 2
    exponent = np.float32(-2.0) / np.float32(config.head_dim)
    theta_scale = np.float32(math.pow(float(np.float32(config.rope_theta)), float(exponent)))
    factors = None
    if config.rope_freq_factors is not None:
        factors = np.asarray(config.rope_freq_factors, dtype=np.float32)
    elif config.rope_scaling_type is not None:
        plain = dataclasses.replace(config, rope_scaling_type=None)
        factors = (rope_inverse_frequencies(plain) / rope_inverse_frequencies(config)).float()
        factors = factors.numpy()
    theta = np.arange(positions, dtype=np.float32)
    angles = np.empty((positions, half), dtype=np.float32)
    for i in range(half):
        angles[:, i] = theta if factors is None else theta / factors[i]
        theta = (theta * theta_scale).astype(np.float32)
    return angles


def _rounded(function, angles: np.ndarray) -> np.ndarray:
    """`function` of each float angle in double precision, rounded to float32."""
    flat = angles.ravel().astype(np.float64).tolist()
    return np.array([function(a) for a in flat], dtype=np.float64).astype(np.float32)


def _ulps_off(table: torch.Tensor, expected: np.ndarray) -> int:
    half = table.shape[1] // 2
    assert torch.equal(table[:, :half], table[:, half:])  # the "rotate half" layout
    return int((table[:, :half].numpy().ravel().view(np.int32) != expected.view(np.int32)).sum())


def _libm_ulps_off(angles: np.ndarray, expected_cos: np.ndarray) -> int:
    """How many of the angles this machine's libm cosf rounds otherwise (glibc 2.36's: about
    1%; llama.cpp's tables are those). Reported, not asserted: a libm may round correctly."""
    libm = ctypes.CDLL("libm.so.6")
    libm.cosf.restype, libm.cosf.argtypes = ctypes.c_float, [ctypes.c_float]
    cos = np.array([libm.cosf(a) for a in angles.ravel().tolist()], dtype=np.float32)
    return int((cos.view(np.int32) != expected_cos.view(np.int32)).sum())


def _planted(table: torch.Tensor, fraction: float = 0.01, seed: int = 0) -> torch.Tensor:
    """The planted break: `fraction` of the entries (seeded) moved by 1 ulp, what another
    libm's roundings do to a table; in the "rotate half" layout like the real ones."""
    half = table.shape[1] // 2
    left = table[:, :half].clone().numpy()
    chosen = np.random.default_rng(seed).random(left.shape) < fraction
    left[chosen] = np.nextafter(left[chosen], np.float32(np.inf))
    return torch.from_numpy(np.concatenate([left, left], axis=1))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.test_id)
def test_the_rope_tables_are_correctly_rounded(variant, capsys) -> None:
    engine = engine_runs.load_engine(_available(variant), "cpu", mode="ggml")
    config = engine.model.config
    lib = ggml_mode.kernels()
    exponent = np.float32(-2.0) / np.float32(config.head_dim)
    exact = math.pow(float(np.float32(config.rope_theta)), float(exponent))
    assert lib.ggml_rope_pow(config.rope_theta, exponent) == np.float32(exact)
    angles = _angles(config)
    cos, sin = ggml_mode.rope_tables(config, POSITIONS, torch.device("cpu"))
    expected_cos, expected_sin = _rounded(math.cos, angles), _rounded(math.sin, angles)
    assert _ulps_off(cos, expected_cos) == 0
    assert _ulps_off(sin, expected_sin) == 0
    # the planted break is seen, entry by entry
    assert _ulps_off(_planted(cos), expected_cos) > 0.005 * expected_cos.size
    off = _libm_ulps_off(angles, expected_cos)
    with capsys.disabled():
        print(f"\n{variant.test_id}: libm's cosf rounds {off} of {expected_cos.size} otherwise")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.test_id)
def test_a_tables_rounding_changes_the_fingerprint(variant, monkeypatch) -> None:
    """The planted break for the bit-identity checks: the same runs with 1% of their rope-table
    entries 1 ulp off (another libm's roundings) have another fingerprint, so the checks above
    would see a build, thread count or level that computed its tables otherwise."""
    unmutated = fingerprint(_available(variant))
    original = ggml_mode.rope_tables

    def planted_tables(config, max_seq_len, device):
        return tuple(_planted(t) for t in original(config, max_seq_len, device))

    monkeypatch.setattr(ggml_mode, "rope_tables", planted_tables)
    assert fingerprint(variant) != unmutated
