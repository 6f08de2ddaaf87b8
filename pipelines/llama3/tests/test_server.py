"""The HTTP server (pipelines/llama3/server.py) under load on loopback, and its bad inputs.

A random tiny model (tools/gen_tiny_model/tiny_llama.py) is served on a free port with a
small KV pool (blocks of 4 tokens, 64 blocks for 16 clients whose requests need up to 16 each, and
the dropped streams' up to 60), so that
requests wait, share prefix blocks, evict and preempt. 16 client threads each send three
requests (one answer whole, one streamed, and either a stream the client drops after two
events or one more whole answer); half the prompts start with one shared 24-token preamble.
Every completed request's tokens must be its own: the greedy tokens `Llama3Engine.generate`
computes alone for its prompt, or differ first at a step where the solo run's two candidates
are within NEAR_TIE of each other (batching moves logits in the last bits); a streamed
answer's pieces must add up to its tokens and text. No request may be lost (each client waits
at most CLIENT_TIMEOUT_S), every dropped stream must be cancelled by the server, and at the
end nothing is pending and no KV block is referenced. p50/p99 latency and tokens/s are
printed (no timing is asserted).

Each guarantee is proven by a planted server bug that the same load run must FAIL:
results handed out in arrival order (another's tokens), an inbox that keeps only
its first arrival (lost requests), a stream that does not cancel when its client goes
away (blocks held to the end), and a cancel that never reaches the serving engine (counted,
but the request runs on to its max_tokens: the outcomes must be exactly 44 "length" and 4
"cancelled").

What one answer holds, each with its plant: several prompts in one request, each choice its
own prompt's tokens (choices built from another prompt's request); a stop string that spans
two tokens, never streamed (a stream that holds nothing back); every logprobs field against
the solo run; a server stopped mid-answer answers 503, or ends the stream with an error and
no `[DONE]` (it answered "length", as if complete).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import pathlib
import socket
import statistics
import threading
import time
import urllib.parse

import numpy as np
import pytest
import torch

from pipelines.llama3 import Llama3Engine
from pipelines.llama3.server import (
    TOKEN_ID_PREFIX,
    EngineWorker,
    RunningServer,
    Server,
    build,
    main,
)
from pipelines.llama3.serving import ServingEngine
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

CLIENTS = 16
DROPPING = 4  # clients whose third request is a stream they close after two events
NEAR_TIE = 1e-4  # |logit gap| at which batched and solo greedy choices may differ
CLIENT_TIMEOUT_S = 30.0
# |Δ log-prob| a served row may be from the solo run's: batches and chunks regroup float32
# sums (the serving lanes' float32 bound, test_llama_serving's INVARIANCE_BOUNDS)
SERVED_VS_SOLO = 1.2e-4
SEED = 20261203


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("server") / "tiny.gguf"
    write_tiny_llama(path, seed=11, n_layers=2, context_length=256)
    return path


@pytest.fixture(scope="module")
def solo(checkpoint) -> Llama3Engine:
    return Llama3Engine.from_gguf(checkpoint)


def _server(checkpoint, server_class=Server, worker_class=EngineWorker, **options) -> Server:
    engine = Llama3Engine.from_gguf(checkpoint)
    serving = ServingEngine(
        engine,
        block_size=4,
        num_blocks=options.pop("num_blocks", 64),
        chunk_size=16,
        max_batch=options.pop("max_batch", 16),
        prefix_caching=True,
        max_context=engine.config.context_length,
    )
    server = server_class(serving, "tiny", max_body=options.pop("max_body", 65536))
    server.worker = worker_class(serving)
    return server


# --- a client -------------------------------------------------------------------------------


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def _post(url: str, path: str, body: bytes | dict, timeout: float = CLIENT_TIMEOUT_S):
    """(status, parsed JSON answer) of a POST of `body` (bytes as they are)."""
    connection, base = _connection(url, timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        connection.request("POST", base + path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _get(url: str, path: str, method: str = "GET"):
    connection, base = _connection(url, CLIENT_TIMEOUT_S)
    try:
        connection.request(method, base + path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _events(response) -> list[dict | str]:
    """The server-sent events of a streamed answer, `[DONE]` as the string."""
    events = []
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
        if payload == "[DONE]":
            break
    return events


@dataclasses.dataclass
class Outcome:
    """One request as its client saw it."""

    client: int
    prompt: list[int]
    kind: str  # "whole", "stream" or "dropped"
    seconds: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    problem: str | None = None


def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        "stream": stream,
    }


def _token_ids(logprobs: dict) -> list[int]:
    return [int(name[len(TOKEN_ID_PREFIX) :]) for name in logprobs["tokens"]]


def _request(url: str, outcome: Outcome, max_tokens: int, timeout: float) -> None:
    start = time.perf_counter()
    try:
        if outcome.kind == "whole":
            status, answer = _post(
                url, "/completions", _body(outcome.prompt, max_tokens, False), timeout
            )
            if status != 200:
                outcome.problem = f"HTTP {status}: {answer}"
                return
            (choice,) = answer["choices"]
            outcome.tokens = _token_ids(choice["logprobs"])
            outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
            if answer["usage"]["completion_tokens"] != len(outcome.tokens):
                outcome.problem = f"usage {answer['usage']} for {len(outcome.tokens)} tokens"
        else:
            connection, base = _connection(url, timeout)
            body = json.dumps(_body(outcome.prompt, max_tokens, True)).encode()
            connection.request(
                "POST", base + "/completions", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            if response.status != 200:
                outcome.problem = f"HTTP {response.status}: {response.read()[:300]!r}"
                return
            if outcome.kind == "dropped":
                for _ in range(2):  # two events, then the client goes away mid-stream
                    while not response.fp.readline().startswith(b"data: "):
                        pass
                response.close()  # closes the socket (the response holds it)
                connection.close()
                return
            events = _events(response)
            connection.close()
            if not events or events[-1] != "[DONE]":
                outcome.problem = f"the stream ended without [DONE]: {events[-1:]}"
                return
            for event in events[:-1]:
                (choice,) = event["choices"]
                outcome.text += choice["text"]
                if choice["logprobs"]:
                    outcome.tokens += _token_ids(choice["logprobs"])
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        outcome.problem = f"{type(error).__name__}: {error}"
    finally:
        outcome.seconds = time.perf_counter() - start


def _prompts(vocab: int) -> list[list[list[int]]]:
    """Three prompts per client, seeded; half of them behind one shared 24-token preamble."""
    rng = np.random.default_rng(SEED)
    preamble = rng.integers(0, vocab, 24).tolist()
    prompts = []
    for client in range(CLIENTS):
        own = []
        for _ in range(3):
            tail = rng.integers(0, vocab, int(rng.integers(3, 17))).tolist()
            own.append(preamble + tail if client % 2 == 0 else tail)
        prompts.append(own)
    return prompts


@dataclasses.dataclass
class LoadResult:
    outcomes: list[Outcome]
    metrics: dict
    seconds: float
    problems: list[str]


def _load(
    server: Server, solo: Llama3Engine, *, max_tokens: int = 24, timeout: float = CLIENT_TIMEOUT_S
) -> LoadResult:
    """CLIENTS threads, three requests each, against `server` on a free port; every problem
    found (module docstring), each naming its client and prompt."""
    prompts = _prompts(solo.config.vocab_size)
    outcomes = [
        Outcome(
            client,
            prompts[client][j],
            ("whole", "stream", "dropped" if client < DROPPING else "whole")[j],
        )
        for client in range(CLIENTS)
        for j in range(3)
    ]
    with RunningServer(server) as running:

        def client(c: int) -> None:
            for outcome in outcomes[3 * c : 3 * c + 3]:
                tokens = 200 if outcome.kind == "dropped" else max_tokens
                _request(running.url, outcome, tokens, timeout)

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        deadline = time.perf_counter() + timeout
        while True:  # the dropped streams are cancelled when the server next writes to them
            metrics = _get(running.url[: -len("/v1")], "/metrics")[1]
            if metrics["pending"] == 0 or time.perf_counter() > deadline:
                break
            time.sleep(0.05)
    problems = [f"client {o.client} ({o.kind}): {o.problem}" for o in outcomes if o.problem]
    for o in outcomes:
        if o.problem or o.kind == "dropped":
            continue
        reference = solo.generate(o.prompt, max_tokens, stop_on_eos=False)
        own = _own_tokens(o.tokens, reference)
        if own is not None:
            problems.append(f"client {o.client} ({o.kind}) prompt {o.prompt[:6]}...: {own}")
        elif o.text != solo.tokenizer.decode(o.tokens):
            problems.append(f"client {o.client} ({o.kind}): text {o.text!r} is not its tokens'")
        elif o.finish_reason != "length":
            problems.append(f"client {o.client} ({o.kind}): finish_reason {o.finish_reason!r}")
    cancelled = metrics["requests"].get("cancelled", 0)
    if cancelled != DROPPING:
        problems.append(
            f"{DROPPING} clients dropped their streams and the server cancelled {cancelled} "
            f"requests (/metrics: {metrics})"
        )
    # A cancelled request leaves the engine at once: none of them runs on to its max_tokens
    # (which a cancel that only stopped listening would count as one more "length").
    expected = {"length": len(outcomes) - DROPPING, "cancelled": DROPPING}
    if metrics["requests"] != expected:
        problems.append(
            f"requests by outcome {metrics['requests']}, expected {expected}: a cancelled "
            f"request ran on in the engine (/metrics: {metrics})"
        )
    if metrics["pending"] or metrics["kv_blocks_in_use"]:
        problems.append(
            f"at the end {metrics['pending']} requests pending, "
            f"{metrics['kv_blocks_in_use']} KV blocks referenced (/metrics: {metrics})"
        )
    return LoadResult(outcomes, metrics, seconds, problems)


def _own_tokens(served: list[int], reference) -> str | None:
    """None if `served` are the solo run's greedy tokens (up to a near tie); else why not."""
    if len(served) != len(reference.tokens):
        return f"{len(served)} tokens, the solo run {len(reference.tokens)}"
    for step, (got, want) in enumerate(zip(served, reference.tokens, strict=True)):
        if got == want:
            continue
        row = reference.logits[step]
        gap = float(row[want] - row[got])
        if gap <= NEAR_TIE * float(row.abs().max()):
            return None  # a near tie: the two runs may go their own ways from here
        return (
            f"step {step} is token {got}, the solo run's {want} leads it by {gap:.3g}: these "
            f"are not this prompt's tokens (served {served[:8]}, solo {reference.tokens[:8]})"
        )
    return None


