"""An OpenAI-compatible HTTP server for the Llama 3 engine: the serving engine behind
`/v1/completions`, streaming included.

    ./bazelw run //pipelines/llama3:serve -- \\
        --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\
        --mode=quantized --port 8080
    curl -s http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

Endpoints: `POST /v1/completions` (OpenAI's legacy completions: `prompt` as text, token ids or
a list of either; `max_tokens`, `temperature` (0: greedy; OpenAI's default 1), `top_p`,
`top_k`, `min_p`, `seed`, the penalties (refused with temperature 0: greedy applies none),
`stop`, `logprobs` (top-K log-probabilities of each generated token; the text leaves out the
end-of-sequence token a stopped answer ends with, its id stays here), `stream` (server-sent
events, `data: [DONE]` last), and vLLM's
`return_tokens_as_token_ids` and `ignore_eos`; constrained decoding by one of
`response_format` (`json_object`, `json_schema`), llama-server's `json_schema` and `grammar`
(GBNF), or vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`:
docs/constrained_decoding.md); `GET /v1/models`; `GET /health`; and
`GET /metrics` (JSON: requests by outcome, pending, KV blocks in use, steps, preemptions).
A chat endpoint is not served: the checkpoints it is tested on have no chat template.

How it runs: one worker owns the `serving.ServingEngine` (continuous batching over a paged KV
cache, prefix caching on) and loops: take new requests and cancellations, run one scheduler
step, hand each request its new tokens. `serve` runs that loop on its main thread, the one
that loaded the engine (`RunningServer.serve_here`); in-process users (the tests) run it on a
thread of its own (`RunningServer.start`). The main thread is faster: OpenMP (the kernels'
and torch's threads) keeps a team of threads per thread that starts parallel work, and the
loading thread's stays alive; with a second team on a 2-core machine libgomp counts more
threads than cores and stops spinning between parallel regions, so every region waits for
its threads to wake (Intel Xeon, 2 cores, SmolLM2 Q4_1 ggml, 16 requests: a decode step of 16
rows ~95 ms on a worker thread, ~60 ms on the loading thread; one 16-row product 0.38 and
0.22 ms). HTTP requests are answered by Flask on
werkzeug's threaded server, one thread per connection, which wait on their own queue: a
request is never handed another's tokens because every event carries its request's id.
A streaming client that goes away is noticed at the next write and its request cancelled
(its KV blocks back to the pool at once). A server told to stop (SIGTERM) cancels what is
still running: a whole answer gets 503 naming the shutdown, a stream an error event and no
`data: [DONE]`, so that no client reads a cut answer as complete. Bad requests get a 4xx
whose message names the field and the fix, in OpenAI's error shape; a body over `--max-body`
bytes gets 413.

Flask is the framework because it is maintained, already locked for the S3 lane's server,
and streams from a generator; the engine's throughput is bound by its one worker, not by
the HTTP layer (README.md's `bench_serving` row has the figures against llama-server).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import flask
import torch
import werkzeug.exceptions
import werkzeug.serving

from pipelines.llama3 import constrained
from pipelines.llama3.constrained import Constraint, ConstraintError
from pipelines.llama3.engine import MODES, Llama3Engine, freeze_imported_objects
from pipelines.llama3.gguf_loader import CheckpointError, load_config
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.serving import Request, Served, ServingEngine, blocks_for
from pipelines.llama3.speculative import NgramDraft, Speculation

MAX_LOGPROBS = 20  # top log-probabilities per token, at most (vLLM's default limit)
MAX_PROMPTS = 64  # prompts in one request, at most
MAX_STOPS = 4  # stop strings, as OpenAI allows
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling
# Constrained decoding's request fields (constrained.py), one per request: OpenAI's
# response_format, llama-server's json_schema and grammar (GBNF), vLLM's guided_* fields.
CONSTRAINT_FIELDS = {
    "response_format": "json_schema",
    "json_schema": "json_schema",
    "grammar": "grammar",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
WAIT_S = 600.0  # a request's longest wait for its next event (a wedged worker: 500, not a hang)


class BadRequest(Exception):
    """A request the server will not run: HTTP `status`, a message naming the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _error(message: str, status: int, param: str | None = None, kind: str | None = None):
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return flask.Response(json.dumps(body), status=status, mimetype="application/json")


# --- the worker: one thread owns the serving engine -------------------------------------------


@dataclasses.dataclass
class Event:
    """What the worker hands a request: new tokens and their logits, its end, or an error."""

    request_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    served: Served | None = None  # set on the last event
    error: str | None = None


