"""The machine a golden or a benchmark was made on, as provenance records it."""

from __future__ import annotations

import platform
from pathlib import Path


def _cpuinfo_field(name: str, cpuinfo: Path) -> str:
    """The first non-empty value of field `name` in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name and value.strip():
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first "model name" in /proc/cpuinfo (e.g. "Intel(R) Xeon(R) Processor"); elsewhere
    whatever `platform` knows."""
    return (
        _cpuinfo_field("model name", cpuinfo)
        or platform.processor()
        or platform.machine()
        or "unknown"
    )


# The flags that choose a kernel build or a library's code path on x86 (the engine's builds:
# avx2 needs avx2 and fma, avx512 avx512f and bw, vnni avx512_vnni; oneDNN and llama.cpp's
# backends also read avx512_bf16 and amx): two CPUs with one model string may differ here.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """KERNEL_FLAGS the CPU has, by its first "flags" line in /proc/cpuinfo (empty elsewhere)."""
    flags = set(_cpuinfo_field("flags", cpuinfo).split())
    return [flag for flag in KERNEL_FLAGS if flag in flags]
