"""The speculative golden lanes: free-running with each draft, and each planted bug failing.

Run by //max_tests/integration/architectures/llama3:test_llama_speculative beside test_llama.py
(every short case teacher-forced through K + 1-row verification forwards: the forced tokens are
the proposals, so that lane sees the verification forward but never a rejection).

Here every short case also runs free (greedy, its own tokens) with each draft proposing: the
n-gram draft (prompt lookup), the checkpoint's 0-layer self-draft (its embedding into its
head), the whole checkpoint drafting for itself, and testdata's draft checkpoint
(tools/gen_tiny_model's write_draft of the float32 file; the tiny checkpoints share its
vocabulary), at K 1, 4 and 8 on the tiny float32 and bfloat16 files and K 4 elsewhere, in
every mode with goldens (eager and quantized against the own goldens, ggml against its own):
accepted, rejected and bonus tokens all occur, and each run is judged against the golden like
any other (its tokens the golden's, its rows within the tolerance). A rejected proposal's keys
and values left in use fails there, as it cannot in the teacher-forced lane.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from goldens.record import case_specs
from goldens.tolerances import tolerance
from harness.llama3 import engine_runs, judge
from harness.llama3.variants import GGML_ENCODINGS, skip_unavailable, variants
from pipelines.llama3 import speculative
from pipelines.llama3.speculative import NgramDraft, Speculation

K = 8  # the lane's largest


def _rows_off_by_one(rows, j):
    return rows[min(j + 1, rows.shape[0] - 1)]


SPECULATION_MUTATIONS = {
    "verification rows off by one": ("verification_row", _rows_off_by_one),
    "verification block one position late": ("block_start", lambda position: position + 1),
}


@pytest.mark.parametrize("name", SPECULATION_MUTATIONS)
def test_a_speculation_bug_fails_the_goldens(name, goldens, monkeypatch) -> None:
    """On the tiny float32 file in the eager mode, K = 8: the own golden's short cases FAIL."""
    (variant,) = [v for v in variants("tinyllama") if v.encoding == "float32"]
    golden, source = goldens.load("own", variant)
    engine = engine_runs.Speculating(engine_runs.load_engine(variant), Speculation(k=K))
    attribute, replacement = SPECULATION_MUTATIONS[name]
    monkeypatch.setattr(speculative, attribute, replacement)
    tol = tolerance("own", variant.encoding, "cpu")
    verdict = judge.check(engine, golden, source, "own", tol, variant, lane="short")
    print(f"{name}: {verdict.summary()}")
    assert verdict.failures, f"{name} passes the goldens: {verdict.summary()}"


DRAFT_CHECKPOINT = Path("max_tests/integration/architectures/llama3/testdata/tiny_llama_draft.gguf")
SWEPT = ("float32", "bfloat16")  # the tiny files swept over K 1, 4 and 8 (cheap rows)


def _drafts(variant, engine, mode: str) -> dict[str, speculative.Draft]:
    """The n-gram draft, the 0-layer self-draft (the bigram: mostly rejected), the whole model
    drafting for itself (mostly accepted: bonus tokens), and the draft checkpoint."""
    layers = engine.config.n_layers
    drafts = {
        "n-gram": NgramDraft(),
        "self-0": speculative.self_draft(variant.path, 0, mode),
        f"self-{layers}": speculative.self_draft(variant.path, layers, mode),
    }
    if variant.size == "tiny":
        drafts["draft checkpoint"] = speculative.file_draft(DRAFT_CHECKPOINT, engine, mode)
    return drafts


def _free_runs(engine, golden, model: str, speculation: Speculation) -> list:
    """Each case of `golden` run free (greedy) with `speculation`: the Runs, and the stats."""
    specs = {spec.id: spec for spec in case_specs(model)}
    drafting = engine_runs.Speculating(engine, speculation)
    return [engine_runs.run_case(drafting, specs[case.id]) for case in golden.cases]


def _lane(variant, mode: str):
    reference = "ggml" if mode == "ggml" else "own"
    return reference, tolerance(reference, variant.encoding, "cpu")


def _free_cases() -> list:
    return [
        pytest.param(v, mode, id=f"{v.test_id}-{mode}")
        for v in variants()
        for mode in ("eager", "quantized", "ggml")
        if mode != "ggml" or v.encoding in GGML_ENCODINGS
    ]


@pytest.mark.parametrize(("variant", "mode"), _free_cases())
def test_free_running_speculation_with_each_draft_passes_the_goldens(
    variant, mode, goldens, record_property
) -> None:
    skip_unavailable(variant)
    reference, tol = _lane(variant, mode)
    full, source = goldens.load(reference, variant)
    golden = judge.in_lane(full, variant.model, "short")
    engine = engine_runs.load_engine(variant, "cpu", mode=mode)
    ks = (1, 4, 8) if variant.encoding in SWEPT else (4,)
    failures, lines, outcomes = [], [], [0, 0, 0]  # accepted, rejected, bonus
    for name, draft in _drafts(variant, engine, mode).items():
        for k in ks:
            runs = _free_runs(engine, golden, variant.model, Speculation(draft, k))
            verdict = judge.compare_runs(
                runs, golden, source, reference, tol, variant, str, lane="short"
            )
            stats = [run.speculation for run in runs]
            proposed = sum(sum(s.proposed) for s in stats)
            accepted = sum(sum(s.accepted) for s in stats)
            outcomes[0] += accepted
            outcomes[1] += proposed - accepted
            outcomes[2] += sum(
                p == a > 0 for s in stats for p, a in zip(s.proposed, s.accepted, strict=True)
            )
            status = "FAIL" if verdict.failures else "PASS"
            lines.append(f"  {name} k={k}: {status}; {accepted}/{proposed} proposals accepted")
            record_property("golden_checks", verdict.steps + verdict.prompt_positions)
            record_property("ambiguous_steps", verdict.ambiguous_steps)
            failures += [f"{name} k={k}: {f}" for f in verdict.failures]
    print(f"\n{variant.test_id} {mode}, free-running with each draft:\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)
    assert all(outcomes), f"accepted, rejected, bonus: {outcomes} (a path never taken)"


def test_a_rejected_proposals_kv_left_in_use_fails_the_free_running_lane(goldens, monkeypatch):
    """The planted rejection bug (every proposal's keys kept as if accepted, the next block
    after them) on the tiny float32 file with the draft checkpoint, K 4: the free-running
    golden lane FAILs. The caches get room for the positions the bug skips (it would overrun
    them and raise, which fails the lane too, but shows no golden verdict)."""
    (variant,) = [v for v in variants("tinyllama") if v.encoding == "float32"]
    reference, tol = _lane(variant, "eager")
    full, source = goldens.load(reference, variant)
    golden = judge.in_lane(full, variant.model, "short")
    engine = engine_runs.load_engine(variant)
    monkeypatch.setattr(
        speculative, "next_position", lambda position, accepted, block: position + block
    )
    setup_caches = engine.model.setup_caches
    monkeypatch.setattr(engine.model, "setup_caches", lambda n, *a: setup_caches(n + 64, *a))
    draft = speculative.file_draft(DRAFT_CHECKPOINT, engine, "eager")
    runs = _free_runs(engine, golden, variant.model, Speculation(draft, 4))
    verdict = judge.compare_runs(runs, golden, source, reference, tol, variant, str, lane="short")
    print(f"a rejected proposal's KV left in use: {verdict.summary()}")
    assert verdict.failures, verdict.summary()
