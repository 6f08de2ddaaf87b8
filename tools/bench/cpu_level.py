"""`--cpu-level`: a bench run as on a CPU of a lower x86 level, both sides of every ratio alike.

The issues' targets are set on a 2-core AVX2 machine; a CPU with AVX-512 (and AMX) runs faster
code on both sides. `--cpu-level=avx2` measures the AVX2 code paths on the CPU at hand:

- this engine: the kernel build of that level ($LLAMA_GOLDENS_KERNELS, pipelines/llama3/
  kernel_library.py), ATen's kernels of that level ($ATEN_CPU_CAPABILITY), oneDNN's and MKL's
  ($ONEDNN_MAX_CPU_ISA, $MKL_ENABLE_INSTRUCTIONS): each read once at start-up, so the bench
  runs itself again with them set;
- llama.cpp: the ggml CPU backend Debian builds for that level (libggml-cpu-haswell.so for
  avx2) and no other. Debian's libggml loads the best backend a folder compiled into it holds
  for the CPU, so the bench runs itself in a private mount namespace (`unshare --mount`, which
  takes root) in which that folder holds only the chosen backend, a copy kept under
  ~/.cache/llama-goldens/ggml-cpu-level/. Every llama.cpp tool the bench starts (llama-bench,
  llama-batched-bench, llama-server) loads it; each names it in its line.

The caches, memory bandwidth and clocks stay this machine's: the figures are a level's code on
this CPU, not the other machine's. Without llama.cpp installed only the engine's side changes.

Example:
    bazel run //tools:bench -- --cpu-level=avx2 --modes=quantized,ggml --no-sampling
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

from pipelines.llama3 import kernel_library
from tools.bench import llama_cpp_peer

ENV = "LLAMA_GOLDENS_BENCH_CPU_LEVEL"  # set in the process that runs at the level
COPIES = pathlib.Path("~/.cache/llama-goldens/ggml-cpu-level").expanduser()
# mount the copy's folder over the backends' folder, then run the bench again in it
_MOUNT_THEN_RUN = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'


@dataclasses.dataclass(frozen=True)
class Level:
    kernels: str  # the engine's kernel build (kernel_library.REQUIRED_FLAGS)
    aten: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA
    mkl: str  # MKL_ENABLE_INSTRUCTIONS
    backend: str  # Debian's libggml-cpu-<backend>.so

    @property
    def environment(self) -> dict[str, str]:
        return {
            kernel_library.KERNELS_ENV: self.kernels,
            "ATEN_CPU_CAPABILITY": self.aten,
            "ONEDNN_MAX_CPU_ISA": self.onednn,
            "MKL_ENABLE_INSTRUCTIONS": self.mkl,
        }

    @property
    def backend_file(self) -> str:
        return f"libggml-cpu-{self.backend}.so"


LEVELS = {
    "avx2": Level("avx2", "avx2", "AVX2", "AVX2", "haswell"),
    "avx512": Level("avx512", "avx512", "AVX512_CORE", "AVX512", "skylakex"),
}


class LevelUnavailable(RuntimeError):
    """This machine cannot run the bench at the level asked for."""


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-level",
        choices=sorted(LEVELS),
        help="run both sides at this x86 level on this CPU: the engine's kernels, ATen, oneDNN "
        "and MKL, and llama.cpp's ggml backend of that level alone (tools/bench/cpu_level.py)",
    )


def backend_folder() -> pathlib.Path | None:
    """The folder Debian's libggml loads its CPU backends from (as `llama-bench --version`
    shows), or None where llama.cpp is not installed or names none."""
    binary = llama_cpp_peer.find_llama_bench()
    if binary is None:
        return None
    path = llama_cpp_peer.cpu_backend_path(binary)
    return path.parent if path else None


def _copy(folder: pathlib.Path, level: Level) -> pathlib.Path:
    """A folder holding a copy of the level's backend (a copy: the mount hides the original)."""
    source = folder / level.backend_file
    if not source.is_file():
        found = ", ".join(sorted(p.name for p in folder.glob("libggml-cpu-*.so"))) or "none"
        raise LevelUnavailable(f"{folder} holds no {level.backend_file} (it holds {found})")
    target = COPIES / level.backend
    copy = target / level.backend_file
    if not copy.is_file() or copy.stat().st_size != source.stat().st_size:
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".{level.backend_file}.partial"
        shutil.copyfile(source, partial)
        partial.replace(copy)  # whole or not at all
    return target


def _check_namespace() -> None:
    try:
        done = subprocess.run(
            ["unshare", "--mount", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LevelUnavailable(f"`unshare --mount` did not run: {error}") from None
    if done.returncode != 0:
        raise LevelUnavailable(
            f"`unshare --mount` failed ({done.stderr.strip() or done.returncode}): a private "
            "mount namespace takes root"
        )


def command(level_name: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `argv` (this process's) at the level."""
    level = LEVELS[level_name]
    missing = kernel_library.missing_flags(level.kernels)
    if missing:
        raise LevelUnavailable(f"this CPU lacks {' '.join(missing)} (/proc/cpuinfo)")
    environment = {**os.environ, **level.environment, ENV: level_name}
    folder = backend_folder()
    if folder is None:
        return argv, environment
    _check_namespace()
    copy = _copy(folder, level)
    mount = ["unshare", "--mount", "sh", "-c", _MOUNT_THEN_RUN, "sh", str(copy), str(folder)]
    return [*mount, *argv], environment


def enter(level_name: str | None, parser: argparse.ArgumentParser) -> str | None:
    """None without a level. Else, in the process that runs at it, the line that says so;
    in any other, runs this bench again at the level (exec: does not return), or exits 2
    naming what is missing."""
    if level_name is None:
        return None
    if os.environ.get(ENV) == level_name:
        level = LEVELS[level_name]
        settings = ", ".join(f"{k}={v}" for k, v in level.environment.items())
        return (
            f"cpu level {level_name}: this engine with {settings}; llama.cpp with "
            f"{level.backend_file} alone (this CPU's caches and memory)"
        )
    try:
        argv, environment = command(level_name, [sys.executable, *sys.orig_argv[1:]])
    except LevelUnavailable as error:
        parser.error(f"--cpu-level={level_name}: {error}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, environment)
    raise AssertionError("unreachable: exec returned")
