import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pipelines.llama3 import tokenizer as engine_tokenizer
from tools.gen_tiny_model import llama3_tokenizer

TESTDATA = Path("max_tests/integration/architectures/llama3/testdata")


@pytest.fixture(scope="module")
def committed():
    return Tokenizer.from_file(str(TESTDATA / "tokenizer.json"))


def test_encodes_like_llama_3(committed):
    encoding = committed.encode("The capital of France is", add_special_tokens=False)
    assert encoding.ids == [791, 6864, 315, 9822, 374]
    assert committed.encode("The capital of France is").ids[0] == 128000  # BOS added


def test_special_tokens_have_llama_3_1_ids(committed):
    expected = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|finetune_right_pad_id|>": 128004,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
        "<|reserved_special_token_247|>": 128255,
    }
    assert {t: committed.token_to_id(t) for t in expected} == expected
    assert committed.get_vocab_size(with_added_tokens=True) == 128256


def test_config_names_bos_eos_and_chat_template():
    config = json.loads((TESTDATA / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|eot_id|>"
    assert config["chat_template"] == llama3_tokenizer.chat_template()
    assert len(config["added_tokens_decoder"]) == 256


@pytest.mark.slow
def test_built_tokenizer_matches_committed_files():
    files = llama3_tokenizer.tokenizer_files(llama3_tokenizer.build_tokenizer())
    for name, content in files.items():
        assert (TESTDATA / name).read_bytes() == content, name


def test_the_llama_3_split_is_the_references():
    """The pre-tokenizer pattern is typed twice (the engine's GGUF tokenizer, this generator)
    and carried by the committed tokenizer.json: each is llama_models' Llama 3 `pat_str`
    (a class attribute: nothing is loaded or downloaded)."""
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    reference = MetaTokenizer.pat_str
    assert reference == engine_tokenizer.LLAMA3_SPLIT
    assert reference == llama3_tokenizer.LLAMA3_PATTERN
    body = json.loads((TESTDATA / "tokenizer.json").read_text(encoding="utf-8"))
    split = body["pre_tokenizer"]["pretokenizers"][0]
    assert (split["type"], split["pattern"]) == ("Split", {"Regex": reference})
