"""llama.cpp as a benchmark peer: its Python binding when that imports, else `llama-bench`.

The bench takes the first of these that it finds:

1. The binding `llama_cpp` (llama-cpp-python), `LlamaCppPeer`: greedy decoding over the
   bench's own prompt token ids in the bench's process, so its tokens are compared with the
   engine's and its load is timed. Optional: never in the lock or CI. It builds from source on
   this kind of machine (10-20 minutes on 2 cores), into a folder of its own:
       CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX=OFF" pip install --no-deps \\
           --target ~/.cache/llama-goldens/llama_cpp_py llama-cpp-python==0.3.36 diskcache
   and the bench finds it there (or in $LLAMA_CPP_PYTHON, or anywhere on sys.path).
   GGML_AMX=OFF: on these VMs its AMX code path dies with "Illegal instruction" at the first
   Q4 decode.
2. `llama-bench` on the PATH, `LlamaBenchPeer`: Debian's llama.cpp command-line tools, which
   tools/llama_cpp/install.sh installs (CI has them). Each call runs it once as a subprocess,
   `-p PROMPT_TOKENS -n NEW_TOKENS-1 -r 1` on the same GGUF and thread count, CPU only
   (`-ngl 0`), flash attention off (`-fa 0`, as the binding's default), and reads its JSON:
   prefill seconds are prompt tokens / its pp tokens/s, decode seconds are the decode steps
   / its tg tokens/s. What differs from the binding, and why the bench says so:
   - it times its own token ids (random ones of the prompt's length, then generated ones it
     feeds back) and returns no tokens, so it takes no part in token comparisons;
   - its tg test decodes from an empty cache, where the engine's decode follows the prompt;
     at the bench's lengths (17 + 32 positions) attention is a sliver of a step: tg31 at
     depth 0 and at depth 17 (`-d 17`) measured 108 and 110 tokens/s, within run-to-run noise;
   - every call is a fresh process that warms up untimed before its timed tests (llama-bench's
     default; with `--no-warmup` SmolLM2's first prompt ran at 159 tokens/s, warm at 240);
   - it reports no load time, and the process's wall time minus the tests is not load alone
     (warm-up, backend loading, process start), so load is not measured (nan; the bench
     prints "n/a", the record null).

Neither installed: the bench skips llama.cpp with one line saying why.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any

DEFAULT_FOLDER = pathlib.Path("~/.cache/llama-goldens/llama_cpp_py").expanduser()
FOLDER_ENV = "LLAMA_CPP_PYTHON"
LLAMA_BENCH = "llama-bench"
LLAMA_BENCH_TIMEOUT_S = 600  # one call: a large GGUF's prompt and decode at one thread
INSTALL_HINT = "tools/llama_cpp/install.sh installs it"


def import_llama_cpp():
    """The `llama_cpp` module, or None with the reason (a line for the bench's output)."""
    for folder in (os.environ.get(FOLDER_ENV), str(DEFAULT_FOLDER)):
        if folder and pathlib.Path(folder).is_dir() and folder not in sys.path:
            sys.path.append(folder)
    try:
        import llama_cpp
    except ImportError as error:
        return None, f"llama_cpp not importable ({error}); see tools/bench/llama_cpp_peer.py"
    return llama_cpp, f"llama-cpp-python {llama_cpp.__version__}"


def find_llama_bench() -> str | None:
    """The path of `llama-bench` on the PATH, or None."""
    return shutil.which(LLAMA_BENCH)


class LlamaCppPeer:
    """Greedy decoding with llama.cpp over the same token ids the engine gets."""

    compares_tokens = True

    def __init__(self, llama_cpp, gguf_path: pathlib.Path, threads: int, context: int) -> None:
        self._llama_cpp = llama_cpp
        start = time.perf_counter()
        self._model = llama_cpp.Llama(
            str(gguf_path), n_threads=threads, n_ctx=context, verbose=False
        )
        self.load_seconds = time.perf_counter() - start
        self._vocab = self._model.n_vocab()

    def describe(self) -> str:
        return f"llama-cpp-python {self._llama_cpp.__version__} (Python binding, in process)"

    def _last_logits(self):
        import numpy as np

        logits = self._llama_cpp.llama_get_logits_ith(self._model._ctx.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self._vocab,))

    def greedy(self, input_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(tokens, prefill seconds, decode seconds), timed like the engine's generate."""
        import numpy as np

        self._model.reset()
        start = time.perf_counter()
        self._model.eval(input_ids)
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        tokens = [int(np.argmax(self._last_logits()))]
        for _ in range(new_tokens - 1):
            self._model.eval([tokens[-1]])
            tokens.append(int(np.argmax(self._last_logits())))
        return tokens, prefill_seconds, time.perf_counter() - start


class LlamaBenchError(RuntimeError):
    """llama-bench did not run, failed, or printed what this module cannot read."""


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(nothing)"


def loaded_backend(stderr: str) -> str | None:
    """The ggml backend library a llama.cpp tool loaded, from its `load_backend:` lines on stderr.

    Debian's packages load one CPU variant per CPU (libggml-cpu-icelake.so, -haswell, ...);
    a static build prints no such line.
    """
    found = _loaded_backends(stderr)
    return ", ".join(f"{kind} {path.name}" for kind, path in found) or None


def _loaded_backends(stderr: str) -> list[tuple[str, pathlib.Path]]:
    """(kind, library file) of each `load_backend: loaded KIND backend from FILE` line."""
    found = re.findall(r"loaded (\S+) backend from (\S+)", stderr)
    return [(kind, pathlib.Path(path)) for kind, path in found]


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LlamaBenchError(f"{' '.join(command)}: {error}") from None
    if done.returncode != 0:
        raise LlamaBenchError(f"{' '.join(command)} exited {done.returncode}: {_tail(done.stderr)}")
    return done


def cpu_backend_path(binary: str) -> pathlib.Path | None:
    """The file of the CPU backend `binary`'s libggml loads on this machine (`--version`), or
    None where it names none (a static build)."""
    stderr = _run([binary, "--version"], 30).stderr
    found = [path for kind, path in _loaded_backends(stderr) if kind == "CPU"]
    return found[-1] if found else None


def version_and_backend(binary: str) -> tuple[str | None, str | None]:
    """llama-bench's version and the CPU backend its libggml loads here (`--version`): the
    backend every tool of the same Debian build loads on this machine, llama-batched-bench's
    too, which names none unless verbose."""
    done = _run([binary, "--version"], 30)
    # "version: 0.7.0 (build 11669, commit Debian)" on stdout or stderr, by version.
    match = re.search(r"version: (\S+)", done.stdout + done.stderr)
    return (match.group(1) if match else None), loaded_backend(done.stderr)


class LlamaBenchPeer:
    """llama.cpp's prefill and decode times from one `llama-bench` run per call.

    No tokens (the bench leaves it out of token comparisons) and no load time (nan): see the
    module docstring.
    """

    compares_tokens = False
    NO_TOKENS = "llama-bench times its own random token ids and returns no tokens"

    def __init__(
        self,
        binary: str,
        gguf_path: pathlib.Path,
        threads: int,
        timeout_s: float = LLAMA_BENCH_TIMEOUT_S,
        repack: bool = True,
    ) -> None:
        self.binary = binary
        self.gguf_path = gguf_path
        self.threads = threads
        # False: `--repack 0`, the weights as the file holds them (by default llama.cpp
        # repacks them at load for the CPU's kernels: AMX tiles on a CPU that has them)
        self.repack = repack
        self.timeout_s = timeout_s
        self.load_seconds = math.nan  # not reported, not measured
        self.version, self.backend = version_and_backend(binary)
        self.build: dict[str, Any] = {}  # build_commit, build_number... of the last JSON

    def without_repack(self) -> LlamaBenchPeer:
        """The same llama-bench with `--repack 0`, without probing its version again."""
        peer = copy.copy(self)
        peer.repack, peer.build = False, {}
        return peer

    def command(self, prompt_tokens: int, decode_steps: int) -> list[str]:
        """The llama-bench command line for one prefill of `prompt_tokens` and `decode_steps`."""
        return [
            self.binary,
            "-m",
            str(self.gguf_path),
            "-t",
            str(self.threads),
            "-p",
            str(prompt_tokens),
            "-n",
            str(decode_steps),
            "-r",
            "1",
            "-ngl",
            "0",
            "-fa",
            "0",
            "--repack",
            "1" if self.repack else "0",
            "-o",
            "json",
        ]

    def measure(self, prompt_tokens: int, decode_steps: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) from one llama-bench run."""
        command = self.command(prompt_tokens, decode_steps)
        done = _run(command, self.timeout_s)
        self.backend = loaded_backend(done.stderr) or self.backend
        try:
            tests = json.loads(done.stdout)
        except json.JSONDecodeError as error:
            raise LlamaBenchError(
                f"{' '.join(command)} printed no JSON ({error}): {_tail(done.stdout)}"
            ) from None
        if not isinstance(tests, list) or not all(isinstance(test, dict) for test in tests):
            raise LlamaBenchError(f"{' '.join(command)} printed {tests!r:.200}, not a test list")
        self.build = {
            key: tests[0][key]
            for key in ("build_commit", "build_number", "backends", "cpu_info")
            if tests and key in tests[0]
        }
        prefill = self._tokens_per_second(tests, prompt_tokens, 0, command)
        decode = self._tokens_per_second(tests, 0, decode_steps, command)
        return prompt_tokens / prefill, decode_steps / decode

    @staticmethod
    def _tokens_per_second(tests: list[dict], n_prompt: int, n_gen: int, command) -> float:
        for test in tests:
            if test.get("n_prompt") == n_prompt and test.get("n_gen") == n_gen:
                value = test.get("avg_ts")
                if isinstance(value, int | float) and math.isfinite(value) and value > 0:
                    return float(value)
                raise LlamaBenchError(f"{' '.join(command)}: avg_ts {value!r} in {test!r:.200}")
        raise LlamaBenchError(
            f"{' '.join(command)}: no test with n_prompt {n_prompt} and n_gen {n_gen} in its JSON"
        )

    def greedy(self, input_ids: list[int], new_tokens: int) -> tuple[None, float, float]:
        """(None, prefill seconds, decode seconds) for a prompt of len(input_ids) tokens and
        new_tokens - 1 decode steps: the shape of the other sides' greedy, without tokens."""
        return None, *self.measure(len(input_ids), new_tokens - 1)

    def describe(self) -> str:
        """Which llama.cpp this is: binary, version, build (from its JSON), backend."""
        build = self.build
        parts = [f"llama-bench {self.binary}"]
        if self.version:
            parts.append(f"version {self.version}")
        if build:
            parts.append(
                f"build_number {build.get('build_number')}, "
                f"build_commit {build.get('build_commit')}"
            )
        parts.append(f"backend {self.backend}" if self.backend else "backend not reported")
        parts += [] if self.repack else ["--repack 0"]
        return ", ".join(parts)
