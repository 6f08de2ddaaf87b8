"""Every published golden discriminates (goldens/sanity.py says what that means), holds
cases.yaml's cases with their step counts and, the engine's, every sampler on every short case,
names the checkpoint (by sha256) and producer it was made from, the claims testdata/README.md
makes about the goldens hold, and a degenerate engine fails against every published golden
under every tolerance entry."""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from goldens import compare, record, schema
from goldens.record import CaseSpec, file_sha256
from goldens.sanity import degeneracy_problems
from goldens.tolerances import Tolerance, entries, tolerance
from harness.llama3 import failure_report, judge, sampler_check
from harness.llama3.engine_runs import Run
from harness.llama3.golden_files import GoldenSource
from harness.llama3.sampling_goldens import check_drawn, check_forced
from harness.llama3.variants import GGML_ENCODINGS, Variant, variants
from pipelines.llama3 import sampling
from pipelines.llama3.tokenizer import Tokenizer

VARIANTS = [v for v in variants() if v.path is not None]
REFERENCES = ["own", "torch"]
# Every published golden: the own and torch goldens of every checkpoint, and the ggml mode's
# of the files it has them for.
GOLDENS = [(v, r) for v in VARIANTS for r in REFERENCES] + [
    (v, "ggml") for v in VARIANTS if v.encoding in GGML_ENCODINGS
]
EACH_GOLDEN = pytest.mark.parametrize(
    ("variant", "reference"), GOLDENS, ids=[f"{v.test_id}-{r}" for v, r in GOLDENS]
)


def _engine_goldens() -> list:
    """(variant, reference) of every engine golden: the eager mode's and the ggml mode's."""
    return [
        pytest.param(v, reference, id=f"{v.test_id}-{reference}")
        for v in VARIANTS
        for reference in ("own", "ggml")
        if reference == "own" or v.encoding in GGML_ENCODINGS
    ]


# testdata/README.md, "Goldens": what every published golden of the golden prompts shows.
README_MIN_GAP = 0.01  # smallest top-1/top-2 logit gap of any step
README_MIN_DISTINCT = 5  # distinct greedy tokens per case (of 10 steps)


@EACH_GOLDEN
def test_golden_is_not_degenerate(variant: Variant, reference: str, goldens) -> None:
    golden, name = goldens.load(reference, variant)
    margin = tolerance(reference, variant.encoding, "cpu").near_tie_margin
    problems = degeneracy_problems(golden, margin)
    assert not problems, f"degenerate golden {name}:\n  " + "\n  ".join(problems)


# How far each model's long cases reach (cases.yaml): past Llama 3.1's original context on
# the tiny checkpoints, about 2k positions on SmolLM2 (context 8192).
LONG_REACH = {"tinyllama": 8192, "smollm2": 2000}


@EACH_GOLDEN
def test_long_cases_reach_far_and_record_prompt_positions(variant, reference, goldens) -> None:
    golden, name = goldens.load(reference, variant)
    if variant.model not in LONG_REACH:
        pytest.skip(f"{variant.model} has no long cases (cases.yaml)")
    long_cases = judge.in_lane(golden, variant.model, "long").cases
    assert long_cases, f"{name} has no long case"
    reach = max(max(c.positions) for c in long_cases)
    assert reach >= LONG_REACH[variant.model], f"{name}: prompt positions end at {reach}"
    specs = {spec.id: spec for spec in record.case_specs(variant.model)}
    for case in golden.cases:
        spread = specs[case.id].positions(len(case.input_ids))
        assert case.positions == spread, f"{name} {case.id}: positions {case.positions[:9]}..."


@pytest.mark.parametrize(
    ("variant", "reference"),
    [(v, r) for v, r in GOLDENS if r in REFERENCES],
    ids=[f"{v.test_id}-{r}" for v, r in GOLDENS if r in REFERENCES],
)  # the claims are the engine's and torch's goldens' (SmolLM2's ggml golden: a 0.0025 gap)
def test_readme_claims_hold_for_the_published_golden(variant, reference, goldens) -> None:
    golden, name = goldens.load(reference, variant)
    golden = judge.in_lane(golden, variant.model, "short")  # the claims' cases
    gaps = {(c.id, i): s.top_gap for c in golden.cases for i, s in enumerate(c.steps)}
    narrowest = min(gaps, key=gaps.get)
    assert gaps[narrowest] >= README_MIN_GAP, f"{name}: gap {gaps[narrowest]} at {narrowest}"
    for case in golden.cases:
        assert len(case.steps) == 10, f"{name} {case.id}: {len(case.steps)} steps"
        assert len(set(case.token_ids)) >= README_MIN_DISTINCT, f"{name} {case.id}"


@functools.cache
def _tokenizer(checkpoint: Path) -> Tokenizer:
    """A checkpoint's tokenizer, read once per session (0.1-0.9 s a file: from_gguf reads the
    whole vocabulary)."""
    return Tokenizer.from_gguf(checkpoint)


@functools.cache
def _checkpoint_sha256(checkpoint: Path) -> str:
    """A checkpoint's sha256, hashed once per session (SmolLM2's 98 MB file: 0.08 s from the
    page cache, the tiny ones 0.02 s each)."""
    return file_sha256(checkpoint)


@EACH_GOLDEN
def test_every_case_has_its_step_count_or_ends_on_end_of_sequence(
    variant, reference, goldens
) -> None:
    """Every case of cases.yaml, short and long, is in the golden with its `steps` greedy
    steps, or fewer whose last token (and only that one) is an end-of-sequence id, as the
    producers generate; `stopped_on_eos` says which. A long case cut to one step passes the
    degeneracy rules (one distinct token of one step) and would leave every position past the
    prompt unjudged."""
    golden, name = goldens.load(reference, variant)
    specs = record.case_specs(variant.model)
    assert [c.id for c in golden.cases] == [s.id for s in specs], f"{name}: its cases"
    eos = _tokenizer(variant.path).eos_ids
    problems = []
    for case, spec in zip(golden.cases, specs, strict=True):
        tokens = case.token_ids
        ends_on_eos = bool(tokens) and tokens[-1] in eos
        if case.stopped_on_eos != ends_on_eos:
            problems.append(
                f"{case.id}: stopped_on_eos {case.stopped_on_eos}, last token {tokens[-1:]}"
            )
        if any(t in eos for t in tokens[:-1]):
            problems.append(f"{case.id}: an end-of-sequence id before the last step: {tokens}")
        if len(tokens) != spec.steps and not (ends_on_eos and len(tokens) < spec.steps):
            problems.append(f"{case.id}: {len(tokens)} steps, cases.yaml's steps {spec.steps}")
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(("variant", "reference"), _engine_goldens())
def test_sampling_goldens_cover_every_short_case_and_sampler(variant, reference, goldens) -> None:
    """An engine golden records, once each, every sampler of cases.yaml on every short case
    (none on a long one) with the sampler's settings, and each seeded continuation has the
    case's step count or ends on its first end-of-sequence id; test_llama_sampling judges only
    the records it finds."""
    golden, name = goldens.load(reference, variant)
    samplers = {spec.id: spec.settings for spec in record.sampler_specs()}
    short = [s for s in record.case_specs(variant.model) if not s.long]
    recorded = [(c.id, s.sampler) for c in golden.cases for s in c.sampling]
    expected = {(case.id, sampler) for case in short for sampler in samplers}
    assert len(recorded) == len(set(recorded)) and set(recorded) == expected, (
        f"{name}: recorded {sorted(recorded)}, cases.yaml {sorted(expected)}"
    )
    steps = {spec.id: spec.steps for spec in short}
    eos = _tokenizer(variant.path).eos_ids
    for case in golden.cases:
        for sampled in case.sampling:
            where = f"{name} {case.id}/{sampled.sampler}"
            assert sampled.settings == samplers[sampled.sampler], f"{where}: {sampled.settings}"
            tokens = sampled.tokens
            stops = [i for i, t in enumerate(tokens) if t in eos]
            assert stops == ([len(tokens) - 1] if len(tokens) < steps[case.id] else []), (
                f"{where}: {len(tokens)} tokens {tokens}, cases.yaml's steps {steps[case.id]}"
            )