def _summary(result: LoadResult) -> str:
    done = [o for o in result.outcomes if not o.problem and o.kind != "dropped"]
    latencies = sorted(o.seconds for o in done)
    tokens = sum(len(o.tokens) for o in done)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return (
        f"{len(done)} requests from {CLIENTS} clients in {result.seconds:.2f} s: latency p50 "
        f"{statistics.median(latencies) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, "
        f"{tokens / result.seconds:.0f} generated tokens/s; /metrics {result.metrics}"
    )


# --- the tests ------------------------------------------------------------------------------


def test_sixteen_clients_get_their_own_tokens_and_nothing_is_lost(checkpoint, solo) -> None:
    result = _load(_server(checkpoint), solo)
    print(_summary(result))
    assert not result.problems, "\n".join(result.problems)
    metrics = result.metrics
    # the pool was under pressure: sharing, and preemption
    assert metrics["prefix_cache_hits"] > 0 and metrics["preemptions"] > 0, metrics


class _FirstComeFirstServed(EngineWorker):
    """Planted: a finished result goes to the request that has waited longest, as if requests
    finished in the order they arrived (they do not: prompts differ, sequences are preempted)."""

    def _finish(self, event) -> None:
        if event.served is not None and self._listeners:
            event = dataclasses.replace(event, request_id=next(iter(self._listeners)))
        super()._finish(event)


