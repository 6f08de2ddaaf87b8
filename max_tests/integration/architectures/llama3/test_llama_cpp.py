"""The llama.cpp lane: Debian's llama-server judged by the goldens through the OpenAI adapter.

For each checkpoint a llama-server is started on a free loopback port (goldens/engines/
llama_server.py: one thread, float32 KV cache, no flash attention) and stopped after, also
when the test fails. On the float32 file llama.cpp must PASS both goldens (own, torch) under
its tolerance entry (`*/float32/llama_cpp`), every case; every checkpoint mutation
(checkpoint_mutations.py) must FAIL it, and this engine too. On the other files llama.cpp's
numerics differ by design (8-bit activations, its own bfloat16): their entries say
`judged: false` with the measured distance, and the test checks that the distance is still
what the entry records. Without llama-server the tests skip with the install command;
.ci/run installs it (tools/llama_cpp/install.sh) and sets CI_REQUIRE_LLAMA_CPP=1, under which
they fail instead. The entries hold the figures of one llama.cpp (llama_server.PINNED_VERSION,
the one install.sh installs): another version fails the lane, naming both; every result
records the version it judged (JUnit property `llama_cpp_version`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile

import numpy as np
import pytest

from goldens.engines import llama_server
from goldens.engines.base import EngineError, forced_run
from goldens.engines.openai import LlamaCppEngine
from goldens.record import case_specs, constraint_specs
from goldens.tolerances import NotJudged, tolerance
from harness.llama3 import checkpoint_mutations, judge, sampler_check
from harness.llama3.constrained_goldens import ConstrainedReport, check_llama_server
from harness.llama3.engine_adapters import ThisEngine, judge_engine
from harness.llama3.variants import variants
from pipelines.llama3 import constrained
from pipelines.llama3.constrained import Constraint
from pipelines.llama3.tokenizer import Tokenizer
from tools.golden_check import golden_check

REQUIRE_ENV = "CI_REQUIRE_LLAMA_CPP"
TINY = {v.encoding: v for v in variants("tinyllama")}
STOPPED: list[int] = []  # pids of every server these tests started


@pytest.fixture(scope="module", autouse=True)
def _llama_server() -> None:
    try:
        llama_server.binary()
    except EngineError as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{e} (${REQUIRE_ENV}=1: the llama.cpp lane must run)")
        pytest.skip(str(e))
    # The entries hold one version's figures: another version's verdict would be a guess.
    mismatch = llama_server.pin_mismatch()
    if mismatch is not None:
        pytest.fail(mismatch)


@pytest.fixture(autouse=True)
def _recorded_version(record_property) -> None:
    """Each result names the llama.cpp it judged (the JUnit property `llama_cpp_version`)."""
    record_property("llama_cpp_version", llama_server.version())


@contextlib.contextmanager
def _served(gguf):
    server = llama_server.LlamaServer(gguf)
    server.start()
    pid = server.pid
    try:
        yield LlamaCppEngine(server.url)
    finally:
        server.stop()
        STOPPED.append(pid)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped, not left running


def _verdicts(engine, variant, goldens, column: str, lane: str = "all") -> list[judge.Verdict]:
    return [
        judge_engine(
            engine, *goldens.load(reference, variant), reference,
            tolerance(reference, variant.encoding, column), variant, lane,
        )
        for reference in ("own", "torch")
    ]  # fmt: skip


def test_llama_cpp_passes_the_float32_goldens(goldens, record_property) -> None:
    variant = TINY["float32"]
    with _served(variant.path) as engine:
        verdicts = _verdicts(engine, variant, goldens, "llama_cpp")
        again = _verdicts(engine, variant, goldens, "llama_cpp")
    for verdict, repeat in zip(verdicts, again, strict=True):
        print("llama.cpp " + verdict.summary())
        share, metric, where = verdict.headroom()
        record_property(
            "headroom", f"{verdict.tolerance.key}|{share:.6g}|llama_cpp-float32|{where}|{metric}"
        )
        # The noise floor's "repeatable": the same server answers the same numbers.
        assert [r.max_logprob_diff for r in verdict.reports] == [
            r.max_logprob_diff for r in repeat.reports
        ]
    assert all(r.input_ids_match for v in verdicts for r in v.reports), "tokenization differs"
    failures = [f for v in verdicts for f in v.failures]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("mutation", checkpoint_mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_checkpoint_mutation_fails_llama_cpp_and_this_engine(mutation, goldens) -> None:
    variant = TINY["float32"]
    with tempfile.TemporaryDirectory() as folder:
        copy = checkpoint_mutations.mutated_copy(variant.path, mutation, folder)
        mutated = dataclasses.replace(variant, path=copy)
        with _served(copy) as engine:
            external = _verdicts(engine, mutated, goldens, "llama_cpp")
        this = _verdicts(ThisEngine(mutated), mutated, goldens, "cpu")
    for who, verdicts in (("llama.cpp", external), ("this engine", this)):
        for verdict in verdicts:
            print(f"{mutation.name} ({mutation.what}), {who}: {verdict.summary()}")
            assert verdict.failures, f"{who} passes {mutation.what}: {verdict.summary()}"
            floor = verdict.tolerance.mutation_floor
            assert verdict.max_logprob_diff >= floor.logprob * 0.999, (
                f"{mutation.name} moved {who} by {verdict.max_logprob_diff:.3g}, under the "
                f"entry's mutation floor {floor.logprob:g} ({floor.measured}): measure again"
            )


@pytest.mark.parametrize("mutation", checkpoint_mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_checkpoint_mutation_fails_llama_cpp_on_the_ggml_goldens(mutation, goldens) -> None:
    """ggml/q4_k/llama_cpp judges llama-server by the ggml mode's goldens: each checkpoint
    edit of the Q4_K file fails it on the cases the entry judges, by at least the entry's
    mutation floor (measured on the ggml mode: this proves it on llama-server itself)."""
    variant = TINY["q4_k"]
    golden, name = goldens.load("ggml", variant)
    tol = tolerance("ggml", "q4_k", "llama_cpp")
    with tempfile.TemporaryDirectory() as folder:
        copy = checkpoint_mutations.mutated_copy(variant.path, mutation, folder)
        mutated = dataclasses.replace(variant, path=copy)
        with _served(copy) as engine:
            verdict = judge_engine(engine, golden, name, "ggml", tol, mutated, "short")
    print(f"{mutation.name} ({mutation.what}), llama.cpp vs the ggml golden: {verdict.summary()}")
    assert verdict.failures, f"llama.cpp passes {mutation.what}: {verdict.summary()}"
    floor = tol.mutation_floor
    assert verdict.max_logprob_diff >= floor.logprob * 0.999, (
        f"{mutation.name} moved llama.cpp by {verdict.max_logprob_diff:.3g}, under the entry's "
        f"mutation floor {floor.logprob:g} ({floor.measured}): measure again"
    )


@pytest.mark.parametrize("encoding", ["bfloat16", "q4_k", "nvfp4"])
def test_llama_cpp_differs_by_design_where_its_entry_says_so(encoding, goldens) -> None:
    variant = TINY[encoding]
    with pytest.raises(NotJudged) as not_judged:
        tolerance("own", encoding, "llama_cpp")
    recorded = float(str(not_judged.value).split("max |Δ log-prob| ")[1].split(",")[0])
    with _served(variant.path) as engine:
        (own, _) = _verdicts(engine, variant, goldens, "external")
    print(f"llama.cpp {encoding}: {own.summary()} (entry records {recorded:g})")
    assert own.failures, f"llama.cpp now agrees on {encoding}: make its entry judged"
    assert recorded / 1.5 <= own.max_logprob_diff <= recorded * 1.5, (
        f"llama.cpp's distance on {encoding} is {own.max_logprob_diff:.3g}, the entry records "
        f"{recorded:g}: measure again and update own/{encoding}/llama_cpp"
    )


def test_llama_cpp_meets_the_ggml_goldens_on_q4_k(goldens, record_property) -> None:
    """The ggml mode's goldens (llama.cpp's numerics) judge llama.cpp tightly where the float
    goldens cannot (2.28 apart): within ggml/q4_k/llama_cpp (1e-3) on the cases the entry
    judges (`cases: short`, measured 1.9e-5). Asked for every case, the verdict holds the
    short ones only; the long cases' distance is printed and recorded, not judged (the entry's
    why: a rounding flip of 8-bit activations at 8k positions, 0.83 on an Intel Xeon)."""
    variant = TINY["q4_k"]
    golden, name = goldens.load("ggml", variant)
    tol = tolerance("ggml", "q4_k", "llama_cpp")
    assert tol.cases == "short", tol
    with _served(variant.path) as engine:
        verdict = judge_engine(engine, golden, name, "ggml", tol, variant, "all")
        measured = judge_engine(
            engine, golden, name, "ggml", dataclasses.replace(tol, cases="all"), variant, "long"
        )
    print(f"llama.cpp vs the ggml golden, the judged cases: {verdict.summary()}")
    print(f"llama.cpp vs the ggml golden, the long cases (not judged): {measured.summary()}")
    record_property("llama_cpp_ggml_q4_k_short", f"{verdict.max_logprob_diff:.3g}")
    record_property("llama_cpp_ggml_q4_k_long_not_judged", f"{measured.max_logprob_diff:.3g}")
    judged = {report.case_id for report in verdict.reports}
    assert judged == {s.id for s in case_specs(variant.model) if not s.long}, judged
    assert not verdict.failures, verdict.summary()


def test_llama_cpp_on_smollm2_is_not_judged_by_the_ggml_golden_and_says_why(goldens) -> None:
    """SmolLM2 with 8-bit activations is chaotic (ggml/q4_1/cpu's why): llama.cpp stays tenths
    from the ggml golden, as the entry records; the day it agrees, the entry must be judged."""
    (variant,) = [v for v in variants("smollm2") if v.encoding == "q4_1"]
    if variant.path is None:
        pytest.fail(variant.unavailable_reason)
    with pytest.raises(NotJudged) as not_judged:
        tolerance("ggml", "q4_1", "llama_cpp")
    recorded = float(str(not_judged.value).split("max |Δ log-prob| ")[1].split(",")[0])
    golden, name = goldens.load("ggml", variant)
    loose = tolerance("ggml", "q4_1", "cpu")
    with _served(variant.path) as engine:
        verdict = judge_engine(engine, golden, name, "ggml", loose, variant, "all")
    print(f"llama.cpp vs the ggml golden on SmolLM2: {verdict.summary()} (entry: {recorded:g})")
    assert recorded / 1.5 <= verdict.max_logprob_diff <= recorded * 1.5, verdict.summary()


# llama-server's sampler, judged by its draws (harness/llama3/sampler_check.py): 2000 first
# tokens of one golden case, one request per seed, against the golden's processed
# distribution in llama.cpp's order and in transformers'.
SAMPLER_CASE = "question"  # top-1 0.21: a spread distribution, where the orders differ
# llama.cpp's request field `samplers`: temperature before top-p, transformers' distribution
# (temperature does not change the top-k ranking)
TEMPERATURE_FIRST = ["top_k", "temperature", "top_p", "min_p"]


def test_llama_cpps_sampler_draws_its_own_order_and_not_the_other(goldens, capsys) -> None:
    """The G-test at alpha 1e-6 of llama-server's draws (temperature 1.5, top-k 20, top-p
    0.8, min-p 0.05): against the golden's distribution in the llama_cpp order it passes, in
    the transformers order it fails, with the power printed and the false-alarm rate measured
    from llama.cpp's own logits. Planted: the same server with temperature moved before top-p
    fails the llama_cpp order and passes the transformers order."""
    variant = TINY["float32"]
    golden, _ = goldens.load("own", variant)
    (case,) = [c for c in golden.cases if c.id == SAMPLER_CASE]
    planted = {**sampler_check.DEFAULT_SAMPLER, "samplers": TEMPERATURE_FIRST}
    with _served(variant.path) as engine:
        verdict = sampler_check.check_sampler(engine, case)
        moved = sampler_check.check_sampler(engine, case, planted)
    with capsys.disabled():
        print(f"\nllama-server's sampler, {sampler_check.DEFAULT_SAMPLER}: {verdict.summary()}")
        print(f"planted, the chain {TEMPERATURE_FIRST}: {moved.summary()}")
    assert verdict.chain[-1] == "temperature", verdict.chain  # llama.cpp's: temperature last
    assert (
        verdict.chain.index("top_k") < verdict.chain.index("top_p") < verdict.chain.index("min_p")
    ), verdict.chain
    assert moved.chain == TEMPERATURE_FIRST, moved.chain
    assert verdict.false_alarm <= 10 * verdict.alpha, verdict.summary()
    assert verdict.power >= 0.999, verdict.summary()
    assert verdict.verdict == "PASS", verdict.summary()
    assert verdict.p_other <= verdict.alpha, f"the orders are not told apart: {verdict.summary()}"
    assert moved.verdict == "FAIL", moved.summary()
    assert moved.p_other > moved.alpha, moved.summary()  # it is the transformers order's


def test_golden_check_sampling_passes_llama_cpps_order_and_fails_the_other(capsys) -> None:
    """`golden_check --sampling` end to end on the short cases (500 draws each): exit 0 in
    llama.cpp's order, exit 1 in transformers' (the 'question' case FAILs; power 0.99997)."""
    argv = ["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling"]
    argv += ["--lane=short", "--draws=500"]
    assert golden_check.main(argv) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("verdict: PASS"), out
    assert golden_check.main([*argv, "--order=transformers"]) == 1
    out = capsys.readouterr().out
    assert "question: FAIL in the transformers order" in out, out


def _distance(engine, reference, case) -> float:
    """Max |Δ log-prob| of `engine` (full rows) over `reference`'s top-k, every step and
    prompt position of `case`."""
    mine, theirs = forced_run(engine, case), forced_run(reference, case)
    worst = 0.0
    rows = zip([*mine.prompt_rows, *mine.rows], [*theirs.prompt_rows, *theirs.rows], strict=True)
    for row, top in rows:
        log_probs = row.astype(np.float64) - np.logaddexp.reduce(row.astype(np.float64))
        pairs = zip(top.ids, top.logprobs, strict=True)
        worst = max(worst, max(abs(log_probs[i] - lp) for i, lp in pairs))
    return worst


def test_no_server_is_left_running() -> None:
    assert STOPPED, "no server was started"
    for pid in STOPPED:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _dropped_option(spec):
    """A planted grammar: a choice's GBNF without the golden's own first option."""

    def grammar(prefix: str = "") -> str | None:
        kept = [o for o in spec.value if o != spec.value[0]]
        return dataclasses.replace(spec, text=json.dumps(kept)).llama_cpp_grammar(prefix)

    return grammar


def test_llama_cpp_meets_the_constrained_goldens(goldens, capsys) -> None:
    """llama-server under each constrained golden's language on the tiny float32 file
    (constrained_goldens.check_llama_server): its greedy continuation ends and is a member
    (the JSON schema through its `json_schema` field: conformance alone, its language admits
    whitespace); with the regex and the choice spelled in GBNF (the same languages: their
    masks in this engine equal the golden's own constraint's along every recorded
    continuation), its tokens are the golden's and its restricted distribution (post-sampling
    top log-probabilities) passes the golden's restricted steps under the llama_cpp column.
    Planted: a choice grammar without one option FAILs."""
    variant = TINY["float32"]
    golden, _ = goldens.load("own", variant)
    specs = {spec.id: spec for spec in constraint_specs()}
    tokenizer = Tokenizer.from_gguf(variant.path)
    tol = tolerance("own", variant.encoding, "llama_cpp")
    entries = [
        (case, entry, specs[entry.constraint])
        for case in golden.cases
        for entry in case.constrained
    ]
    # the GBNF spelling and the golden's constraint give the same masks along each recorded
    # continuation (greedy and seeded), in this engine's matcher
    for case, entry, spec in entries:
        if spec.llama_cpp_grammar() is None:
            continue
        for tokens in (entry.token_ids, entry.sampled.tokens):
            ours = constrained.matcher(Constraint(spec.kind, spec.text), tokenizer)
            theirs = constrained.matcher(Constraint.grammar(spec.llama_cpp_grammar()), tokenizer)
            for step, token in enumerate(tokens):
                assert np.array_equal(ours.allowed(), theirs.allowed()), (
                    f"{case.id}/{spec.id}: the GBNF's mask differs at step {step}"
                )
                ours.consume(token)
                theirs.consume(token)
    report = ConstrainedReport()
    planted = ConstrainedReport()
    with _served(variant.path) as engine:
        for case, entry, spec in entries:
            report.add(check_llama_server(engine, case, entry, spec, tokenizer, tol))
            if spec.kind == "choice":
                bad = _dropped_option(spec)
                planted.add(check_llama_server(engine, case, entry, spec, tokenizer, tol, bad))
    with capsys.disabled():
        print(f"\nllama-server, constrained: {report.summary()}")
        print(f"planted, a choice grammar without its first option: {planted.summary()}")
        for failure in planted.failures:
            print(f"  {failure}")
    assert not report.failures, "\n".join(report.failures)
    assert report.steps and report.greedy
    assert planted.failures, "a grammar of another language passed the constrained goldens"
