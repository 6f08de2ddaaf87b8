"""Where two runs' top tokens flip, step by step, and by how much.

`trace_tokens` runs the engine twice on one prompt: run A decodes greedily, run B (another
checkpoint, mode or dtype) is fed A's tokens (teacher forcing), so both score the same prefix
at every step. Per step it prints A's token, B's top token, whether they differ (a flip), each
run's margin (log-probability of its top token minus its second's: how close the step was to
flipping), the change of A's token's log-probability (B - A), and KL(A || B) over the whole
vocabulary. The summary names the first flip and the largest changes; `--json` writes every
step. A change of engine that moves outputs shows here where and by how much; a step with a
small margin in A is where any change flips first.

Example (the quantized mode's kernels against eager, on the same file):
    bazel run //tools:trace_tokens -- \\
        --gguf=$PWD/max_tests/integration/architectures/llama3/testdata/tiny_llama_q4_k.gguf \\
        --prompt='The capital of France is' --mode=eager --against-mode=quantized

Exit status: 0 no flip, 1 a top token flips, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

from goldens.cli_files import PathError, output_file, user_path, write_atomically
from pipelines.llama3.engine import MODES, Llama3Engine
from pipelines.llama3.gguf_loader import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the two runs (log-probabilities in nats)."""

    step: int
    token: int  # A's greedy token, fed to both
    against_top: int  # B's most likely token at this step
    margin: float  # A: log p(top) - log p(second)
    against_margin: float  # B: the same over its own ranking
    delta: float  # log p_B(token) - log p_A(token)
    kl: float  # KL(A || B) over the vocabulary

    @property
    def flipped(self) -> bool:
        return self.token != self.against_top


def compare(a_logits: torch.Tensor, b_logits: torch.Tensor, tokens: list[int]) -> list[Step]:
    """Per step, A's row against B's: [steps, vocab] float32 logits of the same prefixes."""
    a = torch.log_softmax(a_logits.double(), dim=-1)
    b = torch.log_softmax(b_logits.double(), dim=-1)
    a_top, b_top = a.topk(2, dim=-1), b.topk(2, dim=-1)
    kl = (a.exp() * (a - b)).sum(dim=-1)
    return [
        Step(
            step=i,
            token=token,
            against_top=int(b_top.indices[i, 0]),
            margin=float(a_top.values[i, 0] - a_top.values[i, 1]),
            against_margin=float(b_top.values[i, 0] - b_top.values[i, 1]),
            delta=float(b[i, token] - a[i, token]),
            kl=float(kl[i]),
        )
        for i, token in enumerate(tokens)
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trace_tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gguf", required=True, type=user_path, help="run A's checkpoint")
    parser.add_argument("--prompt", required=True, help="the text both runs continue")
    parser.add_argument("--mode", choices=MODES, default="eager", help="run A's mode")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--against-gguf", type=user_path, help="run B's checkpoint (default: --gguf)"
    )
    parser.add_argument("--against-mode", choices=MODES, help="run B's mode (default: --mode)")
    parser.add_argument("--against-dtype", choices=sorted(DTYPES), help="default: --dtype")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=user_path, metavar="FILE", help="also write every step")
    return parser


def _load(parser, path: pathlib.Path, mode: str, dtype: str, option: str) -> Llama3Engine:
    if path.is_dir():
        parser.error(f"{option}={path} is a folder; name the .gguf file in it")
    if not path.is_file():
        parser.error(f"{option}={path}: no such file")
    try:
        return Llama3Engine.from_gguf(path, dtype=DTYPES[dtype], mode=mode)
    except CheckpointError as error:
        parser.error(f"{option}={path}: {error}")


def _text(engine: Llama3Engine, token: int) -> str:
    """The id and, where the file has a tokenizer, its text: a byte token alone decodes to
    "\ufffd", so two different tokens may print the same text."""
    return f"{token} {engine.tokenizer.decode([token])!r}" if engine.tokenizer else str(token)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json={args.json}: {args.json.parent} does not exist")
    if args.json is not None and args.json.is_dir():  # found before both runs, not after
        parser.error(f"--json={args.json} is a directory; name the file to write")
    if args.json is not None:
        try:
            output_file(args.json, "--json")  # a folder this process can write in
        except PathError as error:
            parser.error(str(error))
    against_gguf = args.against_gguf or args.gguf
    against_mode = args.against_mode or args.mode
    against_dtype = args.against_dtype or args.dtype
    a = _load(parser, args.gguf, args.mode, args.dtype, "--gguf")
    b = _load(parser, against_gguf, against_mode, against_dtype, "--against-gguf")
    if a.tokenizer is None:
        parser.error(f"--gguf={args.gguf}: stores no tokenizer; cannot encode --prompt")
    if a.config.vocab_size != b.config.vocab_size:
        parser.error(
            f"--against-gguf={against_gguf}: a vocabulary of {b.config.vocab_size} tokens, "
            f"not --gguf's {a.config.vocab_size}: the runs' tokens are not comparable"
        )
    prompt = a.tokenizer.encode(args.prompt)
    run_a = a.generate(prompt, args.max_new_tokens)
    tokens = list(run_a.tokens)
    run_b = b.generate(prompt, len(tokens), stop_on_eos=False, forced_tokens=tokens)
    steps = compare(run_a.logits, run_b.logits, tokens)

    print(f"A: {args.gguf.name} ({args.mode}, {args.dtype})")
    print(f"B: {against_gguf.name} ({against_mode}, {against_dtype}), fed A's tokens")
    print(f"{'step':>4}  {'A token':<22} {'B top':<22} {'A margin':>9} {'B margin':>9} "
          f"{'Δ log-p':>10} {'KL(A||B)':>10}")  # fmt: skip
    for s in steps:
        mark = "  <- flip" if s.flipped else ""
        print(
            f"{s.step:>4}  {_text(a, s.token):<22} {_text(b, s.against_top):<22} "
            f"{s.margin:>9.4f} {s.against_margin:>9.4f} {s.delta:>10.3g} {s.kl:>10.3g}{mark}"
        )
    flips = [s.step for s in steps if s.flipped]
    worst = max(steps, key=lambda s: abs(s.delta))
    print(
        f"{len(steps)} steps, {len(flips)} flipped"
        + (f" (first at step {flips[0]})" if flips else "")
        + f"; max |Δ log-p| {abs(worst.delta):.3g} at step {worst.step}, "
        f"max KL {max(s.kl for s in steps):.3g}, smallest A margin "
        f"{min(s.margin for s in steps):.3g}"
    )
    if args.json is not None:
        record = {
            "a": {"gguf": str(args.gguf), "mode": args.mode, "dtype": args.dtype},
            "b": {"gguf": str(against_gguf), "mode": against_mode, "dtype": against_dtype},
            "prompt": args.prompt,
            "steps": [{**dataclasses.asdict(s), "flipped": s.flipped} for s in steps],
        }
        try:  # a write that fails is exit 2, not the verdict "a token flipped" (1)
            write_atomically(args.json, json.dumps(record, indent=1) + "\n")
        except PathError as error:
            print(f"trace_tokens: error: {error}", file=sys.stderr)
            return 2
    return 1 if flips else 0


if __name__ == "__main__":
    sys.exit(main())