class _FirstArrivalOnly(EngineWorker):
    """Planted: the worker takes the first request that arrived during a step, drops the rest."""

    def _take(self):
        inbox, cancels = super()._take()
        return inbox[:1], cancels


class _NoCancelOnClose(Server):
    """Planted: a stream whose client went away is left running to its max_tokens."""

    def _on_close(self, unfinished: list[str]) -> None:
        pass


class _CancelWithoutFreeing(EngineWorker):
    """Planted: a cancel is counted and its listener dropped, but the serving engine is never
    told: the request runs on to its max_tokens, holding its KV blocks."""

    def _cancel(self, request_id: str) -> None:
        if request_id in self._listeners:
            self.counts["cancelled"] += 1
            self._listeners.pop(request_id)


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        (dict(worker_class=_FirstComeFirstServed), "not this prompt's tokens"),
        (dict(worker_class=_FirstArrivalOnly), "timed out"),
        (dict(server_class=_NoCancelOnClose), "the server cancelled 0 requests"),
        (dict(worker_class=_CancelWithoutFreeing), "a cancelled request ran on in the engine"),
    ],
    ids=[
        "another_requests_tokens",
        "lost_requests",
        "no_cancel_on_disconnect",
        "cancel_without_freeing",
    ],
)
def test_each_planted_server_bug_fails_the_load_run(checkpoint, solo, plant, expected) -> None:
    result = _load(_server(checkpoint, **plant), solo, timeout=5.0)
    print("\n".join(result.problems))
    assert any(expected in p for p in result.problems), "\n".join(result.problems) or "no problem"


# --- bad requests ---------------------------------------------------------------------------


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"x" * 70000, 413, "over this server's limit of 65536 bytes"),
    ({"max_tokens": 4}, 400, '"prompt" is required'),
    ({"prompt": [1, 2, 10**6]}, 400, "outside the vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 10**6}, 400, "over this server's context of 256"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, '"max_tokens" must be at least 1'),
    ({"prompt": [1, 2], "temperature": "hot"}, 400, '"temperature" must be a number'),
    ({"prompt": [1, 2], "temperature": -1}, 400, '"temperature" must be >= 0'),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p=0.0 must lie in (0, 1]"),
    ({"prompt": [1, 2], "logprobs": 99}, 400, '"logprobs" must lie in 0..20'),
    ({"prompt": [1, 2], "n": 2}, 400, '"n" must be 1'),
    ({"prompt": [1, 2], "stop": [""]}, 400, '"stop" must be a non-empty string'),
    ({"prompt": [], "max_tokens": 1}, 400, '"prompt" must be text, token ids'),
    ({"prompt": [[1], "a", 3]}, 400, "prompt 2 is neither text nor a list of token ids"),
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
    ([1, 2], 400, "must be a JSON object"),
    # JSON's non-standard NaN and Infinity, which Flask's parser takes as floats
    (b'{"prompt": [1, 2], "presence_penalty": NaN}', 400, "presence_penalty=nan must be a finite"),
    (b'{"prompt": [1, 2], "frequency_penalty": -Infinity}', 400, "frequency_penalty=-inf must"),
    ({"prompt": [1, 2], "repetition_penalty": 1e-320}, 400, "must lie in [0.001, 1000]"),
    # greedy checks the sampler fields too, and refuses a penalty it would not apply
    ({"prompt": [1, 2], "temperature": 0, "top_p": 0}, 400, "top_p=0.0 must lie in (0, 1]"),
    (
        {"prompt": [1, 2], "temperature": 0, "presence_penalty": 0.5},
        400,
        '"presence_penalty" with "temperature": 0 (greedy, which applies no penalty)',
    ),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_bad_request_gets_a_clear_4xx_and_the_server_serves_on(
    checkpoint, body, status, message
) -> None:
    server = _server(checkpoint)
    with RunningServer(server) as running:
        got, answer = _post(running.url, "/completions", body)
        assert got == status, answer
        assert message in answer["error"]["message"], answer
        assert answer["error"]["type"] == "invalid_request_error"
        ok, fine = _post(running.url, "/completions", _body([1, 2, 3], 2, False))
        assert ok == 200 and len(fine["choices"][0]["logprobs"]["tokens"]) == 2, fine


def test_endpoints_and_wrong_methods(checkpoint) -> None:
    with RunningServer(_server(checkpoint)) as running:
        assert _get(running.url, "/models")[1]["data"][0]["id"] == "tiny"
        status, answer = _get(running.url, "/chat/completions", "POST")
        assert status == 404 and "no such endpoint" in answer["error"]["message"]
        status, answer = _get(running.url, "/completions")
        assert status == 405 and "GET is not allowed" in answer["error"]["message"]
        root = running.url[: -len("/v1")]
        assert _get(root, "/health") == (200, {"status": "ok"})


def test_text_prompts_stop_strings_and_seeded_sampling(checkpoint, solo) -> None:
    tokenizer = solo.tokenizer
    with RunningServer(_server(checkpoint)) as running:
        prompt = "the cap"
        status, answer = _post(
            running.url, "/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        )
        assert status == 200, answer
        reference = solo.generate(tokenizer.encode(prompt), 12)
        stopped = answer["choices"][0]["finish_reason"] == "stop"
        assert answer["choices"][0]["text"] == solo.text(reference.tokens, stopped)
        assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))
        # a stop string: the text ends before it, finish_reason "stop"
        text = answer["choices"][0]["text"]
        stop = text[3:5]
        cut = text[: text.find(stop)]
        for stream in (False, True):
            body = {
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0,
                "stop": stop,
                "stream": stream,
            }
            if stream:
                events = _stream(running.url, body)
                got = "".join(e["choices"][0]["text"] for e in events[:-1])
                reason = events[-2]["choices"][0]["finish_reason"]
            else:
                answer = _post(running.url, "/completions", body)[1]
                got, reason = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
            assert (got, reason) == (cut, "stop"), (stream, stop, text)
        # seeded sampling: the same seed, the same draw; the engine's own sampled tokens
        body = {
            "prompt": [5, 6, 7],
            "max_tokens": 8,
            "temperature": 0.9,
            "seed": 7,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        }
        first = _token_ids(_post(running.url, "/completions", body)[1]["choices"][0]["logprobs"])
        again = _token_ids(_post(running.url, "/completions", body)[1]["choices"][0]["logprobs"])
        from pipelines.llama3.sampling import SamplerSettings

        sampled = solo.generate(
            [5, 6, 7], 8, stop_on_eos=False, sampling=SamplerSettings(temperature=0.9, seed=7)
        )
        assert first == again == sampled.tokens


