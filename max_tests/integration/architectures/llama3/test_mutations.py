"""Every tolerance is proven: each known bug (mutations.py) fails under every tolerance entry,
and the unmutated engine passes under every entry. And every diagnosis is proven: a bug placed in
one sub-block of one layer of a 3-layer checkpoint is located there (localize.py).

The comparison is device-agnostic, so the CUDA entries (`cuda`, `cuda_fallback`) are applied
to CPU runs of the engine against the pinned CPU goldens too: a tolerance loose enough to let
a mutation through on a GPU lets it through here. One test per encoding; each prints its rows
of the matrix (tolerance entry x mutation: the failing metric and first failing step).
"""

from __future__ import annotations

import dataclasses
import html
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from goldens import compare, diff, schema
from goldens.record import case_specs
from goldens.tolerances import entries, judged_lane, tolerance
from harness.llama3 import diagnosis, engine_runs, failure_report, judge, localize, torch_reference
from harness.llama3.variants import Variant, variants
from max_tests.integration.architectures.llama3 import mutations
from testing import gguf_reader
from tools.gen_tiny_model import gen_tiny_model
from tools.gen_tiny_model.tiny_llama import TinyLlamaConfig, rope_freq_factors, write_tiny_llama

ENCODINGS = sorted({tol.encoding for tol in entries()})
# What each file's matrix holds (the printed matrices, 2026-12-05): the mutations that do not
# apply to it (SmolLM2 has no rope scaling and goldens to 2,146 positions; every other file
# takes all), and the bugs only the long cases catch (every short cell PASS). A mutation whose
# `applies_to` drifts would otherwise leave the matrix without its column, green.
NOT_APPLICABLE = {
    "q4_1": [
        "rope_late_4096",
        "rope_factor_4",
        "rope_late_8192",
        "kv_late_8192",
        "rope_scaling_dropped",
    ]
}
LONG_ONLY = ("rope_late_4096", "window_1024", "kv_late_2048", "rope_late_8192", "kv_late_8192")
# Bugs an encoding cannot tell from another CPU's rounding: each may pass an entry only where
# it moves the log-probs less than that entry's measured cross-ISA noise (`isa_noise_floor`
# of the lane the case is judged in). bfloat16's long lane: one flipped bfloat16 rounding of
# the residual stream moves a log-prob by 0.0867 on another CPU, and a KV cache one slot
# late from position 8192 moves the 12 golden positions past it by at most 0.0752 (the
# float32, Q4_K and NVFP4 files fail it: 0.133, 0.0559, 0.0811; measured 2026-12-05).
BELOW_NOISE = {("bfloat16", "kv_late_8192")}


def _variant(encoding: str):
    found = [v for v in variants("all", encoding) if v.model != "llama3_1"]
    assert len(found) == 1, f"one checkpoint per encoding expected, got {found}"
    return found[0]


def _cell(verdict: judge.Verdict) -> str:
    """`metric@step` (or `metric@pPOSITION` for a prompt position) of the first failing check
    of the first failing case, or PASS."""
    for report in verdict.reports:
        if report.status == compare.FAIL:
            return _failing_cell(report)
    return "PASS" if not verdict.failures else "cases"


def _failing_cell(report: compare.CaseReport) -> str:
    check = report.first_failing_check
    if not report.input_ids_match or check is None:
        where = ""
    elif check.in_prompt:
        where = f"@p{check.position}"
    else:
        where = f"@{check.step}"
    return f"{report.failing_metrics[0]}{where}"


# One engine and one memo of forced runs per (checkpoint, mutation), kept while the tests stay
# on one checkpoint: a matrix's columns, and the float32 tests after the matrices (norm_eps serves
# three of them, the unmutated engine two), never compute a run twice. Another
# checkpoint drops them (a long case's runs hold 60 MB of logits). A mutation patches its own
# engine only (mutations.load).
_ENGINES: dict[tuple[str, str | None], tuple[object, dict]] = {}


def _engine(variant: Variant, mutation: mutations.Mutation | None):
    key = (variant.test_id, mutation.name if mutation else None)
    if key not in _ENGINES:
        if any(test_id != variant.test_id for test_id, _ in _ENGINES):
            _ENGINES.clear()
        _ENGINES[key] = (mutations.load(variant, mutation), {})
    return _ENGINES[key]


