"""The JSON record `bench --json FILE` writes, shared with perf_regression.

Absolute times wander on shared machines, so what perf_regression compares are the ratios
engine / transformers measured in the same run: both sides see the same load on the CPU. The
record keeps the raw numbers too, so a surprising ratio can be traced to the side that moved.

Layout (keys sorted on write, so two records diff line by line):
- `engine`: one entry per engine mode ("eager" today; more modes are more entries), each with
  `load_seconds`, `prefill_tokens_per_second`, `decode_tokens_per_second`;
- `peers`: the same numbers for each reference implementation ("transformers", and
  "llama.cpp" when the bench measured it, through its binding or llama-bench); a number a
  peer does not report is null (llama-bench's load_seconds), never NaN, which is no JSON;
- `peer_versions`, only when the bench measured llama.cpp: which one, e.g. "llama-bench
  /usr/bin/llama-bench, version 0.7.0, build_number 11669, build_commit Debian, backend CPU
  libggml-cpu-icelake.so" (its numbers mean different things through the binding and
  through llama-bench: tools/bench/llama_cpp_peer.py);
- `ratios`: per engine mode, engine / transformers for `load`, `prefill`, `decode`, each taken
  on the number the table prints (load in seconds, so lower is better there; the others are
  throughputs, so higher is better);
- `machine`, `versions`, `setup`: what a ratio depends on besides the code (CPU, core count,
  torch and transformers versions, checkpoint, thread count, prompt and generation lengths,
  repeats);
- `conditions`: the 1-minute load average at the start and the end of the run, and (since
  the bench measures it) `read_bandwidth_gb_per_s`, the machine's read bandwidth on the
  bench's threads. Ratios are not load-invariant (with two threads on two oversubscribed
  cores, transformers' decode slowed several times more than the engine's), so
  perf_regression warns about a record measured under another load than its baseline.

This module imports neither torch nor transformers: perf_regression and the tests read
records without them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from goldens.cli_files import PathError, output_file, user_path, write_atomically
from goldens.machine import cpu_features, cpu_model

SCHEMA_VERSION = 1
PEER = "transformers"
METRICS = ("load", "prefill", "decode")
LOWER_IS_BETTER = frozenset({"load"})  # seconds; the other metrics are tokens per second


@dataclasses.dataclass(frozen=True)
class Timings:
    """One implementation's numbers in one mode, as the bench table prints them."""

    load_seconds: float
    prefill_tokens_per_second: float
    decode_tokens_per_second: float

    def metric(self, name: str) -> float:
        """The number behind a ratio `name` (one of METRICS)."""
        return {
            "load": self.load_seconds,
            "prefill": self.prefill_tokens_per_second,
            "decode": self.decode_tokens_per_second,
        }[name]


def machine_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The machine class a ratio belongs to: CPU model, the flags that choose the kernels
    (one model string, "Intel(R) Xeon(R) Processor", names VMs with AVX2 alone and with
    AVX-512 and AMX) and how many cores the OS reports."""
    return {
        "cpu_model": cpu_model(cpuinfo),
        "cpu_features": cpu_features(cpuinfo),
        "cpu_count": os.cpu_count(),
    }


def load_average() -> float:
    """The 1-minute load average: how busy other processes kept the CPU around the run."""
    return round(os.getloadavg()[0], 2)


def ratios(engine: Timings, peer: Timings) -> dict[str, float]:
    """engine / peer for every metric, the numbers perf_regression compares."""
    return {name: engine.metric(name) / peer.metric(name) for name in METRICS}


def numbers(timings: Timings) -> dict[str, float | None]:
    """`timings` as the record holds them: a number not measured (nan) is None (null)."""
    return {
        key: value if math.isfinite(value) else None
        for key, value in dataclasses.asdict(timings).items()
    }


def build_record(
    engine: dict[str, Timings],
    peer: Timings,
    *,
    machine: dict[str, Any],
    versions: dict[str, str],
    setup: dict[str, Any],
    conditions: dict[str, float],
    other_peers: dict[str, Timings] | None = None,
    peer_versions: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The record for one bench run: every engine mode, the peers, and the ratios against
    transformers (`other_peers`' numbers are kept, not compared; `peer_versions` says which
    implementation they came from)."""
    record = {
        "schema_version": SCHEMA_VERSION,
        "conditions": conditions,
        "machine": machine,
        "versions": versions,
        "setup": setup,
        "engine": {mode: numbers(timings) for mode, timings in engine.items()},
        "peers": {
            PEER: numbers(peer),
            **{name: numbers(t) for name, t in (other_peers or {}).items()},
        },
        "ratios": {mode: ratios(timings, peer) for mode, timings in engine.items()},
    }
    if peer_versions:
        record["peer_versions"] = dict(peer_versions)
    return record


def dumps(data: dict[str, Any]) -> str:
    """JSON with sorted keys and a final newline: the same data always gives the same text."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write `record` to `path` whole or not at all (an interrupted run leaves no torn file)."""
    write_atomically(path, dumps(record))


def json_output(value: str | None, parser) -> Path | None:
    """A bench's `--json FILE` as the user meant it (relative to where `bazel run` was
    started), checked before the minutes of timing, not after: a path that is a folder, a
    folder that cannot be created, or one this process cannot create a file in is
    `parser.error` (exit 2) now (a folder given as --json ran 93 s of bench, then stopped in
    IsADirectoryError, exit 1, its numbers lost). None without the option."""
    if not value:
        return None
    path = user_path(value)
    try:  # creates and drops a file in the folder, as write_record will
        output_file(path, "--json")
    except PathError as error:
        parser.error(str(error))
    return path
