"""Property-based tests of the tokenizer (tokenizer.py) on random unicode text.

The goldens store the producer's tokenization of each prompt and a run must tokenize it the
same way, so a tokenizer that differs from the reference on some text (a lost merge, a wrong
pre-tokenizer split, a mishandled byte) fails golden tests only for prompts that contain such
text. Here hypothesis draws strings from a broad alphabet (any code point but surrogates,
ASCII words and contractions, digit runs, whitespace runs with tabs, newlines and carriage
returns, CJK, emoji, combining marks, control-token strings of both vocabularies) and checks
two properties on two vocabularies:

- our encode equals the reference's on the same files, BOS as the checkpoint adds it (Llama 3.1
  adds it, SmolLM2 does not);
- decode(encode(s)) == s without BOS (byte-level BPE round-trips any string), and our decode
  of those ids equals the reference's.

The vocabularies: Llama 3.1 as embedded in the committed tiny checkpoint (tiny_llama.gguf),
against the `tokenizers` library on the tokenizer.json beside it; SmolLM2-135M-Instruct's GGUF
(skipped with the reason where the file is absent), against transformers'
`AutoTokenizer.from_pretrained(folder, gguf_file=name)` (about 8 s to build, once per module).

Each property runs FUZZ_EXAMPLES (300) examples per vocabulary; the file takes about 20 s on
2 cores. The runs use testing/fuzz.py's settings: deterministic (derandomize=True, no example
database), so CI sees the same examples every time; on a failure hypothesis prints the
falsifying example and a `@reproduce_failure(...)` line (print_blob=True) that replays exactly
that example.

The `test_planted_*` tests prove each property can fail on each vocabulary: each rebuilds our
tokenizer with one realistic bug planted by monkeypatch, calls the property on it, asserts
that it raises, and that the first failing example came within the FUZZ_EXAMPLES budget (not
only while shrinking).
"""

import dataclasses
import os
import pathlib
import types
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, pre_tokenizers

from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Tokenizer
from pipelines.llama3 import tokenizer as tokenizer_module
from testing import gguf_reader, required
from testing.fuzz import first_failure, fuzz_settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FUZZ_EXAMPLES = 300
TESTDATA = pathlib.Path("max_tests/integration/architectures/llama3/testdata")
VOCABULARIES = ("llama3_1", "smollm2")

# Fragments that reach the merges and pre-tokenizer rules random code points rarely hit.
WORDS = st.sampled_from(
    [
        "the",
        " the",
        " capital",
        " France",
        "ing",
        " don't",
        " I'LL",
        "'s",
        "HTTP",
        "def",
        " fibonacci(n):",
        "==",
        " ...",
        "ä",
        " naïve",
        "Grüße",
        # control tokens inside text: each matches whole in its own vocabulary (Llama 3's,
        # SmolLM2's) and is plain text in the other, the whitespace before it kept
        "<|eot_id|>",
        " <|eot_id|>",
        "<|begin_of_text|>",
        "<|im_start|>",
        "\n<|im_start|>",
        "<|im_end|>",
    ]
)
FRAGMENTS = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=6),
    WORDS,
    st.text("0123456789", min_size=1, max_size=7),
    st.text(" \t\n\r\u00a0\u3000", min_size=1, max_size=12),
    st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=4),
    st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1, max_size=3),
    st.text(st.characters(categories=["Mn"]), min_size=1, max_size=3),
)
TEXTS = st.lists(FRAGMENTS, max_size=8).map("".join)


@dataclasses.dataclass(frozen=True)
class Subject:
    """Our tokenizer and the reference's encode (with or without special tokens) and decode."""

    name: str
    ours: Tokenizer = dataclasses.field(repr=False)
    reference: BackendTokenizer = dataclasses.field(repr=False)
    gguf: pathlib.Path = dataclasses.field(repr=False)

    def reference_encode(self, text: str, special: bool) -> list[int]:
        return self.reference.encode(text, add_special_tokens=special).ids

    def reference_decode(self, ids: list[int]) -> str:
        # control tokens as their text, as ours decodes them (tokenizers skips them by default)
        return self.reference.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def smollm2_transformers(tmp_path_factory: pytest.TempPathFactory):
    """transformers' tokenizer of the SmolLM2 GGUF, as it loads it (about 8 s)."""
    from transformers import AutoTokenizer

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as error:
        required.missing(str(error))
    link = tmp_path_factory.mktemp("smollm2") / gguf.name
    link.symlink_to(gguf.resolve())
    gguf_reader.install()  # the vocabulary parse: 4.5x faster
    return AutoTokenizer.from_pretrained(link.parent, gguf_file=link.name)


