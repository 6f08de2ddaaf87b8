"""Benchmark batched serving: many requests at once through the serving engine, per mode.

Batches of 1, 4 and 16 requests on SmolLM2 (Q4_1), each of --prompt-tokens prompt tokens and
--new-tokens generated ones, served by pipelines/llama3/serving.py (continuous batching over
the paged KV cache), by `Llama3Engine.generate` one request after another, and by llama.cpp's
`llama-batched-bench` (the same prompt and generated lengths, several sequences in one batch,
the same threads; tools/llama_cpp/install.sh installs it from Debian). Prints total tokens per
second (prompt and generated tokens over the wall time of the batch) of each, and the ratios
served/sequential and served/llama.cpp, all from this one run.

Example:
    bazel run //tools:bench_serving
    bazel run //tools:bench_serving -- --modes=quantized --batches=16 --threads=2

Every mode by default: eager, quantized, ggml (llama.cpp's numerics through the same serving
engine) and compiled (each block's dense parts as compiled graphs around the eager attention;
the warm-up batch compiles them, outside the timings).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time

import torch

from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine
from pipelines.llama3.serving import Request, ServingEngine

# Prompt words: request i takes LENGTHS[i % len(LENGTHS)] of them (mixed lengths).
TEXT = (
    "The history of the river valley begins with the first farmers who settled along its "
    "banks, built small villages of timber and clay, and learned to read the floods that "
    "came every spring and left the fields rich and dark for the summer crops"
)
WORDS = TEXT.split(" ")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_serving",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--modes",
        default="eager,quantized,ggml,compiled",
        help="comma-separated (default: %(default)s)",
    )
    parser.add_argument("--batches", default="1,4,16", help="requests per batch")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    return parser


def _prompts(engine: Llama3Engine, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each its own text (a rotation of WORDS)."""
    prompts = []
    for i in range(count):
        words = WORDS[i % len(WORDS) :] + WORDS[: i % len(WORDS)]
        ids = engine.tokenizer.encode(" ".join(words * 4))
        prompts.append(ids[:length])
    return prompts


def llama_cpp_batched(args: argparse.Namespace, batches: list[int]) -> dict[int, float] | str:
    """llama-batched-bench's total tokens/s per batch size, or why there are none."""
    binary = shutil.which("llama-batched-bench")
    if binary is None:
        return "llama-batched-bench not installed (tools/llama_cpp/install.sh)"
    context = max(batches) * (args.prompt_tokens + args.new_tokens) + 64
    command = [binary, "-m", str(smollm2_gguf()), "-c", str(context)]
    command += ["-npp", str(args.prompt_tokens), "-ntg", str(args.new_tokens)]
    command += ["-npl", ",".join(map(str, batches)), "-t", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        return f"llama-batched-bench failed (exit {done.returncode}): {done.stderr[-300:]}"
    totals = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[2]):
            totals[int(cells[2])] = float(cells[9])  # B, S t/s
    return totals


def _sequential(engine: Llama3Engine, prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        engine.generate(prompt, new, stop_on_eos=False)
    return time.perf_counter() - start


def _served(engine: Llama3Engine, prompts: list[list[int]], new: int) -> float:
    # Teacher-forced on token 0: every request generates exactly `new` tokens, no EOS stop,
    # as generate(stop_on_eos=False) does for the sequential baseline.
    requests = [Request(str(i), p, new, forced_tokens=[0] * new) for i, p in enumerate(prompts)]
    server = ServingEngine(engine, block_size=16)
    start = time.perf_counter()
    server.serve(requests)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    peer = llama_cpp_batched(args, batches)
    print(
        f"SmolLM2 Q4_1, {args.threads} threads, {args.prompt_tokens} prompt + "
        f"{args.new_tokens} new tokens per request; total tokens/s"
    )
    print(
        f"{'mode':<10} {'batch':>5} {'served':>8} {'sequential':>11} {'llama.cpp':>10} "
        f"{'served/sequential':>18} {'served/llama.cpp':>17}"
    )
    for mode in args.modes.split(","):
        engine = Llama3Engine.from_gguf(smollm2_gguf(), mode=mode)
        with torch.inference_mode():
            _served(engine, _prompts(engine, 2, 8), 2)  # warm up both paths
            _served(engine, _prompts(engine, 1, 8), 2)  # (one row: a graph of its own)
            _sequential(engine, _prompts(engine, 1, 8), 2)
            for batch in batches:
                prompts = _prompts(engine, batch, args.prompt_tokens)
                total = batch * (args.prompt_tokens + args.new_tokens)
                sequential = total / _sequential(engine, prompts, args.new_tokens)
                theirs = peer.get(batch) if isinstance(peer, dict) else None
                served = total / _served(engine, prompts, args.new_tokens)
                ratio = f"{served / theirs:17.2f}" if theirs else f"{'-':>17}"
                print(
                    f"{mode:<10} {batch:>5} {served:>8.1f} {sequential:>11.1f} "
                    f"{theirs or float('nan'):>10.1f} {served / sequential:>18.2f} {ratio}"
                )
    if isinstance(peer, str):
        print(f"llama.cpp: {peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