def test_top_logprobs_are_the_log_softmax_of_the_engines_logits(checkpoint, solo) -> None:
    with RunningServer(_server(checkpoint)) as running:
        body = {**_body([9, 8, 7, 6], 3, False), "logprobs": 5}
        choice = _post(running.url, "/completions", body)[1]["choices"][0]
    reference = solo.generate([9, 8, 7, 6], 3, stop_on_eos=False)
    for step, top in enumerate(choice["logprobs"]["top_logprobs"]):
        want = torch.log_softmax(reference.logits[step].double(), -1)
        ids = [int(k[len(TOKEN_ID_PREFIX) :]) for k in top]
        assert ids == torch.topk(want, 5).indices.tolist()
        assert np.allclose(list(top.values()), want[ids].numpy(), atol=1e-5)


def test_top_logprobs_named_by_text_keep_each_texts_most_likely_token(checkpoint, solo) -> None:
    """Named by their text (no `return_tokens_as_token_ids`), two ids can share a key: byte
    pieces of one character all decode to U+FFFD. Each text keeps the log-probability of its
    most likely id, in the order of the top K; the entries are as many as the distinct texts.
    Planted (as it was): a dict comprehension, where the least likely id of a text overwrote
    the value, so the first entry said -13.9 for a token at -0.014."""
    prompt = [1, 2, 3, 4]
    with RunningServer(_server(checkpoint)) as running:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 20}
        (top,) = _post(running.url, "/completions", body)[1]["choices"][0]["logprobs"][
            "top_logprobs"
        ]
    want = torch.log_softmax(solo.generate(prompt, 1).logits[0].double(), -1)
    values, ids = torch.topk(want, 20)
    expected: dict[str, float] = {}
    pairs = sorted(zip(values.tolist(), ids.tolist(), strict=True), key=lambda t: (-t[0], t[1]))
    for value, token in pairs:
        expected.setdefault(solo.tokenizer.decode([token]), value)
    assert len(expected) < 20  # texts collide here: the case this test is about
    assert list(top) == list(expected)
    assert np.allclose(list(top.values()), list(expected.values()), atol=1e-5)


def test_a_speculating_server_answers_the_same_tokens(checkpoint, solo) -> None:
    """--speculate: every request decodes speculatively (the n-gram draft): its solo greedy
    tokens, in fewer forwards than tokens where the text repeats."""
    engine = Llama3Engine.from_gguf(checkpoint)
    server = build(engine, "tiny", kv_tokens=1024, block_size=4, speculate=4)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    with RunningServer(server) as running:
        status, answer = _post(running.url, "/completions", _body(prompt, 24, False))
    assert status == 200, answer
    reference = solo.generate(prompt, 24, stop_on_eos=False)
    assert _own_tokens(_token_ids(answer["choices"][0]["logprobs"]), reference) is None
    assert server.serving.steps < 24, server.serving.steps  # proposals accepted


