"""Every tolerance is proven: each known bug (mutations.py) fails under every tolerance entry,
and the unmutated engine passes under every entry. And every diagnosis is proven: a bug placed in
one sub-block of one layer of a 3-layer checkpoint is located there (localize.py).

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

from goldens import compare, diff, schema
from goldens.tolerances import entries, tolerance
from max_tests.integration.architectures.llama3 import (
    diagnosis,
    engine_runs,
    failure_report,
    judge,
    localize,
    mutations,
    torch_reference,
)
from max_tests.integration.architectures.llama3.variants import Variant, variants
from tools.gen_tiny_model import gen_tiny_model

ENCODINGS = sorted({tol.encoding for tol in entries()})


def _variant(encoding: str):
    found = [v for v in variants("all", encoding) if v.model != "llama3_1"]
    assert len(found) == 1, f"one checkpoint per encoding expected, got {found}"
    return found[0]


def _cell(verdict: judge.Verdict) -> str:
    """`metric@step` (or `metric@pPOSITION` for a prompt position) of the first failing check
    of the first failing case, or PASS."""
    for report in verdict.reports:
        if report.status == compare.FAIL:
            check = report.first_failing_check
            if not report.input_ids_match or check is None:
                where = ""
            elif check.in_prompt:
                where = f"@p{check.position}"
            else:
                where = f"@{check.step}"
            return f"{report.failing_metrics[0]}{where}"
    return "PASS" if not verdict.failures else "cases"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_tolerance_catches_every_mutation(encoding: str, goldens, capsys) -> None:
    """Each cell is `short lane / all cases`: a mutation must fail with all cases (short and
    long) under every entry; the short column shows which bugs only the long cases catch."""
    variant = _variant(encoding)
    if variant.path is None:
        pytest.fail(f"the mutation matrix needs {variant.unavailable_reason}")
    tolerances = entries(encoding=encoding)
    keys = [tol.key for tol in tolerances]
    golden_of = {ref: goldens.load(ref, variant) for ref in ("own", "torch")}
    last_position = min(golden.last_position for golden, _ in golden_of.values())
    config = mutations.load(variant, None).config
    applicable = [m for m in mutations.MUTATIONS if m.applies_to(config, last_position)]
    matrix: dict[tuple[str, str], str] = {}
    numbers: dict[tuple[str, str], str] = {}
    failed_all: dict[tuple[str, str], bool] = {}
    for mutation in [None, *applicable]:
        engine = mutations.load(variant, mutation)
        memo: dict = {}  # the own and torch goldens mostly hold the same token sequences
        runs = {ref: engine_runs.forced_runs(engine, g, memo) for ref, (g, _) in golden_of.items()}
        column = mutation.name if mutation else "unmutated"
        for tol in tolerances:
            golden, name = golden_of[tol.reference]
            verdicts = {
                lane: judge.compare_runs(
                    runs[tol.reference], golden, name, tol.reference, tol, variant, str, lane=lane
                )
                for lane in ("short", "all")
            }
            matrix[tol.key, column] = " / ".join(_cell(v) for v in verdicts.values())
            numbers[tol.key, column] = verdicts["all"].summary()
            failed_all[tol.key, column] = bool(verdicts["all"].failures)

    columns = ["unmutated", *(m.name for m in applicable)]
    skipped = [m.name for m in mutations.MUTATIONS if m not in applicable]
    with capsys.disabled():
        print(
            f"\nmutation matrix, {variant.test_id}, goldens to position {last_position} "
            "(cells: short cases / all cases; failing metric@step or @pPOSITION)"
            + (f"; not applicable here: {', '.join(skipped)}" if skipped else "")
        )
        for column in columns:
            print(f"  {column:<22}" + "".join(f"{matrix[k, column]:>34}" for k in keys))
        print(f"  {'':<22}" + "".join(f"{k:>34}" for k in keys))
    let_through = [
        f"{key} lets {m} through: {numbers[key, m]}"
        for key in keys
        for m in columns[1:]
        if not failed_all[key, m]
    ]
    unmutated = [
        f"{key}: the unmutated engine fails: {numbers[key, 'unmutated']}"
        for key in keys
        if failed_all[key, "unmutated"]
    ]
    assert not let_through + unmutated, "\n".join(let_through + unmutated)


def test_a_kv_cache_mutation_first_fails_at_the_first_decode_step(goldens) -> None:
    """Prefill does not touch the decode path: the first decode step is the first to move."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    mutation = mutations.BY_NAME["kv_position"]
    tol = tolerance("own", "float32", "cpu")
    verdict = judge.check(mutations.load(variant, mutation), golden, name, "own", tol, variant)
    assert [r.first_failing.step for r in verdict.reports] == [1] * len(verdict.reports)
    # Step 0 (prefill) is the unmutated engine's, bit for bit: the same distance to the golden.
    # (Not ~0: the golden was made at the machine's thread count, tests run on one thread,
    # and float32 sums round differently.)
    unmutated = judge.check(mutations.load(variant, None), golden, name, "own", tol, variant)
    for mutated, plain in zip(verdict.reports, unmutated.reports, strict=True):
        assert mutated.steps[0].max_logprob_diff == plain.steps[0].max_logprob_diff
        assert mutated.steps[0].kl == plain.steps[0].kl