@EACH_GOLDEN
def test_provenance_names_the_variant_its_checkpoint_and_producer(
    variant, reference, goldens
) -> None:
    """A golden's provenance is what golden_files.provenance writes for this variant and
    reference: its model and encoding, the checkpoint's file name and sha256 (a golden of
    another file judges the wrong weights), the reference's producer (schema.PRODUCERS), the
    compute dtype, and the CPU's hardware key and device. `logits_dtype` is a constant of that
    function (float32 for every producer), so it only catches a file another writer made."""
    golden, name = goldens.load(reference, variant)
    prov = golden.provenance
    expected = {
        "producer": schema.PRODUCERS[reference],
        "model": variant.model,
        "encoding": variant.encoding,
        "checkpoint": variant.path.name,
        "checkpoint_sha256": _checkpoint_sha256(variant.path),
        "dtype": str(variant.dtype).removeprefix("torch."),
        "hardware": "all",
        "device": "cpu",
        "logits_dtype": "float32",
    }
    assert {f: getattr(prov, f) for f in expected} == expected, f"{name}"


@EACH_GOLDEN
def test_a_run_emitting_one_token_at_every_step_fails_under_every_entry(
    variant, reference, goldens
) -> None:
    """The old harness's blind spot: a constant-token run against a golden whose first step
    is a near-tie was AMBIGUOUS, hence green. The constant token here is the golden's own
    runner-up at its narrowest step, the hardest case for the tie rule."""
    golden, name = goldens.load(reference, variant)
    long_ids = {spec.id for spec in record.case_specs(variant.model) if spec.long}
    for entry in entries(reference, variant.encoding):
        for case in golden.cases:
            tol = entry.for_case(case.id in long_ids)  # the thresholds the judge applies
            tokens, logits = _constant_run(golden, case)
            report = compare.compare_case(case, case.input_ids, tokens, logits, tol)
            assert report.status == compare.FAIL, f"{name} {case.id} passes under {tol.key}"
            assert not report.ambiguous_steps, f"{name} {case.id} under {tol.key}"


def _constant_run(golden, case) -> tuple[list[int], np.ndarray]:
    """One token at every step, the golden's own runner-up at its narrowest step."""
    vocab = 1 + max(i for c in golden.cases for s in c.steps for i in s.topk_ids)
    narrowest = min(case.steps, key=lambda s: s.top_gap)
    constant = narrowest.topk_ids[1]
    logits = np.zeros((len(case.steps), vocab), dtype=np.float32)
    logits[:, constant] = 58.0
    return [constant] * len(case.steps), logits


def test_an_entrys_long_thresholds_judge_its_long_cases_and_no_other(goldens) -> None:
    """judge.compare_runs judges each case by its lane's thresholds: tiny bfloat16's long
    cases by `cpu/long` (0.12, one flipped rounding through a long prompt), the short ones by
    `cpu` (0.05); float32, whose entry has no `long`, judges both by `cpu`."""
    for encoding, long_key in (("bfloat16", "own/bfloat16/cpu/long"), ("float32", None)):
        (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == encoding]
        golden, name = goldens.load("own", variant)
        runs = [
            Run(
                CaseSpec(c.id, c.prompt, len(c.steps), 20),
                c.input_ids,
                *_constant_run(golden, c),
                0.0,
            )
            for c in golden.cases
        ]
        entry = tolerance("own", encoding, "cpu")
        verdict = judge.compare_runs(runs, golden, name, "own", entry, variant, str)
        long_ids = {spec.id for spec in record.case_specs(variant.model) if spec.long}
        assert long_ids and len(verdict.reports) == len(golden.cases)
        assert {r.case_id: r.tolerance.key for r in verdict.reports} == {
            c.id: long_key if long_key and c.id in long_ids else entry.key for c in golden.cases
        }


@pytest.mark.parametrize(("variant", "reference"), _engine_goldens())
def test_every_constrained_continuation_is_a_short_member(variant, reference, goldens) -> None:
    """Every constrained continuation of a published golden (greedy and seeded) ends on an
    end-of-sequence id before its max tokens, and its text is a member of its language,
    decided without the engine's library (goldens.record.ConstraintSpec.member: jsonschema,
    Python's `re`, the list of choices); every constraint of cases.yaml is recorded on each
    case it names."""
    golden, name = goldens.load(reference, variant)
    tokenizer = _tokenizer(variant.path)
    specs = {spec.id: spec for spec in record.constraint_specs()}
    recorded = set()
    problems = []
    for case in golden.cases:
        for entry in case.constrained:
            spec = specs[entry.constraint]
            assert (entry.kind, entry.text) == (spec.kind, spec.text), f"{name}: {entry.constraint}"
            recorded.add((case.id, entry.constraint))
            for what, tokens in (("greedy", entry.token_ids), ("seeded", entry.sampled.tokens)):
                where = f"{case.id}/{entry.constraint} {what}"
                if not tokens or tokens[-1] not in tokenizer.eos_ids:
                    problems.append(f"{where}: no end of sequence in {len(tokens)} tokens")
                elif len(tokens) >= spec.max_tokens:
                    problems.append(f"{where}: ran to max tokens ({spec.max_tokens})")
                else:
                    reason = spec.member(tokenizer.decode(tokens[:-1]))
                    if reason:
                        problems.append(f"{where}: {reason}")
    expected = {(case, spec.id) for spec in specs.values() for case in spec.cases}
    assert recorded == expected, (
        f"{name}: recorded {sorted(recorded)}, cases.yaml {sorted(expected)}"
    )
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_a_shipped_checkpoint_missing_fails_where_goldens_are_required(monkeypatch) -> None:
    """The lanes skip a variant without a file, except a checkpoint the project ships or pins
    under $GOLDENS_REQUIRED=1 (every bazel test): that fails (the Llama-3.1-8B file, the
    user's to give, skips)."""
    from harness.llama3.variants import skip_unavailable

    shipped = Variant("smollm2", "q4_1", "real", "smollm2", None, "not fetched")
    users = Variant("llama3_1", "unknown", "real", "llama3_1", None, "no file given")
    monkeypatch.setenv("GOLDENS_REQUIRED", "1")
    with pytest.raises(pytest.fail.Exception, match="a shipped checkpoint missing fails"):
        skip_unavailable(shipped)
    with pytest.raises(pytest.skip.Exception):
        skip_unavailable(users)
    monkeypatch.delenv("GOLDENS_REQUIRED")
    with pytest.raises(pytest.skip.Exception):
        skip_unavailable(shipped)