def test_constrained_completions_in_every_request_form(checkpoint, solo) -> None:
    """Each constraint field (OpenAI's response_format, llama-server's json_schema and GBNF
    grammar, vLLM's guided_*): the answer is its solo constrained generate's text, and it
    conforms; a bad or a doubled constraint is a 400 naming its field."""
    from pipelines.llama3.constrained import Constraint

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    forms = [
        (_json_schema_format(schema), Constraint.json_schema(schema)),
        ({"json_schema": schema}, Constraint.json_schema(schema)),
        ({"grammar": 'root ::= "(" [0-9]+ ")"'}, Constraint.grammar('root ::= "(" [0-9]+ ")"')),
        ({"guided_regex": "[a-c]{2}x"}, Constraint.regex("[a-c]{2}x")),
        ({"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"])),
    ]
    tokenizer = solo.tokenizer
    prompt = "the answer: "
    with RunningServer(_server(checkpoint)) as running:
        for fields, constraint in forms:
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, **fields}
            status, answer = _post(running.url, "/completions", body)
            assert status == 200, (fields, answer)
            want = solo.generate(tokenizer.encode(prompt), 10, constraint=constraint)
            text = answer["choices"][0]["text"]
            # the end-of-sequence token that ends a complete member is not text
            stopped = answer["choices"][0]["finish_reason"] == "stop"
            assert stopped == (want.tokens[-1] in solo.eos_ids), (fields, want.tokens)
            assert text == tokenizer.decode(want.tokens[: len(want.tokens) - stopped]), fields
            if "guided_choice" in fields:  # 'yes<|eot_id|>' before
                assert stopped and text in ("yes", "no"), text
                ids = {"logprobs": 0, "return_tokens_as_token_ids": True}
                streamed = _streamed_choices(_stream(running.url, {**body, **ids}))[0]
                assert (streamed["text"], streamed["finish"]) == (text, "stop"), streamed
                assert streamed["tokens"] == want.tokens, streamed  # the id is kept
        for fields, field in (
            ({"guided_regex": "[0-9"}, "guided_regex"),
            ({"json_schema": "not a schema"}, "json_schema"),
            ({"response_format": {"type": "xml"}}, "response_format"),
            # a bad schema inside response_format names the field sent, not llama-server's
            # top-level json_schema (planted: the field renamed before the checks)
            *((_json_schema_format(bad), "response_format") for bad in (False, "x")),
            ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
            ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
        ):
            body = {"prompt": prompt, "max_tokens": 4, **fields}
            status, answer = _post(running.url, "/completions", body)
            assert status == 400, (fields, answer)
            assert answer["error"]["param"] == field, answer


def _json_schema_format(schema: object) -> dict:
    """A request's OpenAI response_format holding `schema` as its JSON schema."""
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}


# --- what one answer holds: several prompts, stop strings, logprobs, a server that stops ----


def _stream(url: str, body: dict) -> list[dict | str]:
    connection, base = _connection(url, CLIENT_TIMEOUT_S)
    try:
        connection.request("POST", base + "/completions", json.dumps({**body, "stream": True}))
        return _events(connection.getresponse())
    finally:
        connection.close()


def _streamed_choices(events: list[dict | str]) -> dict[int, dict]:
    """Per choice index: its text, token ids and logprobs' lists, joined over the events."""
    choices: dict[int, dict] = {}
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            got = choices.setdefault(
                choice["index"], {"text": "", "tokens": [], "logprobs": {}, "finish": None}
            )
            got["text"] += choice["text"]
            got["finish"] = choice["finish_reason"] or got["finish"]
            for key, values in (choice["logprobs"] or {}).items():
                got["logprobs"].setdefault(key, []).extend(values)
    for got in choices.values():
        if got["logprobs"]:
            got["tokens"] = _token_ids(got["logprobs"])
    return choices


class _ChoicesOutOfOrder(Server):
    """Planted: the request ids come back in another order than the prompts were submitted
    in, so choice i is built from another prompt's request."""

    def run(self, completion):
        base, ids, listener = super().run(completion)
        return base, ids[::-1], listener


@pytest.mark.parametrize(
    "plant", [None, _ChoicesOutOfOrder], ids=["server", "choices_out_of_order"]
)
def test_several_prompts_in_one_request_each_get_their_own_choice(checkpoint, solo, plant) -> None:
    """A request with three prompts of different lengths, whole and streamed: choice i holds
    prompt i's solo greedy tokens and text (the planted mix-up fails both)."""
    prompts = [[3, 4, 5], [60, 61, 62, 63, 64, 65, 66, 67, 68], [9, 1, 9, 1, 9]]
    references = [solo.generate(p, 6, stop_on_eos=False) for p in prompts]
    body = {**_body(prompts, 6, False), "prompt": prompts}
    with RunningServer(_server(checkpoint, server_class=plant or Server)) as running:
        status, whole = _post(running.url, "/completions", body)
        streamed = _streamed_choices(_stream(running.url, body))
    assert status == 200, whole
    problems = []
    for i, reference in enumerate(references):
        choice = whole["choices"][i]
        for path, tokens, text in (
            ("whole", _token_ids(choice["logprobs"]), choice["text"]),
            ("stream", streamed[i]["tokens"], streamed[i]["text"]),
        ):
            own = _own_tokens(tokens, reference)
            if own is not None or text != solo.tokenizer.decode(tokens):
                problems.append(f"{path} choice {i}: {own or 'text is not its tokens'}")
    if plant is None:
        assert not problems, "\n".join(problems)
    else:
        assert problems, "the planted mix-up of choices passed"


def _stop_across_tokens(tokenizer, tokens: list[int]) -> tuple[str, int] | None:
    """A two-character stop string of the text of `tokens` whose first character ends one
    token's text and is a whole character (so only the stop rule holds it back), and where
    the text is cut: its first occurrence."""
    text = tokenizer.decode(tokens)
    for j in range(1, len(tokens)):
        end = len(tokenizer.decode(tokens[:j]))
        if not 0 < end < len(text) or "\ufffd" in text[end - 1 : end + 1]:
            continue
        stop = text[end - 1 : end + 1]
        if text.find(stop) == end - 1:
            return stop, end - 1
    return None


