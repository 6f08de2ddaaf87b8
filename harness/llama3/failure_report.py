"""A failing verdict's HTML report (goldens/report.py's page, every case of the golden),
written where Bazel keeps a test's undeclared outputs, and the failure text that names it."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from goldens import compare, report, schema
from harness.llama3 import golden_files
from harness.llama3.judge import Verdict
from harness.llama3.variants import Variant
from pipelines.llama3 import Llama3Engine

# Bazel's folder for a test's extra outputs; it zips them into bazel-testlogs after the test.
UNDECLARED_OUTPUTS_ENV = "TEST_UNDECLARED_OUTPUTS_DIR"


def report_directory(fallback: Path) -> Path:
    """Where a failing golden test writes its HTML reports: Bazel's undeclared outputs folder,
    else `fallback` (the tests pass pytest's `tmp_path`, of which pytest keeps the last runs)."""
    outputs = os.environ.get(UNDECLARED_OUTPUTS_ENV)
    return Path(outputs) if outputs else fallback


def failures_with_report(
    verdict: Verdict,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    directory: Path,
    test_id: str,
    diagnosis: tuple[str, str] | None = None,
    run_of: tuple[Variant, Llama3Engine, str] | None = None,
) -> list[str]:
    """`verdict.failures`; when there are any, the HTML report of this golden is written into
    `directory` and a last line names it ("report: PATH"). `diagnosis` (`diverging_layer`) is
    added to the failure text and to its case in the report. With `run_of` (variant, engine,
    mode), a failing verdict against the engine's own golden also keeps its run as a golden
    file (`write_run_golden`), for `golden_diff --to=` and `golden_update --from=`."""
    if not verdict.failures:
        return []
    path = write_failure_report(verdict, golden, decode, directory, test_id, diagnosis)
    located = [] if diagnosis is None else [f"case {diagnosis[0]!r}: {diagnosis[1]}"]
    kept = []
    if run_of is not None and verdict.reference == "own":
        run = write_run_golden(verdict, *run_of, directory)
        kept = [f"run as a golden file: {run}{_bazel_outputs_hint(directory)}"]
    return [
        *verdict.failures,
        *located,
        *kept,
        f"report: {path}{_bazel_outputs_hint(directory)}",
    ]


def write_run_golden(
    verdict: Verdict, variant: Variant, engine: Llama3Engine, mode: str, directory: Path
) -> Path:
    """The teacher-forced runs of `verdict` as a golden file named like its golden: in
    `directory` for the eager mode, in `directory/MODE` for the others (a run of another mode
    is never a golden). Each step's token is the engine's own greedy choice (the argmax of its
    logits), so where it differs from the golden's the file says "tokens changed"; the steps
    after it were fed the golden's tokens, so such a file is for review, not to accept."""
    runs = [
        dataclasses.replace(run, tokens=[int(row.argmax()) for row in run.logits])
        for run in verdict.runs
    ]
    golden = golden_files.engine_golden(variant, engine, runs, str(engine.device), mode=mode)
    folder = directory if mode == "eager" else directory / mode
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / verdict.source.file_name
    schema.write(golden, path)
    return path


def write_failure_report(
    verdict: Verdict,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    directory: Path,
    test_id: str,
    diagnosis: tuple[str, str] | None = None,
) -> Path:
    """The HTML report of every case of `verdict`, failing and passing, written into
    `directory` as `golden_report_{test_id}_{golden file stem}.html`; returns its path.
    Golden tokens are the golden's stored texts, run tokens `decode([id])` of the run's; a run
    token is marked changed where its id differs from the golden's, whatever the texts."""
    golden_file = verdict.source.file_name
    notes = {} if diagnosis is None else {diagnosis[0]: [diagnosis[1]]}
    views = [
        _case_view(case_report, golden, decode, notes.get(case_report.case_id, []))
        for case_report in verdict.reports
    ]
    failing = sum(v.status == compare.FAIL for v in views)
    summary = [verdict.summary(), f"cases: {failing} of {len(views)} fail"]
    title = f"golden report: {test_id} against {golden_file} ({verdict.reference})"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / report_file_name(test_id, golden_file)
    return report.write_report(path, title, summary, views)


def report_file_name(test_id: str, golden_file: str) -> str:
    """`golden_report_{test_id}_{golden file stem}.html`, in characters safe in any file name."""
    stem = Path(golden_file).name.removesuffix(".json")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"golden_report_{test_id}_{stem}") + ".html"


def _case_view(
    case_report: compare.CaseReport,
    golden: schema.Golden,
    decode: Callable[[Sequence[int]], str],
    notes: list[str],
) -> report.CaseView:
    case = golden.case(case_report.case_id)
    steps = case_report.steps
    run_tokens = [decode([s.actual_token]) for s in steps if s.actual_token is not None]
    return report.case_view(
        case_report,
        f"{golden.provenance.model} {golden.provenance.encoding} · {case.id}",
        [s.token_text for s in case.steps],
        run_tokens,
        notes=[
            f"free-running greedy agreement: {case_report.greedy_agreement} of {len(steps)}",
            *notes,
        ],
    )


def _bazel_outputs_hint(directory: Path) -> str:
    """Where `bazel test` leaves a report in its undeclared outputs folder: zipped."""
    outputs = os.environ.get(UNDECLARED_OUTPUTS_ENV)
    zipped = bazel_outputs_zip(os.environ)
    if not outputs or zipped is None or directory != Path(outputs):
        return ""
    return f" (after the test: {zipped})"


def bazel_outputs_zip(environ: Mapping[str, str]) -> str | None:
    """The zip that `bazel test` makes of the running test's undeclared outputs, from Bazel's
    test environment: `bazel-testlogs/PACKAGE/NAME/test.outputs/outputs.zip`, and for a
    sharded target (TEST_TOTAL_SHARDS > 1) `bazel-testlogs/PACKAGE/NAME/shard_I_of_N/
    test.outputs/outputs.zip`, I = TEST_SHARD_INDEX + 1; None without TEST_TARGET."""
    target = environ.get("TEST_TARGET")
    if not target:
        return None
    package, _, name = target.split("//", 1)[-1].partition(":")
    total, index = (int(environ.get(key) or 0) for key in ("TEST_TOTAL_SHARDS", "TEST_SHARD_INDEX"))
    shard = f"shard_{index + 1}_of_{total}/" if total > 1 else ""
    return f"bazel-testlogs/{package}/{name}/{shard}test.outputs/outputs.zip"