class EngineWorker:
    """Runs the serving engine on a thread of its own; `submit` and `cancel` from any thread."""

    def __init__(self, serving: ServingEngine) -> None:
        self.serving = serving
        self._lock = threading.Condition()  # the inbox and the cancellations
        self._engine_lock = threading.Lock()  # the serving engine: a step, or a read of it
        self._inbox: list[tuple[list[Request], queue.Queue]] = []
        self._cancels: list[str] = []
        self._listeners: dict[str, queue.Queue] = {}  # request id -> its HTTP thread's queue
        self._sent: dict[str, int] = {}  # request id -> tokens handed out so far
        self._stopping = False
        self.counts: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def run_here(self) -> None:
        """The loop on the calling thread, until `stop_soon` (a signal handler's, say)."""
        self._run()

    def stop_soon(self) -> None:
        """Ask the loop to end after its step: every request still open is cancelled."""
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def stop(self) -> None:
        self.stop_soon()
        if self._thread.ident is not None:  # started on its own thread (`start`)
            self._thread.join(timeout=30)

    def submit(self, requests: list[Request], listener: queue.Queue) -> None:
        with self._lock:
            self._inbox.append((requests, listener))
            self._lock.notify()

    def cancel(self, request_ids: list[str]) -> None:
        with self._lock:
            self._cancels += request_ids
            self._lock.notify()

    def metrics(self) -> dict:
        with self._lock, self._engine_lock:
            pool = self.serving.pool
            return {
                "requests": dict(self.counts),
                "pending": self.serving.pending + sum(len(r) for r, _ in self._inbox),
                "kv_blocks": 0 if pool is None else pool.num_blocks,
                "kv_blocks_in_use": 0 if pool is None else sum(1 for r in pool.refs if r),
                "prefix_cache_hits": 0 if pool is None else pool.hits,
                "steps": self.serving.steps,
                "preemptions": self.serving.preemptions,
            }

    # -- the seams the server's tests plant their bugs in -------------------------------------

    def _take(self) -> tuple[list[tuple[list[Request], queue.Queue]], list[str]]:
        """The requests and cancellations that arrived since the last step (under the lock)."""
        inbox, cancels = self._inbox, self._cancels
        self._inbox, self._cancels = [], []
        return inbox, cancels

    def _deliver(self, event: Event) -> None:
        """Hand `event` to the HTTP thread waiting for its request."""
        listener = self._listeners.get(event.request_id)
        if listener is not None:
            listener.put(event)

    # -- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._cancels or self.serving.pending or self._stopping):
                    self._lock.wait()
                if self._stopping:
                    break
                inbox, cancels = self._take()
            for requests, listener in inbox:
                self._admit(requests, listener)
            for request_id in cancels:
                self._cancel(request_id)
            if self.serving.pending:
                self._step()
        for request_id in list(self._listeners):
            self._cancel(request_id)

    def _admit(self, requests: list[Request], listener: queue.Queue) -> None:
        for r in requests:
            self._listeners[r.id], self._sent[r.id] = listener, 0
        try:
            with self._engine_lock:
                self.serving.submit(requests)
        except ValueError as error:  # checked before, so a bug or a race: the request's error
            for r in requests:
                self._finish(Event(r.id, error=str(error)))

    def _cancel(self, request_id: str) -> None:
        if request_id not in self._listeners:
            return  # finished before the cancel arrived
        try:
            with self._engine_lock:
                served = self.serving.cancel(request_id)
        except KeyError:
            return
        self.counts["cancelled"] += 1
        self._finish(self._progress(request_id, served))

    def _step(self) -> None:
        try:
            with self._engine_lock:  # metrics() reads the pool between steps, not during one
                finished = self.serving.step()
                generated = self.serving.generated()
        except Exception as error:
            message = f"the engine failed: {type(error).__name__}: {error}"
            for request_id in list(self._listeners):
                try:
                    with self._engine_lock:
                        self.serving.cancel(request_id)
                except KeyError:
                    pass
                self.counts["failed"] += 1
                self._finish(Event(request_id, error=message))
            return
        for request_id, (tokens, logits) in generated.items():
            sent = self._sent.get(request_id, 0)
            if len(tokens) > sent:
                self._sent[request_id] = len(tokens)
                self._deliver(Event(request_id, tokens[sent:], logits[sent : len(tokens)]))
        for request_id, served in finished.items():
            self.counts[served.finish_reason] += 1
            self._finish(self._progress(request_id, served))

    def _progress(self, request_id: str, served: Served) -> Event:
        """The last event of a request: what it has not been handed yet, and its result."""
        sent = self._sent.get(request_id, 0)
        output = served.output
        return Event(request_id, output.tokens[sent:], list(output.logits[sent:]), served)

    def _finish(self, event: Event) -> None:
        self._deliver(event)
        self._listeners.pop(event.request_id, None)
        self._sent.pop(event.request_id, None)


