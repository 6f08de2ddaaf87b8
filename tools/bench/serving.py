"""Benchmark batched serving: many requests at once through the serving engine, per mode.

Batches of 1, 4 and 16 requests on SmolLM2 (Q4_1), each of --prompt-tokens prompt tokens and
--new-tokens generated ones, served by pipelines/llama3/serving.py (continuous batching over
the paged KV cache), by `Llama3Engine.generate` one request after another, and by llama.cpp's
`llama-batched-bench` (the same prompt and generated lengths, several sequences in one batch,
the same forwards: the prefill and --new-tokens - 1 decode steps, the same threads;
tools/llama_cpp/install.sh installs it from Debian), by default and with --no-repack
(`no-repack`: the weights as the file holds them, multiplied by the per-block dot products
the ggml mode reproduces; by default llama.cpp repacks them at load for the CPU's kernels,
on a CPU with AMX its batched products' tiles). Prints total tokens per second
(prompt and generated tokens over the wall time of the batch) of each, and the ratios
served/sequential, served/llama.cpp and served/no-repack, all from this one run; and the
serving engine's own cost per scheduler step (`sched ms/step`: the wall time outside the
model's forward, over the steps: admission, block tables, prefix hashing, the decoder).

Then the HTTP servers (`--clients`, default 16): this engine's server (pipelines/llama3/
server.py, in --server-modes, a process of its own as `serve` runs it) and llama.cpp's
`llama-server` (--parallel CLIENTS, its default f16 KV cache, the same threads), each on a free
loopback port, answer CLIENTS concurrent clients, one completion each (--new-tokens greedy
tokens, no EOS stop), in two rounds after a warm-up round of other prompts: `new prompts`
(prompts neither server has seen: every prompt computed in full) and `repeated prompts` (the
same prompts again: each server's prompt cache may serve them; llama-server keeps a slot's
tokens and reuses all but the last, this engine reuses the prompt's cached KV blocks and, a
prompt found whole, copies its last block but the last position), with total tokens/s,
p50/p99 latency and the ratio server/llama-server per round.

Example:
    bazel run //tools:bench_serving
    bazel run //tools:bench_serving -- --modes=quantized --batches=16 --threads=2
    bazel run //tools:bench_serving -- --modes= --clients=16 --server-modes=ggml

Every mode by default: eager, quantized, ggml (llama.cpp's numerics through the same serving
engine) and compiled (each block's dense parts as compiled graphs around the eager attention;
the warm-up batch compiles them, outside the timings).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

import torch

from goldens.cli_files import at_least
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.engine import MODES
from pipelines.llama3.serving import Request, ServingEngine
from tools.bench import cpu_level
from tools.bench.llama_cpp_peer import LlamaBenchError, version_and_backend

# Prompt words: request i takes LENGTHS[i % len(LENGTHS)] of them (mixed lengths).
TEXT = (
    "The history of the river valley begins with the first farmers who settled along its "
    "banks, built small villages of timber and clay, and learned to read the floods that "
    "came every spring and left the fields rich and dark for the summer crops"
)
WORDS = TEXT.split(" ")
CONTEXT = 8192  # SmolLM2-135M's context length (the pinned file's llama.context_length)
SERVER_MARGIN = 16  # the server rows' --max-context: a request's tokens and this many more


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_serving",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default="eager,quantized,ggml,compiled",
        help="comma-separated, of " + ", ".join(MODES) + " (default: %(default)s; empty: none)",
    )
    parser.add_argument(
        "--batches", type=_batches, default="1,4,16", help="requests per batch, comma-separated"
    )
    parser.add_argument(
        "--prompt-tokens", type=at_least(1), default=32, help="prompt tokens per request"
    )
    parser.add_argument(
        "--new-tokens", type=at_least(2), default=16, help="generated per request (at least 2)"
    )
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch threads (default: 2)")
    parser.add_argument(
        "--clients",
        type=int,
        default=16,
        help="concurrent HTTP clients, at most 22 (0: no server rows)",
    )
    parser.add_argument(
        "--server-modes",
        type=_modes,
        default="ggml,quantized",
        help="this engine's server, per mode, comma-separated (empty: none)",
    )
    cpu_level.add_argument(parser)
    return parser


def _modes(text: str) -> list[str]:
    """An argparse `type`: comma-separated engine modes, each one of MODES (an unknown one
    failed only when its rows came, after minutes of the others); empty means none."""
    modes = [mode for mode in text.split(",") if mode]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{','.join(unknown)} is no mode; choose from {', '.join(MODES)}"
        )
    return modes


def _batches(text: str) -> list[int]:
    """An argparse `type`: comma-separated requests per batch, each a whole number of at least
    1 (--batches=-4 printed rows of a batch of -4; --batches=x stopped in a traceback)."""
    try:
        batches = [int(batch) for batch in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give whole numbers of at least 1, comma-separated (e.g. 1,4,16)"
        )
    return batches


def _prompts(engine: Llama3Engine, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each its own text (a rotation of WORDS,
    repeated as often as the length takes: 4 times gave 184 tokens, and longer prompts were
    cut to that silently)."""
    prompts = []
    for i in range(count):
        words = WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]
        repeats = 4
        while len(ids := engine.tokenizer.encode(" ".join(words * repeats))) < length:
            repeats *= 2
        prompts.append(ids[:length])
    return prompts


