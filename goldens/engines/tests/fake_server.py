"""A fake OpenAI-compatible completions server on loopback, for the adapter's tests.

Its "model" is a pure function of the prefix (`logits_of`): the log-softmax of a row seeded
by the prefix's ids, so the tests can record goldens from the same numbers. `shape` picks how
it answers: "llama.cpp" (top_logprobs entries with ids), "token_ids" (OpenAI legacy maps keyed
"token_id:N", as vLLM with return_tokens_as_token_ids), "text" (legacy maps keyed by token
text), "none" (no logprobs), "status" (HTTP 400), "slow" (sleeps past the client's timeout).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import zlib

import numpy as np

VOCAB = 64


def logits_of(prefix: list[int], shift: float = 0.0) -> np.ndarray:
    seed = zlib.crc32(np.asarray(prefix, dtype=np.int64).tobytes())
    row = np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * 3.0
    row[7] += shift  # a "changed model": token 7 moved
    return row


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


class _Quiet(http.server.ThreadingHTTPServer):
    """No traceback when a client went away first (the timeout test's slow answer)."""

    def handle_error(self, request, client_address) -> None:
        pass


class FakeServer:
    def __init__(
        self, shape: str = "llama.cpp", shift: float = 0.0, delay: float = 0.0, logits=None
    ):
        """`logits`: prefix -> next-token logits, the model it serves (default `logits_of`)."""
        self.shape, self.shift, self.delay = shape, shift, delay
        self.logits = logits or (lambda prefix: logits_of(prefix, shift))
        self.requests: list[dict] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.shape == "slow":
                    time.sleep(server.delay)
                if server.shape == "status":
                    self._send(400, {"error": {"message": "prompt tokens out of range"}})
                    return
                prompts = body["prompt"]
                if prompts and isinstance(prompts[0], int):
                    prompts = [prompts]
                choices = [server.choice(i, p, body) for i, p in enumerate(prompts)]
                self._send(200, {"choices": choices, "object": "text_completion"})

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _Quiet(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def top(self, prefix: list[int], k: int) -> list[tuple[int, float]]:
        lp = log_softmax(self.logits(prefix))
        order = np.argsort(-lp, kind="stable")[:k]
        return [(int(i), float(lp[i])) for i in order]

    def choice(self, index: int, prompt: list[int], body: dict) -> dict:
        k = int(body.get("logprobs") or 0)
        if self.shape == "none" or not k:
            return {"index": index, "text": "x", "logprobs": None}
        if body.get("echo"):
            maps = [None] + [
                {f"token_id:{i}": lp for i, lp in self.top(prompt[:j], k)}
                for j in range(1, len(prompt) + 1)
            ]
            return {"index": index, "text": "x", "logprobs": {"top_logprobs": maps}}
        top = self.top(prompt, k)
        if self.shape == "llama.cpp":
            entries = [{"id": i, "token": f"<{i}>", "logprob": lp} for i, lp in top]
            first = {"id": top[0][0], "logprob": top[0][1], "top_logprobs": entries}
            return {"index": index, "text": "x", "logprobs": {"content": [first]}}
        key = "token_id:{}" if self.shape == "token_ids" else "tok{}"
        mapping = {key.format(i): lp for i, lp in top}
        return {"index": index, "text": "x", "logprobs": {"top_logprobs": [mapping]}}
