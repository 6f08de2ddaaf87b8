"""Generate text from a GGUF checkpoint with the Llama 3 engine: greedily, or sampled with
--temperature (and --top-k, --top-p, --min-p, penalties, --seed; pipelines/llama3/sampling.py).

Examples, from the checkout's root (`bazel run` reads --gguf against the folder it is run
from), on the repository's tiny random checkpoint, whose text is noise; for real text name
SmolLM2-135M-Instruct's file instead (docs/environment.md says how to fetch it):
    bazel run //pipelines/llama3:generate -- \\
        --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\
        --prompt "The capital of France is" --max-new-tokens 16 --mode=quantized
    bazel run //pipelines/llama3:generate -- \\
        --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\
        --prompt "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 7
    bazel run //pipelines/llama3:generate -- \\
        --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\
        --prompt "A user record as JSON: " \\
        --json-schema '{"type": "object", "properties": {"name": {"type": "string"}}}'
    bazel run //pipelines/llama3:generate -- \\
        --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\
        --prompt "The capital of France is" --mode=quantized --profile=$PWD/trace.json

--profile writes a Chrome trace-event file of the generation (pipelines/llama3/profiling.py):
torch's operators, the quantized and ggml modes' C kernel calls, the prefill and each decode
step as named ranges. Open it in Perfetto's UI or chrome://tracing.
"""

import argparse
import contextlib
import dataclasses
import os
import pathlib
import sys

import torch

from pipelines.llama3 import profiling
from pipelines.llama3.constrained import Constraint, ConstraintError
from pipelines.llama3.engine import MODES, Llama3Engine, device_problem, freeze_imported_objects
from pipelines.llama3.gguf_loader import CheckpointError
from pipelines.llama3.sampling import ORDERS, SamplerSettings
from pipelines.llama3.speculative import (
    DraftMismatch,
    NgramDraft,
    Speculation,
    file_draft,
    self_draft,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def user_path(path: str) -> pathlib.Path:
    """`path` as the user meant it: `bazel run` starts programs in their runfiles, and names
    the directory the user ran it from $BUILD_WORKING_DIRECTORY. (The repository's tools share
    goldens.cli_files for this; pipelines/ stands alone and imports nothing outside it.)"""
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return pathlib.Path(base, os.path.expanduser(path))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", required=True, type=user_path, help="GGUF checkpoint (llama architecture)"
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="eager",
        help="execution mode: eager (dense), compiled (torch.compile), quantized (packed 4/8-bit)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)"
    )
    parser.add_argument(
        "--profile",
        type=lambda value: profiling.trace_file(user_path(value)),
        metavar="FILE",
        help="write a Chrome trace-event file of the generation: torch's operators, the C "
        "kernels, the prefill and each decode step (Perfetto's UI, chrome://tracing)",
    )
    sampling = parser.add_argument_group("sampling (without --temperature: greedy)")
    sampling.add_argument("--temperature", type=float, default=None, help="> 0: sample")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="relative to the top (0: off)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--order", choices=ORDERS, default="transformers", help="chain order")
    sampling.add_argument("--seed", type=int, default=None, help="default: the system's")
    parser.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: the n-gram (prompt lookup) draft proposes up to K tokens "
        "(1 to 8) that one forward verifies; the same tokens, fewer forwards (0: off)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --speculate: the checkpoint's own first N layers and head draft instead of "
        "the n-gram (self-speculation; 0: the embedding straight into the head)",
    )
    parser.add_argument(
        "--draft",
        metavar="GGUF",
        type=user_path,
        help="with --speculate: this draft checkpoint (the checkpoint's vocabulary, e.g. "
        "//tools/gen_tiny_model:write_draft's) drafts instead of the n-gram",
    )
    parser.add_argument(
        "--draft-samples",
        action="store_true",
        help="with --draft-layers or --draft and a sampler: the draft samples its proposals, "
        "verified by "
        "rejection sampling (the target's distribution, other draws than without speculation)",
    )
    constraint = parser.add_argument_group(
        "constrained decoding (one of them; @FILE reads the text from a file)"
    ).add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", help="the output is an instance of this schema")
    constraint.add_argument("--regex", help="the output matches this regex, whole")
    constraint.add_argument(
        "--choice", action="append", help="the output is one of these (repeat the option)"
    )
    constraint.add_argument("--grammar", help="the output is in this Lark or GBNF grammar")
    return parser


def _option(kind: str) -> str:
    """The command-line option of a constraint kind: json_schema -> --json-schema."""
    return "--" + kind.replace("_", "-")


def _constraint(args, parser) -> Constraint | None:
    """The constraint the options give, its text read from @FILE where one is named."""

    def text(option: str, value: str) -> str:
        if not value.startswith("@"):
            return value
        path = user_path(value[1:])
        if not path.is_file():
            parser.error(f"{option}={value}: {path} is not a file")
        return path.read_text()

    constraint = Constraint.choice(args.choice) if args.choice else None
    for kind in ("json_schema", "regex", "grammar"):
        value = getattr(args, kind)
        if value is not None:
            constraint = Constraint(kind, text(_option(kind), value))
    if constraint is not None:
        try:
            constraint.check()  # before the checkpoint loads
        except ConstraintError as error:
            parser.error(f"{_option(constraint.kind)}: {error}")
    return constraint


