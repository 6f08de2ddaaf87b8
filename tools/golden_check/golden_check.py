"""Judge an engine, this repository's or any other, by the pinned goldens of one checkpoint.

The engine is teacher-forced on every golden case (the golden's prompt, then its greedy
tokens) and each step and recorded prompt position is compared under a tolerance entry of
goldens/tolerances.yaml, as the golden tests do. An HTTP server answers only its top-k
log-probabilities; the comparison then checks what is known and bounds the rest
(docs/goldens.md, "A run that knows only its top-k").

  # any OpenAI-compatible completions server already serving the checkpoint's GGUF
  ./bazelw run //tools:golden_check -- --engine=openai --url=http://127.0.0.1:8080/v1 \\
      --model=tiny --checkpoint=tinyllama-float32
  # llama.cpp: started on a free loopback port with the checkpoint, stopped at the end;
  # --mutations also checks that every checkpoint mutation fails
  ./bazelw run //tools:golden_check -- --engine=llama_cpp --checkpoint=tinyllama-float32 --mutations
  # this engine (any mode), or transformers on the same file
  ./bazelw run //tools:golden_check -- --engine=this --mode=quantized --checkpoint=tinyllama-q4_k
  ./bazelw run //tools:golden_check -- --engine=transformers --checkpoint=smollm2-q4_1
  # the checkpoints and the GGUF file each one's goldens were made from
  ./bazelw run //tools:golden_check -- --list
  # llama.cpp's sampler: 2000 seeded draws per case against the golden's distribution
  # processed in llama.cpp's order (temperature last), by a G-test at alpha 1e-6
  ./bazelw run //tools:golden_check -- --engine=llama_cpp --checkpoint=tinyllama-float32 \
      --sampling --lane=short --sampler=temperature=1.5,top_k=20,top_p=0.8,min_p=0.05

Prints one verdict line per golden (own: this engine's goldens; torch: transformers') and
writes an HTML report of every case. Exit status: 0 every golden passes (and, with
--mutations, every mutation fails); 1 a verdict failed; 2 bad input, or an engine that could
not answer (nothing listening at the URL, no log-probabilities), in one line naming it.
With --sampling: 0 every case's draws pass, 1 a case FAILs or is INCONCLUSIVE (the engine's
own logits too far from the golden's for its draws to judge its sampler).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from goldens.cli_files import OneLineParser, PathError, at_least, output_directory, user_path
from goldens.engines.base import EngineError
from goldens.engines.llama_server import LlamaServer
from goldens.engines.openai import LlamaCppEngine, OpenAIEngine
from goldens.tolerances import NotJudged, tolerance
from harness.llama3 import (
    checkpoint_mutations,
    failure_report,
    golden_files,
    judge,
    sampler_check,
)
from harness.llama3.variants import (
    Variant,
    testdata_directory,
    variants,
)
from pipelines.llama3.engine import MODES
from pipelines.llama3.sampling import ORDERS, settings_from_text, settings_text

ENGINES = ("openai", "llama_cpp", "this", "transformers")
DEFAULT_COLUMN = {
    "openai": "external",
    "llama_cpp": "llama_cpp",
    "this": "cpu",
    "transformers": "cpu",
}


def checkpoints() -> dict[str, Variant]:
    """`{model}-{encoding}` -> variant, for every checkpoint with goldens."""
    return {f"{v.model}-{v.encoding}": v for v in variants() if v.encoding != "unknown"}


def _positive_seconds(text: str) -> float:
    """An argparse `type`: a number of seconds above 0 (--timeout=-5 otherwise reached the
    HTTP client and stopped in a traceback, exit 1, which here means a failed verdict)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0")
    return value


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="golden_check",
        description=__doc__.split("\n\n")[0],
        epilog="example: ./bazelw run //tools:golden_check -- --engine=openai "
        "--url=http://127.0.0.1:8080/v1 --model=tiny --checkpoint=tinyllama-float32",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=ENGINES, help="what to judge")
    p.add_argument("--checkpoint", help="whose goldens: MODEL-ENCODING (see --list)")
    p.add_argument("--list", action="store_true", help="print the checkpoints and their files")
    p.add_argument(
        "--url",
        help="the server's OpenAI base URL, e.g. http://127.0.0.1:8080/v1 (openai: required; "
        "llama_cpp: a server you started; without it one is started on the checkpoint)",
    )
    p.add_argument("--model", default="", help="the model name the server expects, if any")
    p.add_argument(
        "--golden",
        choices=("own", "torch", "both", "ggml"),
        default="both",
        help="which goldens: own, torch, both (default), or ggml (the ggml mode's: llama.cpp's "
        "numerics on the q4_k and q4_1 files)",
    )
    p.add_argument("--lane", choices=judge.LANES, default="all", help="which cases")
    p.add_argument(
        "--tolerance",
        help="the tolerances.yaml column to judge under (default: llama_cpp for llama_cpp, "
        "external for openai, cpu for this and transformers)",
    )
    p.add_argument(
        "--mutations",
        action="store_true",
        help="also judge each checkpoint mutation (a started llama_cpp server, this engine "
        "or transformers), which must FAIL",
    )
    p.add_argument("--mode", default="eager", choices=MODES, help="this engine's execution mode")
    p.add_argument("--report-dir", default=".", help="where the HTML reports go")
    p.add_argument(
        "--timeout", type=_positive_seconds, default=60.0, help="seconds per HTTP request"
    )
    p.add_argument("--batch", type=at_least(1), default=16, help="prefixes per HTTP request")
    p.add_argument(
        "--sampling",
        action="store_true",
        help="judge the engine's sampler by its seeded draws instead of its logits "
        "(--engine=llama_cpp; harness/llama3/sampler_check.py)",
    )
    p.add_argument(
        "--sampler",
        default=settings_text(sampler_check.DEFAULT_SAMPLER),
        help="with --sampling: temperature, top_k, top_p, min_p as KEY=VALUE,... "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="llama_cpp",
        help="with --sampling: the chain order the draws are held to (default: llama_cpp)",
    )
    p.add_argument(
        "--draws", type=int, default=sampler_check.DRAWS, help="with --sampling: per case"
    )
    p.add_argument(
        "--echo",
        action="store_true",
        help='one request per case with prompt log-probabilities ("echo": true, vLLM)',
    )
    return p


