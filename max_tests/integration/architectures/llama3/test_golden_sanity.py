"""Every published golden discriminates (goldens/sanity.py says what that means), holds
cases.yaml's cases with their step counts and, the engine's, every sampler on every short case,
names the checkpoint (by sha256) and producer it was made from, the claims testdata/README.md
makes about the goldens hold, and a degenerate engine fails against every published golden
under every tolerance entry."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from goldens import compare, record, schema
from goldens.record import CaseSpec, file_sha256
from goldens.sanity import degeneracy_problems
from goldens.tolerances import entries, tolerance
from harness.llama3 import judge
from harness.llama3.engine_runs import Run
from harness.llama3.variants import GGML_ENCODINGS, Variant, variants
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