def _column(engine, memo, golden_of, tolerances, variant, run_everything: bool):
    """One mutation's cells, stopping when it has its answer: cases run one at a time in the
    golden's order (short before long), each entry's verdict settled at its first failing case
    (the `all` cell) and at its first failing short case or the end of the short cases (the
    `short` cell). An entry that every case lets through has run every case, and so has the
    unmutated engine (`run_everything`): those cells are the full lane verdicts.

    Returns {entry: (short cell, all cell, full "all" verdict or None)} and the cases run."""
    long_ids = {spec.id for spec in case_specs(variant.model) if spec.long}
    cells: dict[str, list] = {tol.key: [None, None] for tol in tolerances}
    runs: dict[str, list] = {ref: [] for ref in golden_of}
    ran = 0
    for ref, (golden, _) in golden_of.items():
        entries_here = [tol for tol in tolerances if tol.reference == ref]
        for index, case in enumerate(golden.cases):
            pending = [t for t in entries_here if None in cells[t.key]]
            if not pending and not run_everything:
                break
            ran += engine_runs.memo_key(case) not in memo
            (run,) = engine_runs.forced_runs(
                engine, dataclasses.replace(golden, cases=[case]), memo
            )
            runs[ref].append(run)
            for tol in pending:  # each case under the thresholds and lane the judges use
                long = case.id in long_ids
                if long and judged_lane("all", tol) == "short":
                    continue
                report = judge.compare_run(case, run, tol.for_case(long))
                if report.status == compare.FAIL:
                    settled = cells[tol.key]
                    settled[1] = settled[1] or _failing_cell(report)
                    if case.id not in long_ids:
                        settled[0] = settled[0] or _failing_cell(report)
            if all(c.id in long_ids for c in golden.cases[index + 1 :]):
                for tol in entries_here:  # every short case seen: no failing one is a PASS
                    cells[tol.key][0] = cells[tol.key][0] or "PASS"
    result = {}
    for tol in tolerances:
        short, every = cells[tol.key]
        if every is not None and short is not None and not run_everything:
            result[tol.key] = (short, every, None)
            continue
        golden, name = golden_of[tol.reference]
        verdicts = {
            lane: judge.compare_runs(
                runs[tol.reference], golden, name, tol.reference, tol, variant, str, lane=lane
            )
            for lane in ("short", "all")
        }
        result[tol.key] = (_cell(verdicts["short"]), _cell(verdicts["all"]), verdicts["all"])
    return result, ran


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_tolerance_catches_every_mutation(encoding: str, goldens, capsys) -> None:
    """Each cell is `short lane / all cases`: a mutation must fail with all cases (short and
    long) under every entry; the short column shows which bugs only the long cases catch. A
    mutation runs the long cases only where every short case let it through (the cells are
    the same either way: the first failing check of the first failing case)."""
    variant = _variant(encoding)
    if variant.path is None:
        pytest.fail(f"the mutation matrix needs {variant.unavailable_reason}")
    tolerances = entries(encoding=encoding)
    keys = [tol.key for tol in tolerances]
    golden_of = {ref: goldens.load(ref, variant) for ref in ("own", "torch")}
    last_position = min(golden.last_position for golden, _ in golden_of.values())
    config = _engine(variant, None)[0].config
    applicable = [m for m in mutations.MUTATIONS if m.applies_to(config, last_position)]
    matrix: dict[tuple[str, str], str] = {}
    numbers: dict[tuple[str, str], str] = {}
    failed_all: dict[tuple[str, str], bool] = {}
    ran: dict[str, int] = {}
    for mutation in [None, *applicable]:
        engine, memo = _engine(variant, mutation)
        column = mutation.name if mutation else "unmutated"
        cells, ran[column] = _column(
            engine, memo, golden_of, tolerances, variant, run_everything=mutation is None
        )
        for key, (short, every, verdict) in cells.items():
            matrix[key, column] = f"{short} / {every}"
            numbers[key, column] = verdict.summary() if verdict else every
            failed_all[key, column] = every != "PASS"
            if every == "PASS" and (encoding, column) in BELOW_NOISE:
                failed_all[key, column] = _below_noise(verdict, tolerances, key, variant)

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
        print(
            f"  engine runs (case x golden token sequence): {sum(ran.values())}, per column "
            + ", ".join(f"{c} {ran[c]}" for c in columns)
        )
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
    for enc, name in BELOW_NOISE:  # a bug every entry catches leaves the table
        if enc == encoding and name in columns:
            below = [k for k in keys if matrix[k, name].endswith("/ PASS")]
            assert below, f"{name} fails every entry here: take it out of BELOW_NOISE"
    assert skipped == NOT_APPLICABLE.get(encoding, []), f"not applicable here: {skipped}"
    long_only = [m for m in columns[1:] if all(matrix[k, m].startswith("PASS /") for k in keys)]
    expected = [m for m in LONG_ONLY if m in columns]
    assert long_only == expected, f"caught by the long cases only: {long_only}"


