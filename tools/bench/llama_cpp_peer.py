"""llama.cpp as a benchmark peer, when its Python binding `llama_cpp` can be imported.

Optional: never in the lock or CI. It builds from source on this kind of machine (10-20
minutes on 2 cores), into a folder of its own:
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX=OFF" pip install --no-deps \\
        --target ~/.cache/llama-goldens/llama_cpp_py llama-cpp-python==0.3.36 diskcache
and the bench finds it there (or in $LLAMA_CPP_PYTHON, or anywhere on sys.path). GGML_AMX=OFF:
on these VMs its AMX code path dies with "Illegal instruction" at the first Q4 decode.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np

DEFAULT_FOLDER = pathlib.Path("~/.cache/llama-goldens/llama_cpp_py").expanduser()
FOLDER_ENV = "LLAMA_CPP_PYTHON"


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


class LlamaCppPeer:
    """Greedy decoding with llama.cpp over the same token ids the engine gets."""

    def __init__(self, llama_cpp, gguf_path: pathlib.Path, threads: int, context: int) -> None:
        self._llama_cpp = llama_cpp
        start = time.perf_counter()
        self._model = llama_cpp.Llama(
            str(gguf_path), n_threads=threads, n_ctx=context, verbose=False
        )
        self.load_seconds = time.perf_counter() - start
        self._vocab = self._model.n_vocab()

    def _last_logits(self) -> np.ndarray:
        logits = self._llama_cpp.llama_get_logits_ith(self._model._ctx.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self._vocab,))

    def greedy(self, input_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(tokens, prefill seconds, decode seconds), timed like the engine's generate."""
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
