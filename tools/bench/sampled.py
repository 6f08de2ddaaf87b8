"""The bench's sampled decode: each engine mode greedy and sampled, beside llama.cpp doing both.

The engine samples through its one decoder (pipelines/llama3/sampling.py: the processed
distribution in float64, the draw keyed by the seed at each position); llama.cpp through
llama-server (goldens/engines/llama_server.py, the golden lanes' numerics flags, --threads as
the bench's), asked for the same number of new tokens with the same settings, its decode speed
read from its own timings (`predicted_per_second`: the generation after the prompt, sampling
included, HTTP not). Both sides ignore end-of-sequence so that every run decodes as many
tokens. Each side keeps its fastest of `repeats` alternating runs, as the greedy table does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import urllib.request
from collections.abc import Mapping, Sequence

DEFAULT_SAMPLER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
LLAMA_SERVER = "llama-server"


@dataclasses.dataclass
class Row:
    """One side's decode tokens/s, greedy and sampled (nan: not measured)."""

    name: str
    greedy: float = math.nan
    sampled: float = math.nan
    note: str = ""


def engine_decode_tps(engine, input_ids: Sequence[int], new_tokens: int, sampling=None) -> float:
    out = engine.generate(list(input_ids), new_tokens, stop_on_eos=False, sampling=sampling)
    return (len(out.tokens) - 1) / out.decode_seconds


def llama_server_missing(not_wanted: bool) -> str:
    """Why a bench runs no llama-server ('' when it does): --no-llama-server, or none on the
    PATH."""
    if not_wanted:
        return "llama-server: not run (--no-llama-server)"
    if shutil.which("llama-server") is None:
        return "llama-server: not on the PATH (tools/llama_cpp/install.sh installs Debian's)"
    return ""


class LlamaServerSide:
    """llama-server on the checkpoint (with `extra_args` of its command line), timed by its
    own report of each completion. The benches' one way to run the peer."""

    def __init__(self, gguf, threads: int, extra_args: Sequence[str] = ()) -> None:
        from goldens.engines.llama_server import LlamaServer

        threads_args = ("--threads", str(threads), "--threads-batch", str(threads))
        self.server = LlamaServer(gguf, extra_args=(*threads_args, *extra_args))
        self.server.start()
        self.root = self.server.url[: -len("/v1")]

    def completion(self, input_ids: Sequence[int], new_tokens: int, **fields) -> dict:
        """llama-server's native /completion answer (its `timings` too): `new_tokens` after
        `input_ids`, greedy, no prompt cache, end of sequence ignored, unless `fields` say
        otherwise."""
        body = {
            "prompt": [int(i) for i in input_ids],
            "n_predict": new_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
            **fields,
        }
        request = urllib.request.Request(
            self.root + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def decode_tps(self, input_ids: Sequence[int], new_tokens: int, sampler=None) -> float:
        fields = {**sampler, "seed": 0} if sampler else {}
        answer = self.completion(input_ids, new_tokens, **fields)
        return float(answer["timings"]["predicted_per_second"])

    def close(self) -> None:
        self.server.stop()


def measure(
    engines: Mapping[str, object],
    llama: LlamaServerSide | None,
    input_ids: Sequence[int],
    new_tokens: int,
    repeats: int,
    sampler: Mapping,
) -> list[Row]:
    """Every side greedy then sampled, `repeats` rounds in turn; each keeps its fastest."""
    from pipelines.llama3.sampling import SamplerSettings

    settings = SamplerSettings(seed=0, **sampler)
    rows = {name: Row(name) for name in engines}
    if llama is not None:
        rows[LLAMA_SERVER] = Row(LLAMA_SERVER)
    for _ in range(repeats):
        for name, engine in engines.items():
            row = rows[name]
            row.greedy = _max(row.greedy, engine_decode_tps(engine, input_ids, new_tokens))
            sampled = engine_decode_tps(engine, input_ids, new_tokens, settings)
            row.sampled = _max(row.sampled, sampled)
        if llama is not None:
            row = rows[LLAMA_SERVER]
            row.greedy = _max(row.greedy, llama.decode_tps(input_ids, new_tokens))
            row.sampled = _max(row.sampled, llama.decode_tps(input_ids, new_tokens, sampler))
    return list(rows.values())


def _max(a: float, b: float) -> float:
    return b if math.isnan(a) else max(a, b)


def _number(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "n/a"


def lines(rows: Sequence[Row], sampler: Mapping, repeats: int, skipped: str = "") -> list[str]:
    """The section the bench prints: a row per side, then each mode's sampled decode over
    llama-server's sampled decode."""
    settings = ", ".join(f"{k}={v}" for k, v in sampler.items())
    out = [
        f"sampled decode ({settings}, seed 0), tok/s, fastest of {repeats}:",
        f"  {'side':<14}{'greedy':>10}{'sampled':>10}{'sampled/greedy':>16}",
    ]
    for row in rows:
        out.append(
            f"  {row.name:<14}{_number(row.greedy):>10}{_number(row.sampled):>10}"
            f"{_number(row.sampled / row.greedy, 3):>16}"
        )
    peer = next((r for r in rows if r.name == LLAMA_SERVER), None)
    if peer is None:
        out.append(f"  {LLAMA_SERVER}: skipped: {skipped}")
        return out
    for row in rows:
        if row is not peer:
            out.append(
                f"{row.name}/{LLAMA_SERVER} sampled decode: "
                f"{_number(row.sampled / peer.sampled, 3)} (greedy "
                f"{_number(row.greedy / peer.greedy, 3)})"
            )
    return out