# --- The judging harness itself (harness/llama3: judge, sampling_goldens, sampler_check,
# failure_report) on made-up numbers and the published tiny float32 golden, without an engine.


def _tiny_float32(goldens) -> tuple[Variant, schema.Golden, object]:
    (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == "float32"]
    golden, name = goldens.load("own", variant)
    return variant, golden, name


def _constant_runs(golden: schema.Golden, cases: list[schema.Case]) -> list[Run]:
    return [
        Run(CaseSpec(c.id, c.prompt, len(c.steps), 20), c.input_ids, *_constant_run(golden, c), 0.0)
        for c in cases
    ]


def test_a_case_cases_yaml_does_not_list_stays_in_every_lane_and_fails_the_case_list(
    goldens,
) -> None:
    """judge.in_lane keeps each lane's cases of cases.yaml, in its order, and a case that
    cases.yaml does not list in every lane, where compare_runs judges it and fails the case
    list naming it. Catches an in_lane that keeps only the lane's listed ids (the unlisted
    case then vanishes, and with it the case-list failure) and a lane filter that mixes the
    lanes up."""
    variant, golden, name = _tiny_float32(goldens)
    specs = record.case_specs(variant.model)
    extra = dataclasses.replace(golden.cases[0], id="unlisted")
    with_extra = dataclasses.replace(golden, cases=[*golden.cases, extra])
    for lane, listed in (
        ("all", [s.id for s in specs]),
        ("short", [s.id for s in specs if not s.long]),
        ("long", [s.id for s in specs if s.long]),
    ):
        kept = [c.id for c in judge.in_lane(with_extra, variant.model, lane).cases]
        assert kept == [*listed, "unlisted"], f"lane {lane}"
    entry = tolerance("own", "float32", "cpu")
    runs = _constant_runs(with_extra, with_extra.cases)
    verdict = judge.compare_runs(runs, with_extra, name, "own", entry, variant, str)
    assert verdict.failures[0].startswith(f"golden {name} has cases ")
    assert "'unlisted'" in verdict.failures[0] and "cases.yaml lists" in verdict.failures[0]
    assert [r.case_id for r in verdict.reports] == [c.id for c in with_extra.cases]


def test_the_case_list_check_compares_prompts_and_order_not_only_ids(goldens) -> None:
    """A golden whose cases have cases.yaml's ids but another prompt (cases.yaml edited, the
    golden not regenerated), or cases.yaml's cases in another order, fails the case list;
    the published golden does not. Catches a check that compares the ids alone or as sets."""
    variant, golden, name = _tiny_float32(goldens)
    entry = tolerance("own", "float32", "cpu")
    first = golden.cases[0]
    edited = dataclasses.replace(golden.cases[0], prompt=first.prompt + " Then?")
    for changed in (
        dataclasses.replace(golden, cases=[edited, *golden.cases[1:]]),
        dataclasses.replace(golden, cases=[*golden.cases[1:], first]),
        golden,
    ):
        runs = _constant_runs(changed, changed.cases)
        verdict = judge.compare_runs(runs, changed, name, "own", entry, variant, str)
        listed = [f for f in verdict.failures if "cases.yaml lists" in f]
        assert len(listed) == (changed is not golden), f"{listed}"
        assert len(verdict.reports) == len(golden.cases)


def test_a_case_without_a_run_fails_naming_it(goldens) -> None:
    """compare_runs fails a golden case that no run answers ("no run of case ..."), and
    judges the others. Catches a missing run skipped in silence (a lane that lost a case,
    green)."""
    variant, golden, name = _tiny_float32(goldens)
    entry = tolerance("own", "float32", "cpu")
    runs = _constant_runs(golden, golden.cases[1:])
    verdict = judge.compare_runs(runs, golden, name, "own", entry, variant, str)
    assert f"no run of case {golden.cases[0].id!r} of golden {name}" in verdict.failures
    assert [r.case_id for r in verdict.reports] == [c.id for c in golden.cases[1:]]


def _step_check(step, logprob, kl, position, tokens=(7, 7), **fields) -> compare.StepCheck:
    return compare.StepCheck(
        step=step,
        status=fields.pop("status", compare.PASS),
        metric="",
        detail="",
        expected_token=tokens[0],
        actual_token=tokens[1],
        golden_gap=1.0,
        max_logprob_diff=logprob,
        kl=kl,
        topk_overlap=1.0,
        worst=[],
        position=position,
        **fields,
    )


def _made_up_verdict(failures: list[str]) -> judge.Verdict:
    """Two made-up case reports under an entry whose long thresholds are wider: `short`
    (two steps, the second's greedy token another), `long` (one prompt position and one
    ambiguous step, judged by the long thresholds as compare_runs gives them)."""
    long = Tolerance("made/up/cpu/long", 0.12, 1e-3, 0.9, 0.01, "made up")
    entry = Tolerance("made/up/cpu", 0.05, 1e-3, 0.9, 0.01, "made up", long=long)
    short_report = compare.CaseReport(
        "short",
        "a short prompt",
        compare.PASS,
        [_step_check(0, 0.04, 0.0, 5), _step_check(1, 0.01, 0.9e-3, 6, tokens=(7, 8))],
        True,
        entry,
    )
    long_report = compare.CaseReport(
        "long",
        "a long prompt",
        compare.PASS,
        [_step_check(0, 0.03, 0.0, 4000, status=compare.AMBIGUOUS)],
        True,
        long,
        prompt_checks=[_step_check(0, 0.06, 0.0, 100, in_prompt=True)],
    )
    source = GoldenSource("made_up.json")
    return judge.Verdict(source, "own", entry, [short_report, long_report], failures)


def test_verdict_headroom_takes_each_cases_own_thresholds_and_the_summary_counts() -> None:
    """Verdict.headroom divides each check by its case's thresholds (a long case's own where
    the entry has them): the long prompt position's 0.06 is 0.5 of its 0.12, under the short
    case's KL at 0.9 of its limit; the summary counts generated steps apart from prompt
    positions, greedy agreement over the steps, the ambiguous steps, and says FAIL exactly
    when the verdict has failures. Catches headroom against the entry's thresholds for every
    case (the long position would read 1.2) and steps counted with the prompt positions."""
    verdict = _made_up_verdict([])
    assert verdict.headroom() == (pytest.approx(0.9), "kl", "short, step 1 (position 6)")
    assert (verdict.steps, verdict.prompt_positions, verdict.ambiguous_steps) == (3, 1, 1)
    assert verdict.last_position == 4000
    assert verdict.max_logprob_diff == 0.06
    assert verdict.summary() == (
        "own made_up.json [made/up/cpu]: PASS, 3 steps teacher-forced and 1 prompt positions, "
        "up to position 4000, max |Δ log-prob| 0.06, max KL 0.0009, greedy agreement 2/3, "
        "ambiguous steps 1 (long step 0)"
    )
    assert (
        _made_up_verdict(["the case list"])
        .summary()
        .startswith("own made_up.json [made/up/cpu]: FAIL, 3 steps")
    )