def _below_noise(verdict: judge.Verdict, tolerances, key: str, variant: Variant) -> bool:
    """Whether a BELOW_NOISE bug's pass under entry `key` is what the table says: every case
    moved less than the cross-ISA noise floor of the lane it is judged in (True: counted as
    caught in the matrix; False: let through, the test fails). An entry with no floor of its
    own (a GPU's, none measured) takes the CPU entry's: a GPU's rounding against the CPU
    golden is another CPU's at least."""
    (tol,) = [t for t in tolerances if t.key == key]
    cpu = tolerance(tol.reference, tol.encoding, "cpu")
    long_ids = {spec.id for spec in case_specs(variant.model) if spec.long}
    for report in verdict.reports:
        long = report.case_id in long_ids
        floor = tol.for_case(long).isa_noise_floor or cpu.for_case(long).isa_noise_floor
        if floor is None or report.max_logprob_diff >= floor.logprob:
            return False
    return True


def test_a_kv_cache_mutation_first_fails_at_the_first_decode_step(goldens) -> None:
    """Prefill does not touch the decode path: the first decode step is the first to move."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    mutation = mutations.BY_NAME["kv_position"]
    tol = tolerance("own", "float32", "cpu")
    engine, memo = _engine(variant, mutation)
    verdict = judge.check(engine, golden, name, "own", tol, variant, memo=memo)
    assert [r.first_failing.step for r in verdict.reports] == [1] * len(verdict.reports)
    # Step 0 (prefill) is the unmutated engine's, bit for bit: the same distance to the golden,
    # whatever that distance is (the assertion compares with the unmutated run, not with 0).
    plain_engine, plain_memo = _engine(variant, None)
    unmutated = judge.check(plain_engine, golden, name, "own", tol, variant, memo=plain_memo)
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
    engine, memo = _engine(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "own", tol, variant, memo=memo)
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
    plain_engine, plain_memo = _engine(variant, None)
    unmutated = judge.check(plain_engine, golden, name, "own", tol, variant, memo=plain_memo)
    assert (
        failure_report.failures_with_report(
            unmutated, golden, str, tmp_path / "pass", "x", run_of=(variant, engine, "eager")
        )
        == []
    )
    assert not (tmp_path / "pass").exists()


def _lenient(golden: schema.Golden) -> diff.GoldenFile:
    return diff.parse_golden(schema.to_json(golden).encode(), "golden")


def test_a_norm_eps_mutation_fails_naming_its_html_report(
    goldens, tmp_path: Path, monkeypatch
) -> None:
    """The failing golden writes its report (goldens/report.py), every case in it with
    its token strip and its curves, and the failure text names the file (and, under
    `bazel test`, the outputs.zip it ends in: a sharded target's is its shard's)."""
    variant = _variant("float32")
    golden, name = goldens.load("own", variant)
    tol = tolerance("own", "float32", "cpu")
    engine, memo = _engine(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "own", tol, variant, memo=memo)
    directory = failure_report.report_directory(tmp_path)  # kept by Bazel: test.outputs
    decode = engine.tokenizer.decode
    failures = failure_report.failures_with_report(
        verdict, golden, decode, directory, variant.test_id
    )

    def cells(row: str) -> list[tuple[int, str]]:  # a token strip row's (id, title) each
        found = re.findall(r'<td data-step="\d+"[^>]* title="([^"]*)" data-token-id="(\d+)"', row)
        return [(int(token_id), html.unescape(title)) for title, token_id in found]

    path = directory / "golden_report_tiny-float32-llama3_1_tinyllama_float32_all_golden.html"
    assert failures[:-1] == verdict.failures
    assert failures[-1].startswith(f"report: {path}")
    page = path.read_text(encoding="utf-8")
    sections = re.findall(r'<section class="case".*?</section>', page, re.S)
    assert len(sections) == len(verdict.reports) == len(golden.cases)
    for section, case_report, case in zip(sections, verdict.reports, golden.cases, strict=True):
        assert 'data-status="FAIL"' in section
        assert f'data-first-failing-step="{case_report.first_failing.step}"' in section
        # The golden row holds the golden's stored tokens, the run row the run's greedy
        # choices; only run cells are marked changed, where the ids differ.
        golden_row = re.search(r'<tr class="golden">(.*?)</tr>', section)[1]
        run_row = re.search(r'<tr class="run">(.*?)</tr>', section)[1]
        ran = [s.actual_token for s in case_report.steps]
        assert cells(golden_row) == [(s.token_id, repr(s.token_text)) for s in case.steps]
        assert cells(run_row) == [(t, repr(decode([t]))) for t in ran]
        assert "changed" not in golden_row
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

    # Under `bazel test` the line names the zip Bazel makes of the outputs folder: the
    # shard's own for a sharded target (shard I of N is TEST_SHARD_INDEX + 1).
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("TEST_UNDECLARED_OUTPUTS_DIR", str(outputs))
    monkeypatch.setenv("TEST_TARGET", "//max_tests/integration/architectures/llama3:test_llama")
    testlogs = "bazel-testlogs/max_tests/integration/architectures/llama3/test_llama"
    for index, total, folder in ((None, None, ""), ("1", "2", "shard_2_of_2/")):
        for key, value in (("TEST_SHARD_INDEX", index), ("TEST_TOTAL_SHARDS", total)):
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        last = failure_report.failures_with_report(
            verdict, golden, decode, failure_report.report_directory(tmp_path), variant.test_id
        )[-1]
        zipped = f"{testlogs}/{folder}test.outputs/outputs.zip"
        assert last == f"report: {outputs / path.name} (after the test: {zipped})"


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
    errors = _position_errors(engine, three_layers_reference, (layer, subblock))
    assert found.relative_error == pytest.approx(float(errors.max()), rel=1e-6)


def _position_errors(engine, reference, point: localize.Point):
    """Per position the engine sees at `point`: max |engine - transformers| / max
    |transformers| over the sub-block (its worst position is what a divergence reports)."""
    ours = localize.engine_outputs(engine, PROMPT_IDS, FORCED)[point]
    sequence = [*PROMPT_IDS, *FORCED][:-1]  # the last forced token is fed to no step
    theirs = localize.reference_outputs(reference, sequence)[point][-len(ours) :]
    return (ours - theirs).abs().amax(dim=-1) / theirs.abs().amax()


@pytest.mark.parametrize("subblock", localize.FINAL, ids=lambda value: value.replace(" ", "_"))
def test_a_mutation_after_the_layers_is_located_there(
    three_layers, three_layers_reference, subblock: str
) -> None:
    """The final norm and the LM head are checked too: a 1% scale of either's weight is found
    there (no layer before it moves), from the last prompt position (the first the engine
    computes logits at), with the sub-block's worst relative error over the positions."""
    engine = mutations.load(three_layers, mutations.in_final(subblock))
    found = localize.first_divergence(engine, three_layers_reference, PROMPT_IDS, FORCED)
    assert found is not None, f"{subblock} was not found"
    assert (found.layer, found.subblock) == (None, subblock), found.describe()
    assert found.position == len(PROMPT_IDS) - 1
    errors = _position_errors(engine, three_layers_reference, (None, subblock))
    assert len(errors) == len(FORCED)  # the last prompt position and each decode step
    assert found.relative_error == pytest.approx(float(errors.max()), rel=1e-6)
    assert found.relative_error == pytest.approx(0.01, rel=1e-3)  # the 1% scale, at its worst
    assert found.describe().startswith(f"first diverging layer: {subblock} (max |engine - ")


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
    engine, memo = _engine(variant, mutations.BY_NAME["norm_eps"])
    verdict = judge.check(engine, golden, name, "torch", tol, variant, memo=memo)
    layer = diagnosis.diverging_layer(engine, variant, golden, verdict)
    assert layer is not None and layer[0] == verdict.reports[0].case_id
    assert layer[1].startswith("first diverging layer: layer 0, attention norm (")
    failures = failure_report.failures_with_report(
        verdict, golden, engine.tokenizer.decode, tmp_path, variant.test_id, layer
    )
    assert failures[-2] == f"case {layer[0]!r}: {layer[1]}"
    page = Path(failures[-1].removeprefix("report: ").split(" (after")[0]).read_text()
    assert html.escape(layer[1], quote=False) in page


