"""What the harness asks of an engine it judges: teacher-forced next-token distributions.

An engine is given a golden case's token sequence (the prompt, then the golden's greedy
tokens) and answers, for each generated step and each recorded prompt position, its
next-token distribution there: a full row of logits (this repository's engine, transformers)
or only its top-k log-probabilities (`compare.TopLogprobs`, an HTTP server). Its greedy
choice at each step is the argmax, or the top-1. `forced_run` turns that into what
`compare.compare_case` takes.

Adapters: `goldens.engines.openai` (any OpenAI-compatible completions server, and llama.cpp's
`llama-server` with its tokenizer endpoint); this engine and transformers in
harness/llama3/engine_adapters.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

from goldens.compare import Row, greedy_token
from goldens.schema import Case


class EngineError(Exception):
    """An engine could not answer (unreachable, no log-probabilities, a bad reply): the
    message names the engine and what to do. Not a verdict: `golden check` exits 2."""


class Engine(Protocol):
    name: str  # for messages and reports: "llama.cpp at http://127.0.0.1:8080/v1"
    full_logits: bool  # rows are full logits (else TopLogprobs)
    tokenizes: bool  # tokenize() answers (else the golden's input ids are sent unchecked)

    def tokenize(self, text: str) -> list[int] | None:
        """The engine's own tokenization of a prompt (BOS included where it adds one), or
        None where it cannot say (then the golden's input ids are sent as given)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, for failure messages (ids as text where it cannot say)."""
        ...

    def teacher_forced(
        self, prompt: Sequence[int], tokens: Sequence[int], positions: Sequence[int], top_k: int
    ) -> tuple[list[Row], list[Row]]:
        """(step rows, prompt rows): the next-token distribution after `prompt` plus the first
        i of `tokens`, for each i < len(tokens), and after `prompt[: p + 1]` for each prompt
        position p in `positions` (ascending): full logits, or at least `top_k`
        log-probabilities."""
        ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ForcedRun:
    """One engine fed one golden case's tokens."""

    input_ids: list[int] | None  # its tokenization of the prompt; None: not known
    tokens: list[int]  # its greedy choice at each step
    rows: list[Row]  # its next-token distribution at each step
    positions: list[int]  # the golden's prompt positions it was asked about
    prompt_rows: list[Row]  # its distribution there
    seconds: float


def forced_inputs(case: Case, own_ids: list[int] | None) -> tuple[list[int], list[int]]:
    """What a run teacher-forced on `case` is fed, the one conversion of a golden case into a
    run (every engine, every serving scenario): the prompt (the engine's own tokenization,
    else the golden's ids for an engine that cannot tokenize) and the golden's prompt positions
    where that prompt has them (a tokenization that differs fails on input ids anyway; its
    positions past the prompt go missing). The forced tokens are the golden's, `case.token_ids`."""
    prompt = list(case.input_ids) if own_ids is None else list(own_ids)
    return prompt, [p for p in case.positions if p < len(prompt) - 1]


def forced_run(engine: Engine, case: Case) -> ForcedRun:
    """`engine` teacher-forced on `case`: every step's prefix (the prompt and the golden's
    first i tokens) and every recorded prompt position, in one `teacher_forced` call."""
    top_k = len(case.steps[0].topk_ids)
    own_ids = engine.tokenize(case.prompt)
    prompt, positions = forced_inputs(case, own_ids)
    start = time.perf_counter()
    step_rows, prompt_rows = engine.teacher_forced(prompt, list(case.token_ids), positions, top_k)
    seconds = time.perf_counter() - start
    tokens = [greedy_token(row) for row in step_rows]
    return ForcedRun(own_ids, tokens, step_rows, positions, prompt_rows, seconds)