# --- requests -------------------------------------------------------------------------------


@dataclasses.dataclass
class Completion:
    """One parsed `/v1/completions` request."""

    prompts: list[list[int]]
    max_tokens: int
    sampling: SamplerSettings | None
    logprobs: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    token_ids: bool  # name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    ignore_eos: bool
    constraint: Constraint | None = None  # constrained decoding (`_constraint`)


def _field(body: dict, name: str, kinds: tuple[type, ...], default=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # JSON true is not a number here
    if not isinstance(value, kinds):
        raise BadRequest(f'"{name}" must be {what or " or ".join(k.__name__ for k in kinds)}', name)
    return value


class Server:
    """The Flask application around one EngineWorker."""

    def __init__(
        self,
        serving: ServingEngine,
        model_name: str,
        max_body: int = 1 << 20,
        speculation: Speculation | None = None,
    ) -> None:
        self.serving = serving
        self.speculation = speculation  # every request's (None: no speculative decoding)
        self.engine = serving.engine
        self.model_name = model_name
        self.worker = EngineWorker(serving)
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self.app = flask.Flask("llama3-serve")
        self.app.config["MAX_CONTENT_LENGTH"] = max_body
        self.app.json.sort_keys = False  # top_logprobs keep their order, most likely first
        self._routes()

    # -- parsing ---------------------------------------------------------------------------

    def parse(self, body: object) -> Completion:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", self.model_name):
            raise BadRequest(
                f"model {model!r} is not served here: this server serves {self.model_name!r} "
                "(GET /v1/models)",
                "model",
                404,
            )
        for name, value, allowed in (("n", 1, (1,)), ("best_of", 1, (1,))):
            if body.get(name, value) not in allowed:
                raise BadRequest(f'"{name}" must be 1: one completion per prompt', name)
        if body.get("echo"):
            raise BadRequest(
                '"echo" is not supported: ask "logprobs" of the tokens instead', "echo"
            )
        if body.get("suffix"):
            raise BadRequest('"suffix" (insertion) is not supported', "suffix")
        prompts = self._prompts(body.get("prompt"))
        max_tokens = _field(body, "max_tokens", (int,), 16, "an integer >= 1")
        if max_tokens < 1:
            raise BadRequest(f'"max_tokens" must be at least 1, not {max_tokens}', "max_tokens")
        limit = self.serving.max_context
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_tokens > limit:
                raise BadRequest(
                    f"prompt {i} has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                    f"{len(prompt) + max_tokens} is over this server's context of {limit} "
                    "(shorten the prompt or lower max_tokens)",
                    "max_tokens",
                )
            pool = self.serving.num_blocks
            if pool and blocks_for(len(prompt) + max_tokens, self.serving.block_size) > pool:
                raise BadRequest(
                    f"prompt {i} with max_tokens {max_tokens} needs more KV cache than this "
                    f"server has ({pool} blocks of {self.serving.block_size} tokens)",
                    "max_tokens",
                )
        logprobs = _field(body, "logprobs", (int,), None, f"an integer from 0 to {MAX_LOGPROBS}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(
                f'"logprobs" must lie in 0..{MAX_LOGPROBS}, not {logprobs}', "logprobs"
            )
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest('"stop" must be a non-empty string or a list of them', "stop")
        if len(stop) > MAX_STOPS:
            raise BadRequest(f'"stop" takes at most {MAX_STOPS} strings', "stop")
        if stop and self.engine.tokenizer is None:
            raise BadRequest('"stop" needs the checkpoint\'s tokenizer, and it has none', "stop")
        stream = _field(body, "stream", (bool,), False, "true or false")
        options = _field(body, "stream_options", (dict,), {}, "an object")
        constraint = self._constraint(body)
        if constraint is not None and body.get("ignore_eos"):
            raise BadRequest(
                "a constrained completion ends with an end-of-sequence token once its text is "
                'complete: drop "ignore_eos"',
                "ignore_eos",
            )
        return Completion(
            prompts=prompts,
            max_tokens=max_tokens,
            sampling=self._sampling(body),
            logprobs=logprobs,
            stop=tuple(stop),
            stream=stream,
            include_usage=bool(options.get("include_usage")),
            token_ids=bool(body.get("return_tokens_as_token_ids")),
            ignore_eos=bool(body.get("ignore_eos")),
            constraint=constraint,
        )

    def _constraint(self, body: dict) -> Constraint | None:
        """The completion's constraint, from the one field of CONSTRAINT_FIELDS it gives,
        compiled against the vocabulary here so that a bad one is a 400 naming its field."""
        given = [name for name in CONSTRAINT_FIELDS if body.get(name) is not None]
        if not given:
            return None
        if len(given) > 1:
            raise BadRequest(f"give one constraint, not {', '.join(given)}", given[1])
        name, value = given[0], body[given[0]]
        if name == "response_format":  # the errors below still name the field the client sent
            kind = value.get("type") if isinstance(value, dict) else None
            if kind == "text":
                return None
            if kind == "json_object":
                value = {"type": "object"}
            elif kind == "json_schema" and isinstance(value.get("json_schema"), dict):
                value = value["json_schema"].get("schema", {})
            else:
                raise BadRequest(
                    '"response_format" must be {"type": "text"}, {"type": "json_object"} or '
                    '{"type": "json_schema", "json_schema": {"schema": {...}}}',
                    "response_format",
                )
        kind = CONSTRAINT_FIELDS.get(name, "json_schema")
        wants = {"json_schema": (dict, bool), "choice": (list,)}.get(kind, (str,))
        if not isinstance(value, wants):
            shape = {"json_schema": "a JSON schema object", "choice": "a list of strings"}
            raise BadRequest(f'"{name}" must be {shape.get(kind, "text")}', name)
        text = json.dumps(value) if kind in ("json_schema", "choice") else value
        constraint = Constraint(kind, text)
        if self.engine.tokenizer is None:
            raise BadRequest(f'"{name}" needs the checkpoint\'s tokenizer, and it has none', name)
        try:  # compiled against the vocabulary; the request's matcher is built at admission
            constraint.check(constrained.Vocabulary.of(self.engine.tokenizer))
        except ConstraintError as error:
            raise BadRequest(f'"{name}": {error}', name) from None
        return constraint

    def _prompts(self, prompt: object) -> list[list[int]]:
        if prompt is None:
            raise BadRequest('"prompt" is required: text, token ids, or a list of either', "prompt")
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)
        ):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest('"prompt" must be text, token ids, or a non-empty list of either')
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f'"prompt" holds {len(prompt)} prompts; at most {MAX_PROMPTS}')
        vocab = self.engine.config.vocab_size
        prompts = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                if self.engine.tokenizer is None:
                    raise BadRequest(
                        "this checkpoint stores no tokenizer: send the prompt as token ids",
                        "prompt",
                    )
                p = self.engine.tokenizer.encode(p)
            elif not (isinstance(p, list) and all(_is_id(t) for t in p)):
                raise BadRequest(f"prompt {i} is neither text nor a list of token ids", "prompt")
            if not p:
                raise BadRequest(f"prompt {i} is empty", "prompt")
            outside = [t for t in p if not 0 <= t < vocab]
            if outside:
                raise BadRequest(
                    f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}",
                    "prompt",
                )
            prompts.append(list(p))
        return prompts

    def _sampling(self, body: dict) -> SamplerSettings | None:
        temperature = _field(body, "temperature", (int, float), 1.0, "a number >= 0")
        if temperature < 0:
            raise BadRequest(f'"temperature" must be >= 0, not {temperature}', "temperature")
        top_k = _field(body, "top_k", (int,), 0, "an integer")
        try:  # every field checked, greedy or not
            settings = SamplerSettings(
                temperature=float(temperature or 1.0),
                top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" -1
                top_p=float(_field(body, "top_p", (int, float), 1.0, "a number")),
                min_p=float(_field(body, "min_p", (int, float), 0.0, "a number")),
                repetition_penalty=float(
                    _field(body, "repetition_penalty", (int, float), 1.0, "a number")
                ),
                presence_penalty=float(
                    _field(body, "presence_penalty", (int, float), 0.0, "a number")
                ),
                frequency_penalty=float(
                    _field(body, "frequency_penalty", (int, float), 0.0, "a number")
                ),
                seed=_field(body, "seed", (int,), None, "an integer"),
            )
        except ValueError as error:
            raise BadRequest(str(error)) from None
        if temperature != 0:
            return settings
        # greedy: the truncations keep the top token and the seed draws nothing, but a
        # penalty can move the argmax, and the greedy decoder applies none: refused, not ignored
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if getattr(settings, name) != getattr(SamplerSettings(), name):
                raise BadRequest(
                    f'"{name}" with "temperature": 0 (greedy, which applies no penalty): send a '
                    f'temperature above 0 to sample with it, or drop "{name}"',
                    name,
                )
        return None

    # -- answering -------------------------------------------------------------------------

    def _request_ids(self, count: int) -> tuple[str, list[str]]:
        with self._id_lock:
            number = next(self._ids)
        base = f"cmpl-{number}-{os.getpid()}"
        return base, [f"{base}-{i}" for i in range(count)]

    def run(self, completion: Completion) -> tuple[str, list[str], queue.Queue]:
        base, ids = self._request_ids(len(completion.prompts))
        requests = [
            Request(
                id=request_id,
                prompt=prompt,
                max_new_tokens=completion.max_tokens,
                sampling=completion.sampling,
                stop=completion.stop,
                ignore_eos=completion.ignore_eos,
                speculation=self.speculation,
                constraint=completion.constraint,
            )
            for request_id, prompt in zip(ids, completion.prompts, strict=True)
        ]
        listener: queue.Queue = queue.Queue()
        self.worker.submit(requests, listener)
        return base, ids, listener

    def _next(self, listener: queue.Queue) -> Event:
        try:
            event = listener.get(timeout=WAIT_S)
        except queue.Empty:
            raise BadRequest(f"the engine sent nothing for {WAIT_S:g} s", status=500) from None
        if event.error is not None:
            raise BadRequest(event.error, status=500)
        return event

    def complete(self, completion: Completion) -> dict:
        base, ids, listener = self.run(completion)
        index = {request_id: i for i, request_id in enumerate(ids)}
        results: dict[int, Served] = {}
        try:
            while len(results) < len(ids):
                event = self._next(listener)
                if event.served is not None:
                    results[index[event.request_id]] = event.served
        except BaseException:
            self.worker.cancel([i for n, i in enumerate(ids) if n not in results])
            raise
        cancelled = [i for i in range(len(ids)) if results[i].finish_reason == "cancelled"]
        if cancelled:  # the server is stopping (a client that went away reads nothing)
            raise BadRequest(_cancelled_message(results[cancelled[0]]), status=503)
        choices, generated = [], 0
        for i in range(len(ids)):
            served = results[i]
            tokens = served.output.tokens
            generated += len(tokens)
            text, _ = self._text(tokens, completion.stop, served.finish_reason == "stop")
            choice = {"index": i, "text": text, "finish_reason": served.finish_reason}
            choice["logprobs"] = (
                None
                if completion.logprobs is None
                else self._logprobs(tokens, list(served.output.logits), completion, [])
            )
            choices.append(choice)
        prompt_tokens = sum(map(len, completion.prompts))
        return {
            "id": base,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, generated),
        }

    def stream(self, completion: Completion) -> Iterator[str]:
        base, ids, listener = self.run(completion)
        index = {request_id: i for i, request_id in enumerate(ids)}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(ids))}
        shown: dict[int, int] = dict.fromkeys(range(len(ids)), 0)  # characters sent
        done: set[int] = set()
        created = int(time.time())

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {
                "id": base,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            while len(done) < len(ids):
                try:
                    event = self._next(listener)
                except BadRequest as error:
                    yield f"data: {json.dumps({'error': {'message': str(error)}})}\n\n"
                    return
                i = index[event.request_id]
                if event.served is not None and event.served.finish_reason == "cancelled":
                    # the server is stopping: an error, and no [DONE] (the answer is not whole)
                    message = _cancelled_message(event.served)
                    yield f"data: {json.dumps({'error': {'message': message, 'code': 503}})}\n\n"
                    return
                first = len(tokens[i])
                tokens[i] += event.tokens
                final = event.served is not None
                stopped = final and event.served.finish_reason == "stop"
                text, cut = self._text(tokens[i], completion.stop, stopped)
                if not final and not cut:
                    text = self._sendable(text, shown[i], completion.stop)
                piece = text[shown[i] :]
                shown[i] = len(text)
                choice = {"index": i, "text": piece, "finish_reason": None, "logprobs": None}
                if completion.logprobs is not None and event.tokens:
                    choice["logprobs"] = self._logprobs(
                        event.tokens, event.logits, completion, tokens[i][:first]
                    )
                if final:
                    done.add(i)
                    choice["finish_reason"] = event.served.finish_reason
                if piece or final or choice["logprobs"]:
                    yield chunk([choice])
            if completion.include_usage:
                generated = sum(map(len, tokens.values()))
                yield chunk([], _usage(sum(map(len, completion.prompts)), generated))
            yield "data: [DONE]\n\n"
        finally:
            # The client went away (werkzeug closes this generator when a write fails), or
            # the answer is complete: cancel what is still running (nothing, when complete).
            self._on_close([request_id for request_id in ids if index[request_id] not in done])

    def _sendable(self, text: str, shown: int, stop: tuple[str, ...]) -> str:
        """What of an unfinished stream's `text` can be sent (at least the `shown` characters
        already sent): not the last characters that could still begin a stop string, nor a
        partial character at the end."""
        hold = max((len(s) - 1 for s in stop), default=0)
        keep = len(text) - hold
        while keep > shown and text[keep - 1] == "\ufffd":
            keep -= 1
        return text[: max(keep, shown)]

    def _on_close(self, unfinished: list[str]) -> None:
        """A stream ended before these requests finished: cancel them, free their blocks."""
        if unfinished:
            self.worker.cancel(unfinished)

    def _text(
        self, tokens: list[int], stop: tuple[str, ...], stopped: bool = False
    ) -> tuple[str, bool]:
        """The generated text (`Llama3Engine.text`: without the end-of-sequence token a
        `stopped` sequence ends with), cut before the first stop string; whether one was cut."""
        if self.engine.tokenizer is None:
            return "", False
        text = self.engine.text(tokens, stopped)
        ends = [text.find(s) for s in stop if s in text]
        if ends:
            return text[: min(ends)], True
        return text, False

    def _name(self, token: int, completion: Completion) -> str:
        tokenizer = self.engine.tokenizer
        if completion.token_ids or tokenizer is None:
            return f"{TOKEN_ID_PREFIX}{token}"
        return tokenizer.decode([token])

    def _logprobs(
        self,
        tokens: list[int],
        logits: list[torch.Tensor],
        completion: Completion,
        before: list[int],
    ) -> dict:
        """OpenAI's legacy logprobs of `tokens`, generated after `before`, from each step's
        logits: log-softmax in float64, the top K by log-probability (equal ones by id), and
        each token's character offset in the generated text. The top K map each token's text
        to its log-probability: ids whose texts are equal (byte pieces of one character all
        decode to U+FFFD) share one entry, the most likely one's, so fewer than K can come
        back; `return_tokens_as_token_ids` names every id apart."""
        k = completion.logprobs
        names, chosen, tops, offsets = [], [], [], []
        tokenizer = self.engine.tokenizer
        for j, (token, row) in enumerate(zip(tokens, logits, strict=True)):
            logp = torch.log_softmax(row.double(), dim=-1)
            names.append(self._name(token, completion))
            chosen.append(float(logp[token]))
            previous = [*before, *tokens[:j]]
            offsets.append(len(tokenizer.decode(previous)) if tokenizer else len(previous))
            if k:
                values, ids = torch.topk(logp, k)
                pairs = sorted(
                    zip(values.tolist(), ids.tolist(), strict=True), key=lambda t: (-t[0], t[1])
                )
                top: dict[str, float] = {}
                for v, i in pairs:  # ids of one text (byte pieces: U+FFFD): the likeliest's
                    top.setdefault(self._name(i, completion), v)
                tops.append(top)
            else:
                tops.append({})
        return {
            "tokens": names,
            "token_logprobs": chosen,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    # -- routes ----------------------------------------------------------------------------

    def _routes(self) -> None:
        app = self.app

        @app.post("/v1/completions")
        def completions():
            try:
                body = flask.request.get_json(force=True, silent=False)
            except werkzeug.exceptions.RequestEntityTooLarge:
                raise
            except werkzeug.exceptions.BadRequest:
                return _error("the request body is not valid JSON", 400)
            try:
                completion = self.parse(body)
                if completion.stream:
                    return flask.Response(
                        flask.stream_with_context(self.stream(completion)),
                        mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache"},
                    )
                return flask.jsonify(self.complete(completion))
            except BadRequest as error:
                return _error(str(error), error.status, error.param)

        @app.get("/v1/models")
        def models():
            return flask.jsonify(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.model_name,
                            "object": "model",
                            "owned_by": "llama3",
                            "max_model_len": self.serving.max_context,
                        }
                    ],
                }
            )

        @app.get("/health")
        def health():
            return flask.jsonify({"status": "ok"})

        @app.get("/metrics")
        def metrics():
            return flask.jsonify(self.worker.metrics())

        @app.errorhandler(werkzeug.exceptions.HTTPException)
        def http_error(error: werkzeug.exceptions.HTTPException):
            messages = {
                404: f"no such endpoint {flask.request.path}: POST /v1/completions, GET "
                "/v1/models, /health, /metrics",
                405: f"{flask.request.method} is not allowed on {flask.request.path}",
                413: f"the request body is over this server's limit of "
                f"{self.app.config['MAX_CONTENT_LENGTH']} bytes (--max-body)",
            }
            return _error(messages.get(error.code, error.description), error.code)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cancelled_message(served: Served) -> str:
    return (
        f"the server is shutting down: this request was cancelled after "
        f"{len(served.output.tokens)} generated tokens; send it again"
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- running it -----------------------------------------------------------------------------


class RunningServer:
    """`Server` on werkzeug's threaded HTTP server on `host`:`port` (0: a free port), in a
    thread of its own: `url` is its OpenAI base URL; `stop()` shuts both down."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.http = werkzeug.serving.make_server(host, port, server.app, threaded=True)
        self.http.daemon_threads = True
        self.port = self.http.server_port
        self.url = f"http://{host}:{self.port}/v1"
        self._thread = threading.Thread(target=self.http.serve_forever, name="http", daemon=True)

    def start(self) -> RunningServer:
        self.server.worker.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.http.shutdown()
        self._thread.join(timeout=30)
        self.server.worker.stop()

    def serve_here(self) -> None:
        """HTTP on a thread of its own and the engine's loop on this one (module docstring)
        until `server.worker.stop_soon()`; then the HTTP server stops too."""
        self._thread.start()
        try:
            self.server.worker.run_here()
        finally:
            self.http.shutdown()
            self._thread.join(timeout=30)

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """`serve` in a process of its own, as `./bazelw run //pipelines/llama3:serve` runs it
    (and as llama-server runs): entered, `url` is its OpenAI base URL once it listens; left,
    it gets SIGTERM and `code` is its exit status (0: stopped cleanly). `options` are serve's
    flags after --gguf and --mode; --port=0 (a free port) is added. Its stderr goes to a file,
    so a chatty server never blocks on a full pipe; `stderr` is its end once stopped.

        with ServerProcess(gguf, "ggml", "--threads=2") as server:
            post(server.url + "/completions", ...)
    """

    def __init__(self, gguf: str | os.PathLike, mode: str, *options: str) -> None:
        self.command = [sys.executable, "-m", "pipelines.llama3.server"]
        self.command += [f"--gguf={os.path.abspath(gguf)}", f"--mode={mode}", "--port=0", *options]
        self.url = ""
        self.code: int | None = None
        self.stderr = ""
        self._process: subprocess.Popen | None = None
        self._stderr = None  # the file of the running server's stderr

    def _tail(self) -> str:
        """The last 2,000 characters the server wrote to stderr (kept in `stderr` on exit)."""
        self._stderr.seek(0)
        self.stderr = self._stderr.read()[-2000:]
        self._stderr.close()
        return self.stderr

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the caller's packages
        self._stderr = tempfile.TemporaryFile(mode="w+")  # closed by _tail
        try:
            self._process = subprocess.Popen(
                self.command, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env
            )
        except OSError:
            self._stderr.close()
            raise
        line = self._process.stdout.readline()  # "serving NAME at URL", once it listens
        match = re.search(r" at (http://\S+)", line)
        if match is None:
            self._process.kill()
            self._process.wait()
            self._process.stdout.close()
            raise RuntimeError(f"the server did not start: {line!r} {self._tail()}")
        self.url = match.group(1)
        return self

    def __exit__(self, *exc) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        try:
            self.code = self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            raise RuntimeError("the server did not stop within 30 s of SIGTERM") from None
        finally:
            self._process.stdout.close()
            self._tail()


def build(
    engine: Llama3Engine,
    model_name: str,
    *,
    kv_tokens: int = 65536,
    block_size: int = 16,
    max_batch: int | None = 64,
    chunk_size: int | None = 512,
    max_context: int | None = None,
    max_body: int = 1 << 20,
    speculate: int = 0,
) -> Server:
    """A Server for `engine`: a pool of `kv_tokens` keys (in blocks of `block_size`), at most
    `max_batch` requests in a step, prefill in chunks of `chunk_size`, prefix caching on;
    `speculate` > 0: every request decodes speculatively, the n-gram draft proposing up to that
    many tokens a step (the same tokens, fewer forwards)."""
    context = max_context or min(engine.config.context_length or 8192, 16384)
    serving = ServingEngine(
        engine,
        block_size=block_size,
        num_blocks=blocks_for(kv_tokens, block_size),
        chunk_size=chunk_size,
        max_batch=max_batch,
        prefix_caching=True,
        max_context=context,
    )
    speculation = Speculation(NgramDraft(), speculate) if speculate else None
    return Server(serving, model_name, max_body=max_body, speculation=speculation)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example, from the checkout's root (`bazel run` reads --gguf against the folder\n"
        "it is run from), on the repository's tiny random checkpoint, whose text is noise; for\n"
        "real text name SmolLM2-135M-Instruct's file instead (docs/environment.md says how to\n"
        "fetch it):\n"
        "  ./bazelw run //pipelines/llama3:serve -- \\\n"
        "      --gguf max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \\\n"
        "      --mode=quantized --port 8080",
    )
    parser.add_argument("--gguf", required=True, help="GGUF checkpoint (llama architecture)")
    parser.add_argument("--mode", choices=MODES, default="eager", help="execution mode")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="compute dtype (bfloat16 files: bfloat16, as their goldens)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port (0: a free one, printed)")
    parser.add_argument(
        "--model-name", default="", help="the name clients send (default: file stem)"
    )
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV cache size in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--max-batch", type=int, default=64, help="requests in one step, at most")
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (0: whole)")
    parser.add_argument("--max-context", type=int, default=0, help="tokens per request (0: file's)")
    parser.add_argument("--max-body", type=int, default=1 << 20, help="request body limit, bytes")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    parser.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: the n-gram draft proposes up to K tokens (1-8) a step (0: off)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    freeze_imported_objects()
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value, least in (
        ("--kv-tokens", args.kv_tokens, 1),
        ("--block-size", args.block_size, 1),
        ("--max-batch", args.max_batch, 1),
        ("--chunk-size", args.chunk_size, 0),
        ("--max-context", args.max_context, 0),
        ("--max-body", args.max_body, 1),
        ("--port", args.port, 0),
        ("--speculate", args.speculate, 0),
        ("--threads", args.threads, 0),  # 0: torch's default
    ):
        if value < least:
            parser.error(f"{flag}={value} must be at least {least}")
    if args.speculate > 8:
        parser.error(f"--speculate={args.speculate} must lie in 0..8")
    if args.port > 65535:  # the socket layer would take it modulo 65536: 70000 served on 4464
        parser.error(f"--port={args.port} must lie in 0..65535")
    family = werkzeug.serving.select_address_family(args.host, args.port)
    if family != socket.AF_UNIX:
        try:
            socket.getaddrinfo(args.host, args.port, family, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            parser.error(
                f"--host={args.host} is not an address here ({error}); give one such as "
                "127.0.0.1 or 0.0.0.0"
            )
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    gguf = pathlib.Path(base, os.path.expanduser(args.gguf))
    if gguf.is_dir():
        parser.error(f"--gguf={args.gguf}: {gguf} is a folder; name the GGUF file in it")
    if not gguf.is_file():
        parser.error(f"--gguf={args.gguf}: no such file ({gguf})")
    try:  # the metadata alone (0.16 s for tiny_llama): --max-context is checked before the load
        context_length = load_config(gguf).context_length
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.max_context > context_length:  # 99999999 grew to 16 GB in 25 s, never serving
        parser.error(
            f"--max-context={args.max_context} exceeds the checkpoint's context length "
            f"{context_length}; give at most that (0: the file's, up to 16384)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {gguf} ({args.mode}, {args.dtype})", file=sys.stderr)
    try:
        engine = Llama3Engine.from_gguf(gguf, mode=args.mode, dtype=DTYPES[args.dtype])
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    server = build(
        engine,
        args.model_name or gguf.stem,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_batch=args.max_batch,
        chunk_size=args.chunk_size or None,
        max_context=args.max_context or None,
        max_body=args.max_body,
        speculate=args.speculate,
    )
    try:
        running = RunningServer(server, args.host, args.port)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error} (--port)", file=sys.stderr)
        return 2
    except SystemExit:  # werkzeug printed the reason (e.g. a port in use), then sys.exit(1)
        print(
            f"error: cannot listen on {args.host}:{args.port}, as said above; give another "
            "--port or --host",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.worker.stop_soon())
    signal.signal(signal.SIGINT, lambda *_: server.worker.stop_soon())
    print(f"serving {server.model_name} at {running.url}", flush=True)
    running.serve_here()  # the engine's steps on this thread, the one that loaded it
    print("stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
