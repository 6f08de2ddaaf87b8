"""Tokenizers from a GGUF vocabulary and from a tokenizer.json folder."""

import json
import pathlib

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from pipelines.llama3 import CheckpointError, Tokenizer
from tools.gen_tiny_model.tiny_llama import write_tiny_llama


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
