"""The engine's own HTTP server judged by the goldens, as llama-server is: through the OpenAI
adapter (`golden_check --engine=openai`).

`python -m pipelines.llama3.server` (what `./bazelw run //pipelines/llama3:serve` runs) is
started on a free loopback port for one checkpoint and mode and stopped after (SIGTERM: it
must exit 0); golden_check then sends every golden case's teacher-forced prefixes, 16 to a
request, and judges the answers' top-k log-probabilities under the `cpu` tolerance column, the
one this engine's own lanes use: the HTTP layer may add no error of its own. Served:
the float32 file in the eager mode (own and torch goldens) and the q4_k file in the ggml mode
(the ggml goldens). Every checkpoint mutation, served, must FAIL the short cases.
"""

from __future__ import annotations

import contextlib

import pytest

from harness.llama3 import checkpoint_mutations
from harness.llama3.variants import variants
from pipelines.llama3.server import ServerProcess
from tools.golden_check import golden_check

TINY = {v.encoding: v for v in variants("tinyllama")}


@contextlib.contextmanager
def _served(gguf, mode: str = "eager"):
    """The server on `gguf` in `mode`: its OpenAI base URL; stopped (and checked) after."""
    with ServerProcess(gguf, mode, "--threads=1") as server:  # RuntimeError: did not start/stop
        yield server.url
    assert server.code == 0, f"the server exited {server.code}: {server.stderr}"


def _check(url: str, checkpoint: str, tmp_path, *more: str) -> int:
    argv = ["--engine=openai", f"--url={url}", f"--checkpoint={checkpoint}", "--tolerance=cpu"]
    return golden_check.main([*argv, f"--report-dir={tmp_path}", *more])


@pytest.mark.parametrize(
    ("encoding", "mode", "golden"),
    [("float32", "eager", "both"), ("q4_k", "ggml", "ggml")],
    ids=["float32-eager", "q4_k-ggml"],
)
def test_the_served_engine_passes_its_goldens_over_http(encoding, mode, golden, tmp_path, capsys):
    with _served(TINY[encoding].path, mode) as url:
        code = _check(url, f"tinyllama-{encoding}", tmp_path, f"--golden={golden}")
    printed = capsys.readouterr().out
    print(printed)
    assert code == 0, printed
    assert "verdict: PASS" in printed


@pytest.mark.parametrize("mutation", checkpoint_mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_checkpoint_mutation_served_fails(mutation, tmp_path, capsys) -> None:
    copy = checkpoint_mutations.mutated_copy(TINY["float32"].path, mutation, tmp_path)
    with _served(copy) as url:
        code = _check(url, "tinyllama-float32", tmp_path, "--lane=short", "--golden=own")
    printed = capsys.readouterr().out
    print(f"{mutation.name} ({mutation.what}):\n{printed}")
    assert code == 1, printed
    assert "verdict: FAIL" in printed
