"""Benchmark speculative decoding: decode tokens/s with and without it, beside llama-server.

On SmolLM2 (Q4_1), greedy, one request at a time, --new-tokens after a prompt whose text
repeats (where prompt lookup finds its n-grams): this engine's `generate` (--mode) without
speculation, with the n-gram draft (prompt lookup, K = --k), and with a model draft (the
checkpoint's own first --draft-layers layers and head: all of them by default, the checkpoint
drafting for itself); llama.cpp's `llama-server` (the same threads) without speculation, with
its n-gram draft (`--spec-type ngram-simple`, up to K drafted) and with the same checkpoint as
`--model-draft` (`--spec-type draft-simple`, up to K drafted), each with the golden lanes'
numerics flags (float32 KV cache, no flash attention: goldens/engines/llama_server.py).
Each row: decode tokens/s (the engine's decode seconds; llama-server's own
`predicted_per_second`), the draft's proposals accepted, tokens per decode forward, and the
speed-up over its own side's run without speculation; then the ratios this engine /
llama-server per draft, all from this one run. Each side keeps its fastest of --repeats runs.

Example:
    bazel run //tools:bench_speculative
    bazel run //tools:bench_speculative -- --mode=ggml --k=8 --new-tokens=128
    bazel run //tools:bench_speculative -- --draft-layers=24 --no-llama-server
    bazel run //tools:bench_speculative -- --mode=eager \
        --gguf=$PWD/max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \
        --draft=$PWD/max_tests/integration/architectures/llama3/testdata/tiny_llama_draft.gguf

The self-draft of all layers accepts nearly every proposal and costs as much as the target:
it measures the machinery (draft, verify, KV rollback), not a useful draft; an untrained early
exit (fewer layers) is accepted 1-2% of the time on SmolLM2 (README).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import torch

from goldens.cli_files import at_least, user_path, write_atomically
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine, speculative
from pipelines.llama3.gguf_file import CheckpointError
from tools.bench.record import json_output
from tools.bench.sampled import LlamaServerSide, llama_server_missing

PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\n"
    "def add(a, b):\n    return"
)
LLAMA_SERVER = "llama-server"


@dataclasses.dataclass
class Row:
    """One way of decoding: its fastest tokens/s and what its drafts did."""

    side: str  # "engine" or "llama-server"
    draft: str  # "none", "n-gram", "model"
    tps: float = 0.0
    proposed: int = 0
    accepted: int = 0
    forwards: int = 0
    note: str = ""

    def acceptance(self) -> str:
        if self.draft == "none":
            return "-"
        if not self.proposed:
            return "n/a"
        return f"{self.accepted}/{self.proposed} ({self.accepted / self.proposed:.2f})"

    def per_forward(self, new_tokens: int) -> str:
        if self.draft == "none" or not self.forwards:
            return "-"
        return f"{(new_tokens - 1) / self.forwards:.2f}"  # the first token is the prefill's


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_speculative",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gguf", type=user_path, default=None, help="default: SmolLM2-135M-Instruct Q4_1"
    )
    parser.add_argument(
        "--mode", default="quantized", choices=("eager", "quantized", "ggml"), help="engine mode"
    )
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per step (1 to 8)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded per run")
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="the model draft's layers (default: all, the checkpoint drafting for itself)",
    )
    parser.add_argument(
        "--draft",
        type=user_path,
        default=None,
        metavar="GGUF",
        help="a draft checkpoint as the model draft of both sides instead of the self-draft "
        "(//tools/gen_tiny_model:write_draft writes one; llama-server's --model-draft)",
    )
    parser.add_argument(
        "--threads", type=at_least(1), default=2, help="torch and llama.cpp threads"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest kept")
    parser.add_argument(
        "--no-llama-server", action="store_true", help="only this engine's rows (no peer)"
    )
    parser.add_argument("--json", default=None, help="write the rows to this file too")
    return parser


def _engine_row(engine, draft, name: str, input_ids, args) -> Row:
    row = Row("engine", name)
    speculation = None if draft is None else speculative.Speculation(draft, args.k)
    for _ in range(args.repeats):
        out = engine.generate(
            list(input_ids), args.new_tokens, stop_on_eos=False, speculation=speculation
        )
        tps = (len(out.tokens) - 1) / out.decode_seconds
        if tps > row.tps:
            row.tps = tps
            if out.speculation is not None:
                row.proposed = sum(out.speculation.proposed)
                row.accepted = sum(out.speculation.accepted)
                row.forwards = out.speculation.forwards
    return row


def _llama_row(gguf, name: str, extra: tuple[str, ...], input_ids, args) -> Row:
    row = Row("llama-server", name)
    server = LlamaServerSide(gguf, args.threads, extra)
    try:
        for _ in range(args.repeats):
            timings = server.completion(input_ids, args.new_tokens)["timings"]
            tps = float(timings["predicted_per_second"])
            if tps > row.tps:
                row.tps = tps
                row.proposed = int(timings.get("draft_n", 0))
                row.accepted = int(timings.get("draft_n_accepted", 0))
                # each decode forward gives one token more than the drafted ones it accepts
                row.forwards = args.new_tokens - 1 - row.accepted if row.proposed else 0
    finally:
        server.close()
    return row


def _lines(rows: list[Row], args, mode: str) -> list[str]:
    base = {r.side: r.tps for r in rows if r.draft == "none"}
    out = [
        f"speculative decoding, greedy, {args.new_tokens} new tokens, K={args.k}, "
        f"{args.threads} threads (engine mode {mode}); fastest of {args.repeats}:",
        f"  {'side':<13} {'draft':<7} {'tok/s':>7} {'speed-up':>9} {'accepted':>18} "
        f"{'tokens/forward':>15}",
    ]
    for r in rows:
        speedup = r.tps / base[r.side] if base.get(r.side) else math.nan
        out.append(
            f"  {r.side:<13} {r.draft:<7} {r.tps:>7.1f} {speedup:>8.2f}x "
            f"{r.acceptance():>18} {r.per_forward(args.new_tokens):>15}"
            + (f"  {r.note}" if r.note else "")
        )
    ours = {r.draft: r.tps for r in rows if r.side == "engine"}
    theirs = {r.draft: r.tps for r in rows if r.side == "llama-server"}
    ratios = [
        f"{draft} {ours[draft] / theirs[draft]:.2f}"
        for draft in ("none", "n-gram", "model")
        if ours.get(draft) and theirs.get(draft)
    ]
    if ratios:
        out.append("engine / llama-server decode tok/s, same draft: " + ", ".join(ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.k <= 8:
        parser.error(f"--k={args.k}: speculation drafts 1 to 8 tokens a step")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("--new-tokens must be at least 2 and --repeats at least 1")
    if args.draft is not None and args.draft_layers is not None:
        parser.error("--draft and --draft-layers are two model drafts: give one")
    for flag, path in (("--gguf", args.gguf), ("--draft", args.draft)):
        if path is not None and not path.is_file():
            parser.error(f"{flag}={path} is not a file; give a GGUF checkpoint")
    json_path = json_output(args.json, parser)
    gguf = str(args.gguf or smollm2_gguf())
    torch.set_num_threads(args.threads)
    try:
        engine = Llama3Engine.from_gguf(gguf, mode=args.mode)
    except CheckpointError as error:  # truncated, not GGUF, not a llama: the loader says which
        print(f"error: --gguf: {error}", file=sys.stderr)
        return 2
    layers = engine.config.n_layers if args.draft_layers is None else args.draft_layers
    if not 0 <= layers <= engine.config.n_layers:
        parser.error(f"--draft-layers={layers}: 0 to {engine.config.n_layers}")
    if engine.tokenizer is None:
        print(f"error: {gguf} stores no tokenizer; the bench's prompt needs one", file=sys.stderr)
        return 2
    input_ids = engine.tokenizer.encode(PROMPT)
    if args.draft is None:
        print(
            f"loading the model draft: {layers} of {engine.config.n_layers} layers", file=sys.stderr
        )
        draft = speculative.self_draft(gguf, layers, mode=args.mode)
        note, model_draft = f"{layers}-layer self-draft", gguf
    else:
        try:
            draft = speculative.file_draft(args.draft, engine, args.mode)
        except (CheckpointError, speculative.DraftMismatch) as error:
            print(f"error: --draft={args.draft}: {error}", file=sys.stderr)
            return 2
        note, model_draft = f"draft checkpoint {args.draft.name}", str(args.draft)
    rows = [
        _engine_row(engine, None, "none", input_ids, args),
        _engine_row(engine, speculative.NgramDraft(), "n-gram", input_ids, args),
        _engine_row(engine, draft, "model", input_ids, args),
    ]
    rows[2].note = note
    skipped = llama_server_missing(args.no_llama_server)
    if not skipped:
        k = ("--spec-draft-n-max", str(args.k))
        for name, extra in (
            ("none", ()),
            ("n-gram", ("--spec-type", "ngram-simple", *k)),
            # --model-draft alone loads the draft and does not speculate: draft-simple does
            ("model", ("--model-draft", model_draft, "--spec-type", "draft-simple", *k)),
        ):
            print(f"llama-server, draft {name}", file=sys.stderr)
            rows.append(_llama_row(gguf, name, extra, input_ids, args))
        rows[-1].note = "the same checkpoint as --model-draft" if args.draft is None else note
    lines = _lines(rows, args, args.mode)
    if skipped:
        lines.append(skipped)
    print("\n".join(lines))
    if json_path:
        text = json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n"
        write_atomically(json_path, text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