def _sampling(args, parser) -> SamplerSettings | None:
    if args.temperature is None:
        given = [
            flag
            for flag, value, off in (
                ("--top-k", args.top_k, 0),
                ("--top-p", args.top_p, 1.0),
                ("--min-p", args.min_p, 0.0),
                ("--seed", args.seed, None),
            )
            if value != off
        ]
        if given:
            parser.error(f"{', '.join(given)} sample: give --temperature too (1.0: unscaled)")
        return None
    # every field of SamplerSettings is the option of the same name
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplerSettings)}
    try:
        return SamplerSettings(**fields)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    freeze_imported_objects()  # before the first load: see its docstring
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    problem = device_problem(args.device)
    if problem is not None:
        parser.error(problem)
    if args.threads is not None and args.threads < 0:
        parser.error(f"--threads={args.threads}: give at least 1 (or 0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = _sampling(args, parser)
    constraint = _constraint(args, parser)
    speculation = None
    if args.draft_layers is not None and not args.speculate:
        parser.error("--draft-layers drafts for speculative decoding: give --speculate=K too")
    if args.draft is not None and not args.speculate:
        parser.error("--draft drafts for speculative decoding: give --speculate=K too")
    if args.draft is not None and args.draft_layers is not None:
        parser.error("--draft and --draft-layers are two drafts: give one")
    if args.draft is not None and not os.path.isfile(args.draft):
        parser.error(f"--draft={args.draft} is not a file; give a draft GGUF checkpoint")
    model_draft = args.draft_layers is not None or args.draft is not None
    if args.draft_samples and (not model_draft or sampling is None):
        parser.error(
            "--draft-samples: give --draft-layers=N or --draft=GGUF and a sampler (--temperature=T)"
        )
    if args.speculate:
        try:
            speculation = Speculation(NgramDraft(), args.speculate)
        except ValueError as error:
            parser.error(f"--speculate={args.speculate}: {error}")
    gguf_path = args.gguf
    print(f"loading {gguf_path} on {args.device} ({args.dtype}, {args.mode})", file=sys.stderr)
    try:
        engine = Llama3Engine.from_gguf(
            gguf_path, device=args.device, dtype=DTYPES[args.dtype], mode=args.mode
        )
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.draft_layers is not None:
        if not 0 <= args.draft_layers < engine.config.n_layers:
            parser.error(
                f"--draft-layers={args.draft_layers}: the draft takes 0 to "
                f"{engine.config.n_layers - 1} of the checkpoint's {engine.config.n_layers} layers"
            )
        draft = self_draft(gguf_path, args.draft_layers, args.mode, sample=args.draft_samples)
        speculation = dataclasses.replace(speculation, draft=draft)
    if args.draft is not None:
        try:
            draft = file_draft(args.draft, engine, args.mode, sample=args.draft_samples)
        except (CheckpointError, DraftMismatch) as error:
            print(f"error: --draft={args.draft}: {error}", file=sys.stderr)
            return 2
        speculation = dataclasses.replace(speculation, draft=draft)
    if engine.tokenizer is None:
        print(
            f"error: {gguf_path} stores no tokenizer (tokenizer.ggml.*); cannot encode --prompt",
            file=sys.stderr,
        )
        return 2
    input_ids = engine.tokenizer.encode(args.prompt)
    profile = contextlib.nullcontext() if args.profile is None else profiling.trace(args.profile)
    try:
        with profile as taken:
            out = engine.generate(
                input_ids,
                args.max_new_tokens,
                sampling=sampling,
                speculation=speculation,
                constraint=constraint,
            )
    except ConstraintError as error:
        print(f"error: {_option(constraint.kind)}: {error}", file=sys.stderr)
        return 2
    print(args.prompt + engine.text(out.tokens, stopped=True))  # the CLI stops on one
    prefill_rate = len(input_ids) / out.prefill_seconds
    print(
        f"{len(input_ids)} prompt tokens at {prefill_rate:.1f} tok/s, "
        f"{len(out.tokens)} new tokens, decode {out.decode_tokens_per_second:.1f} tok/s"
    )
    if out.speculation is not None:
        name = "n-gram" if args.draft_layers is None else f"{args.draft_layers}-layer self"
        name = name if args.draft is None else os.path.basename(args.draft)
        name += ", sampling" if args.draft_samples else ""
        print(f"speculation ({name} draft, k={args.speculate}): {out.speculation.summary()}")
    if taken is not None:
        print(
            f"profile: {taken.path} ({taken.events} trace events; Perfetto's UI, chrome://tracing)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