@dataclasses.dataclass
class Target:
    """An engine to judge and what to close after."""

    engine: object
    server: LlamaServer | None = None

    def close(self) -> None:
        self.engine.close()
        if self.server is not None:
            self.server.stop()


def _target(args, variant: Variant, gguf: Path) -> Target:
    options = dict(timeout=args.timeout, batch=args.batch, echo=args.echo)
    if args.engine == "openai":
        return Target(OpenAIEngine(args.url, args.model, **options))
    if args.engine == "llama_cpp":
        if args.url:
            return Target(LlamaCppEngine(args.url, args.model, **options))
        server = LlamaServer(gguf)
        server.start()
        return Target(LlamaCppEngine(server.url, **options), server)
    from harness.llama3.engine_adapters import ThisEngine, Transformers

    variant = dataclasses.replace(variant, path=gguf)
    if args.engine == "transformers":
        return Target(Transformers(variant))
    return Target(ThisEngine(variant, mode=args.mode))


def _verdicts(target: Target, variant: Variant, goldens, column: str, lane: str):
    from harness.llama3.engine_adapters import judge_engine

    return [
        judge_engine(
            target.engine, golden, source, reference,
            tolerance(reference, variant.encoding, column), variant, lane,
        )
        for reference, (golden, source) in goldens
    ]  # fmt: skip


COLUMNS = (
    ("golden", 6), ("tolerance", 24), ("verdict", 7), ("steps", 5), ("prompt", 6),
    ("max |Δ log-prob|", 16), ("max KL", 8), ("greedy", 7), ("bounded", 7),
)  # fmt: skip


def _header() -> str:
    return "  ".join(f"{name:<{width}}" for name, width in COLUMNS) + "  worst check"


