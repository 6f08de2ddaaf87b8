"""The OpenAI-compatible adapter against a fake server on loopback: both answer shapes, the
errors a user meets (nothing listening, no log-probabilities, ids only as text, too few,
an HTTP error, a timeout), and a judged verdict that passes and fails on the model's numbers;
retries counted, choices matched by index, the URL and key sent, llama.cpp's tokenizer calls."""

from __future__ import annotations

import io
import socket
import threading
import time
import urllib.error

import numpy as np
import pytest

from goldens import compare
from goldens.engines import openai
from goldens.engines.base import EngineError, forced_run
from goldens.engines.openai import LlamaCppEngine, OpenAIEngine
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


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_one_error_naming_the_url():
    port = _closed_port()
    engine = OpenAIEngine(f"http://127.0.0.1:{port}/v1", retries=1)
    with pytest.raises(EngineError, match=f"nothing answers at http://127.0.0.1:{port}/v1"):
        engine.next_token_rows(PROMPT, [4], 8)


def test_a_connection_refused_at_first_is_retried():
    port = _closed_port()
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


@pytest.mark.parametrize("cap", [5, 7])
def test_too_few_log_probabilities_ask_for_the_goldens_k(cap):
    """A row must hold at least the golden's k log-probabilities (base.Engine.teacher_forced:
    "at least `top_k`"): a server that caps k below it (at 5, or one short at 7) cannot be
    judged and says so, naming k. Planted, caught at 7: the count check off by one
    (`len(pairs) < top_k - 1`)."""
    with FakeServer() as server:
        engine = OpenAIEngine(server.url)
        engine.extra_body = lambda: {"logprobs": cap}  # a server that caps k
        with pytest.raises(EngineError, match=rf"returned {cap} log-probabilities .* needs 8"):
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


def test_every_retry_is_counted_and_the_message_says_how_many():
    """`retries=N` is N retries after the first try, N + 1 requests in all, and the error
    says so ("after N + 1 tries"). Planted, caught here: the loop giving up one try early
    (`attempt == self.retries - 1`)."""
    port = _closed_port()
    engine = OpenAIEngine(f"http://127.0.0.1:{port}/v1", retries=2)
    with pytest.raises(EngineError, match=r"\(after 3 tries\)"):
        engine.next_token_rows(PROMPT, [4], 8)
    assert engine.requests == 3


def test_a_connect_timeout_is_a_timeout_error_and_not_retried(monkeypatch):
    """A request that times out while connecting (urllib wraps it in a URLError) is the
    documented timeout error naming --timeout, at once: a timeout is not retried as a refused
    connection is. Planted, caught here: the URLError's timeout reason not looked at (then
    it is retried and reported as "nothing answers")."""
    calls = []

    def urlopen(request, timeout):
        calls.append(timeout)
        raise urllib.error.URLError(TimeoutError("timed out"))

    monkeypatch.setattr(openai.urllib.request, "urlopen", urlopen)
    engine = OpenAIEngine("http://127.0.0.1:9/v1", timeout=0.5, retries=2)
    with pytest.raises(EngineError, match=r"did not answer within 0\.5 s \(--timeout\)"):
        engine.next_token_rows(PROMPT, [4], 8)
    assert calls == [0.5]


def test_choices_are_matched_to_prefixes_by_their_index_not_their_order():
    """A batched answer's choices belong to the prompts by `index` (OpenAI's completions API;
    a server may list them in any order): a reversed list gives the same rows as the ordered
    one. Planted, caught here: the choices taken in the order listed (no sort by index)."""
    with FakeServer("token_ids") as server:
        ordered = OpenAIEngine(server.url, batch=4)
        expected = ordered.next_token_rows(PROMPT, [1, 2, 3, 4], 8)
        shuffled = OpenAIEngine(server.url, batch=4)
        post = shuffled.post

        def reversed_post(path, body):
            answer = post(path, body)
            return {**answer, "choices": answer["choices"][::-1]}

        shuffled.post = reversed_post
        got = shuffled.next_token_rows(PROMPT, [1, 2, 3, 4], 8)
    assert [r.ids for r in got] == [r.ids for r in expected]
    assert [r.logprobs for r in got] == [r.logprobs for r in expected]
    assert got[0].ids[0] == int(np.argmax(logits_of(PROMPT[:2])))


