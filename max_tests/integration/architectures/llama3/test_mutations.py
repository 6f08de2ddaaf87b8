"""Every tolerance is proven: each known bug (mutations.py) fails under every tolerance entry,
and the unmutated engine passes under every entry.

The comparison is device-agnostic, so the CUDA entries (`cuda`, `cuda_fallback`) are applied
to CPU runs of the engine against the pinned CPU goldens too: a tolerance loose enough to let
a mutation through on a GPU lets it through here. One test per encoding; each prints its rows
of the matrix (tolerance entry x mutation: the failing metric and first failing step).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from max_tests.goldens import compare
from max_tests.goldens.tolerances import entries, tolerance
from max_tests.integration.architectures.llama3 import golden_run, mutations
from max_tests.integration.architectures.llama3.variants import variants

ENCODINGS = sorted({tol.encoding for tol in entries()})


def _variant(encoding: str):
    found = [v for v in variants("all", encoding) if v.model != "llama3_1"]
    assert len(found) == 1, f"one checkpoint per encoding expected, got {found}"
    return found[0]


def _cell(verdict: golden_run.Verdict) -> str:
    """`metric@step` of the first failing step of the first failing case, or PASS."""
    for report in verdict.reports:
        if report.status == compare.FAIL:
            step = report.first_failing
            where = f"@{step.step}" if step is not None else ""
            return f"{report.failing_metrics[0]}{where}"
    return "PASS" if not verdict.failures else "cases"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_tolerance_catches_every_mutation(encoding: str, goldens, capsys) -> None:
    variant = _variant(encoding)
    if variant.path is None:
        pytest.fail(f"the mutation matrix needs {variant.unavailable_reason}")
    tolerances = entries(encoding=encoding)
    keys = [tol.key for tol in tolerances]
    golden_of = {ref: goldens.load(ref, variant) for ref in ("own", "torch")}
    matrix: dict[str, dict[str, str]] = {key: {} for key in keys}
    numbers: dict[tuple[str, str], str] = {}
    for mutation in [None, *mutations.MUTATIONS]:
        engine = mutations.load(variant, mutation)
        runs = {ref: golden_run.forced_runs(engine, g) for ref, (g, _) in golden_of.items()}
        column = mutation.name if mutation else "unmutated"
        for tol in tolerances:
            golden, name = golden_of[tol.reference]
            verdict = golden_run.compare_runs(
                runs[tol.reference], golden, name, tol.reference, tol, variant, str
            )
            matrix[tol.key][column] = _cell(verdict)
            numbers[tol.key, column] = verdict.summary()

    columns = ["unmutated", *(m.name for m in mutations.MUTATIONS)]
    with capsys.disabled():
        print(f"\nmutation matrix, {variant.test_id} (cells: failing metric@first failing step)")
        print(f"  {'tolerance':<28}" + "".join(f"{c:>16}" for c in columns))
        for key in keys:
            print(f"  {key:<28}" + "".join(f"{matrix[key][c]:>16}" for c in columns))
    let_through = [
        f"{key} lets {m} through: {numbers[key, m]}"
        for key in keys
        for m in columns[1:]
        if matrix[key][m] == "PASS"
    ]
    unmutated = [
        f"{key}: the unmutated engine fails: {numbers[key, 'unmutated']}"
        for key in keys
        if matrix[key]["unmutated"] != "PASS"
    ]
    assert not let_through + unmutated, "\n".join(let_through + unmutated)


def test_a_kv_cache_mutation_first_fails_at_the_first_decode_step(goldens) -> None:
    """Prefill does not touch the decode path: the first decode step is the first to move."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    mutation = mutations.BY_NAME["kv_position"]
    tol = tolerance("own", "float32", "cpu")
    verdict = golden_run.check(mutations.load(variant, mutation), golden, name, "own", tol, variant)
    assert [r.first_failing.step for r in verdict.reports] == [1] * len(verdict.reports)
    # Step 0 differs only by the golden's float32 rounding of its logsumexp.
    assert all(r.steps[0].max_logprob_diff < 1e-8 for r in verdict.reports)


def test_a_norm_eps_mutation_fails_naming_its_html_report(goldens, tmp_path: Path) -> None:
    """The failing golden writes its report (max_tests/goldens/report.py), every case in it with
    its token strip and its curves, and the failure text names the file."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    tol = tolerance("own", "float32", "cpu")
    engine = mutations.load(variant, mutations.BY_NAME["norm_eps"])
    verdict = golden_run.check(engine, golden, name, "own", tol, variant)
    directory = golden_run.report_directory(tmp_path)  # kept by Bazel: test.outputs
    failures = golden_run.failures_with_report(
        verdict, golden, engine.tokenizer.decode, directory, variant.test_id
    )

    path = directory / "golden_report_tiny-float32-llama3_1_tinyllama_float32_all_golden.html"
    assert failures[:-1] == verdict.failures
    assert failures[-1].startswith(f"report: {path}")
    page = path.read_text(encoding="utf-8")
    sections = re.findall(r'<section class="case".*?</section>', page, re.S)
    assert len(sections) == len(verdict.reports) == len(golden.cases)
    for section, case_report, case in zip(sections, verdict.reports, golden.cases, strict=True):
        assert 'data-status="FAIL"' in section
        assert f'data-first-failing-step="{case_report.first_failing.step}"' in section
        for token in (s.token_text for s in case.steps):
            assert f'title="{html.escape(repr(token))}"' in section
        changed = [s.step for s in case_report.steps if s.actual_token != s.expected_token]
        assert _changed_steps(section) == changed
        for metric, values, limit in (
            ("kl", [s.kl for s in case_report.steps], tol.kl_max),
            ("logprob_delta", [s.max_logprob_diff for s in case_report.steps], tol.logprob_atol),
        ):
            chart = re.search(rf'<svg class="curve" data-metric="{metric}".*?</svg>', section)
            points = re.search(r'<polyline [^>]*points="([^"]*)"', chart[0])[1].split()
            assert len(points) == len(case.steps)
            assert f'<line class="tolerance" data-value="{limit:g}"' in chart[0]
            above = [i for i, v in enumerate(values) if v > limit]
            assert re.findall(r'<circle data-step="(\d+)" class="point above"', chart[0]) == [
                str(i) for i in above
            ]
    # The translation case's greedy tokens diverge: its strip marks the changed steps.
    assert any(_changed_steps(section) for section in sections)


def _changed_steps(section: str) -> list[int]:
    return [int(step) for step in re.findall(r'<td data-step="(\d+)" class="changed', section)]
