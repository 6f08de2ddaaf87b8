"""The Llama 3.1 tokenizer, built offline from the tiktoken file that ships in `llama-models`.

Nothing is downloaded: the 128000 BPE ranks come from `llama_models/llama3/tokenizer.model`,
transformers' `TikTokenConverter` turns them into a fast tokenizer, and the 256 special tokens
are appended in the order of Meta's Llama 3.1 release (ids 128000..128255).

As a command it writes the three Hugging Face tokenizer files that testdata carries:

    ./bazelw run //tools/gen_tiny_model:write_tokenizer -- \
        --output-dir=$PWD/max_tests/integration/architectures/llama3/testdata
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, processors

from goldens.cli_files import PathError, output_directory, user_path, write_atomically
from pipelines.llama3.gguf_writer import Vocabulary

# The pre-tokenizer split of Llama 3 (llama_models.llama3.tokenizer.Tokenizer.pat_str).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_BASE_TOKENS = 128000
NUM_SPECIAL_TOKENS = 256
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"  # the Instruct release ends a turn, not the text
MODEL_MAX_LENGTH = 131072

# Llama 3.1 as released (ids 128000..128010). llama-models 0.3.0 names 128005 <|step_id|> and
# 128011 <|image|> (its Llama 3.2 vocabulary); Llama 3.1 checkpoints and their GGUF files keep
# those two reserved, which is what this list reproduces.
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)

CHAT_TEMPLATE_PATH = Path(__file__).with_name("llama3_1_chat_template.jinja")


def special_tokens() -> list[str]:
    """The 256 special tokens in id order, starting at 128000."""
    reserved = [
        f"<|reserved_special_token_{3 + i}|>"
        for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
    ]
    return [*_NAMED_SPECIAL_TOKENS, *reserved]


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def tiktoken_model_path() -> Path:
    return Path(str(resources.files("llama_models.llama3") / "tokenizer.model"))


@functools.cache
def build_tokenizer() -> Tokenizer:
    """The Llama 3.1 fast tokenizer (128256 entries), BOS added like the Hugging Face release."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(
        vocab_file=str(tiktoken_model_path()),
        pattern=LLAMA3_PATTERN,
        extra_special_tokens=special_tokens(),
    )
    tokenizer = converter.converted()
    if tokenizer.get_vocab_size(with_added_tokens=True) != NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS:
        raise RuntimeError(
            f"{tiktoken_model_path()} gave {tokenizer.get_vocab_size()} tokens, expected "
            f"{NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS}: is llama-models the pinned version?"
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def gguf_vocab(tokenizer: Tokenizer) -> Vocabulary:
    """The tokenizer as llama.cpp's `gpt2` vocabulary stores it in GGUF metadata."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    if [token_id for _, token_id in by_id] != list(range(len(by_id))):
        raise RuntimeError("tokenizer ids are not contiguous; cannot write a GGUF token list")
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return Vocabulary(
        tokens=[token for token, _ in by_id],
        token_types=[
            int(TokenType.CONTROL if token in special else TokenType.NORMAL) for token, _ in by_id
        ],
        merges=merges,
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        chat_template=chat_template(),
    )


def load_tokenizer_dir(directory: Path) -> Tokenizer:
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def _added_token_entry(content: str) -> dict[str, object]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """File name -> bytes of tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    decoder = tokenizer.get_added_tokens_decoder()
    config = {
        "added_tokens_decoder": {
            str(token_id): _added_token_entry(decoder[token_id].content)
            for token_id in sorted(decoder)
        },
        "bos_token": BOS_TOKEN,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": True,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {
        "bos_token": {k: v for k, v in _added_token_entry(BOS_TOKEN).items() if k != "special"},
        "eos_token": {k: v for k, v in _added_token_entry(EOS_TOKEN).items() if k != "special"},
    }
    return {
        "tokenizer.json": tokenizer.to_str().encode("utf-8") + b"\n",
        "tokenizer_config.json": _json_bytes(config),
        "special_tokens_map.json": _json_bytes(special_map),
    }


def _json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="write_tokenizer",
        description="Write the Llama 3.1 tokenizer files (tokenizer.json, tokenizer_config.json, "
        "special_tokens_map.json) built from llama-models' tiktoken file.",
        epilog="example: write_tokenizer "
        "--output-dir=$PWD/max_tests/integration/architectures/llama3/testdata",
    )
    parser.add_argument("--output-dir", required=True, help="folder to write into (created)")
    args = parser.parse_args(argv)
    try:
        out_dir = output_directory(user_path(args.output_dir), "--output-dir")
    except PathError as error:
        print(f"write_tokenizer: error: {error}", file=sys.stderr)
        return 2
    print(f"building the Llama 3.1 tokenizer from {tiktoken_model_path()}", file=sys.stderr)
    for name, content in tokenizer_files(build_tokenizer()).items():
        write_atomically(out_dir / name, content)
        print(out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
