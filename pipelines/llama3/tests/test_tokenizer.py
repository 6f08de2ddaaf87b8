"""Tokenizers from a GGUF vocabulary and from a tokenizer.json folder."""

import json
import os
import pathlib
import types

import numpy as np
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, processors

from pipelines.llama3 import CheckpointError, Tokenizer
from pipelines.llama3.tokenizer import _BYTE_ALPHABET
from testing import required
from tools.gen_tiny_model.tiny_llama import byte_vocab, write_tiny_llama

TESTDATA = pathlib.Path("max_tests/integration/architectures/llama3/testdata")


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tiny.gguf"
    write_tiny_llama(path)
    return Tokenizer.from_gguf(path)


def test_gguf_tokenizer_applies_merges_and_adds_bos(gguf_tokenizer: Tokenizer) -> None:
    ids = gguf_tokenizer.encode(" the cap")
    assert ids[0] == gguf_tokenizer.bos_id == 261
    assert ids[1:] == [258, 259, 260]  # "Ġthe", "Ġc", "ap"
    assert gguf_tokenizer.decode(ids[1:]) == " the cap"
    assert gguf_tokenizer.encode(" the", add_bos=False) == [258]
    assert gguf_tokenizer.eos_ids == {262}


def test_gguf_control_tokens_stay_whole(gguf_tokenizer: Tokenizer) -> None:
    assert gguf_tokenizer.encode("<|end_of_text|>", add_bos=False) == [262]


def test_gguf_tokenizer_round_trips_arbitrary_bytes(gguf_tokenizer: Tokenizer) -> None:
    text = "Grüße, 東京! 123\n\ttabs"
    assert gguf_tokenizer.decode(gguf_tokenizer.encode(text, add_bos=False)) == text


def test_an_unknown_pre_tokenizer_is_refused_naming_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_llama(path, tokenizer_pre="qwen9")
    expected = r"odd\.gguf: tokenizer\.ggml\.pre 'qwen9' is not supported \(known: .*llama-bpe"
    with pytest.raises(CheckpointError, match=expected):
        Tokenizer.from_gguf(path)


