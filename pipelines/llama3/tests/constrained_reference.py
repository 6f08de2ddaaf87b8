"""A brute-force reference for constrained decoding's masks, independent of llguidance.

A token is allowed after the text so far iff the text plus the token's bytes can still be
extended to a member of the language; an end-of-sequence id iff the text is a member. Each
language is a pattern of the `regex` module (recursive where the language is not regular:
JSON values, nested expressions), decided by its partial matching: `fullmatch(text,
partial=True)` matches iff the text is a prefix of a member. A JSON schema's pattern is made
here (`schema_pattern`) from the JSON grammar (RFC 8259) and the schema's keywords, written
compactly (no whitespace, properties in the schema's order), as the engine's constraint
writes JSON; a choice's is the alternation of its strings.

Every vocabulary token is checked, through a character trie of the tokens' texts: a text
that is no prefix of a member has no extension that is one, so a dead trie node prunes the
tokens below it (the verdict per token is the same as checking each alone).

A token may end inside a UTF-8 character (byte-level vocabularies split them). It is allowed
iff some character that completes those bytes is. Every corpus pattern treats non-ASCII
characters alike except the literal ones it names (`assert_uniform_outside_literals`: no
`\\w \\d \\s \\p \\b`, no non-ASCII in a character class), so the completions tried are the
pattern's own non-ASCII literals that start with those bytes and one other character that
does: exact for those patterns. A token whose bytes are no UTF-8 prefix is never allowed.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import regex

# A JSON string's character (RFC 8259), in I-JSON's Unicode (RFC 7493: no unpaired
# surrogate in a \u escape), as the engine writes strings.
_HEX = "[0-9a-fA-F]"
_UNICODE_ESCAPE = (
    rf"\\u(?:(?![dD][89a-fA-F]){_HEX}{{4}}"
    rf"|[dD][89abAB]{_HEX}{{2}}\\u[dD][c-fC-F]{_HEX}{{2}})"
)
_RFC_STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|' + _UNICODE_ESCAPE + ")"
# llguidance's known limits (docs/constrained_decoding.md), each proven still there by
# test_constrained: a raw DEL (U+007F) and the escape \/ are refused, though JSON allows them.
LIBRARY_LIMITS = ("raw DEL in a string", "the escape \\/")
_STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\bfnrt]|' + _UNICODE_ESCAPE + ")"
_JSON_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_JSON_INTEGER = r"-?(?:0|[1-9][0-9]*)"


def _json_any(char: str) -> str:
    """Any JSON value (RFC 8259), compact, its strings' characters `char`."""
    return (
        r"(?P<jv>(?P<jo>\{(?:(?&js):(?&jv)(?:,(?&js):(?&jv))*)?\})"
        r"|(?P<ja>\[(?:(?&jv)(?:,(?&jv))*)?\])"
        r'|(?P<js>"' + char + r'*")'
        r"|" + _JSON_NUMBER + r"|true|false|null)"
    )


def schema_pattern(schema, root=None, rfc: bool = False) -> str:
    """A `regex` pattern for the compact JSON texts of `schema`'s instances (the keywords
    the corpus uses; anything else is refused, not guessed); strings without the library's
    limits with `rfc` (JSON's whole string syntax)."""
    root = schema if root is None else root
    char = _RFC_STRING_CHAR if rfc else _STRING_CHAR
    if schema is True or schema == {}:
        return _json_any(char)
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"reference: only local $ref, not {ref}")
        target = root
        for part in ref[2:].split("/"):
            target = target[part]
        return schema_pattern(target, root, rfc)
    if "enum" in schema:
        return "(?:" + "|".join(regex.escape(_compact(v)) for v in schema["enum"]) + ")"
    if "const" in schema:
        return regex.escape(_compact(schema["const"]))
    if "anyOf" in schema:
        return "(?:" + "|".join(schema_pattern(s, root, rfc) for s in schema["anyOf"]) + ")"
    kind = schema.get("type")
    simple = {
        "null": "null",
        "boolean": "(?:true|false)",
        "integer": _JSON_INTEGER,
        "number": _JSON_NUMBER,
    }
    if kind in simple:
        _only(schema, {"type"})
        return simple[kind]
    if kind == "string":
        _only(schema, {"type", "minLength", "maxLength"})
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return '"' + char + "{" + f"{low},{high}" + '}"'
    if kind == "array":
        _only(schema, {"type", "items", "minItems", "maxItems"})
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return r"\[\]"
        item = schema_pattern(schema.get("items", {}), root, rfc)
        rest = "{" + f"{max(low - 1, 0)},{'' if high is None else high - 1}" + "}"
        items = f"{item}(?:,{item}){rest}"
        return r"\[" + (items if low > 0 else f"(?:{items})?") + r"\]"
    if kind == "object":
        _only(schema, {"type", "properties", "required", "additionalProperties"})
        if schema.get("additionalProperties", True) is not False:
            raise ValueError("reference: objects need additionalProperties false")
        properties, required = schema.get("properties", {}), schema.get("required", [])
        names = list(properties)
        if names[: len(required)] != list(required):
            raise ValueError("reference: required properties first, in the schema's order")
        parts = [
            regex.escape(json.dumps(n)) + ":" + schema_pattern(properties[n], root, rfc)
            for n in names
        ]
        body = ",".join(parts[: len(required)])
        for part in parts[len(required) :]:  # optional ones, in order, each may be left out
            body += f"(?:,{part})?" if body else f"(?:{part})?"
        return r"\{" + body + r"\}"
    raise ValueError(f"reference: schema {schema} is not in the reference's keywords")