# torch_reference itself: the model-only copy transformers loads, and the refusal of rope_freqs
# transformers cannot reproduce.
@pytest.fixture(scope="module")
def rope_tiny(tmp_path_factory) -> Path:
    """A 2-layer Q8_0 checkpoint with the byte vocabulary and Llama 3.1's rope_freqs at rope
    theta 1e4 (head dim 16: factors 1 six times, 4.68, 8), written in milliseconds."""
    path = tmp_path_factory.mktemp("rope_tiny") / "tiny_rope.gguf"
    shape = TinyLlamaConfig(
        n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, intermediate_dim=128, rope_theta=1e4
    )
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    write_tiny_llama(path, rope_freqs=rope_freq_factors(shape), weight_type=q8_0)
    return path


def _tensors(reader: gguf.GGUFReader) -> list[tuple[str, int, list[int], bytes]]:
    """A GGUF's tensors as gguf-py reads them, in file order: name, type, shape and bytes."""
    return [(t.name, t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in reader.tensors]


def test_the_model_only_copy_keeps_every_tensor_and_model_field(rope_tiny: Path) -> None:
    """torch_reference.model_only_copy, read back by gguf-py, holds the original's tensors
    (names, types, shapes, bytes) and every metadata field but the vocabulary arrays, in
    order, with the same types and values: transformers sees the file's model."""
    original = gguf.GGUFReader(rope_tiny)
    copy = gguf.GGUFReader(torch_reference.model_only_copy(rope_tiny))

    def fields(reader: gguf.GGUFReader) -> list[tuple[str, list, object]]:
        return [
            (key, field.types, field.contents())
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and key not in torch_reference._VOCABULARY_KEYS
        ]

    vocabulary = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
    assert vocabulary <= set(original.fields) and not vocabulary & set(copy.fields)
    assert len(fields(original)) == 16
    assert fields(copy) == fields(original)
    assert len(original.tensors) == 22
    assert _tensors(copy) == _tensors(original)


def test_rope_freqs_transformers_cannot_reproduce_exit_2_naming_the_file(
    rope_tiny: Path, tmp_path: Path, capsys
) -> None:
    """The file's Llama 3.1 factors load and are used exactly; a copy whose last rope_freqs
    factor is x1.1 (8 -> 8.8) stops the reference with exit status 2 and a message naming the
    file, the mismatch (that inverse frequency 1 - 1/1.1 = 0.0909 off) and what to do."""
    model = torch_reference.load_model(rope_tiny, torch.float32)
    rope_freqs = gguf.GGUFReader(rope_tiny).get_tensor(0)
    assert rope_freqs.name == "rope_freqs.weight"
    factors = torch.from_numpy(rope_freqs.data.copy())
    base = 1.0 / 1e4 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)
    assert torch.equal(model.model.rotary_emb.inv_freq, base / factors)

    copy = tmp_path / "tiny_rope_freqs_x1.1.gguf"
    shutil.copyfile(rope_tiny, copy)
    reader = gguf.GGUFReader(copy, "r+")
    rope_freqs = reader.get_tensor(0)
    assert rope_freqs.name == "rope_freqs.weight"
    rope_freqs.data[-1] *= np.float32(1.1)
    gguf_reader.flush(reader)
    del reader, rope_freqs
    with pytest.raises(SystemExit) as stop:
        torch_reference.load_model(copy, torch.float32)
    assert stop.value.code == 2
    message = str(stop.value)
    assert message.startswith(
        f"transformers reference: {copy}: rope_freqs.weight differs from transformers' "
        "llama3 rope scaling {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
        "'original_max_position_embeddings': 8192} at rope_theta 10000 (inverse frequency 7 "
        "of 8 off by 0.0909, relative; 1e-5 allowed)"
    )
    assert message.endswith(
        "give a Llama 3.1 GGUF (llama.cpp's convert_hf_to_gguf.py writes rope_freqs from these "
        "parameters), or judge this file by its own goldens only (golden_check --golden=own)"
    )
    assert message + "\n" in capsys.readouterr().err