def _row(verdict: judge.Verdict) -> str:
    """One golden's verdict as a table row; `bounded`: golden ids outside the run's top-k."""
    bounded = sum(c.bounded for r in verdict.reports for c in r.checks)
    share, metric, where = verdict.headroom()
    agreement = sum(r.greedy_agreement for r in verdict.reports)
    status = "FAIL" if verdict.failures else "PASS"
    if not all(r.input_ids_match for r in verdict.reports):
        status += " (input ids differ)"
    cells = (
        verdict.reference, verdict.tolerance.key, status, verdict.steps,
        verdict.prompt_positions, f"{verdict.max_logprob_diff:.3g}", f"{verdict.max_kl:.3g}",
        f"{agreement}/{verdict.steps}", bounded,
    )  # fmt: skip
    row = "  ".join(f"{c!s:<{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True))
    size = f"{share:.0%} of" if share < 10 else f"{share:.3g}x"
    return f"{row}  {metric} at {size} its threshold ({where})"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    table = checkpoints()
    if args.list:
        for name, variant in table.items():
            where = variant.path.resolve() if variant.path else variant.unavailable_reason
            print(f"{name:<20} {where}")
        return 0
    if not args.engine or not args.checkpoint:
        _parser().error("give --engine and --checkpoint (or --list)")
    variant = table.get(args.checkpoint)
    if variant is None:
        _parser().error(f"--checkpoint={args.checkpoint} is not one of {', '.join(table)}")
    if variant.path is None:
        print(f"golden_check: {args.checkpoint}: {variant.unavailable_reason}", file=sys.stderr)
        return 2
    if args.engine == "openai" and not args.url:
        _parser().error("--engine=openai needs --url=http://HOST:PORT/v1")
    if args.mutations and (args.engine == "openai" or args.url):
        _parser().error(
            "--mutations needs an engine this command starts on each mutated copy: "
            "--engine=llama_cpp without --url, or --engine=this"
        )
    if args.sampling:
        return _sampling(args, variant)
    column = args.tolerance or DEFAULT_COLUMN[args.engine]
    references = ("own", "torch") if args.golden == "both" else (args.golden,)
    try:
        for reference in references:
            tolerance(reference, variant.encoding, column)
        report_dir = output_directory(user_path(args.report_dir).resolve(), "--report-dir")
    except NotJudged as e:
        print(
            f"golden_check: {e}; --tolerance=external judges it under an external engine's "
            "tolerance anyway",
            file=sys.stderr,
        )
        return 2
    except (KeyError, ValueError) as e:
        print(f"golden_check: {e}", file=sys.stderr)
        return 2
    goldens = []
    for reference in references:
        found = golden_files.find_golden(reference, variant, testdata_directory())
        if found is None:
            name = golden_files.golden_file_name(reference, variant)
            print(f"golden_check: no {reference} golden {name} is pinned", file=sys.stderr)
            return 2
        goldens.append((reference, found))

    try:
        verdicts, (name, tokenizes), reports = _judge(
            args, variant, variant.path, goldens, column, report_dir
        )
        print(f"golden check: {name}, {args.checkpoint} ({variant.path.name}), {args.lane} cases")
        print(_header())
        for verdict in verdicts:
            print(_row(verdict))
        if not tokenizes:
            print(
                "input ids: not checked (the server has no tokenizer endpoint; it was sent the "
                "golden's ids)"
            )
        for verdict, report in zip(verdicts, reports, strict=True):
            print(f"report ({verdict.reference}: {verdict.source}): {report}")
        failed = any(v.failures for v in verdicts)
        if failed:  # the first failing case of each golden, as the golden tests print it
            print("\n\n".join(v.failures[0] for v in verdicts if v.failures))
        if args.mutations:
            failed |= not _mutations(args, variant, goldens, column)
    except (EngineError, PathError) as e:  # PathError: a report that could not be written
        print(f"golden_check: {e}", file=sys.stderr)
        return 2
    print("verdict: " + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


def _sampling(args, variant: Variant) -> int:
    """--sampling: each case of the lane, the engine's draws after its prompt judged against
    the own golden's first step processed in --order (sampler_check)."""
    if args.engine != "llama_cpp":
        _parser().error(
            "--sampling needs --engine=llama_cpp (llama.cpp's /completion draws by seed)"
        )
    if args.draws < 1:
        _parser().error(f"--draws={args.draws}: give at least 1")
    try:
        sampler = settings_from_text(args.sampler)
    except ValueError as e:
        _parser().error(str(e))
    found = golden_files.find_golden("own", variant, testdata_directory())
    if found is None:
        name = golden_files.golden_file_name("own", variant)
        print(f"golden_check: no own golden {name} is pinned", file=sys.stderr)
        return 2
    golden, source = found
    cases = judge.in_lane(golden, variant.model, args.lane).cases
    for case in cases:
        problem = sampler_check.usable(case.steps[0], sampler)
        if problem is not None:
            _parser().error(f"--sampler: {problem}")
    target = _target(args, variant, variant.path)
    try:
        print(
            f"golden check --sampling: {target.engine.name}, {args.checkpoint} "
            f"({variant.path.name}), {sampler} in the {args.order} order, {args.draws} draws "
            f"per case, G-test at alpha {sampler_check.ALPHA:g}, against {source}"
        )
        verdicts = [
            sampler_check.check_sampler(target.engine, case, sampler, args.draws, args.order)
            for case in cases
        ]
    except EngineError as e:
        print(f"golden_check: {e}", file=sys.stderr)
        return 2
    finally:
        target.close()
    for verdict in verdicts:
        print("  " + verdict.summary())
    failed = [v.case_id for v in verdicts if v.verdict != "PASS"]
    print("verdict: " + (f"FAIL ({', '.join(failed)})" if failed else "PASS"))
    return 1 if failed else 0


def _judge(args, variant: Variant, gguf: Path, goldens, column: str, report_dir=None):
    """(verdicts, engine name, report paths); the reports are written while the engine is
    up (llama.cpp decodes the run's tokens)."""
    target = _target(args, variant, gguf)
    try:
        verdicts = _verdicts(target, variant, goldens, column, args.lane)
        reports = []
        if report_dir is not None:
            test_id = f"{args.engine}-{args.checkpoint}"
            for verdict, (_, (golden, _)) in zip(verdicts, goldens, strict=True):
                reports.append(
                    failure_report.write_failure_report(
                        verdict, golden, target.engine.decode, report_dir, test_id
                    )
                )
        return verdicts, (target.engine.name, target.engine.tokenizes), reports
    finally:
        target.close()


def _mutations(args, variant: Variant, goldens, column: str) -> bool:
    """Each checkpoint mutation judged like the checkpoint; True when every one FAILs."""
    print("checkpoint mutations (each must FAIL):")
    caught = True
    with tempfile.TemporaryDirectory(prefix="golden-check-") as folder:
        for mutation in checkpoint_mutations.MUTATIONS:
            try:
                copy = checkpoint_mutations.mutated_copy(variant.path, mutation, folder)
            except (KeyError, ValueError) as e:
                print(f"  {mutation.name:<14} not applicable: {e}")
                continue
            try:
                verdicts, _, _ = _judge(args, variant, copy, goldens, column)
            except SystemExit as e:  # transformers refuses rope tables it cannot reproduce
                print(f"  {mutation.name:<14} not applicable: the engine refuses the file: {e}")
                continue
            fails = all(v.failures for v in verdicts)
            caught &= fails
            worst = min(v.max_logprob_diff for v in verdicts)
            kl = min(v.max_kl for v in verdicts)
            print(
                f"  {mutation.name:<14} {mutation.what:<32} {'FAIL' if fails else 'PASS (missed)'}"
                f": max |Δ log-prob| {worst:.3g}, max KL {kl:.3g} (the smaller over the goldens)"
            )
    return caught


if __name__ == "__main__":
    sys.exit(main())
