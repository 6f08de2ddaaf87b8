"""evaluate_llama: compute this engine's goldens for every model x encoding.

Writes `{model}_{encoding}_{hardware}_golden.json` per combination into --output-dir
(default: the testdata folder; created if missing), prints a summary table on stdout and
progress on stderr. A selection with no checkpoint at all (--model=llama3_1 without
--llama3-1-gguf) exits 2 and names what is missing; --model=all runs what is available.
Publish the files with tools/upload-public-bazel-artifact.sh (see testdata/README.md).
Goldens come from --mode=eager (the default), and from --mode=ggml on the encodings where that
mode computes llama.cpp's numbers (variants.GGML_ENCODINGS: q4_k, q4_1): files
`ggml_{model}_{encoding}_golden.json`, producer `engine-ggml`, the goldens of reference
"ggml" (published in the engine's archive). Another execution mode writes the engine's file
names, with producer `engine-MODE`, into an --output-dir of your choice, never the testdata
folder: compare them with the goldens by `./bazelw run //tools:golden_diff -- --from=... --to=...`.

Examples:
  ./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- --model=tinyllama
  ./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- \\
      --encoding=all --model=all --output-dir=/tmp/goldens
  ./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- \\
      --model=smollm2 --mode=quantized --output-dir=/tmp/quantized
  ./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- \\
      --model=all --mode=ggml --output-dir=/tmp/ggml
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from goldens import schema
from goldens.cli_files import PathError, user_path
from harness.llama3 import engine_runs, golden_files
from harness.llama3.variants import (
    ENCODINGS,
    GGML_ENCODINGS,
    LLAMA3_1_ENV,
    MODELS,
    TESTDATA_REL,
    Llama3FileError,
    checkout_testdata,
    unavailable_selection,
    variants,
)
from pipelines.llama3.engine import MODES, device_problem


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evaluate_llama",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--modular-path",
        help=f"a checkout whose {TESTDATA_REL} folder supplies the tiny checkpoints and, "
        "without --output-dir, receives the goldens; the engine that runs and "
        "goldens/cases.yaml are this checkout's either way (default: the workspace `bazel "
        "run` was called in)",
    )
    p.add_argument("--encoding", default="all", choices=["all", *ENCODINGS])
    p.add_argument("--model", default="all", choices=["all", *MODELS])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--mode",
        default="eager",
        choices=MODES,
        help="execution mode (default: eager; ggml makes its own goldens on q4_k and q4_1)",
    )
    p.add_argument("--output-dir", help="where to write goldens (default: the testdata folder)")
    p.add_argument(
        "--llama3-1-gguf",
        type=user_path,
        help=f"a Llama-3.1-8B-Instruct GGUF (else ${LLAMA3_1_ENV}; this flag wins)",
    )
    p.add_argument(
        "--full-logits",
        action="store_true",
        help="also store every step's full-vocabulary logits (large files)",
    )
    return p


def _usage_error(parser: argparse.ArgumentParser, message: str) -> None:
    parser.print_usage(sys.stderr)
    print(f"evaluate_llama: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    problem = device_problem(args.device)  # before anything is written: no folder left
    if problem is not None:
        _usage_error(parser, problem)
    repository = user_path(args.modular_path).resolve() if args.modular_path else None
    testdata = checkout_testdata(repository)
    if not testdata.is_dir():
        _usage_error(parser, f"--modular-path={repository} has no {TESTDATA_REL}; pass a checkout")
    os.environ["PIPELINES_TESTDATA"] = str(testdata)

    try:
        selected = variants(args.model, args.encoding, args.llama3_1_gguf)
    except Llama3FileError as error:
        _usage_error(parser, str(error))
    if not selected:
        _usage_error(parser, f"--model={args.model} has no --encoding={args.encoding} checkpoint")
    nothing = unavailable_selection(selected)
    if nothing is not None:
        _usage_error(parser, nothing)
    if args.mode not in ("eager", "ggml") and args.output_dir is None:
        _usage_error(
            parser,
            f"--mode={args.mode} does not make goldens (eager and ggml do); pass --output-dir "
            "to write its run somewhere else than the testdata folder",
        )
    if args.mode == "ggml":
        skipped = [v for v in selected if v.encoding not in GGML_ENCODINGS and v.path]
        selected = [v for v in selected if v.encoding in GGML_ENCODINGS or not v.path]
        for variant in skipped:
            print(
                f"evaluate_llama: {variant.model} {variant.encoding}: the ggml mode computes "
                "eager's numbers here; its goldens are eager's",
                file=sys.stderr,
            )
        if not selected:
            _usage_error(
                parser,
                f"--mode=ggml makes goldens for --encoding in {', '.join(GGML_ENCODINGS)} only",
            )
    try:
        output_dir = golden_files.output_folder(args.output_dir, testdata)
    except PathError as error:
        _usage_error(parser, str(error))
    torch.set_num_threads(engine_runs.GOLDEN_THREADS)
    rows, unavailable = [], []
    for variant in selected:
        if variant.path is None:
            unavailable.append(variant)
            print(
                f"evaluate_llama: {variant.model}: unavailable: {variant.unavailable_reason}",
                file=sys.stderr,
            )
            continue
        print(
            f"evaluate_llama: {variant.model} {variant.encoding} "
            f"on {args.device} ({args.mode}) ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        engine = engine_runs.load_engine(variant, args.device, mode=args.mode)
        load_seconds = time.perf_counter() - start
        runs = engine_runs.run_cases(engine, variant.model)
        golden = golden_files.engine_golden(
            variant, engine, runs, args.device, args.full_logits, args.mode
        )
        name = schema.golden_file_name(
            variant.model, variant.encoding, golden.provenance.hardware, golden.provenance.producer
        )
        schema.write(golden, output_dir / name)
        rows.append(
            (
                variant,
                golden,
                name,
                load_seconds,
                sum(r.seconds for r in runs),
                (output_dir / name).stat().st_size,
            )
        )

    _print_summary(rows, unavailable, output_dir)
    return 0


def _print_summary(rows, unavailable, output_dir: Path) -> None:
    header = (
        "model",
        "encoding",
        "hardware",
        "cases",
        "steps",
        "distinct",
        "min gap",
        "load s",
        "model s",
        "bytes",
        "file",
    )
    table = [header]
    for variant, golden, name, load_s, model_s, size in rows:
        steps = [s for c in golden.cases for s in c.steps]
        distinct = min(len(set(c.token_ids)) for c in golden.cases)
        table.append(
            (
                variant.model,
                variant.encoding,
                golden.provenance.hardware,
                str(len(golden.cases)),
                str(len(steps)),
                str(distinct),
                f"{min(s.top_gap for s in steps):.3g}",
                f"{load_s:.3f}",
                f"{model_s:.3f}",
                str(size),
                name,
            )
        )
    for variant in unavailable:
        table.append(
            (variant.model, variant.encoding, "-", "-", "-", "-", "-", "-", "-", "-", "unavailable")
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"{len(rows)} goldens written to {output_dir}")


if __name__ == "__main__":
    sys.exit(main())
