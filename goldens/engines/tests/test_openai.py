"""The OpenAI-compatible adapter against a fake server on loopback: both answer shapes, the
errors a user meets (nothing listening, no log-probabilities, ids only as text, too few,
an HTTP error, a timeout), and a judged verdict that passes and fails on the model's numbers."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from goldens import compare
from goldens.engines.base import EngineError, forced_run
from goldens.engines.openai import OpenAIEngine
from goldens.engines.tests.fake_server import FakeServer, logits_of
from goldens.record import CaseSpec, record_case
from goldens.tolerances import Tolerance

TOL = Tolerance("own/float32/cpu", 1e-4, 1e-7, 0.95, 2e-4, "test")
PROMPT = [1, 5, 9, 11, 3]


def _golden(steps: int = 4, top_k: int = 8, positions=(0, 2)):
    """A golden recorded from the fake model's own logits (greedy, prompt positions)."""
    ids, tokens, rows = list(PROMPT), [], []
    for _ in range(steps):
        row = logits_of(ids)
        tokens.append(int(np.argmax(row)))
        rows.append(row)
        ids.append(tokens[-1])
    prompt_rows = np.stack([logits_of(PROMPT[: p + 1]) for p in positions])
    spec = CaseSpec("fake", "a prompt", steps, top_k)
    return record_case(
        spec, PROMPT, tokens, np.stack(rows), str, set(), False, list(positions), prompt_rows
    )


def _judge(engine, case) -> compare.CaseReport:
    run = forced_run(engine, case)
    prompt = dict(zip(run.positions, run.prompt_rows, strict=True))
    return compare.compare_case(case, run.input_ids, run.tokens, run.rows, TOL, prompt)


@pytest.mark.parametrize("shape", ["llama.cpp", "token_ids"])
def test_a_server_with_the_goldens_numbers_passes_and_a_moved_one_fails(shape):
    case = _golden()
    with FakeServer(shape) as server:
        engine = OpenAIEngine(server.url, "fake", batch=3)
        report = _judge(engine, case)
        assert report.status == compare.PASS
        assert report.max_logprob_diff < 1e-6
        assert len(report.prompt_checks) == 2
        # 2 prompt positions + 4 steps in batches of 3: two requests, prefixes as token ids.
        assert len(server.requests) == 2
        assert server.requests[0]["prompt"][0] == PROMPT[:1]
        assert server.requests[0]["logprobs"] == 8 and server.requests[0]["max_tokens"] == 1
    with FakeServer(shape, shift=0.05) as server:
        report = _judge(OpenAIEngine(server.url, "fake"), case)
        assert report.status == compare.FAIL
        assert report.failing_metrics[0] == "logprob"


def test_echo_mode_reads_prompt_log_probabilities_in_one_request_per_case():
    case = _golden()
    with FakeServer("token_ids") as server:
        report = _judge(OpenAIEngine(server.url, echo=True), case)
        assert report.status == compare.PASS
        assert len(server.requests) == 1 and server.requests[0]["echo"] is True


def test_nothing_listening_is_one_error_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    engine = OpenAIEngine(f"http://127.0.0.1:{port}/v1", retries=1)
    with pytest.raises(EngineError, match=f"nothing answers at http://127.0.0.1:{port}/v1"):
        engine.next_token_rows(PROMPT, [4], 8)


def test_a_connection_refused_at_first_is_retried():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = FakeServer()
    server.httpd.server_close()

    def start_late():
        time.sleep(0.3)
        import http.server

        server.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", port), server.httpd.RequestHandlerClass
        )
        server.httpd.serve_forever()

    thread = threading.Thread(target=start_late, daemon=True)
    thread.start()
    try:
        rows = OpenAIEngine(f"http://127.0.0.1:{port}/v1", retries=5).next_token_rows(
            PROMPT, [4], 8
        )
        assert rows[0].ids[0] == int(np.argmax(logits_of(PROMPT)))
    finally:
        time.sleep(0.05)
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("none", "answered without log-probabilities"),
        ("text", "names its top tokens by text"),
        ("status", "answered HTTP 400: .*prompt tokens out of range"),
    ],
)
def test_a_server_that_cannot_be_judged_says_why(shape, message):
    with FakeServer(shape) as server:
        with pytest.raises(EngineError, match=message) as error:
            OpenAIEngine(server.url).next_token_rows(PROMPT, [4], 8)
        assert server.url in str(error.value)


def test_too_few_log_probabilities_ask_for_the_goldens_k():
    with FakeServer() as server:
        engine = OpenAIEngine(server.url)
        engine.extra_body = lambda: {"logprobs": 5}  # a server that caps k at 5
        with pytest.raises(EngineError, match=r"returned 5 log-probabilities .* needs 8"):
            engine.next_token_rows(PROMPT, [4], 8)


def test_a_slow_server_times_out_with_the_url():
    with (
        FakeServer("slow", delay=1.0) as server,
        pytest.raises(EngineError, match=r"did not answer within 0\.2 s"),
    ):
        OpenAIEngine(server.url, timeout=0.2).next_token_rows(PROMPT, [4], 8)


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(EngineError, match="not an http"):
        OpenAIEngine("localhost:8080")


def test_every_request_is_the_documented_completion_of_token_ids():
    """What the adapter sends (its docstring; README "Judge your own engine"): one completion
    of each prefix as token ids, `max_tokens` 1 and `logprobs` the golden's k, greedy, ids in
    the answer (`return_tokens_as_token_ids`: vLLM names top tokens by text without it), the
    prefix cache on, `ignore_eos` (llama.cpp answers an end-of-generation choice without
    log-probabilities), and the `model` the user named (--model).
    The fake server answers whatever is sent, so only the body shows these. Planted, each
    caught here: the model, return_tokens_as_token_ids, ignore_eos or temperature left out."""
    with FakeServer("token_ids") as server:
        OpenAIEngine(server.url, "tiny", batch=2).next_token_rows(PROMPT, [1, 2, 4], 8)
    every = {
        "logprobs": 8,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
        "cache_prompt": True,
        "ignore_eos": True,
        "model": "tiny",
        "max_tokens": 1,
    }
    assert server.requests == [
        {**every, "prompt": [PROMPT[:2], PROMPT[:3]]},
        {**every, "prompt": PROMPT},  # a lone prefix is sent as one prompt, not a list of one
    ]