class _NoHoldBack(Server):
    """Planted: a stream sends all its text so far, the start of a stop string included."""

    def _sendable(self, text: str, shown: int, stop: tuple[str, ...]) -> str:
        return text


@pytest.mark.parametrize("plant", [None, _NoHoldBack], ids=["server", "no_hold_back"])
def test_a_stop_string_that_spans_tokens_is_never_streamed(checkpoint, solo, plant) -> None:
    """The stop string starts with the last character of one token's text and ends in the
    next token's: the stream must hold that character back until it knows, and send the
    same text as the whole answer (the text before the stop string)."""
    prompt = [7, 3, 5, 2]
    reference = solo.generate(prompt, 24, stop_on_eos=False)
    found = _stop_across_tokens(solo.tokenizer, reference.tokens)
    assert found is not None, "no stop string across a token boundary in this continuation"
    stop, cut = found
    text = solo.tokenizer.decode(reference.tokens)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop}
    with RunningServer(_server(checkpoint, server_class=plant or Server)) as running:
        whole = _post(running.url, "/completions", body)[1]["choices"][0]
        streamed = _streamed_choices(_stream(running.url, body))[0]
    assert (whole["text"], whole["finish_reason"]) == (text[:cut], "stop"), (stop, text)
    if plant is None:
        assert (streamed["text"], streamed["finish"]) == (text[:cut], "stop"), (stop, text)
    else:
        assert streamed["text"] != text[:cut], "the planted stream passed"


def test_logprobs_are_the_engines_whole_and_streamed(checkpoint, solo) -> None:
    """Every field of `logprobs`, whole and streamed: `token_logprobs` the chosen token's
    log-softmax of the solo run's row, `top_logprobs` the top 3 of it, `text_offset` each
    token's character offset in the generated text (the stream's second request reads its
    prompt from the prefix cache: the same values up to batch invariance)."""
    prompt = [9, 8, 7, 6, 5]
    reference = solo.generate(prompt, 6, stop_on_eos=False)
    body = {**_body(prompt, 6, False), "logprobs": 3}
    with RunningServer(_server(checkpoint)) as running:
        whole = _post(running.url, "/completions", body)[1]["choices"][0]["logprobs"]
        streamed = _streamed_choices(_stream(running.url, body))[0]["logprobs"]
    for logprobs in (whole, streamed):
        tokens = _token_ids(logprobs)
        assert tokens == reference.tokens
        for j, token in enumerate(tokens):
            logp = torch.log_softmax(reference.logits[j].double(), -1)
            want = float(logp[token])
            assert logprobs["token_logprobs"][j] == pytest.approx(want, abs=SERVED_VS_SOLO)
            row = logprobs["top_logprobs"][j]
            top = {int(k[len(TOKEN_ID_PREFIX) :]): v for k, v in row.items()}
            ids = torch.topk(logp, 3).indices.tolist()
            assert list(top) == ids
            assert list(top.values()) == pytest.approx(logp[ids].tolist(), abs=SERVED_VS_SOLO)
            assert logprobs["text_offset"][j] == len(solo.tokenizer.decode(tokens[:j]))


class _SlowWorker(EngineWorker):
    """The engine worker, 20 ms a step: a 200-token request is still running when the
    server is told to stop."""

    def _step(self) -> None:
        time.sleep(0.02)
        super()._step()


def test_a_server_that_stops_mid_answer_says_so(checkpoint) -> None:
    """Stopped (SIGTERM's `stop_soon`) while a whole answer and a stream run: the whole one
    gets 503 naming the shutdown, the stream an error event and no `[DONE]`; neither reads
    as a complete answer (finish_reason "length")."""
    server = _server(checkpoint, worker_class=_SlowWorker)
    answers: dict[str, object] = {}
    with RunningServer(server) as running:

        def whole() -> None:
            answers["whole"] = _post(running.url, "/completions", _body([1, 2, 3], 200, False))

        def stream() -> None:
            answers["stream"] = _stream(running.url, _body([4, 5, 6], 200, True))

        threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.perf_counter() + CLIENT_TIMEOUT_S
        while server.worker.serving.steps < 5 and time.perf_counter() < deadline:
            time.sleep(0.01)
        server.worker.stop_soon()
        for t in threads:
            t.join()
    status, answer = answers["whole"]
    assert status == 503 and "shutting down" in answer["error"]["message"], answer
    events = answers["stream"]
    assert "[DONE]" not in events, events[-2:]
    assert "shutting down" in events[-1]["error"]["message"], events[-1]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1]), events[-2]


# --- serve's command line -------------------------------------------------------------------


def _no_load(*args, **kwargs):
    raise AssertionError("serve loaded the checkpoint before refusing its command line")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--port=70000", "--port=70000 must lie in 0..65535"),  # served on 70000 - 65536
        ("--max-context=257", "--max-context=257 exceeds the checkpoint's context length 256"),
        ("--host=no.such.host.invalid", "--host=no.such.host.invalid is not an address here"),
        ("--gguf=.", "is a folder; name the GGUF file"),
    ],
)
def test_impossible_options_exit_2_naming_them_before_the_load(
    flag, message, checkpoint, monkeypatch, capsys
) -> None:
    """Each was taken: --port=70000 served on 4464, --max-context=99999999 grew to 16 GB
    without serving, an unresolvable --host was werkzeug's rc 1 naming no flag."""
    monkeypatch.setattr(Llama3Engine, "from_gguf", _no_load)
    monkeypatch.chdir(checkpoint.parent)
    with pytest.raises(SystemExit) as refused:
        main([f"--gguf={checkpoint}", flag])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "loading" not in error, error