def test_the_failure_report_counts_failing_cases_not_failure_lines(goldens, tmp_path) -> None:
    """The HTML report's summary says how many of the verdict's cases fail: a golden case
    without a run is a failure line but no case report, so 'cases: N of N fail' for the N
    cases judged. Catches a count of the failure lines instead."""
    variant, golden, name = _tiny_float32(goldens)
    entry = tolerance("own", "float32", "cpu")
    runs = _constant_runs(golden, golden.cases[1:])
    verdict = judge.compare_runs(runs, golden, name, "own", entry, variant, str)
    judged = len(golden.cases) - 1
    assert len(verdict.failures) == judged + 1
    path = failure_report.write_failure_report(
        verdict, golden, lambda ids: f"<{ids[0]}>", tmp_path, "sweep"
    )
    assert path.name == "golden_report_sweep_tinyllama_float32_all_golden.html"
    assert f"cases: {judged} of {judged} fail" in path.read_text(encoding="utf-8")


# Made-up sampling goldens: a vocabulary of 24, a 3-token prompt, rows of N(0, 2) logits.
SWEEP_TOL = Tolerance("made/up/cpu", 0.05, 1e-3, 0.9, 0.01, "made up")
VOCAB = 24
PROMPT = [3, 1, 4]
PENALIZED = {"temperature": 0.8, "top_k": 8, "repetition_penalty": 1.5, "presence_penalty": 1.0}


def _rows(seed: int, steps: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, (steps, VOCAB)).astype(np.float32)


def _processed(rows, settings, history_of) -> list[schema.Kept]:
    return [
        schema.kept_from(*sampling.processed(row, settings, history_of(i)))
        for i, row in enumerate(rows)
    ]


def _draws(rows: np.ndarray, settings: sampling.SamplerSettings) -> tuple[list, list]:
    """A seeded continuation as the engine draws it: token i from row i processed with the
    prompt and the tokens drawn before as history, at the uniform of its position."""
    history, tokens = list(PROMPT), []
    for row in rows:
        ids, probs = sampling.processed(row, settings, history)
        tokens.append(int(sampling.pick(ids, probs, sampling.uniform(settings.seed, len(history)))))
        history.append(tokens[-1])
    return tokens, _processed(rows, settings, lambda i: [*PROMPT, *tokens[:i]])


def _made_up_case(rows: np.ndarray, sampler: str, settings: dict, drawn_rows=None) -> schema.Case:
    """A case whose greedy tokens are the rows' argmax, with one sampler's goldens: the
    teacher-forced distributions of `rows`, and the seeded continuation drawn from
    `drawn_rows` (none without)."""
    tokens = [int(row.argmax()) for row in rows]
    s = sampling.SamplerSettings(**settings)
    forced = _processed(rows, s, lambda i: [*PROMPT, *tokens[:i]])
    drawn_tokens, drawn = ([], []) if drawn_rows is None else _draws(drawn_rows, s)
    return schema.Case(
        id="made_up",
        prompt="made up",
        input_ids=PROMPT,
        steps=[
            schema.step_from_logits(r, t, f"<{t}>", 8) for r, t in zip(rows, tokens, strict=True)
        ],
        sampling=[schema.Sampled(sampler, settings, forced, drawn_tokens, drawn)],
    )


def _forced_run(case: schema.Case, rows: np.ndarray) -> Run:
    spec = CaseSpec(case.id, case.prompt, len(case.steps), 8)
    return Run(spec, PROMPT, case.token_ids, rows, 0.0)


def test_check_forced_holds_each_step_to_its_own_history_and_kept_set() -> None:
    """sampling_goldens.check_forced: the run of the golden's own logits passes every step
    (its history is the prompt and the golden's tokens before the step: with penalties the
    step's own token is not yet penalized); a run whose step 2 no longer keeps a token the
    golden keeps fails that step and only it, naming the case, sampler and step 2; one whose
    step 4 moves the kept probabilities past the draw margin fails step 4. Catches a history
    off by one, kept-set failures (TV infinite) let through, and a message naming step 3."""
    rows = _rows(1, 6)
    case = _made_up_case(rows, "penalized", {**PENALIZED, "seed": 5})
    report = check_forced(case, _forced_run(case, rows), SWEEP_TOL, "made-up")
    assert (report.forced_steps, report.boundary_steps, report.failures) == (6, 0, [])
    kept = case.sampling[0].forced
    dropped = rows.copy()
    dropped[2, kept[2].ids[0]] -= 30.0  # the top kept token falls out of the top 8
    report = check_forced(case, _forced_run(case, dropped), SWEEP_TOL, "made-up")
    assert len(report.failures) == 1, report.failures
    assert report.failures[0].startswith(
        "made-up: case 'made_up', sampler 'penalized', teacher-forced step 2: the reference's "
        "kept tokens lie outside what the run's logits allow within the tolerance: it "
    )
    assert f"keeps [{kept[2].ids[0]}], which the chain cannot keep" in report.failures[0]
    moved = rows.copy()
    moved[4, kept[4].ids[1]] += 1.0  # still kept, with far more of the mass
    report = check_forced(case, _forced_run(case, moved), SWEEP_TOL, "made-up")
    assert len(report.failures) == 1 and "teacher-forced step 4: TV " in report.failures[0]