def test_an_echo_answer_shorter_than_the_prompt_says_to_run_without_echo():
    """With --echo, a server whose prompt log-probabilities do not cover every prompt token
    (a server that ignores "echo" answers one entry, for the generated token) is one
    EngineError saying to run without --echo, not an IndexError. Planted, caught here: the
    length check dropped (`if not top:`)."""
    engine = OpenAIEngine("http://127.0.0.1:9/v1", echo=True)
    engine.post = lambda path, body: {
        "choices": [{"index": 0, "logprobs": {"top_logprobs": [{"token_id:4": -0.1}]}}]
    }
    with pytest.raises(EngineError, match=r"\(1 entries for 5 tokens\): run without --echo"):
        engine.next_token_rows(PROMPT, [0, 2], 1)


def test_requests_go_to_the_url_given_with_the_bearer_key(monkeypatch):
    """`{url}/completions` for a --url with or without its trailing slash (README: "--url=
    http://127.0.0.1:8080/v1"), with `Authorization: Bearer KEY` when an API key is given
    (the OpenAI convention). Planted, each caught here: the trailing slash kept (requests to
    `/v1//completions`), the key sent without "Bearer "."""
    seen = []

    def urlopen(request, timeout):
        seen.append((request.full_url, request.get_header("Authorization")))
        raise urllib.error.HTTPError(request.full_url, 401, "no", {}, io.BytesIO(b"denied"))

    monkeypatch.setattr(openai.urllib.request, "urlopen", urlopen)
    engine = OpenAIEngine("http://127.0.0.1:9/v1/", api_key="sk-1")
    assert engine.url == "http://127.0.0.1:9/v1"
    with pytest.raises(EngineError, match=r"/v1/completions answered HTTP 401: denied"):
        engine.next_token_rows(PROMPT, [4], 8)
    assert seen == [("http://127.0.0.1:9/v1/completions", "Bearer sk-1")]


def test_llama_cpp_tokenizes_at_its_root_with_bos_and_biases_a_plain_token():
    """`LlamaCppEngine` (its docstring): the prompt is tokenized by the server at its root's
    `/tokenize` (not under /v1) with its special tokens (BOS), and every completion carries a
    `logit_bias` of +100 on the single token of "a", tokenized without them. Planted, each
    caught here: tokenize() without add_special, the bias token tokenized with it."""
    seen = []

    def post(self, path, body):
        seen.append((self.url + path, body))
        if path == "/tokenize":
            ids = [ord(c) for c in body["content"]]
            return {"tokens": [1, *ids] if body["add_special"] else ids}
        k = body["logprobs"]
        entries = [{"id": i, "logprob": -float(i)} for i in range(k)]
        return {"choices": [{"index": 0, "logprobs": {"content": [{"top_logprobs": entries}]}}]}

    engine = LlamaCppEngine("http://127.0.0.1:9/v1")
    engine.post = post.__get__(engine)
    assert engine.tokenize("hi") == [1, ord("h"), ord("i")]
    engine.next_token_rows(PROMPT, [4], 2)
    assert [url for url, _ in seen] == [
        "http://127.0.0.1:9/tokenize",
        "http://127.0.0.1:9/tokenize",
        "http://127.0.0.1:9/v1/completions",
    ]
    assert seen[0][1] == {"content": "hi", "add_special": True}
    assert seen[1][1] == {"content": "a", "add_special": False}
    assert seen[2][1]["logit_bias"] == {str(ord("a")): 100}
