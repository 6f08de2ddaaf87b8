"""The machine a golden or a benchmark was made on, as provenance records it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first "model name" in /proc/cpuinfo (e.g. "Intel(R) Xeon(R) Processor"); elsewhere
    whatever `platform` knows."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
