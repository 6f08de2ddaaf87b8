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
they fail instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import gguf
import numpy as np
import pytest

from goldens.engines import llama_server
from goldens.engines.base import EngineError, forced_run
from goldens.engines.openai import LlamaCppEngine
from goldens.tolerances import NotJudged, tolerance
from max_tests.integration.architectures.llama3 import checkpoint_mutations, judge
from max_tests.integration.architectures.llama3.engine_adapters import ThisEngine, judge_engine
from max_tests.integration.architectures.llama3.variants import variants
from pipelines.llama3 import ggml_activations

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


def test_ggml_activations_bring_this_engine_to_llama_cpp_on_q4_k(goldens) -> None:
    """With Q8_K activations in front of every Q4_K product (ggml_activations), this engine
    computes what llama.cpp computes on the Q4_K file: measured 1.3e-5 .. 1.75e-5 on the short
    cases, against 1.54 with float activations. (Long prompts still differ at isolated
    positions; SmolLM2's Q4_1 does not close yet: ggml_activations' docstring.)"""
    variant = TINY["q4_k"]
    golden, _ = goldens.load("own", variant)
    short = judge.in_lane(golden, variant.model, "short")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(variant.path).tensors}
    types.setdefault("output.weight", types["token_embd.weight"])  # the head is tied
    plain, ggml = ThisEngine(variant), ThisEngine(variant)
    linears = ggml_activations.model_linears(ggml.engine.model)
    assert ggml_activations.install(linears, types) == len(linears)
    with _served(variant.path) as engine:
        distance = {
            name: max(_distance(e, engine, case) for case in short.cases)
            for name, e in (("float activations", plain), ("ggml activations", ggml))
        }
    print(f"this engine vs llama.cpp on tiny q4_k, short cases: {distance}")
    assert distance["ggml activations"] <= 1e-4, distance
    assert distance["float activations"] > 0.5, distance


def test_no_server_is_left_running() -> None:
    assert STOPPED, "no server was started"
    for pid in STOPPED:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