def test_check_drawn_follows_the_golden_until_it_differs_and_to_its_end() -> None:
    """sampling_goldens.check_drawn on a made-up continuation: its own draws pass every step
    (the uniform of token i at position len(prompt) + i); a run that goes on past the
    golden's last token fails, one that stops early fails at the step it lacks; a draw that
    differs where the uniform lies within the TV of a boundary is AMBIGUOUS and ends the
    comparison there (the histories differ). Catches the uniform taken at another position,
    a run past the golden's end let through, and the comparison going on after an AMBIGUOUS
    draw (which then fails on the diverged tokens)."""
    rows = _rows(2, 6)
    drawn_rows = _rows(3, 6)
    case = _made_up_case(rows, "hot", {"temperature": 1.5, "top_k": 8, "seed": 9}, drawn_rows)
    sampled = case.sampling[0]
    tokens = sampled.tokens
    report = check_drawn(case, sampled, PROMPT, tokens, drawn_rows, SWEEP_TOL, "solo")
    assert (report.draws, report.ambiguous_draws, report.failures) == (6, 0, [])
    longer = np.concatenate([drawn_rows, _rows(4, 1)])
    report = check_drawn(case, sampled, PROMPT, [*tokens, 0], longer, SWEEP_TOL, "solo")
    assert report.failures == [
        "solo: case 'made_up', sampler 'hot', seeded draw: the run went on past the golden's 6 "
        "tokens (stopped on an end-of-sequence id there) to 7"
    ]
    report = check_drawn(case, sampled, PROMPT, tokens[:3], drawn_rows[:3], SWEEP_TOL, "solo")
    assert len(report.failures) == 1 and report.failures[0].startswith(
        "solo: case 'made_up', sampler 'hot', seeded draw 3: the run stopped after 3 tokens"
    )

    # Two tokens kept at every step; at step 2 the golden's P(5) lies 0.002 above the
    # step's uniform (it draws 5), the run's 0.002 below it (it draws 6): TV 0.004.
    settings = {"top_k": 2, "seed": 9}
    u = float(sampling.uniform(9, len(PROMPT) + 2))
    assert 0.01 < u < 0.99

    def two_way(p: float) -> np.ndarray:
        row = np.full(VOCAB, -10.0, dtype=np.float32)
        row[5], row[6] = np.log(p / (1 - p)), 0.0
        return row

    golden_rows = _rows(5, 6)
    golden_rows[2] = two_way(u + 0.002)
    case = _made_up_case(rows, "two_way", settings, golden_rows)
    sampled = case.sampling[0]
    assert sampled.tokens[2] == 5
    run_rows = golden_rows.copy()
    run_rows[2] = two_way(u - 0.002)
    run_tokens = [*sampled.tokens[:2], 6, *sampled.tokens[3:]]
    report = check_drawn(case, sampled, PROMPT, run_tokens, run_rows, SWEEP_TOL, "solo")
    assert (report.draws, report.ambiguous_draws, report.failures) == (3, 1, [])


def _sampler_case(step_logits: list[float]) -> schema.Case:
    ids = list(range(100, 100 + len(step_logits)))
    row = np.full(200, -30.0)
    row[ids] = step_logits
    step = schema.step_from_logits(row, ids[0], "<100>", len(step_logits))
    return schema.Case(id="made_up", prompt="made up", input_ids=PROMPT, steps=[step])


class _StratifiedSampler:
    """An engine whose sampler draws the golden's first step processed in `order`, exactly:
    draw j of n at the uniform (j + 0.5) / n; its own top-k log-probabilities are the
    golden's."""

    def __init__(self, case: schema.Case, order: str) -> None:
        self.step, self.order = case.steps[0], order

    def sampled_tokens(self, input_ids, sampler, seeds):
        want = sampler_check.expected(
            self.step.topk_ids, self.step.topk_logits, sampler, self.order
        )
        ids, probs = np.array(list(want)), np.array(list(want.values()))
        seeds = list(seeds)
        return [int(sampling.pick(ids, probs, (s + 0.5) / len(seeds))) for s in seeds], ["x"]

    def next_token_rows(self, input_ids, positions, k):
        lp = self.step.topk_log_probs()[:k]
        return [types.SimpleNamespace(ids=self.step.topk_ids[:k], logprobs=list(lp))]


def test_check_sampler_passes_its_order_and_tells_the_other_apart() -> None:
    """sampler_check.check_sampler against an engine that draws exactly the judged order's
    distribution (its own logits the golden's): PASS, with the other order's p-value at most
    alpha and the power against it near 1; the same draws judged in the other order FAIL
    with the judged order's p-value (p_other) high. Catches p_other computed against the
    judged order's distribution."""
    case = _sampler_case([4.0 - 0.3 * i for i in range(20)])
    for order, other in (("llama_cpp", "transformers"), ("transformers", "llama_cpp")):
        engine = _StratifiedSampler(case, order)
        verdict = sampler_check.check_sampler(engine, case, order=order)
        assert verdict.verdict == "PASS", verdict.summary()
        assert verdict.p_value > 0.5 and verdict.p_other <= verdict.alpha, verdict.summary()
        assert verdict.power >= 0.999 and verdict.kl_noise == pytest.approx(0.0, abs=1e-12)
        judged_wrong = sampler_check.check_sampler(engine, case, order=other)
        assert judged_wrong.verdict == "FAIL", judged_wrong.summary()
        assert judged_wrong.p_other > 0.5, judged_wrong.summary()


def test_a_sampler_verdict_is_inconclusive_only_past_ten_times_alpha() -> None:
    """SamplerVerdict.verdict: INCONCLUSIVE where the false-alarm rate exceeds 10 x alpha
    (the module docstring), else PASS or FAIL by the p-value at alpha. Catches the rate held
    to alpha itself (a 5 x alpha rate: INCONCLUSIVE)."""
    alpha = sampler_check.ALPHA
    passing = sampler_check.SamplerVerdict("c", "llama_cpp", [], 5, 0.5, 0.0, 1.0, 0.0, 0.0)
    for false_alarm, p_value, expected in (
        (0.0, 0.5, "PASS"),
        (0.0, alpha / 2, "FAIL"),
        (5 * alpha, 0.5, "PASS"),
        (5 * alpha, alpha / 2, "FAIL"),
        (11 * alpha, 0.5, "INCONCLUSIVE"),
        (11 * alpha, alpha / 2, "INCONCLUSIVE"),
    ):
        verdict = dataclasses.replace(passing, false_alarm=false_alarm, p_value=p_value)
        assert verdict.verdict == expected, (false_alarm, p_value)


def test_a_sampler_is_usable_only_with_a_top_k_the_golden_stores() -> None:
    """sampler_check.usable: a top_k from 1 to the golden's stored top-k gives an exact
    expected distribution; top_k 0 (off: any token may be kept), none, or more than stored
    does not. Catches top_k 0 accepted."""
    step = _sampler_case([4.0 - 0.3 * i for i in range(20)]).steps[0]
    for sampler, ok in (
        ({"top_k": 1}, True),
        ({"top_k": 20}, True),
        ({"top_k": 0}, False),
        ({}, False),
        ({"top_k": 21}, False),
    ):
        assert (sampler_check.usable(step, sampler) is None) == ok, sampler


# docs/goldens.md's claims about the sampling, sampler and constrained checks that no fast
# test held (a claims audit): each test below passed its plant before it was written, and
# fails with it now.


def test_the_draw_margin_is_the_documented_bound() -> None:
    """docs/goldens.md:168-170: draw_margin(atol, settings) = expm1(delta) / 2 with delta =
    2 atol max(r, 1/r) / T (r the repetition penalty, T the temperature), checked at a
    penalty below 1, above 1 and none, and at three temperatures. Plants caught: the halving
    dropped, r taken for max(r, 1/r) (a penalty below 1 then narrows the margin), and the
    temperature left out (the draw-rule proofs in test_sampling pass all three)."""
    for atol, t, r in ((0.01, 1.0, 1.0), (0.01, 0.5, 0.8), (0.05, 2.0, 1.3), (1e-4, 0.7, 1.0)):
        settings = sampling.SamplerSettings(temperature=t, repetition_penalty=r)
        delta = 2.0 * atol * max(r, 1.0 / r) / t
        assert sampling.draw_margin(atol, settings) == pytest.approx(
            np.expm1(delta) / 2.0, rel=1e-12
        ), (atol, t, r)
    assert sampling.draw_margin(0.01, sampling.SamplerSettings(repetition_penalty=0.8)) == (
        sampling.draw_margin(0.01, sampling.SamplerSettings(repetition_penalty=1.25))
    )


