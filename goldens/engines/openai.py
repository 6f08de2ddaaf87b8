"""An engine behind an OpenAI-compatible completions API, judged by the goldens over HTTP.

Each teacher-forced position is one completion of the prefix as token ids:

    POST {url}/completions
    {"model": NAME, "prompt": [[ids of prefix 1], [ids of prefix 2], ...], "max_tokens": 1,
     "logprobs": K, "temperature": 0, "return_tokens_as_token_ids": true, "cache_prompt": true,
     "ignore_eos": true}

and the answer's top-K log-probabilities of the first generated token are the run's
next-token distribution there (`compare.TopLogprobs`). Several prefixes go in one request
(`batch`); llama.cpp's server keeps the shared prefix in its cache (`cache_prompt`), vLLM
its prefix cache. With `echo=True` the server is asked once per case for its prompt
log-probabilities instead (`"echo": true`, vLLM's legacy completions): position p's top-k is
then the entry of token p + 1.

Answers are read in the two shapes servers give, each naming token ids:
  - llama.cpp: `choices[i].logprobs.content[0].top_logprobs` = [{"id", "token", "logprob"}];
  - OpenAI legacy (vLLM with `return_tokens_as_token_ids`): `choices[i].logprobs.top_logprobs`
    = [{"token_id:1234": logprob, ...}].
A server that names its top tokens by text only cannot be judged by id: the error says so.

Connection errors are retried (`retries`, with a short backoff), a request that takes longer
than `timeout` seconds is an error; every error is an `EngineError` naming the URL.
`LlamaCppEngine` adds llama.cpp's `/tokenize` and `/detokenize`, so the prompt is tokenized by
the server itself (a tokenizer difference then fails on input ids) and failures show text,
and a `logit_bias` that keeps llama.cpp from withholding a byte token's log-probabilities.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from goldens.compare import TopLogprobs
from goldens.engines.base import EngineError

TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling
# llama.cpp's samplers other than temperature, top-k, top-p and min-p, each set to its no-op
# (most are its defaults; stated so that another build's defaults cannot move a draw).
NEUTRAL_SAMPLERS = {
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "typical_p": 1.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "mirostat": 0,
}


class OpenAIEngine:
    """Teacher-forced top-k log-probabilities from `{url}/completions`."""

    full_logits = False
    tokenizes = False

    def __init__(
        self,
        url: str,
        model: str = "",
        *,
        timeout: float = 60.0,
        retries: int = 3,
        batch: int = 16,
        echo: bool = False,
        api_key: str = "",
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise EngineError(
                f"--url={url!r} is not an http(s) URL: give e.g. http://127.0.0.1:8080/v1"
            )
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.retries = retries
        self.batch = batch
        self.echo = echo
        self.api_key = api_key
        self.name = f"OpenAI-compatible server at {self.url}"
        self.requests = 0  # made so far, for the summary

    # -- the Engine interface -------------------------------------------------------------

    def tokenize(self, text: str) -> list[int] | None:
        return None  # the completions API has no tokenizer endpoint: the golden's ids are sent

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def teacher_forced(
        self, prompt: Sequence[int], tokens: Sequence[int], positions: Sequence[int], top_k: int
    ) -> tuple[list[TopLogprobs], list[TopLogprobs]]:
        sequence = [*prompt, *tokens]
        steps = [len(prompt) - 1 + i for i in range(len(tokens))]
        rows = self.next_token_rows(sequence, [*positions, *steps], top_k)
        return rows[len(positions) :], rows[: len(positions)]

    def next_token_rows(
        self, ids: Sequence[int], positions: Sequence[int], top_k: int
    ) -> list[TopLogprobs]:
        ids = [int(i) for i in ids]
        if self.echo:
            return self._echo_rows(ids, positions, top_k)
        rows: list[TopLogprobs] = []
        for start in range(0, len(positions), self.batch):
            chunk = positions[start : start + self.batch]
            prompts = [ids[: p + 1] for p in chunk]
            answer = self.post(
                "/completions",
                {
                    **self._base(top_k),
                    "prompt": prompts if len(prompts) > 1 else prompts[0],
                    "max_tokens": 1,
                },
            )
            choices = _choices(answer, len(prompts), self.url)
            rows += [
                self._first_token_row(c, top_k, p) for c, p in zip(choices, chunk, strict=True)
            ]
        return rows

    def close(self) -> None:
        pass

    # -- HTTP -----------------------------------------------------------------------------

    def _base(self, top_k: int) -> dict:
        body = {
            "logprobs": top_k,
            "temperature": 0,
            "return_tokens_as_token_ids": True,
            "cache_prompt": True,
            # An end-of-generation token as the greedy choice must still come with its
            # log-probabilities (llama.cpp answers a stop without them).
            "ignore_eos": True,
        }
        if self.model:
            body["model"] = self.model
        return {**body, **self.extra_body()}

    def extra_body(self) -> dict:
        """Fields a server flavour adds to every completion request."""
        return {}

    def post(self, path: str, body: dict) -> dict:
        """POST JSON to `{url}{path}`; the parsed answer. Connection errors are retried."""
        return self._request(path, json.dumps(body).encode())

    def get(self, path: str) -> dict:
        return self._request(path, None)

    def _request(self, path: str, data: bytes | None) -> dict:
        target = self.url + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(target, data=data, headers=headers)
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                self.requests += 1
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:500]
                raise EngineError(f"{target} answered HTTP {e.code}: {detail}") from None
            except TimeoutError:
                raise EngineError(
                    f"{target} did not answer within {self.timeout:g} s (--timeout)"
                ) from None
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise EngineError(
                        f"{target} did not answer within {self.timeout:g} s (--timeout)"
                    ) from None
                if attempt == self.retries:
                    raise EngineError(
                        f"nothing answers at {self.url}: {reason} (after {self.retries + 1} "
                        f"tries); start the server, or fix --url"
                    ) from None
                time.sleep(delay)
                delay *= 2
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise EngineError(
                f"{target} answered with something that is not JSON: {raw[:200]!r}"
            ) from None

    # -- answers --------------------------------------------------------------------------

    def _first_token_row(self, choice: dict, top_k: int, position: int) -> TopLogprobs:
        logprobs = choice.get("logprobs")
        if not logprobs:
            raise EngineError(
                f"{self.url}/completions answered without log-probabilities (choice "
                f'{choice.get("index", 0)}); the server must support "logprobs": {top_k}'
            )
        content = logprobs.get("content")
        if content:  # llama.cpp: entries with ids
            return _row_from_entries(
                content[0].get("top_logprobs") or [], top_k, self.url, position
            )
        top = logprobs.get("top_logprobs")
        if top:  # OpenAI legacy: one {token: logprob} per generated token
            return _row_from_mapping(top[0], top_k, self.url, position)
        raise EngineError(
            f"{self.url}/completions answered log-probabilities without top_logprobs at position "
            f"{position}: {json.dumps(logprobs)[:200]}"
        )

    def _echo_rows(self, ids: list[int], positions: Sequence[int], top_k: int) -> list[TopLogprobs]:
        """One request for the whole sequence with its prompt log-probabilities: the entry of
        token p + 1 is the distribution after ids[: p + 1]."""
        answer = self.post(
            "/completions", {**self._base(top_k), "prompt": ids, "max_tokens": 1, "echo": True}
        )
        (choice,) = _choices(answer, 1, self.url)
        top = (choice.get("logprobs") or {}).get("top_logprobs")
        if not top or len(top) < len(ids):
            raise EngineError(
                f'{self.url}/completions with "echo": true gave no prompt log-probabilities '
                f"({0 if not top else len(top)} entries for {len(ids)} tokens): run without --echo"
            )
        rows = []
        for p in positions:
            if p + 1 >= len(ids) or top[p + 1] is None:
                raise EngineError(f"{self.url}: no prompt log-probabilities at position {p + 1}")
            rows.append(_row_from_mapping(top[p + 1], top_k, self.url, p))
        return rows


class LlamaCppEngine(OpenAIEngine):
    """llama.cpp's `llama-server`: the OpenAI adapter plus its tokenizer endpoints."""

    tokenizes = True

    def __init__(self, url: str, model: str = "", **options) -> None:
        super().__init__(url, model, **options)
        self.root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        self.name = f"llama.cpp server at {self.url}"
        self._plain_token: int | None = None

    def extra_body(self) -> dict:
        # llama.cpp withholds the log-probabilities of a sampled token whose text is an
        # incomplete UTF-8 sequence (a byte token). Its reported log-probabilities are the raw
        # logits' (before any sampler), so a bias that makes it sample a plain ASCII token
        # changes nothing in them and keeps every answer complete.
        if self._plain_token is None:
            (self._plain_token,) = self._tokens("a", add_special=False)
        return {"logit_bias": {str(self._plain_token): 100}}

    def tokenize(self, text: str) -> list[int] | None:
        return self._tokens(text, add_special=True)

    def _tokens(self, text: str, add_special: bool) -> list[int]:
        answer = self._at_root("/tokenize", {"content": text, "add_special": add_special})
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise EngineError(f"{self.root}/tokenize answered without tokens: {answer}")
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return str(self._at_root("/detokenize", {"tokens": [int(i) for i in ids]})["content"])
        except (EngineError, KeyError):
            return super().decode(ids)

    def sampled_tokens(
        self, prompt: Sequence[int], sampler: dict, seeds: Sequence[int]
    ) -> tuple[list[int], list[str]]:
        """The token llama-server draws after `prompt` (ids) under `sampler` (its own field
        names: temperature, top_k, top_p, min_p), one request per seed (each seeds its own
        generator); and the sampler chain it reports, in its order. No logit bias here: the
        draw must be the server's own distribution's."""
        body = {
            "prompt": [int(i) for i in prompt],
            "n_predict": 1,
            "cache_prompt": True,
            "return_tokens": True,
            **NEUTRAL_SAMPLERS,
            **sampler,
        }
        tokens: list[int] = []
        chain: list[str] = []
        for seed in seeds:
            answer = self._at_root("/completion", {**body, "seed": int(seed)})
            drawn = answer.get("tokens")
            if not isinstance(drawn, list) or len(drawn) != 1:
                raise EngineError(
                    f"{self.root}/completion with seed {seed} answered {drawn!r} as its tokens, "
                    "not one token id (an end-of-generation draw?)"
                )
            tokens.append(int(drawn[0]))
            chain = list(answer.get("generation_settings", {}).get("samplers", chain))
        return tokens, chain

    def completion(self, prompt: Sequence[int], n_predict: int, **fields) -> dict:
        """llama-server's own `/completion` of token ids, its answer whole (tokens returned,
        no prompt cache: each answer its own computation); `fields` are its request fields
        (grammar, json_schema, n_probs, post_sampling_probs, samplers, temperature, ...)."""
        body = {
            "prompt": [int(i) for i in prompt],
            "n_predict": int(n_predict),
            "cache_prompt": False,
            "return_tokens": True,
            **NEUTRAL_SAMPLERS,
            **fields,
        }
        return self._at_root("/completion", body)

    def _at_root(self, path: str, body: dict) -> dict:
        saved, self.url = self.url, self.root
        try:
            return self.post(path, body)
        finally:
            self.url = saved


