"""Constrained decoding: a request's output held to a language (a JSON schema, a regex, a
choice of strings, a grammar), token by token.

A `Constraint` names the language; `Matcher` is one request's state in it, over the
checkpoint's vocabulary (`Vocabulary`: every token's bytes). At each step the decoder
(decoder.Decoder) asks the matcher for the allowed tokens (`mask`), sets every other logit to
-inf before it chooses (greedy or sampled: the distribution restricted to the language and
renormalized), and feeds the matcher the token it took (`consume`). An end-of-sequence id is
allowed exactly when the text so far is a member of the language; a sequence whose language
admits nothing more gets only end-of-sequence ids. Speculative decoding truncates a draft's
proposals to the prefix the language allows (`Matcher.viable`: consume, then roll back).

The masks are computed by llguidance (docs/constrained_decoding.md says why that library),
with two settings that make a mask the language and nothing else:
- `no_forcing`: llguidance's default forces the canonical tokenization of bytes the grammar
  determines (after `{` of a one-property object, only the token `{"` instead of `{` too);
  here a token is allowed iff the text so far plus its bytes can still be extended to a
  member of the language, whatever the split. A model that prefers the canonical split keeps
  it; the goldens' "restricted and renormalized" distribution is then well defined.
- JSON without flexible whitespace: a schema's language is its instances written compactly
  (`,` and `:` with no spaces, properties in the schema's order), so that no model can loop
  on whitespace until max tokens.
Both are proven token by token against a reference that does not use the library
(tests/test_constrained.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import ClassVar

import numpy as np
import torch

KINDS = ("json_schema", "regex", "choice", "grammar")
# llguidance options in a Lark grammar's header: masks are the language (see the docstring)
_HEADER = '%llguidance {"no_forcing": true}\n'


class ConstraintError(ValueError):
    """A constraint that does not compile, or a token outside its language."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A language for a request's output. `kind` is one of KINDS; `text` is a JSON schema
    (JSON text), a regex (Rust `regex` syntax, anchored at both ends), a JSON list of strings
    (choice), or a grammar in Lark (llguidance's dialect) or GBNF (llama.cpp's) syntax."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Constraint:
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(options))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        return cls("grammar", text)

    def lark(self) -> str:
        """The constraint as one Lark grammar for llguidance, with the options above."""
        if self.kind == "json_schema":
            schema = _loads(self.text, "json_schema")
            if schema is True:  # any JSON: `{}`, which can carry the options (compact JSON)
                schema = {}
            if isinstance(schema, dict):
                schema = copy.deepcopy(schema)
                guidance = schema.setdefault("x-guidance", {})
                guidance.setdefault("whitespace_flexible", False)
                guidance.setdefault("json_allow_general_unicode_escapes", True)
            elif schema is not True and schema is not False:
                raise ConstraintError("json_schema: a schema is a JSON object or a boolean")
            return _HEADER + "start: %json " + json.dumps(schema)
        if self.kind == "regex":
            return _HEADER + "start: " + _lark_regex(self.text)
        if self.kind == "choice":
            options = _loads(self.text, "choice")
            if (
                not isinstance(options, list)
                or not options
                or not all(isinstance(o, str) and o for o in options)
            ):
                raise ConstraintError(
                    'choice: give a JSON list of non-empty strings, e.g. \'["yes", "no"]\''
                )
            return _HEADER + "start: " + " | ".join(json.dumps(o) for o in options)
        # a grammar: Lark as is, or GBNF converted by llguidance's own converter
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return _HEADER + any_to_lark(self.text)
        except Exception as error:  # the converter raises plain exceptions
            raise ConstraintError(f"grammar: not Lark or GBNF: {error}") from None

    def check(self, vocabulary: Vocabulary | None = None) -> str:
        """The constraint compiled for llguidance (against `vocabulary`'s tokens, or without
        any before a checkpoint loads): ConstraintError naming what is wrong."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(self.lark())
        error = llguidance.LLMatcher.validate_grammar(
            grammar, None if vocabulary is None else vocabulary.llg
        )
        if error:
            raise ConstraintError(f"{self.kind}: {error}")
        return grammar


def _loads(text: str, kind: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConstraintError(f"{kind}: not JSON ({error})") from None


def _lark_regex(pattern: str) -> str:
    """A Lark regex terminal for `pattern`: `/.../` with each slash the pattern does not
    escape escaped. Read as Lark reads the terminal, an escape pair at a time: in `\\\\/` the
    backslash is escaped and the slash is not (replacing `\\/` first, as this did, ate the
    second backslash and ended the terminal at that slash)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i : i + 2])  # an escape pair as it is, `\/` included
            i += 2
            continue
        out.append("\\/" if pattern[i] == "/" else pattern[i])
        i += 1
    return "/" + "".join(out) + "/"