def llama_cpp_batched(
    args: argparse.Namespace, batches: list[int], repack: bool = True
) -> tuple[dict[int, float], str]:
    """llama-batched-bench's total tokens/s per batch size, and a line saying why there are
    none (empty when there are). Without `repack` (--no-repack): the weights as the file holds
    them, products by the per-block dot products the ggml mode reproduces, not the kernels of
    weights repacked at load."""
    binary = shutil.which("llama-batched-bench")
    if binary is None:
        return {}, "llama-batched-bench not installed (tools/llama_cpp/install.sh)"
    context = max(batches) * (args.prompt_tokens + args.new_tokens) + 64
    command = [binary, "-m", str(smollm2_gguf()), "-c", str(context)]
    # the same forwards as the engine's: the prefill (its logits choose the first new token),
    # then --new-tokens - 1 decode steps (-ntg counts decode steps after the prefill)
    command += ["-npp", str(args.prompt_tokens), "-ntg", str(args.new_tokens - 1)]
    command += ["-npl", ",".join(map(str, batches)), "-t", str(args.threads)]
    command += [] if repack else ["--no-repack"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        return {}, f"llama-batched-bench failed (exit {done.returncode}): {done.stderr[-300:]}"
    return batched_totals(done.stdout, args.prompt_tokens + args.new_tokens), ""


def batched_totals(table: str, tokens: int) -> dict[int, float]:
    """Per batch size B, B x `tokens` (a request's prompt and new tokens, as the engine's rows
    count them) over the batch's wall time, from llama-batched-bench's table (| PP | TG | B |
    N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |): its own S t/s counts the
    TG decode steps' tokens and not the one the prefill's logits choose."""
    totals = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
            batch = int(cells[2])
            totals[batch] = batch * tokens / float(cells[8])  # B x tokens / T s
    return totals


def _ggml_backend() -> str | None:
    """The CPU backend Debian's ggml loads on this machine, as llama-bench names it (Debian's
    build picks one per CPU: on a CPU with AMX, `sapphirerapids`, whose batched products run
    on AMX tiles); llama-batched-bench names none unless verbose."""
    binary = shutil.which("llama-bench")
    if binary is None:
        return None
    try:
        return version_and_backend(binary)[1]
    except LlamaBenchError:
        return None


def _sequential(engine: Llama3Engine, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        engine.generate(prompt, new, stop_on_eos=False)
    return time.perf_counter() - start


def _served(engine: Llama3Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(wall seconds, scheduler seconds per step) of serving `prompts`: the scheduler's
    share is the wall time outside the model's forward (`forward_paged`), per step."""
    # Teacher-forced on token 0: every request generates exactly `new` tokens, no EOS stop,
    # as generate(stop_on_eos=False) does for the sequential baseline.
    requests = [Request(str(i), p, new, forced_tokens=[0] * new) for i, p in enumerate(prompts)]
    server = ServingEngine(engine, block_size=16)
    model, in_forward = engine.model, [0.0]

    def timed_forward(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return type(model).forward_paged(model, *args, **kwargs)
        finally:
            in_forward[0] += time.perf_counter() - begin

    model.forward_paged = timed_forward  # an instance attribute, removed after
    try:
        start = time.perf_counter()
        server.serve(requests)
        seconds = time.perf_counter() - start
    finally:
        del model.forward_paged
    return seconds, (seconds - in_forward[0]) / max(server.steps, 1)


def _complete(url: str, prompt: list[int], new: int) -> float:
    """One greedy completion of `new` tokens over HTTP; its latency in seconds."""
    parts = urllib.parse.urlsplit(url)
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        connection.request("POST", parts.path + "/completions", json.dumps(body).encode())
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"{url} answered HTTP {response.status}: {str(answer)[:300]}")
    generated = answer["usage"]["completion_tokens"]
    if generated != new:
        raise RuntimeError(f"{url} generated {generated} tokens, not {new}")
    return time.perf_counter() - start


def _clients(url: str, prompts: list[list[int]], new: int) -> tuple[float, list[float]]:
    """Every prompt by a client thread of its own, all at once: wall seconds, latencies."""
    latencies: list[float] = [0.0] * len(prompts)
    errors: list[Exception] = []

    def client(i: int) -> None:
        try:
            latencies[i] = _complete(url, prompts[i], new)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed: {errors[0]}")
    return time.perf_counter() - start, latencies


ROUNDS = ("new prompts", "repeated prompts")


def _server_rows(name: str, url: str, rounds: dict[str, list[list[int]]], args) -> dict:
    """Total tokens/s of each round (ROUNDS), after a warm-up round of other prompts."""
    _clients(url, rounds["warm-up"], args.new_tokens)  # first requests, caches, threads
    totals = {}
    for label in ROUNDS:
        prompts = rounds[label]
        seconds, latencies = _clients(url, prompts, args.new_tokens)
        totals[label] = len(prompts) * (args.prompt_tokens + args.new_tokens) / seconds
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(
            f"{name:<24} {label:<17} {len(prompts):>7} {totals[label]:>8.1f} "
            f"{statistics.median(latencies) * 1e3:>8.0f} {p99 * 1e3:>8.0f}"
        )
    return totals


@contextlib.contextmanager
def _own_server(mode: str, args: argparse.Namespace):
    """This engine's server in a process of its own, as `serve` runs it (and as llama-server
    runs): its OpenAI base URL; stopped by SIGTERM after."""
    from pipelines.llama3.server import ServerProcess

    context = args.prompt_tokens + args.new_tokens + SERVER_MARGIN
    options = (f"--threads={args.threads}", f"--max-batch={args.clients}")
    with ServerProcess(smollm2_gguf(), mode, *options, f"--max-context={context}") as server:
        yield server.url


def servers(args: argparse.Namespace) -> None:
    """The HTTP rows: this engine's server per mode, then llama-server, and the ratios."""
    from goldens.engines.base import EngineError
    from goldens.engines.llama_server import LlamaServer

    engine = Llama3Engine.from_gguf(smollm2_gguf(), mode="eager")
    # Prompts are rotations of WORDS: the warm-up's start at other words than the measured
    # ones, so no server's cache holds a measured prompt before its `new prompts` round.
    both = _prompts(engine, 2 * args.clients, args.prompt_tokens)
    fresh = both[: args.clients]
    rounds = {"warm-up": both[args.clients :], ROUNDS[0]: fresh, ROUNDS[1]: fresh}
    print(
        f"\nHTTP servers, {args.clients} concurrent clients, one completion each "
        f"({args.prompt_tokens} prompt + {args.new_tokens} new tokens), {args.threads} threads"
    )
    print(f"{'server':<24} {'round':<17} {'clients':>7} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    ours = {}
    for mode in args.server_modes:
        with _own_server(mode, args) as url:
            ours[mode] = _server_rows(f"this engine ({mode})", url, rounds, args)
    theirs = None
    if shutil.which("llama-server") is None:
        print("llama-server: not installed (tools/llama_cpp/install.sh)")
    else:
        slots = args.clients
        extra = ("--threads", str(args.threads), "--threads-batch", str(args.threads))
        extra += ("--parallel", str(slots), "--ctx-size", str(slots * 256))
        extra += ("--cache-type-k", "f16", "--cache-type-v", "f16")
        try:
            with LlamaServer(smollm2_gguf(), extra_args=extra) as peer:
                theirs = _server_rows("llama-server", peer.url, rounds, args)
        except EngineError as error:
            print(f"llama-server: {error}")
    if theirs:
        for mode, totals in ours.items():
            ratios = ", ".join(f"{label} {totals[label] / theirs[label]:.2f}" for label in ROUNDS)
            print(f"this engine ({mode}) / llama-server: {ratios}")


def batched(args: argparse.Namespace, modes: list[str]) -> None:
    """The batch rows: each mode served, sequential, and llama-batched-bench."""
    batches = args.batches
    totals, why = llama_cpp_batched(args, batches)
    plain, _ = llama_cpp_batched(args, batches, repack=False)
    peer_line = why or f"llama-batched-bench, {_ggml_backend() or 'backend not printed'}"
    print(
        f"SmolLM2 Q4_1, {args.threads} threads, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens per request; total tokens/s"
    )
    print(
        f"{'mode':<10} {'batch':>5} {'served':>8} {'sequential':>11} {'llama.cpp':>10} "
        f"{'no-repack':>10} {'served/sequential':>18} {'served/llama.cpp':>17} "
        f"{'served/no-repack':>17} {'sched ms/step':>14}"
    )
    for mode in modes:
        engine = Llama3Engine.from_gguf(smollm2_gguf(), mode=mode)
        with torch.inference_mode():
            _served(engine, _prompts(engine, 2, 8), 2)  # warm up both paths
            _served(engine, _prompts(engine, 1, 8), 2)  # (one row: a graph of its own)
            _sequential(engine, _prompts(engine, 1, 8), 2)
            for batch in batches:
                prompts = _prompts(engine, batch, args.prompt_tokens)
                total = batch * (args.prompt_tokens + args.new_tokens)
                sequential = total / _sequential(engine, prompts, args.new_tokens)
                theirs, unpacked = totals.get(batch), plain.get(batch)
                seconds, scheduler = _served(engine, prompts, args.new_tokens)
                served = total / seconds
                ratios = [f"{served / t:17.2f}" if t else f"{'-':>17}" for t in (theirs, unpacked)]
                print(
                    f"{mode:<10} {batch:>5} {served:>8.1f} {sequential:>11.1f} "
                    f"{theirs or float('nan'):>10.1f} {unpacked or float('nan'):>10.1f} "
                    f"{served / sequential:>18.2f} {ratios[0]} {ratios[1]} {scheduler * 1e3:>14.2f}"
                )
    print(f"llama.cpp: {peer_line}; no-repack: the same with --no-repack")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    level_line = cpu_level.enter(args.cpu_level, parser)  # runs the bench again at the level
    if level_line:
        print(level_line)
    if not 0 <= args.clients <= len(WORDS) // 2:  # the server rows' prompts: rotations of WORDS
        parser.error(
            f"--clients={args.clients}: every client and its warm-up twin get a prompt of "
            f"their own, rotations of a {len(WORDS)}-word text: pass 0 to "
            f"{len(WORDS) // 2} (0: no server rows)"
        )
    if args.prompt_tokens + args.new_tokens > CONTEXT - SERVER_MARGIN:
        parser.error(
            f"--prompt-tokens={args.prompt_tokens} and --new-tokens={args.new_tokens} do not fit "
            f"SmolLM2's context of {CONTEXT} tokens: give at most {CONTEXT - SERVER_MARGIN} in "
            f"all (the server rows keep {SERVER_MARGIN} more)"
        )
    torch.set_num_threads(args.threads)
    if args.modes:
        batched(args, args.modes)
    if args.clients:
        servers(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