def _choices(answer: dict, expected: int, url: str) -> list[dict]:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != expected:
        got = "no choices" if not isinstance(choices, list) else f"{len(choices)} choices"
        raise EngineError(
            f"{url}/completions answered {got} for {expected} prompts: {str(answer)[:200]}"
        )
    return sorted(choices, key=lambda c: c.get("index", 0))


def _row_from_entries(entries: list, top_k: int, url: str, position: int) -> TopLogprobs:
    if any("id" not in e for e in entries):
        raise EngineError(f"{url}: top_logprobs entries without token ids at position {position}")
    pairs = sorted(
        ((float(e["logprob"]), int(e["id"])) for e in entries), key=lambda t: (-t[0], t[1])
    )
    return _row(pairs, top_k, url, position)


def _row_from_mapping(mapping: dict, top_k: int, url: str, position: int) -> TopLogprobs:
    pairs = []
    for key, logprob in mapping.items():
        if not key.startswith(TOKEN_ID_PREFIX):
            raise EngineError(
                f"{url} names its top tokens by text ({key!r}), not by id, so they cannot be "
                f"matched to the golden's ids: enable token ids in its answers (vLLM: "
                f'"return_tokens_as_token_ids", sent with every request)'
            )
        pairs.append((float(logprob), int(key[len(TOKEN_ID_PREFIX) :])))
    pairs.sort(key=lambda t: (-t[0], t[1]))
    return _row(pairs, top_k, url, position)


def _row(pairs: list[tuple[float, int]], top_k: int, url: str, position: int) -> TopLogprobs:
    if len(pairs) < top_k:
        raise EngineError(
            f"{url} returned {len(pairs)} log-probabilities at position {position}, the golden "
            f"needs {top_k}: raise the server's limit (vLLM: --max-logprobs)"
        )
    return TopLogprobs(tuple(i for _, i in pairs), tuple(lp for lp, _ in pairs))