def test_a_port_in_use_exits_2_naming_the_port(checkpoint, capsys) -> None:
    """werkzeug answers a failed bind with sys.exit(1); serve says which address and exits 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main([f"--gguf={checkpoint}", f"--port={port}", "--kv-tokens=64"])
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


# --- request fields at their limits, the sampler's fields, stream framing, engine faults ------


def _small_context_server(checkpoint, context: int) -> Server:
    """`_server`'s engine and pool with a context of `context` tokens per request."""
    engine = Llama3Engine.from_gguf(checkpoint)
    serving = ServingEngine(
        engine,
        block_size=4,
        num_blocks=64,
        chunk_size=16,
        max_batch=16,
        prefix_caching=True,
        max_context=context,
    )
    return Server(serving, "tiny", max_body=65536)


def test_each_limit_is_served_at_the_limit_and_refused_one_past_it(checkpoint, solo) -> None:
    """Each documented limit holds exactly: a prompt plus max_tokens of exactly the context
    (16 here), `logprobs` 20, four stop strings and the vocabulary's last id are served; one
    more of each is a 400 naming it. JSON `true` is no number (`max_tokens`, `temperature`),
    an empty `model` is this server's, and greedy refuses every penalty, not only presence.
    Plants that fail it: `>=` for the context check, `<` for the logprobs range or the stop
    count, `<=` for the vocabulary bound, `_field` taking booleans as numbers, `model: ""`
    refused, frequency_penalty left out of greedy's refusals."""
    from pipelines.llama3.server import MAX_LOGPROBS

    vocab = solo.config.vocab_size
    fits = {"prompt": [1, 2, 3, 4], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    served = [
        fits,
        {**fits, "logprobs": MAX_LOGPROBS, "return_tokens_as_token_ids": True},
        {**fits, "stop": ["zz1", "zz2", "zz3", "zz4"]},
        {**fits, "prompt": [1, vocab - 1]},
        {**fits, "model": ""},
    ]
    refused = [
        ({**fits, "max_tokens": 13}, "max_tokens", "17 is over this server's context of 16"),
        ({**fits, "logprobs": MAX_LOGPROBS + 1}, "logprobs", '"logprobs" must lie in 0..20'),
        ({**fits, "stop": ["zz1", "zz2", "zz3", "zz4", "zz5"]}, "stop", "at most 4 strings"),
        ({**fits, "prompt": [1, vocab]}, "prompt", f"outside the vocabulary [0, {vocab})"),
        ({**fits, "max_tokens": True}, "max_tokens", '"max_tokens" must be an integer >= 1'),
        ({**fits, "temperature": True}, "temperature", '"temperature" must be a number >= 0'),
        (
            {**fits, "frequency_penalty": 0.5},
            "frequency_penalty",
            '"frequency_penalty" with "temperature": 0',
        ),
        (
            {**fits, "repetition_penalty": 1.3},
            "repetition_penalty",
            '"repetition_penalty" with "temperature": 0',
        ),
    ]
    with RunningServer(_small_context_server(checkpoint, 16)) as running:
        answers = [_post(running.url, "/completions", body) for body in served]
        refusals = [_post(running.url, "/completions", body) for body, _, _ in refused]
    for body, (status, answer) in zip(served, answers, strict=True):
        assert status == 200, (body, answer)
        assert answer["usage"]["completion_tokens"] == 12, (body, answer["usage"])
    top = answers[1][1]["choices"][0]["logprobs"]["top_logprobs"]
    assert [len(row) for row in top] == [MAX_LOGPROBS] * 12, top[0]
    for (body, param, message), (status, answer) in zip(refused, refusals, strict=True):
        assert status == 400, (body, answer)
        assert answer["error"]["param"] == param, (body, answer)
        assert message in answer["error"]["message"], (body, answer)


def _stops_in(text: str) -> tuple[str, str, str]:
    """Three strings of `text` without a partial character: `early` (two characters, the
    earliest such), `late` (two, first found after `early` starts) and `overlap` (three,
    whose last character first occurs as its last: the token completing `overlap` completes
    that character's one-character stop string too)."""
    clean = [k for k in range(len(text) - 2) if "\ufffd" not in text[k : k + 3]]
    early = text[clean[0] : clean[0] + 2]
    late = next(p for p in (text[k : k + 2] for k in clean) if text.find(p) > text.find(early))
    k = next(k for k in clean if text.find(text[k : k + 3]) == k == text.find(text[k + 2]) - 2)
    return early, late, text[k : k + 3]


def test_every_stop_string_counts_and_the_earliest_cuts(checkpoint, solo) -> None:
    """`stop` as a list: the text is cut before whichever stop string starts first, wherever
    it stands in the list, whole and streamed (finish_reason "stop"): four strings of which
    the third occurs first; and a one-character string completed by the same token as a
    three-character one ending in it, which starts earlier and so cuts. Plants that fail it:
    only the first stop string reaching the engine, the cut at the latest match (`max` for
    `min`), four stop strings refused."""
    prompt = "the cap"
    reference = solo.generate(solo.tokenizer.encode(prompt), 12, stop_on_eos=False)
    text = solo.tokenizer.decode(reference.tokens)
    early, late, overlap = _stops_in(text)
    cases = [
        (["not there", late, early, "nor here"], text[: text.find(early)]),
        ([overlap[-1], overlap], text[: text.find(overlap)]),
    ]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with RunningServer(_server(checkpoint)) as running:
        for stop, cut in cases:
            status, whole = _post(running.url, "/completions", {**body, "stop": stop})
            streamed = _streamed_choices(_stream(running.url, {**body, "stop": stop}))[0]
            assert status == 200, whole
            choice = whole["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (cut, "stop"), (stop, text)
            assert (streamed["text"], streamed["finish"]) == (cut, "stop"), (stop, text)


def test_each_sampler_field_reaches_the_sampler(checkpoint, solo) -> None:
    """Every sampler field of a request is its own SamplerSettings field: the served tokens
    are the solo run's under the same settings and seed, with all of top_k, top_p, min_p and
    the three penalties set; `temperature` left out is OpenAI's 1 (sampling, not greedy);
    `top_k: -1` is vLLM's "off", top_k 0. Plants that fail it: min_p read from "top_p",
    temperature's default 0 (greedy), -1 passed on as top_k (a 400)."""
    from pipelines.llama3.sampling import SamplerSettings

    prompt = [5, 6, 7]
    fields = {
        "temperature": 0.9,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.02,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.2,
    }
    cases = [
        (fields, SamplerSettings(**fields, seed=7)),
        ({}, SamplerSettings(temperature=1.0, seed=7)),
        ({"temperature": 0.9, "top_k": -1}, SamplerSettings(temperature=0.9, top_k=0, seed=7)),
    ]
    base = {
        "prompt": prompt,
        "max_tokens": 16,
        "seed": 7,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    with RunningServer(_server(checkpoint)) as running:
        answers = [_post(running.url, "/completions", {**base, **f}) for f, _ in cases]
    for (f, settings), (status, answer) in zip(cases, answers, strict=True):
        assert status == 200, (f, answer)
        want = solo.generate(prompt, 16, stop_on_eos=False, sampling=settings).tokens
        assert _token_ids(answer["choices"][0]["logprobs"]) == want, (f, settings)


def test_a_stream_ends_with_its_finish_reason_usage_and_done(checkpoint, solo) -> None:
    """A stream without logprobs whose last step is the end-of-sequence token (no text of
    its own): one chunk still carries finish_reason "stop"; with `stream_options:
    {include_usage: true}` the chunk before `[DONE]` has no choices and the request's usage;
    every chunk has the same id and object "text_completion"; on the wire (text/event-stream)
    each event is one `data:` line ended by a blank line, as SSE clients split them. Plants
    that fail it: a final chunk without text or logprobs not sent (no finish_reason),
    include_usage ignored, events ended by one newline (a client joins them into one)."""
    from pipelines.llama3.constrained import Constraint

    prompt = "the answer: "
    want = solo.generate(
        solo.tokenizer.encode(prompt), 8, constraint=Constraint.choice(["yes", "no"])
    ).tokens
    assert want[-1] in solo.eos_ids, want
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "guided_choice": ["yes", "no"],
        "stream_options": {"include_usage": True},
    }
    with RunningServer(_server(checkpoint)) as running:
        connection, base = _connection(running.url, CLIENT_TIMEOUT_S)
        try:
            connection.request("POST", base + "/completions", json.dumps({**body, "stream": True}))
            response = connection.getresponse()
            kind, raw = response.getheader("Content-Type"), response.read().decode()
        finally:
            connection.close()
    assert kind.startswith("text/event-stream"), kind
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and all(
        b.startswith("data: ") and "\n" not in b for b in blocks[:-1]
    ), raw[:300]
    events = [b[len("data: ") :] for b in blocks[:-1]]
    assert events[-1] == "[DONE]", events[-2:]
    events = [*map(json.loads, events[:-1]), "[DONE]"]
    chunks = events[:-1]
    assert {(c["id"], c["object"]) for c in chunks} == {(chunks[0]["id"], "text_completion")}
    usage = chunks[-1]
    assert usage["choices"] == [], usage
    prompt_tokens = len(solo.tokenizer.encode(prompt))
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(want),
        "total_tokens": prompt_tokens + len(want),
    }
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert reasons[-1] == "stop" and reasons.count(None) == len(reasons) - 1, reasons
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == solo.text(want, True) and text in ("yes", "no"), text


def test_an_engine_failure_is_a_500_and_the_server_serves_on(checkpoint) -> None:
    """The serving engine's step raises (once for a whole answer, once for a stream): the
    whole answer is a 500 of type server_error naming the failure, the stream an error event
    and no `[DONE]`; /metrics counts both as failed, and the next request is served. Plant
    that fails it: the engine's error answered as a 400 (the client's fault)."""
    server = _server(checkpoint)
    step, failures = server.serving.step, [2]

    def failing_step():
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("planted step failure")
        return step()

    server.serving.step = failing_step
    with RunningServer(server) as running:
        status, answer = _post(running.url, "/completions", _body([1, 2, 3], 4, False))
        events = _stream(running.url, _body([4, 5, 6], 4, True))
        ok, fine = _post(running.url, "/completions", _body([1, 2, 3], 4, False))
        metrics = _get(running.url[: -len("/v1")], "/metrics")[1]
    assert status == 500, answer
    assert answer["error"]["type"] == "server_error", answer
    assert "the engine failed: RuntimeError: planted step failure" in answer["error"]["message"]
    assert "[DONE]" not in events and len(events) == 1, events
    assert "the engine failed: RuntimeError" in events[0]["error"]["message"], events
    assert ok == 200 and len(fine["choices"][0]["logprobs"]["tokens"]) == 4, fine
    assert metrics["requests"] == {"failed": 2, "length": 1}, metrics