def test_compare_continuations_stops_at_the_first_draw_that_is_not_equal() -> None:
    """docs/goldens.md:184-186: compare_continuations walks two seeded continuations and stops
    at the first step that is not equal (after an AMBIGUOUS draw the histories differ). Step
    0 keeps tokens 5 and 6, the reference's P(5) 0.002 above the step's uniform and the
    run's 0.002 below it (an AMBIGUOUS draw); the continuations then go on with other tokens.
    One verdict comes back. Plant caught: the walk stopping only on FAIL (it then judges
    step 1 on the reference's history, where the run's token is not its draw)."""
    settings = sampling.SamplerSettings(top_k=2, seed=9)
    u = float(sampling.uniform(9, len(PROMPT)))
    assert 0.01 < u < 0.99

    def two_way(p: float) -> np.ndarray:
        row = np.full(VOCAB, -10.0)
        row[5], row[6] = np.log(p / (1 - p)), 0.0
        return row

    later = _rows(6, 3).astype(np.float64)
    reference = np.stack([two_way(u + 0.002), *later])
    run = np.stack([two_way(u - 0.002), *later])
    margin = sampling.draw_margin(SWEEP_TOL.logprob_atol, settings)
    ref_tokens = [5, 0, 1, 2]
    run_tokens = [6, 3, 4, 7]
    verdicts = sampling.compare_continuations(
        (ref_tokens, reference), (run_tokens, run), settings, 9, PROMPT, margin
    )
    assert [(v.verdict, v.reference_token, v.run_token) for v in verdicts] == [("AMBIGUOUS", 5, 6)]


def test_a_sampler_whose_own_logits_keep_other_tokens_is_inconclusive() -> None:
    """docs/goldens.md:336-339 (sampler_check's docstring): where the engine's own logits,
    processed, keep other tokens than the golden's, its draws cannot be judged against the
    golden: the false-alarm rate is 1, the KL infinite, the verdict INCONCLUSIVE, even for
    draws that are exactly the judged order's. Plant caught: that branch's rate set to 0
    (the verdict then reads PASS)."""
    case = _sampler_case([4.0 - 0.3 * i for i in range(20)])

    class _OtherTopK(_StratifiedSampler):
        def next_token_rows(self, input_ids, positions, k):
            lp = self.step.topk_log_probs()[:k]
            return [
                types.SimpleNamespace(
                    ids=[i + 50 for i in self.step.topk_ids[:k]], logprobs=list(lp)
                )
            ]

    verdict = sampler_check.check_sampler(_OtherTopK(case, "llama_cpp"), case)
    assert verdict.p_value > 0.5, verdict.summary()  # the draws themselves are right
    assert (verdict.false_alarm, verdict.kl_noise) == (1.0, np.inf)
    assert verdict.verdict == "INCONCLUSIVE", verdict.summary()


def test_a_constrained_mask_must_hold_the_goldens_ids_not_only_their_count() -> None:
    """docs/goldens.md:275-276: each teacher-forced step's allowed ids must equal the golden's
    exactly. constrained_goldens._mask_failure: the same ids pass; as many other ids fail,
    listed (up to 64 ids, the golden lists them) or by count and sha256 alone (over 64).
    Plant caught: a mask compared by its count only."""
    from harness.llama3 import constrained_goldens

    for golden_ids, run_ids, detail in (
        ([1, 2, 3], [1, 2, 3], None),
        (
            [1, 2, 3],
            [1, 2, 4],
            "the run allows 3 ids, the golden 3 (the run's extra [4], missing [3])",
        ),
        ([1, 2, 3], [1, 2], "the run allows 2 ids, the golden 3 (the run's extra [], missing [3])"),
        (list(range(100)), list(range(100)), None),
        (list(range(100)), list(range(1, 101)), "the run allows 100 ids, the golden 100"),
    ):
        golden = schema.allowed_from(golden_ids)
        got = constrained_goldens._mask_failure(golden, np.array(run_ids))
        assert got == detail, (golden_ids[:4], run_ids[:4])


def test_a_constrained_greedy_continuation_differs_only_at_a_near_tie_of_both_rows() -> None:
    """docs/goldens.md:281-282: the greedy constrained continuation must equal the golden's up
    to a step where both restricted rows make the two choices a near-tie (AMBIGUOUS, counted,
    the comparison ending there); a choice the golden's row or the run's prefers by the
    margin or more fails. Plant caught: a near-tie of either row accepted (`or`)."""
    from harness.llama3 import constrained_goldens

    assert SWEEP_TOL.near_tie_margin == 0.01  # the gaps below are read against it
    rows = np.full((3, VOCAB), -np.inf)
    rows[:, 5:9] = [[3.0, 1.0, 0.5, 0.0], [2.0, 1.995, 1.9, 0.0], [0.0, 0.0, 0.0, 4.0]]
    tokens = [5, 5, 8]
    steps = [schema.step_from_logits(r, t, f"<{t}>", 4) for r, t in zip(rows, tokens, strict=True)]
    entry = types.SimpleNamespace(constraint="made", steps=steps, token_ids=tokens)
    case = types.SimpleNamespace(id="made_up")

    def judged(run_rows, run_tokens):
        return constrained_goldens.check_greedy(
            case, entry, run_tokens, run_rows, SWEEP_TOL, "solo"
        )

    same = judged(rows, tokens)
    assert (same.greedy, same.ambiguous_greedy, same.failures) == (3, 0, [])
    tied = rows.copy()
    tied[1, 6] = 2.003  # the run takes 6, 0.003 ahead; the golden had it 0.005 behind
    report = judged(tied, [5, 6, 0])
    assert (report.greedy, report.ambiguous_greedy, report.failures) == (2, 1, [])
    run_far = rows.copy()
    run_far[1, 6] = 2.5  # the golden's near-tie, but the run prefers 6 by 0.5
    golden_far = rows.copy()
    golden_far[1, 7] = 2.001  # the run's near-tie, but the golden has 7 0.1 behind
    for run_rows, token in ((run_far, 6), (golden_far, 7)):
        report = judged(run_rows, [5, token, 8])
        assert report.ambiguous_greedy == 0 and len(report.failures) == 1, report.failures
        assert report.failures[0].startswith(
            f"solo: case 'made_up', constraint 'made', greedy step 1: the run chose {token}, "
            "the golden 5"
        )


