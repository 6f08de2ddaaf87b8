"""The sampling goldens on every mode and serving path (harness/llama3/sampling_goldens.py).

Each short case's golden records, for every sampler of cases.yaml's table, the processed
distribution at each teacher-forced step and the continuation the sampler draws under its
seed. Here, per checkpoint and mode (the eager and quantized modes against the engine's
goldens, the ggml mode against its own on Q4_K and Q4_1; transformers' goldens record no
sampling; their teacher-forced distributions are checked by test_llama, in every mode, from
its own runs):

- solo and served: the seeded continuation drawn by `generate` and by the serving engine in a
  ragged batch, in chunks of 3, over blocks of 4, from the prefix cache and under preemption
  (one serving per scenario; all samplers of all cases served together), against the golden's
  by the draw rule (a differing draw is AMBIGUOUS, counted, only where the uniform lies within
  the tolerance's TV of a cumulative boundary; anything else FAILs);
- the constrained goldens' continuations (harness/llama3/constrained_goldens.py), greedy and
  seeded, solo and served beside them (each request its own matcher): the greedy one equal
  to the golden's up to a near-tie of its restricted row, the seeded one by the draw rule;
  and the greedy ones again decoded speculatively with a model draft (`draft4`: each
  proposal masked, the matcher rolled back);
- in the quantized and ggml modes the continuations are also identical across every scenario
  (the same tokens as solo; ggml's logits are bitwise on every path).

Id `{size}-{encoding}-{arch}[-{mode}]` as in test_llama; one alone:
  ./bazelw test //max_tests/integration/architectures/llama3:test_llama_sampling \\
      --test_arg=-k --test_arg='test_llama_sampling[tiny-float32-llama3_1]'
Each test records the JUnit property `sampling` per path
(`PATH|CHECKS|BOUNDARY_STEPS|AMBIGUOUS_DRAWS|MAX_TV`): the matrix of ambiguous draws; and
`constrained` (`PATH|CHECKS|AMBIGUOUS_GREEDY|AMBIGUOUS_DRAWS|MAX_TV`) for the constrained
continuations.

test_planted_constraint_bugs_fail_the_constrained_goldens: each planted constrained-decoding
bug (pipelines/llama3/tests/constrained_mutations.py) that a golden can see fails the tiny
float32 constrained goldens, teacher-forced, solo, drafted or served (CONSTRAINT_PLANTS says
which one is test_constrained's alone, and why).

test_planted_sampler_bugs_fail_the_sampling_goldens: each planted sampler bug
(pipelines/llama3/tests/sampler_mutations.py) fails the tiny float32 goldens in the eager mode,
but one that is proven to change no step of them (EQUIVALENT_ON_GOLDENS: over-accepted top-k
ties, where float32 logits hold no exact tie; test_sampling catches it).
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np
import pytest

from goldens.tolerances import tolerance
from harness.llama3 import constrained_goldens, engine_runs, judge, scenarios
from harness.llama3.constrained_goldens import ConstrainedReport
from harness.llama3.sampling_goldens import (
    SamplingReport,
    check_forced,
    check_outputs,
    settings_of,
    solo_outputs,
)
from harness.llama3.variants import GGML_ENCODINGS, Variant, skip_unavailable, variants
from pipelines.llama3 import sampling
from pipelines.llama3.serving import ServingEngine
from pipelines.llama3.speculative import Speculation, self_draft
from pipelines.llama3.tests.constrained_mutations import MUTATIONS as CONSTRAINED_MUTATIONS
from pipelines.llama3.tests.sampler_mutations import DRAW_MUTATIONS, MUTATIONS

VARIANTS = variants()
MODES = ("eager", "quantized", "ggml")
# One serving per scenario: the batch in the order given, chunks of 3, blocks of 4 (the
# servings test_llama_serving runs beside them take the same code paths).
SERVINGS = {
    "batch": "batch",
    "chunked": "chunk3",
    "paged": "block4",
    "prefix": "prefix",
    "preempt": "preempt",
}
# The modes whose seeded continuations must be the same on every path.
IDENTICAL_MODES = ("quantized", "ggml")


def _serving(scenario: str) -> scenarios.Serving:
    (serving,) = [s for s in scenarios.servings(scenario, "short") if s.name == SERVINGS[scenario]]
    return serving


def _case_id(variant: Variant, mode: str) -> str:
    return variant.test_id if mode == "eager" else f"{variant.test_id}-{mode}"


def _cases() -> list:
    return [
        pytest.param(v, mode, id=_case_id(v, mode))
        for mode in MODES
        for v in VARIANTS
        if mode != "ggml" or v.encoding in GGML_ENCODINGS
    ]


def _golden(goldens, variant: Variant, mode: str):
    reference = "ggml" if mode == "ggml" else "own"
    full, _ = goldens.load(reference, variant)
    return judge.in_lane(full, variant.model, "short"), tolerance(
        reference, variant.encoding, "cpu"
    )


def _checked(golden, outputs: dict, tol, where: str) -> tuple[SamplingReport, ConstrainedReport]:
    """The sampling and the constrained goldens' continuations among `outputs`."""
    return (
        check_outputs(golden, outputs, tol, where),
        constrained_goldens.check_outputs(golden, outputs, tol, where),
    )