def test_a_failing_golden_keeps_its_run_as_a_golden_file(goldens, tmp_path: Path) -> None:
    """The run behind a failing own golden is written beside its report as a golden file of
    the same name (each step's token the engine's argmax), so golden_diff and golden_update
    can review it from the test's outputs without recomputing."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    tol = tolerance("own", "float32", "cpu")
    engine = mutations.load(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "own", tol, variant)
    failures = failure_report.failures_with_report(
        verdict,
        golden,
        engine.tokenizer.decode,
        tmp_path,
        variant.test_id,
        run_of=(variant, engine, "eager"),
    )
    path = tmp_path / name.file_name
    assert failures[-2] == f"run as a golden file: {path}"
    run = schema.read(path)
    assert [c.id for c in run.cases] == [c.id for c in golden.cases]
    for case, forced in zip(run.cases, verdict.runs, strict=True):
        assert case.input_ids == golden.case(case.id).input_ids
        assert case.token_ids == [int(row.argmax()) for row in forced.logits]
    klass, _ = diff.file_class(diff.diff_file(name.file_name, _lenient(golden), _lenient(run)))
    assert klass in ("over tolerance", "tokens changed")
    unmutated = judge.check(mutations.load(variant, None), golden, name, "own", tol, variant)
    assert (
        failure_report.failures_with_report(
            unmutated, golden, str, tmp_path / "pass", "x", run_of=(variant, engine, "eager")
        )
        == []
    )
    assert not (tmp_path / "pass").exists()


def _lenient(golden: schema.Golden) -> diff.GoldenFile:
    return diff.parse_golden(schema.to_json(golden).encode(), "golden")


def test_a_norm_eps_mutation_fails_naming_its_html_report(goldens, tmp_path: Path) -> None:
    """The failing golden writes its report (goldens/report.py), every case in it with
    its token strip and its curves, and the failure text names the file."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    tol = tolerance("own", "float32", "cpu")
    engine = mutations.load(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "own", tol, variant)
    directory = failure_report.report_directory(tmp_path)  # kept by Bazel: test.outputs
    failures = failure_report.failures_with_report(
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


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory, testdata_directory: Path) -> Variant:
    """A 3-layer tiny float32 checkpoint (the committed ones have 1 layer), made by the
    repository's generator with the committed tokenizer."""
    path = tmp_path_factory.mktemp("three_layers") / "tiny_llama_3_layers.gguf"
    shape = ["--n-layers=3", "--n-heads=2", "--n-kv-heads=1", "--hidden-dim=32"]
    argv = [f"--output={path}", "--quantization-encoding=float32", *shape]
    assert gen_tiny_model.main([*argv, f"--tokenizer-dir={testdata_directory}"]) == 0
    return Variant("tinyllama", "float32", "tiny", "llama3_1", path)


@pytest.fixture(scope="module")
def three_layers_reference(three_layers: Variant):
    return torch_reference.load_model(three_layers.path, three_layers.dtype)


PROMPT_IDS = [128000, 791, 6864, 315, 9822, 374]  # BOS "The capital of France is"
FORCED = [12366, 13, 578, 6864, 315, 9822]


def test_the_unmutated_engine_agrees_with_transformers_in_every_sub_block(
    three_layers, three_layers_reference
) -> None:
    engine = mutations.load(three_layers, None)
    assert localize.first_divergence(engine, three_layers_reference, PROMPT_IDS, FORCED) is None


@pytest.mark.parametrize(
    ("subblock", "layer"),
    [("attention", 1), ("MLP", 2), ("MLP norm", 0), ("attention norm", 2)],
    ids=lambda value: str(value).replace(" ", "_"),
)
def test_a_mutation_in_layer_k_is_located_at_layer_k(
    three_layers, three_layers_reference, subblock: str, layer: int
) -> None:
    engine = mutations.load(three_layers, mutations.in_layer(subblock, layer))
    found = localize.first_divergence(engine, three_layers_reference, PROMPT_IDS, FORCED)
    assert found is not None, f"{subblock} in layer {layer} was not found"
    assert (found.layer, found.subblock) == (layer, subblock), found.describe()
    assert found.position == 0  # every position passes through every layer
    assert found.relative_error > 10 * found.tolerance  # far from the threshold, not near it


def test_a_kv_cache_mutation_is_located_at_the_first_decode_position(
    three_layers, three_layers_reference
) -> None:
    engine = mutations.load(three_layers, mutations.BY_NAME["kv_position"])
    found = localize.first_divergence(engine, three_layers_reference, PROMPT_IDS, FORCED)
    assert (found.layer, found.subblock, found.position) == (0, "attention", len(PROMPT_IDS))


def test_a_failure_against_torch_names_the_first_diverging_layer(goldens, tmp_path: Path) -> None:
    """norm_eps against transformers' golden: the failure text and the report say where."""
    variant = _variant("float32")
    golden, name = goldens.load("torch", variant)
    tol = tolerance("torch", "float32", "cpu")
    engine = mutations.load(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "torch", tol, variant)
    layer = diagnosis.diverging_layer(engine, variant, golden, verdict)
    assert layer is not None and layer[0] == verdict.reports[0].case_id
    assert layer[1].startswith("first diverging layer: layer 0, attention norm (")
    failures = failure_report.failures_with_report(
        verdict, golden, engine.tokenizer.decode, tmp_path, variant.test_id, layer
    )
    assert failures[-2] == f"case {layer[0]!r}: {layer[1]}"
    page = Path(failures[-1].removeprefix("report: ").split(" (after")[0]).read_text()
    assert html.escape(layer[1], quote=False) in page