def test_a_case_list_mismatch_names_the_regenerate_command(goldens) -> None:
    """docs/goldens.md:347-348: compare_runs fails when the golden's case list (ids and
    prompts) differs from cases.yaml, with the regenerate command. Plant caught: the
    failure without the command."""
    from harness.llama3.golden_files import regenerate_command

    variant, golden, name = _tiny_float32(goldens)
    entry = tolerance("own", "float32", "cpu")
    edited = dataclasses.replace(golden.cases[0], prompt=golden.cases[0].prompt + " Then?")
    changed = dataclasses.replace(golden, cases=[edited, *golden.cases[1:]])
    runs = _constant_runs(changed, changed.cases)
    verdict = judge.compare_runs(runs, changed, name, "own", entry, variant, str)
    listed = [f for f in verdict.failures if "cases.yaml lists" in f]
    assert len(listed) == 1
    assert listed[0].endswith(f": regenerate with {regenerate_command(variant, 'own', 'cpu')}")


def _localized(monkeypatch, dtype: torch.dtype, over: dict) -> object:
    """localize.first_divergence on a made-up 2-layer engine whose recorded outputs equal the
    reference's (3 positions, max |reference| 1) except `over`: {(point, position): the
    difference}, so each sub-block's relative error is exactly its difference."""
    from harness.llama3 import localize

    layer = types.SimpleNamespace(attention_norm=0, attention=1, ffn_norm=2, feed_forward=3)
    model = types.SimpleNamespace(layers=[layer, layer], norm=4, output=5)
    engine = types.SimpleNamespace(dtype=dtype, model=model)
    points = [point for point, _ in localize.engine_points(engine)]
    reference = torch.zeros(3, 4)
    reference[:, 0] = 1.0
    theirs = {point: reference.clone() for point in points}
    ours = {point: reference.clone() for point in points}
    for (point, position), difference in over.items():
        ours[point][position, 1] = difference
    monkeypatch.setattr(localize, "engine_outputs", lambda *args: ours)
    monkeypatch.setattr(localize, "reference_outputs", lambda *args: theirs)
    return localize.first_divergence(engine, None, [1, 2], [3, 4])


@pytest.mark.parametrize(("dtype", "documented"), [(torch.float32, 3e-5), (torch.bfloat16, 5e-3)])
def test_the_first_diverging_layer_is_the_first_over_the_documented_tolerance(
    monkeypatch, dtype, documented
) -> None:
    """docs/goldens.md:873-875: the first sub-block whose max |engine - transformers| /
    max |transformers| exceeds 3e-5 (float32 computation) or 5e-3 (bfloat16) is named. A
    difference 0.8x the tolerance in layer 0's attention is passed over, one 1.2x in layer 1's
    MLP is named with its position; with only the first, none is. Plant caught: float32's
    threshold 3e-4 (RELATIVE_TOLERANCE in harness/llama3/localize.py)."""
    below, above = ((0, "attention"), 1), ((1, "MLP"), 2)
    found = _localized(monkeypatch, dtype, {below: 0.8 * documented, above: 1.2 * documented})
    assert found is not None, f"{dtype}: a difference 1.2x {documented:g} found nowhere"
    assert (found.layer, found.subblock, found.position) == (1, "MLP", 2), found
    assert found.relative_error == pytest.approx(1.2 * documented, rel=1e-6)
    assert _localized(monkeypatch, dtype, {below: 0.8 * documented}) is None


def test_regenerate_command_names_each_references_producer() -> None:
    """docs/architecture.md:244, 253 and 58: the torch golden is made by testdata's
    run_torch_llama, the engine's by evaluate_llama, the ggml mode's by evaluate_llama
    --mode=ggml, each with the variant's model, encoding and device (what a missing golden
    names, :551). Plant caught: regenerate_command naming evaluate_llama for every reference."""
    from harness.llama3.golden_files import regenerate_command

    variant = Variant("smollm2", "q4_1", "real", "smollm2", None)
    args = "-- --model=smollm2 --encoding=q4_1 --device=cuda"
    evaluate = "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama"
    torch_tool = (
        "./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama"
    )
    assert regenerate_command(variant, "torch", "cuda") == f"{torch_tool} {args}"
    assert regenerate_command(variant, "own", "cuda") == f"{evaluate} {args}"
    assert regenerate_command(variant, "ggml", "cuda") == f"{evaluate} {args} --mode=ggml"