def _smollm2_reference(transformers_tokenizer) -> BackendTokenizer:
    """transformers' vocabulary, merges, BPE model and decoder, with the pre-tokenizer of
    SmolLM2's own tokenizer.json (and llama.cpp's `smollm`): every digit split off, then
    GPT-2's split. transformers' GGUF loader drops the digit split (pinned below)."""
    reference = BackendTokenizer.from_str(transformers_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return reference


@pytest.fixture(scope="module", params=VOCABULARIES)
def subject(request: pytest.FixtureRequest) -> Subject:
    if request.param == "llama3_1":
        gguf = TESTDATA / "tiny_llama.gguf"
        # tokenizer.json's post-processor adds <|begin_of_text|>, as the GGUF's add_bos says.
        reference = BackendTokenizer.from_file(str(TESTDATA / "tokenizer.json"))
        return Subject("llama3_1", Tokenizer.from_gguf(gguf), reference, gguf)
    reference = _smollm2_reference(request.getfixturevalue("smollm2_transformers"))
    return Subject("smollm2", Tokenizer.from_gguf(smollm2_gguf()), reference, smollm2_gguf())


@fuzz_settings(FUZZ_EXAMPLES)
@given(text=TEXTS)
def test_encode_equals_the_reference(subject: Subject, text: str) -> None:
    ours, theirs = subject.ours.encode(text), subject.reference_encode(text, special=True)
    assert ours == theirs, f"encode differs from the reference on {text!r}"


@fuzz_settings(FUZZ_EXAMPLES)
@given(text=TEXTS)
def test_decode_of_encode_is_the_text(subject: Subject, text: str) -> None:
    ids = subject.ours.encode(text, add_bos=False)
    decoded = subject.ours.decode(ids)
    # SmolLM2's vocabulary has no token for some bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d,
    # 0xf1, 0xf2, ...): text with them cannot round-trip, in the reference either.
    if subject.reference_decode(subject.reference_encode(text, special=False)) == text:
        assert decoded == text, f"round trip changed {text!r}"
    assert decoded == subject.reference_decode(ids), f"decode of {ids} differs from the reference"


def test_transformers_gguf_loader_drops_smollm2s_digit_split(smollm2_transformers) -> None:
    """Why the SmolLM2 reference above sets its pre-tokenizer: transformers' loader splits
    "\n\n0" as GPT-2 does (the newline run stops before the digit), SmolLM2's own split
    and ours isolate the digit first, so the newlines stay one token."""
    text = "\n\n0"
    assert smollm2_transformers(text)["input_ids"] == [198, 198, 32]  # "Ċ" "Ċ" "0"
    ours = Tokenizer.from_gguf(smollm2_gguf()).encode(text)
    reference = _smollm2_reference(smollm2_transformers).encode(text).ids
    assert ours == reference == [1116, 32]


def _rebuilt(subject: Subject) -> Subject:
    """`subject` with our tokenizer built again from its GGUF (with whatever is patched), not
    taken from the cache of built backends."""
    with mock.patch.object(tokenizer_module, "_backend", tokenizer_module._backend.__wrapped__):
        return dataclasses.replace(subject, ours=Tokenizer.from_gguf(subject.gguf))


def test_planted_lost_merge_fails_the_encode_property(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An off-by-one that loses the first (highest-priority) merge of tokenizer.ggml.merges.
    read = tokenizer_module.metadata_value

    def without_first_merge(reader, key, *default):
        value = read(reader, key, *default)
        return value[1:] if key == "tokenizer.ggml.merges" else value

    monkeypatch.setattr(tokenizer_module, "metadata_value", without_first_merge)
    buggy = _rebuilt(subject)
    planted = first_failure(
        monkeypatch, test_encode_equals_the_reference, match="encode differs", subject=buggy
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_decoder_that_only_maps_spaces_fails_the_round_trip(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decoder that knows the byte alphabet's space ("Ġ") but no other byte.
    only_spaces = decoders.Sequence([decoders.Replace("Ġ", " "), decoders.Fuse()])
    monkeypatch.setattr(
        tokenizer_module, "decoders", types.SimpleNamespace(ByteLevel=lambda: only_spaces)
    )
    buggy = _rebuilt(subject)
    planted = first_failure(
        monkeypatch, test_decode_of_encode_is_the_text, match="round trip changed", subject=buggy
    )
    assert planted.first <= FUZZ_EXAMPLES


def test_planted_control_token_that_eats_the_space_before_it_fails_the_encode_property(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Control tokens added with lstrip=True: "Hi <|eot_id|>" loses its space into the token.
    added_token = tokenizer_module.AddedToken

    def stripping(content, **kwargs):
        return added_token(content, **kwargs, lstrip=kwargs.get("special", False))

    monkeypatch.setattr(tokenizer_module, "AddedToken", stripping)
    buggy = _rebuilt(subject)
    control = {"llama3_1": "<|eot_id|>", "smollm2": "<|im_end|>"}[subject.name]
    assert buggy.ours.encode(f"Hi {control}", add_bos=False) == subject.ours.encode(
        f"Hi{control}", add_bos=False
    )  # the bug as planted
    planted = first_failure(
        monkeypatch, test_encode_equals_the_reference, match="encode differs", subject=buggy
    )
    assert planted.first <= FUZZ_EXAMPLES
