"""Benchmark batched serving: many requests at once through the serving engine, per mode.

Batches of 1, 4 and 16 greedy requests of mixed prompt lengths on SmolLM2 (Q4_1), each
generating --new-tokens tokens, served by pipelines/llama3/serving.py (continuous batching
over the paged KV cache) and, as the baseline in the same run, by `Llama3Engine.generate`
one request after another. Prints total tokens per second (prompt and generated tokens over
the wall time of the batch) and generated tokens per second for each, and the ratio
served/sequential. llama.cpp's batched serving (several sequence ids in one llama_batch) is
the peer the issue names; it is not wired in here (llama-cpp-python is not in the lock and
builds from source: tools/bench/llama_cpp_peer.py).

Example:
    bazel run //tools:bench_serving
    bazel run //tools:bench_serving -- --modes=quantized --batches=16 --threads=2
"""

from __future__ import annotations

import argparse
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
LENGTHS = (4, 12, 24, 40)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_serving",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", default="eager,quantized", help="comma-separated")
    parser.add_argument("--batches", default="1,4,16", help="requests per batch")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated per request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    return parser


def _prompts(engine: Llama3Engine, count: int) -> list[list[int]]:
    return [
        engine.tokenizer.encode(" ".join(WORDS[: LENGTHS[i % len(LENGTHS)]])) for i in range(count)
    ]


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
    print(
        f"SmolLM2 Q4_1, {args.threads} threads, {args.new_tokens} new tokens per request, "
        f"prompts of {'/'.join(map(str, LENGTHS))} words"
    )
    print(
        f"{'mode':<10} {'batch':>5} {'tokens':>7} {'served tok/s':>13} {'gen tok/s':>10} "
        f"{'sequential tok/s':>17} {'served/sequential':>18}"
    )
    for mode in args.modes.split(","):
        engine = Llama3Engine.from_gguf(smollm2_gguf(), mode=mode)
        with torch.inference_mode():
            _served(engine, _prompts(engine, 2), 2)  # warm up both paths
            _sequential(engine, _prompts(engine, 1), 2)
            for batch in batches:
                prompts = _prompts(engine, batch)
                total = sum(len(p) for p in prompts) + batch * args.new_tokens
                served = _served(engine, prompts, args.new_tokens)
                sequential = _sequential(engine, prompts, args.new_tokens)
                print(
                    f"{mode:<10} {batch:>5} {total:>7} {total / served:>13.1f} "
                    f"{batch * args.new_tokens / served:>10.1f} {total / sequential:>17.1f} "
                    f"{sequential / served:>18.2f}"
                )
    print("llama.cpp batched: not measured (see this command's --help)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