def test_a_missing_golden_skips_with_its_command_and_fails_where_required(
    monkeypatch, goldens
) -> None:
    """docs/architecture.md:247 and 551-552 (conftest.py's GoldenStore.load): a missing
    golden skips the test with the command that makes it; under $GOLDENS_REQUIRED=1 (every
    bazel test) it fails, with the same command. Plants caught: the skip without the command;
    the required check dropped (a skip under $GOLDENS_REQUIRED=1)."""
    from harness.llama3.golden_files import regenerate_command

    variant = Variant("no_such_model", "float32", "tiny", "llama3_1", None)
    command = regenerate_command(variant, "torch", "cpu")
    monkeypatch.delenv("GOLDENS_REQUIRED", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        goldens.load("torch", variant)
    assert f"Make it with:\n  {command}\n" in str(skipped.value)
    monkeypatch.setenv("GOLDENS_REQUIRED", "1")
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as failed:
        goldens.load("torch", variant)  # a skip here must fail this test, not skip it
    assert failed.type is pytest.fail.Exception, f"skipped under $GOLDENS_REQUIRED=1: {failed}"
    assert f"Make it with:\n  {command}\n" in str(failed.value)
    assert "$GOLDENS_REQUIRED=1: a missing golden fails" in str(failed.value)


def test_localize_names_the_first_point_in_order_its_first_position_and_worst_error(
    monkeypatch,
) -> None:
    """harness/llama3/localize.py's docstrings: sub-blocks are compared in execution order and
    the first over the tolerance is named, with its first position over it and its worst
    relative error, max |engine - reference| / max |reference| over the whole sub-block (one
    scale, not each position's); the final norm and head, which the engine computes at fewer
    positions, are aligned with the reference at the end; `describe` names layer 0 as a layer.
    Plants caught: the points walked in reverse; the error of the first position over instead
    of the worst; a per-position scale; the final points' position without its offset, or
    aligned at the start; `describe` testing `if self.layer` (layer 0 dropped)."""
    from harness.llama3 import localize

    tol = localize.RELATIVE_TOLERANCE[torch.float32]
    layer = types.SimpleNamespace(attention_norm=0, attention=1, ffn_norm=2, feed_forward=3)
    model = types.SimpleNamespace(layers=[layer, layer], norm=4, output=5)
    engine = types.SimpleNamespace(dtype=torch.float32, model=model)
    points = [point for point, _ in localize.engine_points(engine)]
    reference = torch.zeros(3, 4)
    reference[:, 0] = torch.tensor([1.0, 0.5, 0.25])  # max |reference| 1, position 0's
    reference[:, 2] = torch.tensor([0.1, 0.2, 0.3])  # positions differ: misalignment shows

    def localized(over: dict) -> object:
        theirs = {point: reference.clone() for point in points}
        ours = {p: reference[-2:].clone() if p[0] is None else reference.clone() for p in points}
        for (point, position), difference in over.items():
            ours[point][position, 1] = difference
        monkeypatch.setattr(localize, "engine_outputs", lambda *args: ours)
        monkeypatch.setattr(localize, "reference_outputs", lambda *args: theirs)
        return localize.first_divergence(engine, None, [1, 2], [3, 4])

    found = localized(
        {
            ((0, "attention"), 1): 0.8 * tol,  # 1.6x tol of position 1's own max: not over
            ((0, "MLP norm"), 0): 1.5 * tol,
            ((0, "MLP norm"), 2): 4.0 * tol,
            ((1, "attention"), 0): 9.0 * tol,
        }
    )
    assert (found.layer, found.subblock, found.position) == (0, "MLP norm", 0), found
    assert found.relative_error == pytest.approx(4.0 * tol, rel=1e-6)
    assert found.describe().startswith("first diverging layer: layer 0, MLP norm (")
    head = localized({((None, "LM head"), 0): 2.0 * tol})  # the engine's row 0: position 1
    assert (head.layer, head.subblock, head.position) == (None, "LM head", 1), head
    # over the positions compared (1 and 2: max |reference| 0.5)
    assert head.relative_error == pytest.approx(4.0 * tol, rel=1e-6)
    assert head.describe().startswith("first diverging layer: LM head (")


def test_engine_outputs_restores_the_fused_decode_step(monkeypatch) -> None:
    """localize.engine_outputs runs the decode steps module by module (fused_decode set aside
    so that the hooks fire) and puts the engine's fused step back after, so a diagnosis leaves
    the engine as it found it. Plant caught: the `finally` that restores it dropped."""
    from harness.llama3 import localize

    fused = object()
    model = types.SimpleNamespace(
        layers=[], norm=torch.nn.Identity(), output=torch.nn.Identity(), fused_decode=fused
    )
    during = []

    def generate(input_ids, steps, forced_tokens):
        during.append(model.fused_decode)
        model.output(model.norm(torch.ones(1, 2, 3)))

    engine = types.SimpleNamespace(model=model, generate=generate)
    outputs = localize.engine_outputs(engine, [1, 2], [3])
    assert during == [None] and model.fused_decode is fused
    assert {point: tuple(t.shape) for point, t in outputs.items()} == {
        (None, "final norm"): (2, 3),
        (None, "LM head"): (2, 3),
    }


def test_diverging_layer_localizes_the_first_failing_case_of_a_torch_verdict_only(
    monkeypatch,
) -> None:
    """harness/llama3/diagnosis.py: a failing verdict against the torch goldens is located on
    its first failing case, both models fed that case's prompt and all its golden tokens; a
    verdict of another reference, or one that fails nowhere, gets None without loading
    transformers; no divergence reads "none". Plants caught: the reference condition dropped;
    the last failing case taken; a forced token dropped."""
    from harness.llama3 import diagnosis, localize

    calls = []
    monkeypatch.setattr(diagnosis, "_reference_model", lambda *a: calls.append(a) or "model")
    found = localize.Divergence(1, "MLP", 7, 0.5, 3e-5)
    answers = [found, None]
    monkeypatch.setattr(
        localize,
        "first_divergence",
        lambda engine, model, ids, tokens: calls.append((model, ids, tokens)) or answers.pop(0),
    )
    cases = {n: types.SimpleNamespace(id=n, input_ids=[1, n], token_ids=[n, 5, 6]) for n in (8, 9)}
    golden = types.SimpleNamespace(case=cases.__getitem__)
    reports = [
        types.SimpleNamespace(case_id=case_id, status=status)
        for case_id, status in ((7, compare.PASS), (8, compare.FAIL), (9, compare.FAIL))
    ]
    variant = types.SimpleNamespace(path=Path("m.gguf"), dtype=torch.float32)
    engine = types.SimpleNamespace(device="cpu")

    def verdict(reference, reports):
        return types.SimpleNamespace(reference=reference, reports=reports)

    assert diagnosis.diverging_layer(engine, variant, golden, verdict("own", reports)) is None
    assert diagnosis.diverging_layer(engine, variant, golden, verdict("torch", reports[:1])) is None
    assert calls == []
    got = diagnosis.diverging_layer(engine, variant, golden, verdict("torch", reports))
    assert got == (8, found.describe())
    assert calls == [(Path("m.gguf"), torch.float32, "cpu"), ("model", [1, 8], [8, 5, 6])]
    none = diagnosis.diverging_layer(engine, variant, golden, verdict("torch", reports))
    assert none[0] == 8 and none[1].startswith("first diverging layer: none, every sub-block")


def test_forced_runs_feed_the_goldens_tokens_and_positions_and_memoize_by_all_of_them(
    goldens, monkeypatch
) -> None:
    """harness/llama3/engine_runs.py: a forced run feeds the engine its own tokenization of
    the prompt, the golden's tokens (teacher forcing) and its prompt positions; with a memo a
    case whose prompt, tokens, top-k and positions were run is not run again but comes back
    under its own id, and one whose positions differ is run. Speculating passes its
    speculation to every generation; load_engine passes the mode. Plants caught: positions
    left out of memo_key; the memo's run returned under the other case's id; prompt
    positions not passed; Speculating or load_engine dropping their argument."""
    from harness.llama3 import engine_runs

    _, golden, _ = _tiny_float32(goldens)
    case = next(
        c for c in golden.cases if len([p for p in c.positions if p < len(c.input_ids) - 1]) > 1
    )
    calls = []

    def generate(input_ids, steps, **kwargs):
        calls.append((list(input_ids), steps, kwargs))
        logits = torch.zeros(steps, 8)
        return types.SimpleNamespace(
            tokens=kwargs["forced_tokens"], logits=logits, prompt_logits=None, speculation=None
        )

    tokenizer = types.SimpleNamespace(encode=lambda prompt: list(case.input_ids))
    engine = types.SimpleNamespace(tokenizer=tokenizer, generate=generate)
    renamed = dataclasses.replace(case, id="again")
    moved = dataclasses.replace(
        case, id="moved", positions=case.positions[:1], position_steps=case.position_steps[:1]
    )
    memo: dict = {}
    runs = engine_runs.forced_runs(
        engine, dataclasses.replace(golden, cases=[case, renamed, moved]), memo
    )
    assert [r.spec.id for r in runs] == [case.id, "again", "moved"]
    expected = [p for p in case.positions if p < len(case.input_ids) - 1]
    assert expected and len(calls) == 2 and len(memo) == 2
    assert calls[0] == (
        list(case.input_ids),
        len(case.steps),
        {"forced_tokens": case.token_ids, "prompt_positions": expected},
    )
    assert runs[0].positions == expected and runs[2].positions == case.positions[:1]
    speculation = object()
    engine_runs.Speculating(engine, speculation).generate([1], 1, forced_tokens=[2])
    assert calls[-1][2]["speculation"] is speculation
    loaded = []
    monkeypatch.setattr(
        engine_runs.Llama3Engine, "from_gguf", lambda path, **kwargs: loaded.append(kwargs)
    )
    variant = types.SimpleNamespace(path=Path("m.gguf"), dtype=torch.float32)
    engine_runs.load_engine(variant, mode="ggml")
    assert loaded == [{"device": "cpu", "dtype": torch.float32, "overrides": None, "mode": "ggml"}]