def test_folder_tokenizer_reads_bos_and_eos_from_config(tmp_path: pathlib.Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    backend = BackendTokenizer(models.BPE(vocab, [("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True})
    )
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.encode("ab b") == [0, 4, 3]
    assert tokenizer.encode("ab", add_bos=False) == [4]
    assert tokenizer.bos_id == 0 and tokenizer.eos_ids == {1}


def test_folder_without_tokenizer_json_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)


def _metadata_tokenizer(
    extra: tuple[tuple[str, int], ...] = (), pre: str = "llama-bpe", **keys: object
) -> Tokenizer:
    """A tokenizer from GGUF metadata alone (a reader whose `fields` are given): the tiny byte
    vocabulary (BOS 261, EOS 262) plus `extra` (token, token type) from id 263 on; `keys` are
    tokenizer.ggml.<key> values to add, or None to leave a key out."""
    vocab = byte_vocab(pre)
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": (*vocab.tokens, *(token for token, _ in extra)),
        "tokenizer.ggml.merges": tuple(vocab.merges),
        "tokenizer.ggml.token_type": np.array(
            [*vocab.token_types, *(kind for _, kind in extra)], np.int32
        ),
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.bos_token_id": vocab.bos_token_id,
        "tokenizer.ggml.eos_token_id": vocab.eos_token_id,
        "tokenizer.ggml.add_bos_token": True,
    }
    fields.update({f"tokenizer.ggml.{key}": value for key, value in keys.items()})
    fields = {key: value for key, value in fields.items() if value is not None}
    return Tokenizer.from_gguf_reader(types.SimpleNamespace(fields=fields), "meta.gguf")


def test_gguf_eot_token_is_an_eos_token_too() -> None:
    """Llama 3 Instruct ends a turn with <|eot_id|> (tokenizer.ggml.eot_token_id): it stops
    generation like EOS. Catches eos_ids built from eos_token_id alone."""
    tokenizer = _metadata_tokenizer(extra=(("<|eot_id|>", 3),), eot_token_id=263)
    assert tokenizer.eos_ids == {262, 263}


def test_gguf_without_add_bos_key_adds_bos_exactly_when_there_is_one() -> None:
    """With no tokenizer.ggml.add_bos_token, BOS is added iff the vocabulary names one; an
    explicit False wins. Catches a default of False (or True) for the missing key."""
    assert _metadata_tokenizer(add_bos_token=None).encode(" the") == [261, 258]
    assert _metadata_tokenizer(add_bos_token=False).encode(" the") == [258]
    no_bos = _metadata_tokenizer(add_bos_token=None, bos_token_id=None)
    assert no_bos.bos_id is None and no_bos.encode(" the") == [258]
    with pytest.raises(ValueError, match="no BOS"):
        no_bos.encode(" the", add_bos=True)


def test_llama3_takes_a_whole_word_from_the_vocabulary_without_merges() -> None:
    """llama.cpp (and ignore_merges in tokenizers) takes a Llama 3 pre-token that is itself a
    vocabulary entry whole, even when no merge builds it; GPT-2-style vocabularies merge. The
    tiny vocabulary gets "Ġcat" with no merge for it. Catches ignore_merges fixed to False or
    True instead of `pre_type in LLAMA3_PRE_TYPES`."""
    extra = (("Ġcat", 1),)
    assert _metadata_tokenizer(extra).encode(" cat", add_bos=False) == [263]
    gpt2 = _metadata_tokenizer(extra, pre="gpt2").encode(" cat", add_bos=False)
    assert gpt2 == [259, ord("a") - 33, ord("t") - 33]  # "Ġc", "a", "t"


def test_a_normal_token_stored_in_plain_utf8_is_read_as_llama_cpp_reads_it() -> None:
    """Some converters store a token as plain UTF-8 ("€") rather than in GPT-2's byte alphabet
    ("â‚¬"). llama.cpp takes the spelling as it is: text is encoded in the byte alphabet, so "€"
    encodes to its three byte tokens (llama-tokenize on such a file: 158 224 105), never to the
    token; the engine does the same, and decodes the token to its text. Catches the token
    respelled in the byte alphabet (then "€" encodes to [263], which llama.cpp never gives)."""
    tokenizer = _metadata_tokenizer(extra=(("€", 1),))
    assert tokenizer.encode("€", add_bos=False) == [158, 224, 105]
    assert tokenizer.decode([263]) == "€"
    assert tokenizer.token_bytes()[0][263] == "€".encode()


@pytest.mark.parametrize("pre", ["llama-bpe", "smollm", "default"])
def test_merges_in_plain_utf8_like_their_tokens_load_and_encode_as_llama_cpp_does(
    pre: str,
) -> None:
    """A vocabulary whose tokens ("中", "文", "中文") and merge ("中 文") are both stored in plain
    UTF-8 loads, and encodes as llama.cpp's llama-tokenize and `tokenizers` do on the same file
    (ids below are theirs): no byte-level merge builds "中" from its bytes, so it is 3 byte
    tokens, even where a Llama 3 pre-token equal to a token is taken whole. Catches the tokens
    respelled in the byte alphabet but not the merges naming them (then building the BPE model
    fails: "Token `中` out of vocabulary"), and both respelled (then "中文" is [265])."""
    extra = (("中", 1), ("文", 1), ("中文", 1))
    merges = (*byte_vocab().merges, "中 文")
    tokenizer = _metadata_tokenizer(extra, pre=pre, merges=merges)
    in_bytes = [160, 116, 255, 162, 244, 229]  # "ä¸Ń" "æĸĩ": 中文's six UTF-8 bytes
    assert tokenizer.encode(" the 中文 cap", add_bos=False) == [258, 220, *in_bytes, 259, 260]
    assert tokenizer.encode("中文", add_bos=False) == in_bytes


def test_added_tokens_in_plain_utf8_keep_their_ids_as_in_llama_cpp() -> None:
    """A user-defined token ("中文", type 4) and a control token ("‹｜eos｜>", type 3, as
    DeepSeek's vocabularies spell theirs) outside the byte alphabet match whole in text and
    keep their own ids, as in llama-tokenize (x‹｜eos｜> is 87 then the token). Catches a
    user-defined token respelled in the vocabulary (then its text gets a new id past the
    vocabulary, 265 here, outside the embedding table) and control tokens outside the
    alphabet left out of the special tokens (then they split into byte tokens)."""
    tokenizer = _metadata_tokenizer(extra=(("中文", 4), ("‹｜eos｜>", 3)))
    assert tokenizer.encode("中文", add_bos=False) == [263]
    assert tokenizer.encode("x‹｜eos｜>", add_bos=False) == [87, 264]
    assert tokenizer.backend.get_vocab_size(with_added_tokens=True) == 265
    token_bytes, special = tokenizer.token_bytes()
    assert token_bytes[263] == "中文".encode() and token_bytes[264] == "‹｜eos｜>".encode()
    assert special == {261, 262, 264}


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["HE", "'S", "Ġ", "123", "45", "Ġok"]),  # contractions any case; 1-3 digits
        ("smollm", ["HE", "'", "S", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),  # every digit alone
        ("gpt2", ["HE", "'", "S", "Ġ12345", "Ġok"]),
    ],
)
def test_pre_tokenizer_splits_as_llama_cpp_does_for_each_pre_type(
    pre: str, pieces: list[str]
) -> None:
    """Each tokenizer.ggml.pre gets llama.cpp's split: Llama 3's regex (case-insensitive
    contractions, digit runs of at most 3), digits one by one then GPT-2's split, or GPT-2's.
    The tiny vocabulary has no digit merges, so only the pre-tokens show this. Catches \\p{N}{1,4},
    individual_digits=False, and Llama 3 types given GPT-2's split."""
    backend = _metadata_tokenizer(pre=pre).backend
    assert [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("HE'S 12345 ok")] == pieces