def _drafting(engine, variant: Variant) -> engine_runs.Speculating:
    """`engine` decoding speculatively, K 4, drafted by the checkpoint's embedding straight
    into its head (self_draft with no layer, eager: a draft the target often rejects)."""
    return engine_runs.Speculating(engine, Speculation(self_draft(variant.path, 0), k=4))


def _draft_outcomes_missing(drafted: dict) -> list[str]:
    """What the drafted continuations never did, of the two outcomes a verification has (a
    proposal accepted, a proposal rejected): `draft4` proves nothing about a path it never
    takes. Measured: 9-17 of 54-101 proposals accepted, on every checkpoint and mode."""
    proposed = sum(sum(out.speculation.proposed) for out in drafted.values())
    accepted = sum(sum(out.speculation.accepted) for out in drafted.values())
    missing = {"no proposal accepted": not accepted, "none rejected": accepted == proposed}
    return [
        f"draft4: {what} ({accepted} of {proposed} proposals accepted): a path never taken"
        for what, never in missing.items()
        if never
    ]


def _tokens(outputs: dict) -> dict:
    return {key: list(out.tokens) for key, out in outputs.items()}


@pytest.mark.parametrize(("variant", "mode"), _cases())
def test_llama_sampling(variant: Variant, mode: str, goldens, record_property) -> None:
    skip_unavailable(variant)
    engine = engine_runs.load_engine(variant, "cpu", mode=mode)
    golden, tol = _golden(goldens, variant, mode)
    assert any(case.sampling for case in golden.cases), (
        f"{variant.test_id}: its golden records no sampling (schema 4 or later)"
    )
    assert any(case.constrained for case in golden.cases), (
        f"{variant.test_id}: its golden records no constrained continuations (schema 5 or later)"
    )
    solo = {**solo_outputs(engine, golden), **constrained_goldens.solo_outputs(engine, golden)}
    reports = {"solo": _checked(golden, solo, tol, "solo")}
    # the greedy constrained continuations decoded speculatively by a model draft, which
    # masks each of its proposals and rolls its matcher back (a seeded one under speculation
    # draws other tokens than the golden's: the draw rule does not apply)
    drafting = _drafting(engine, variant)
    drafted = constrained_goldens.solo_outputs(drafting, golden, greedy_only=True)
    draft_missing = _draft_outcomes_missing(drafted)
    reports["draft4"] = (
        SamplingReport(),
        constrained_goldens.check_outputs(golden, drafted, tol, "draft4", greedy_only=True),
    )
    differing = []
    for scenario in SERVINGS:
        serving = _serving(scenario)
        served = scenarios.sampled_served(engine, golden, serving)
        reports[serving.name] = _checked(golden, served, tol, serving.name)
        if mode in IDENTICAL_MODES:
            solo_tokens, served_tokens = _tokens(solo), _tokens(served)
            differing += [
                f"{serving.name}: case {case!r}, sampler {sampler!r}: {served_tokens[key]}, "
                f"solo {solo_tokens[key]}"
                for key in solo_tokens
                for case, sampler in [key]
                if served_tokens[key] != solo_tokens[key]
            ]
    failures = list(draft_missing)
    for path, (report, restricted) in reports.items():
        if report.checks:  # draft4 has constrained continuations only
            record_property(
                "sampling",
                f"{path}|{report.checks}|{report.boundary_steps}|{report.ambiguous_draws}|"
                f"{report.max_tv:.3g}",
            )
            print(f"  {path}: {report.summary()}")
        record_property(
            "constrained",
            f"{path}|{restricted.checks}|{restricted.ambiguous_greedy}|"
            f"{restricted.ambiguous_draws}|{restricted.max_tv:.3g}",
        )
        print(f"  {path}: {restricted.summary()}")
        failures += report.failures + restricted.failures
    checks = sum(r.checks + c.checks for r, c in reports.values())
    record_property("golden_checks", checks)
    ambiguous = sum(c.ambiguous_steps + c.ambiguous_greedy for _, c in reports.values())
    record_property("ambiguous_steps", ambiguous)
    if differing:
        failures.append(
            f"the seeded continuations of the {mode} mode differ across serving paths:\n  "
            + "\n  ".join(differing)
        )
    assert not failures, "\n".join(failures)