def test_the_model_only_copy_follows_a_checkpoint_rewritten_in_place(tmp_path: Path) -> None:
    """model_only_copy is made once per file and process, keyed by the file's path, size and
    modification time: a checkpoint regenerated in place (same path, same size, other weights,
    as gen_tiny_model rewrites one) gets a fresh copy with the new tensors, not the first
    one's. Planted: the modification time dropped from the key (the old weights were served
    to transformers)."""
    import os

    path = tmp_path / "tiny_rewritten.gguf"
    write_tiny_llama(path, n_layers=1, seed=0)

    first = _tensors(gguf.GGUFReader(torch_reference.model_only_copy(path)))
    assert first == _tensors(gguf.GGUFReader(path))
    mtime_ns = path.stat().st_mtime_ns
    size = path.stat().st_size
    write_tiny_llama(path, n_layers=1, seed=1)
    os.utime(path, ns=(mtime_ns + 10**9, mtime_ns + 10**9))  # however coarse the clock
    assert path.stat().st_size == size
    second = _tensors(gguf.GGUFReader(torch_reference.model_only_copy(path)))
    assert second == _tensors(gguf.GGUFReader(path))
    assert second != first


def test_a_bfloat16_reference_keeps_its_dtype_and_computes_attention_in_float32(
    tmp_path: Path,
) -> None:
    """A bfloat16 checkpoint loads in bfloat16 with transformers' SDPA computed in float32 and
    rounded once to bfloat16 (as the engine's attention), and load_reference keeps the
    variant's dtype; float32_head then runs the final norm in float32 (eps included) and
    yields the LM head in float32, and takes its hook off after. Planted: the float32 SDPA
    chosen for float32 models only, its output left in float32, load_reference loading
    float32, the norm's eps dropped, the hook left on."""
    from transformers import AttentionInterface

    path = tmp_path / "tiny_bf16.gguf"
    write_tiny_llama(path, n_layers=1, weight_type=gguf.GGMLQuantizationType.BF16)
    variant = Variant("tinyllama", "bfloat16", "tiny", "llama3_1", path)
    assert variant.dtype == torch.bfloat16
    model, _ = torch_reference.load_reference(variant, "cpu")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == torch_reference.FLOAT32_SDPA

    # The registered attention: float32 SDPA of the bfloat16 inputs, rounded once.
    attention = AttentionInterface()[torch_reference.FLOAT32_SDPA]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=generator).bfloat16()  # 4 heads, 2 kv heads
    k, v = (torch.randn(1, 2, 5, 16, generator=generator).bfloat16() for _ in range(2))
    module = model.model.layers[0].self_attn
    out, _ = attention(module, q, k, v, None, dropout=0.0, scaling=0.25, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
        is_causal=True, scale=0.25,
    ).transpose(1, 2)  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-6)

    ids = torch.tensor([[0, 5, 9, 200, 17]])
    with torch.inference_mode():
        logits = model(ids).logits
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
        x = torch.randn(1, 3, 64, generator=generator).bfloat16() * 1e-3  # eps matters here
        norm = model.model.norm
        with torch_reference.float32_head(model) as head:
            assert head.dtype == torch.float32
            assert torch.equal(head, model.lm_head.weight.float())
            hooked = norm(x)
        xf = x.float()
        expected = norm.weight.float() * (
            xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        )
        assert hooked.dtype == torch.float32
        assert torch.equal(hooked, expected)
        assert norm(x).dtype == torch.bfloat16  # the hook is off again
