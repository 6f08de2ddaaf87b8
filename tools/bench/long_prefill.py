"""Benchmark the prefill of each checkpoint's longest golden case against transformers.

The long golden cases (goldens/cases.yaml) prefill thousands of tokens in one call
and run the LM head at the recorded prompt positions only. This prints, per checkpoint, the
prefill seconds, tokens/s and peak resident memory of the engine (eager and quantized) and of
transformers on the same token ids (its own model on the same GGUF, the head at the same
positions), and the engine/transformers ratio. Each measurement runs in a fresh process, so
its peak RSS is its own (loading included); prefill time is the fastest of --repeats.

Example:
    bazel run //tools:bench_long_prefill
    bazel run //tools:bench_long_prefill -- --models=smollm2 --repeats=3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers never reaches a hub

SIDES = ("eager", "quantized", "transformers")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_long_prefill",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default="tinyllama,smollm2", help="comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=2, help="prefills per side (default: 2)")
    return parser


def measure(side: str, model: str, encoding: str, threads: int, repeats: int) -> dict:
    """In a fresh process: load `side` for the variant, prefill its longest case `repeats`
    times; the fastest prefill, tokens and the process's peak RSS."""
    import torch

    from goldens.record import case_specs
    from harness.llama3.variants import variants
    from pipelines.llama3 import Llama3Engine

    torch.set_num_threads(threads)
    (variant,) = variants(model, encoding)
    spec = max(case_specs(model), key=lambda s: len(s.prompt))
    engine = Llama3Engine.from_gguf(
        variant.path, dtype=variant.dtype, mode="eager" if side == "transformers" else side
    )
    ids = engine.tokenizer.encode(spec.prompt)
    positions = spec.positions(len(ids))
    if side == "transformers":
        from harness.llama3.torch_reference import load_model

        reference = load_model(variant.path, variant.dtype)
        head = reference.lm_head.weight.float()

        @torch.inference_mode()
        def prefill() -> None:
            hidden = reference.model(torch.tensor([ids]), use_cache=True).last_hidden_state
            hidden[0, [*positions, len(ids) - 1]].float() @ head.T

    else:

        def prefill() -> None:
            engine.generate(ids, 1, prompt_positions=positions)

    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        prefill()
        seconds.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rss_mib = peak_kib / 1024
    return {"seconds": min(seconds), "tokens": len(ids), "case": spec.id, "rss_mib": rss_mib}


def _variants(models: list[str]) -> list[tuple[str, str]]:
    from harness.llama3.variants import variants

    return [(v.model, v.encoding) for m in models for v in variants(m) if v.path is not None]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    known = ("tinyllama", "smollm2")
    if not models or any(m not in known for m in models):
        parser.print_usage(sys.stderr)
        print(f"bench_long_prefill: error: --models takes {', '.join(known)}", file=sys.stderr)
        return 2
    if args.threads < 1 or args.repeats < 1:
        parser.print_usage(sys.stderr)
        print("bench_long_prefill: error: --threads and --repeats must be >= 1", file=sys.stderr)
        return 2
    context = multiprocessing.get_context("spawn")
    rows = []
    for model, encoding in _variants(models):
        results = {}
        for side in SIDES:
            print(f"bench_long_prefill: {model} {encoding} {side} ...", file=sys.stderr, flush=True)
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                job = pool.submit(measure, side, model, encoding, args.threads, args.repeats)
                results[side] = job.result()
        rows.append((model, encoding, results))

    print(
        f"longest golden case per checkpoint, prefill on {args.threads} thread(s), fastest of "
        f"{args.repeats}; peak RSS of a fresh process (load included)"
    )
    header = f"{'model':<10} {'encoding':<9} {'case':<8} {'tokens':>6}"
    header += "".join(f" {side + ' s':>15} {'RSS MiB':>8}" for side in SIDES)
    print(header + f" {'eager/tf':>9} {'quant/tf':>9}")
    for model, encoding, results in rows:
        first = results["eager"]
        line = f"{model:<10} {encoding:<9} {first['case']:<8} {first['tokens']:>6}"
        for side in SIDES:
            line += f" {results[side]['seconds']:>15.3f} {results[side]['rss_mib']:>8.0f}"
        peer = results["transformers"]["seconds"]
        # Ratios of speed (peer seconds over ours): above 1 is faster than transformers.
        line += f" {peer / results['eager']['seconds']:>9.2f}"
        line += f" {peer / results['quantized']['seconds']:>9.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