class Vocabulary:
    """A checkpoint's tokens as bytes, and llguidance's tokenizer over them (built once per
    tokenizer backend: about 0.4 s for Llama 3's 128k tokens)."""

    _built: ClassVar[dict[int, tuple[object, Vocabulary]]] = {}

    def __init__(self, tokenizer) -> None:
        import llguidance

        self.tokens, self.special = tokenizer.token_bytes()
        self.eos_ids = sorted(tokenizer.eos_ids)
        backend = tokenizer.backend

        class _Wrapped:  # what llguidance.TokenizerWrapper reads
            eos_token_id = self.eos_ids[0] if self.eos_ids else None
            bos_token_id = tokenizer.bos_id
            special_token_ids = sorted(self.special)
            tokens = self.tokens

            def __call__(self, text: bytes | str) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return backend.encode(text, add_special_tokens=False).ids

        self.llg = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Wrapped()), eos_token=self.eos_ids or None
        )

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        key = id(tokenizer.backend)
        built = cls._built.get(key)
        if built is None or built[0] is not tokenizer.backend:
            built = cls._built[key] = (tokenizer.backend, cls(tokenizer))
        return built[1]


class Matcher:
    """One request's place in its constraint's language."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary) -> None:
        import llguidance

        self.constraint, self.vocabulary = constraint, vocabulary
        self.consumed: list[int] = []  # the tokens taken, in order
        self._allowed: np.ndarray | None = None  # this state's mask, once computed
        grammar = constraint.check(vocabulary)
        self._matcher = llguidance.LLMatcher(vocabulary.llg, grammar, log_level=0)
        self._raise_on_error(constraint.kind)

    def _raise_on_error(self, what: str) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"{what}: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """The allowed token ids, ascending (computed once per state)."""
        if self._allowed is None:
            bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            self._raise_on_error(f"{self.constraint.kind} mask")
            self._allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
        return self._allowed

    def mask(self, size: int) -> torch.Tensor:
        """[size] bool: True where a token is allowed (ids past the vocabulary never are)."""
        mask = torch.zeros(size, dtype=torch.bool)
        ids = allowed_ids(self)
        mask[torch.from_numpy(ids[ids < size])] = True
        return mask

    def consume(self, token: int) -> None:
        """Take `token` into the text; a token the language does not allow is an error."""
        self._allowed = None
        if not self._matcher.consume_token(int(token)):
            tokens = self.vocabulary.tokens
            text = tokens[token] if 0 <= token < len(tokens) else b"?"
            raise ConstraintError(
                f"token {token} ({text!r}) is outside the {self.constraint.kind} constraint "
                f"after {len(self.consumed)} tokens: {self._matcher.get_error()}"
            )
        self.consumed.append(int(token))

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens."""
        if count:
            self._allowed = None
            if not self._matcher.rollback(count):
                raise ConstraintError(f"rollback of {count} tokens failed")
            del self.consumed[-count:]

    def viable(self, tokens: list[int]) -> int:
        """How many leading `tokens` the language allows from here (the state is kept):
        consumed up to the first the language refuses, then rolled back."""
        taken = self._matcher.try_consume_tokens([int(t) for t in tokens])
        self._raise_on_error(f"{self.constraint.kind} proposals")
        self.consumed.extend(int(t) for t in tokens[:taken])
        rollback_proposals(self, taken)
        return taken

    @property
    def stopped(self) -> bool:
        """Whether the text admits nothing more (an end of sequence was taken)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a member of the language."""
        return self._matcher.is_accepting()


# Seams the constrained-decoding mutations patch (tests/test_constrained.py).


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf wherever `mask` is False."""
    return logits.masked_fill(~mask, float("-inf"))


def allowed_ids(matcher: Matcher) -> np.ndarray:
    """The ids a step's mask allows."""
    return matcher.allowed()


def rollback_proposals(matcher: Matcher, taken: int) -> None:
    """Undo the `taken` draft proposals consumed to mask or check them: the state is the
    verified tokens' only."""
    matcher.rollback(taken)


def matcher(constraint: Constraint | None, tokenizer) -> Matcher | None:
    """A request's matcher over the engine's vocabulary; None without a constraint."""
    if constraint is None:
        return None
    if tokenizer is None:
        raise ConstraintError(
            "a constraint needs the checkpoint's vocabulary: this GGUF stores no tokenizer"
        )
    return Matcher(constraint, Vocabulary.of(tokenizer))