def _only(schema: dict, keys: set) -> None:
    extra = set(schema) - keys - {"$defs", "x-guidance"}
    if extra:
        raise ValueError(f"reference: keywords {sorted(extra)} are not modelled")


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def choice_pattern(options: list[str]) -> str:
    return "(?:" + "|".join(regex.escape(o) for o in options) + ")"


def assert_uniform_outside_literals(pattern: str) -> None:
    """The condition under which one completion character stands for the others."""
    for escape in regex.findall(r"\\.", pattern):  # escapes, left to right (\\\\ is one)
        assert escape[1] not in "wWdDsSpPbBX", f"{escape} in {pattern!r}: not exact"
    for klass in regex.findall(r"(?<!\\)\[(?:\\.|[^\]\\])*\]", pattern):
        assert klass.isascii(), f"non-ASCII class {klass} in {pattern!r}"


class Language:
    """The members of a `regex` pattern, decided by partial matching."""

    def __init__(self, pattern: str) -> None:
        assert_uniform_outside_literals(pattern)
        self.pattern = pattern
        self.compiled = regex.compile(pattern)
        self.literals = {c for c in pattern if not c.isascii()}

    def viable(self, text: str) -> bool:
        return self.compiled.fullmatch(text, partial=True) is not None

    def member(self, text: str) -> bool:
        return self.compiled.fullmatch(text) is not None


def _split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """(the complete characters, the bytes of an unfinished last one), or None when the
    bytes are no prefix of UTF-8 text."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        tail = data[cut:]
        return (text, tail) if not tail or _completions_of(tail) else None
    return None


@functools.cache
def _completions_of(tail: bytes) -> tuple[str, ...]:
    """Characters whose UTF-8 starts with `tail` (one per next byte; empty if none)."""
    need = {0xC: 2, 0xD: 2, 0xE: 3, 0xF: 4}.get(tail[0] >> 4, 0) - len(tail) if tail else 0
    found = []
    for second in range(0x80, 0xC0) if need > 0 else ():
        candidate = tail + bytes([second]) + b"\x80" * (need - 1)
        try:
            found.append(candidate.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return tuple(found)


class TokenTexts:
    """A vocabulary's tokens as the texts the reference checks, in a character trie."""

    def __init__(self, tokens: list[bytes], special: set[int]) -> None:
        self.size = len(tokens)
        self.texts = [(i, data) for i, data in enumerate(tokens) if i not in special and data]
        # The tokens that can go on from an unfinished character: those starting with a
        # continuation byte (10xxxxxx). After any other byte the character is broken, so the
        # bytes are no UTF-8 prefix and _split_utf8 refuses them; skipping them gives the same
        # verdicts without trying the 128k tokens one by one at every such state.
        self.continuing = [(i, data) for i, data in self.texts if data[0] >> 6 == 0b10]
        self.trie: dict = {}  # tokens that are UTF-8 text by themselves (but maybe a tail)
        for index, data in self.texts:
            split = _split_utf8(data)
            if split is None:
                continue
            node = self.trie
            for char in split[0]:
                node = node.setdefault(char, {})
            node.setdefault(None, []).append((index, split[1]))

    def allowed(self, language: Language, text: bytes, eos_ids) -> np.ndarray:
        """The ids the reference allows after `text` (the bytes generated so far)."""
        split = _split_utf8(text)
        assert split is not None, f"generated bytes {text!r} are not UTF-8"
        prefix, pending = split
        assert language.viable(prefix), f"generated text {prefix!r} is outside the language"
        if pending:  # the text ends inside a character: each token must go on from it
            allowed = []
            for index, data in self.continuing:
                joined = _split_utf8(pending + data)
                if joined is not None and self._completes(language, prefix + joined[0], joined[1]):
                    allowed.append(index)
            return np.array(allowed, dtype=np.int64)
        allowed = [t for t in eos_ids if language.member(prefix)]
        stack = [(self.trie, prefix)]
        while stack:
            node, so_far = stack.pop()
            for key, child in node.items():
                if key is None:  # tokens ending here: so_far is viable (checked on the way),
                    # so a token without an unfinished character's tail is allowed as it is
                    for index, tail in child:
                        if not tail or self._completes(language, so_far, tail):
                            allowed.append(index)
                elif language.viable(so_far + key):
                    stack.append((child, so_far + key))
        return np.array(sorted(allowed), dtype=np.int64)

    @staticmethod
    def _completes(language: Language, text: str, tail: bytes) -> bool:
        """Whether `text` (viable, or checked here) and a character starting with `tail`
        (none when empty) are a prefix of a member."""
        if not tail:
            return language.viable(text)
        completions = _completions_of(tail)
        candidates = [c for c in language.literals if c.encode().startswith(tail)]
        candidates += [c for c in completions if c not in language.literals][:1]
        return any(language.viable(text + c) for c in candidates)