# Planted bugs that no golden here can see, proven so below: the goldens' float32 logits hold
# no exact tie at the k-th place of any step, where over-accepting ties would keep one token
# more (test_sampling's tie cases catch it).
EQUIVALENT_ON_GOLDENS = ("top-k ties over-accepted",)


def _processed_steps(golden, runs) -> list:
    """Every teacher-forced step's processed distribution, under every case's samplers."""
    return [
        sampling.processed(
            run.logits[i], settings_of(sampled), [*run.input_ids, *case.token_ids[:i]]
        )
        for case, run in zip(golden.cases, runs, strict=True)
        for sampled in case.sampling
        for i in range(len(sampled.forced))
    ]


def _same(a: list, b: list) -> bool:
    return all(
        np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


def test_planted_sampler_bugs_fail_the_sampling_goldens(goldens, monkeypatch, capsys) -> None:
    """Each planted sampler bug fails the tiny float32 goldens (eager, solo), but those of
    EQUIVALENT_ON_GOLDENS, which must then change no processed distribution of any step; the
    unmutated sampler passes. The chain's bugs fail the teacher-forced distributions, the
    draw's the continuation."""
    (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == "float32"]
    engine = engine_runs.load_engine(variant, "cpu")
    golden, tol = _golden(goldens, variant, "eager")
    runs = engine_runs.forced_runs(engine, golden)

    def failures() -> list[str]:
        report = SamplingReport()
        for case, run in zip(golden.cases, runs, strict=True):
            report.add(check_forced(case, run, tol, "teacher-forced"))
        report.add(check_outputs(golden, solo_outputs(engine, golden), tol, "solo"))
        return report.failures

    assert failures() == []
    unmutated = _processed_steps(golden, runs)
    lines, missed, equivalent = [], [], []
    for name, (attribute, replacement) in {**MUTATIONS, **DRAW_MUTATIONS}.items():
        with monkeypatch.context() as patch:
            patch.setattr(sampling, attribute, replacement)
            found = failures()
            same = not found and _same(_processed_steps(golden, runs), unmutated)
        if found:
            lines.append(f"  {name:<32} FAIL ({len(found)} failures): {found[0]}")
        elif same:
            equivalent.append(name)
            lines.append(f"  {name:<32} equivalent on these goldens (no step changes)")
        else:
            missed.append(name)
            lines.append(f"  {name:<32} PASS (missed)")
    with capsys.disabled():
        print("\nplanted sampler bugs against the sampling goldens:\n" + "\n".join(lines))
    assert not missed, f"planted sampler bugs the sampling goldens miss: {missed}"
    assert equivalent == list(EQUIVALENT_ON_GOLDENS), equivalent


# Planted constrained-decoding bugs the constrained goldens must catch, and where: the
# teacher-forced masks and rows (plain and through speculative verification), the solo
# continuations, a ragged batch of every continuation (each request its own matcher),
# and the greedy continuations drafted by a model (each proposal masked, the matcher rolled
# back). Two are test_constrained's alone: draft_unmasked, a greedy draft proposing from its
# unmasked logits, whose refused proposals the verification cuts (the same tokens: only a
# draft's proposal distribution shows it, which its draft check holds inside the mask); and
# served_proposals_kept, the serving engine's proposals left in the matcher, which only a
# constrained request served speculatively shows (its `spec` serving scenario).
CONSTRAINT_PLANTS = (
    "eos_before_complete",
    "eos_never",
    "one_id_off",
    "mask_after_sampling",
    "another_requests_mask",
    "state_not_rolled_back",
)


def test_planted_constraint_bugs_fail_the_constrained_goldens(goldens, monkeypatch, capsys) -> None:
    """Each planted constrained-decoding bug of CONSTRAINT_PLANTS
    (pipelines/llama3/tests/constrained_mutations.py) fails the tiny float32 constrained
    goldens (eager); the unmutated engine passes. The
    matrix printed: each plant's verdict on each check."""
    (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == "float32"]
    engine = engine_runs.load_engine(variant, "cpu")
    speculating = engine_runs.Speculating(engine, Speculation(k=4))
    drafting = _drafting(engine, variant)
    golden, tol = _golden(goldens, variant, "eager")
    cases = [case for case in golden.cases if case.constrained]
    checks = {
        "forced": lambda: [
            f for c in cases for f in constrained_goldens.check_forced(c, engine, tol, "").failures
        ],
        "spec4": lambda: [
            f
            for c in cases
            for f in constrained_goldens.check_forced(c, speculating, tol, "spec4").failures
        ],
        "solo": lambda: (
            constrained_goldens.check_outputs(
                golden, constrained_goldens.solo_outputs(engine, golden), tol, "solo"
            ).failures
        ),
        "draft4": lambda: (
            constrained_goldens.check_outputs(
                golden,
                constrained_goldens.solo_outputs(drafting, golden, greedy_only=True),
                tol,
                "draft4",
                greedy_only=True,
            ).failures
        ),
        "batch": lambda: (
            constrained_goldens.check_outputs(
                golden, scenarios.sampled_served(engine, golden, _serving("batch")), tol, "batch"
            ).failures
        ),
    }

    def verdicts() -> dict[str, str | None]:
        found = {}
        for check, run in checks.items():
            try:
                failures = run()
            except Exception as error:  # a planted bug may also break the engine outright
                failures = [f"{type(error).__name__}: {error}"]
            found[check] = failures[0].strip(": ")[:110] if failures else None
        return found

    assert verdicts() == dict.fromkeys(checks), "the unmutated engine fails its goldens"
    lines, missed = [], []
    for name in CONSTRAINT_PLANTS:
        with monkeypatch.context() as patch:
            CONSTRAINED_MUTATIONS[name](patch)
            found = verdicts()
        cells = ", ".join(f"{check} {'FAILED' if v else 'passed'}" for check, v in found.items())
        first = next((v for v in found.values() if v), None)
        lines.append(f"  {name:<22} {cells}" + (f"\n      first: {first}" if first else ""))
        if first is None:
            missed.append(name)
    with capsys.disabled():
        print("\nplanted constraint bugs against the constrained goldens:\n" + "\n".join(lines))
    assert not missed, f"planted constraint bugs the constrained goldens miss: {missed}"


class _NeverCached(ServingEngine):
    """A prefix cache that finds nothing: each block's hash is new."""

    def _block_hash(self, parent, tokens):
        return secrets.token_bytes(32)


class _RoomyPool(ServingEngine):
    """A pool ten times the size asked for: nothing is preempted."""

    def _new_pool(self, num_blocks):
        return super()._new_pool(10 * num_blocks)


@pytest.mark.parametrize(
    ("scenario", "serving_class"), [("prefix", _NeverCached), ("preempt", _RoomyPool)]
)
def test_a_serving_that_skips_its_scenarios_path_fails(goldens, scenario, serving_class) -> None:
    """The sampled servings of `prefix` and `preempt` must take their path (a cache hit for
    every request whose prompt an earlier one cached; a preemption), or no verdict of theirs
    says anything about it: a serving that skips it raises PathNotTaken; served as asked,
    the same requests pass."""
    (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == "float32"]
    engine = engine_runs.load_engine(variant, "cpu")
    golden, _ = _golden(goldens, variant, "eager")
    assert scenarios.sampled_served(engine, golden, _serving(scenario))
    with pytest.raises(scenarios.PathNotTaken, match=r"prefix-cache hits|no request was preempted"):
        scenarios.sampled_served(engine, golden, _serving(scenario), serving_class)


def test_a_draft_lane_without_both_outcomes_is_named(goldens) -> None:
    """draft4's outcome check, proven: the lane's draft (the embedding into the head) has
    proposals accepted and rejected; the checkpoint drafting for itself with all of its layers
    has every proposal accepted (an end of sequence proposed and chosen too), and the lane's
    outputs with none accepted: each is named."""
    (variant,) = [v for v in VARIANTS if v.size == "tiny" and v.encoding == "float32"]
    engine = engine_runs.load_engine(variant, "cpu")
    golden, _ = _golden(goldens, variant, "eager")
    drafted = constrained_goldens.solo_outputs(_drafting(engine, variant), golden, greedy_only=True)
    assert _draft_outcomes_missing(drafted) == []
    itself = Speculation(self_draft(variant.path, engine.config.n_layers), k=4)
    drafting = engine_runs.Speculating(engine, itself)
    accepted = constrained_goldens.solo_outputs(drafting, golden, greedy_only=True)
    (every,) = _draft_outcomes_missing(accepted)
    assert every.startswith("draft4: none rejected"), every
    rejected = {}
    for key, out in drafted.items():
        none = dataclasses.replace(out.speculation, accepted=[0] * out.speculation.forwards)
        rejected[key] = dataclasses.replace(out, speculation=none)
    (none,) = _draft_outcomes_missing(rejected)
    assert none.startswith("draft4: no proposal accepted"), none