def test_token_bytes_of_added_tokens_are_their_text_and_only_control_ones_are_special() -> None:
    """token_bytes: a user-defined token's bytes are its text in UTF-8 (not read back through
    the byte alphabet, in which "é" would be the single byte 0xE9), a byte-level token's its
    bytes, and the special ids are the control tokens only. Catches every added token counted
    special, and added tokens decoded through the byte alphabet."""
    tokenizer = _metadata_tokenizer(extra=(("é!", 4), ("<|eot_id|>", 3)))
    token_bytes, special = tokenizer.token_bytes()
    assert token_bytes[263] == "é!".encode() == b"\xc3\xa9!"
    assert token_bytes[264] == b"<|eot_id|>"
    assert token_bytes[258] == b" the"
    assert token_bytes[byte_vocab().tokens.index("Ã")] == bytes([0xC3])
    assert special == {261, 262, 264}


def test_folder_eos_ids_join_the_generation_config_ones(tmp_path: pathlib.Path) -> None:
    """generation_config.json's eos_token_id (an id or a list) adds to tokenizer_config.json's
    EOS, it does not replace it. Catches `eos_ids = ...` for `eos_ids |= ...`."""
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, "a": 3}
    backend = BackendTokenizer(models.BPE(vocab, []))
    backend.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    assert Tokenizer.from_folder(tmp_path).eos_ids == {1, 2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_folder(tmp_path).eos_ids == {1, 2}


@pytest.mark.parametrize("post_processor_adds_bos", [True, False])
def test_folder_without_add_bos_token_follows_the_post_processor(
    tmp_path: pathlib.Path, post_processor_adds_bos: bool
) -> None:
    """With no add_bos_token in tokenizer_config.json, BOS is added iff tokenizer.json's
    post-processor adds it (Llama 3's does). Catches add_bos defaulting to True or False."""
    backend = BackendTokenizer(models.BPE({"<s>": 0, "a": 1}, []))
    backend.add_special_tokens(["<s>"])
    if post_processor_adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.add_bos is post_processor_adds_bos
    assert tokenizer.encode("a") == ([0, 1] if post_processor_adds_bos else [1])


def _bytes_by_characters(backend: BackendTokenizer) -> list[bytes]:
    """token_bytes' rule one character at a time: an added token's text, a spelling wholly in
    GPT-2's byte alphabet read back byte by byte, any other spelling's UTF-8."""
    alphabet = {char: byte for byte, char in _BYTE_ALPHABET.items()}
    added = backend.get_added_tokens_decoder()
    spelled = [backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(True))]
    return [
        s.encode()
        if i in added or any(c not in alphabet for c in s)
        else bytes(alphabet[c] for c in s)
        for i, s in enumerate(spelled)
    ]


def test_token_bytes_of_every_spelling_follow_the_byte_alphabet_character_by_character() -> None:
    """token_bytes reads spellings back in C (str.translate): the same bytes as the rule taken
    one character at a time, on the Llama 3 vocabulary (128,256 tokens), SmolLM2's and tokens
    stored in plain UTF-8 with characters outside the alphabet below its last (a soft hyphen,
    a DEL, a space, a no-break space: one byte each in Latin-1, two in UTF-8). Catches those
    characters read back as Latin-1 (then "a\\xad" is 2 bytes, not 3)."""
    backends = [_metadata_tokenizer(extra=(("a\xad", 1), ("\x7fb", 1), ("c d", 1), ("\xa0", 1)))]
    for path in (TESTDATA / "tiny_llama.gguf", pathlib.Path(os.environ.get("SMOLLM2_GGUF", ""))):
        if not path.is_file():
            required.missing(f"{path} not found (testdata's README.md; SMOLLM2_GGUF)")
        backends.append(Tokenizer.from_gguf(path))
    for tokenizer in backends:
        assert tokenizer.token_bytes()[0] == _bytes_by_characters(tokenizer.backend)
    assert backends[0].token_bytes()[0][263:] == [b"a\xc2\xad", b"\x7fb", b"c d", b"\xc2\xa0"]
