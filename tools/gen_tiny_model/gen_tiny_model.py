"""Write a tiny random Llama 3.1 checkpoint as a GGUF file, the same bytes on every machine.

    ./bazelw run //tools:gen_tiny_model -- --output=$PWD/tiny_llama.gguf \
        --quantization-encoding=float32 --n-layers=1 --n-heads=1 --n-kv-heads=1 --hidden-dim=16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from goldens.cli_files import OneLineParser, PathError, atomic_path, output_directory, user_path
from pipelines.llama3.gguf_writer import Vocabulary
from tools.gen_tiny_model import llama3_tokenizer
from tools.gen_tiny_model.tiny_llama import ENCODINGS, ROW_MULTIPLE, TinyLlamaConfig, write_gguf

PROG = "gen_tiny_model"
# The first seed whose testdata checkpoints (hidden 16 in float32, hidden 256 in q4_k) clear
# the near-tie margin at every greedy step of the golden prompts (tests/test_checkpoints.py);
# the NVFP4 file uses seed 8 and the bfloat16 file seed 59 (testdata/README.md says why).
DEFAULT_SEED = 2
# The hidden dim feeds a fused QKV matmul whose kernels want 8-aligned rows.


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit status 2, nothing written."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Write a tiny random Llama 3.1 GGUF checkpoint (llama.cpp conventions, "
        "full Llama 3.1 tokenizer) for golden tests. Same arguments, same bytes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./bazelw run //tools:gen_tiny_model -- "
        "--output=$PWD/tiny_llama.gguf --quantization-encoding=float32 \\\n"
        "      --n-layers=1 --n-heads=1 --n-kv-heads=1 --hidden-dim=16",
    )
    parser.add_argument("--output", required=True, help="GGUF file to write (folder created)")
    parser.add_argument(
        "--quantization-encoding",
        required=True,
        choices=ENCODINGS,
        help="storage of the 2-D weights; norms stay float32",
    )
    parser.add_argument("--n-layers", type=positive_int, required=True)
    parser.add_argument("--n-heads", type=positive_int, required=True)
    parser.add_argument("--n-kv-heads", type=positive_int, required=True)
    parser.add_argument(
        "--hidden-dim", type=positive_int, required=True, help="divisible by --n-heads"
    )
    parser.add_argument(
        "--intermediate-dim",
        type=positive_int,
        help="MLP width (default: 4 x hidden dim)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="default: %(default)s")
    parser.add_argument(
        "--tokenizer-dir",
        help="folder with a tokenizer.json to embed (default: build the Llama 3.1 tokenizer "
        "from the llama-models package)",
    )
    return parser


def validate(args: argparse.Namespace) -> tuple[TinyLlamaConfig, Path, Vocabulary | None]:
    hidden, heads, kv_heads = args.hidden_dim, args.n_heads, args.n_kv_heads
    if hidden % heads:
        raise UsageError(f"--n-heads={heads} must divide --hidden-dim={hidden}")
    if heads % kv_heads:
        raise UsageError(
            f"--n-kv-heads={kv_heads} must divide --n-heads={heads} (grouped-query attention)"
        )
    if (hidden // heads) % 2:
        raise UsageError(
            f"head dim --hidden-dim/--n-heads={hidden // heads} must be even (RoPE rotates "
            "pairs); pick fewer heads"
        )
    intermediate = args.intermediate_dim or 4 * hidden
    _check_block_rows(args.quantization_encoding, hidden, intermediate)
    output = user_path(args.output)
    if output.is_dir():
        raise UsageError(f"--output={args.output} is a directory; name the file to write")
    config = TinyLlamaConfig(
        n_layers=args.n_layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
    )
    vocab = None
    if args.tokenizer_dir is not None:
        vocab = _tokenizer_dir_vocab(args.tokenizer_dir, config.vocab_size)
    try:  # last: nothing is created for an invalid command
        output_directory(output.parent, "--output's folder")
    except PathError as error:
        raise UsageError(str(error)) from error
    return config, output, vocab


def _tokenizer_dir_vocab(flag_value: str, vocab_size: int) -> Vocabulary:
    """The GGUF vocabulary of --tokenizer-dir's tokenizer.json, read and checked before any
    output folder is created: the file parses as a tokenizer of `vocab_size` tokens (the
    model's rows) that holds the BOS and EOS tokens the GGUF metadata names."""
    flag = f"--tokenizer-dir={flag_value}"
    fix = "write one with //tools/gen_tiny_model:write_tokenizer"
    folder = user_path(flag_value)
    if not (folder / "tokenizer.json").is_file():
        raise UsageError(f"{flag} has no tokenizer.json; {fix}")
    try:
        tokenizer = llama3_tokenizer.load_tokenizer_dir(folder)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
        reason = (str(error).splitlines() or [type(error).__name__])[0][:120]
        raise UsageError(f"{flag}: tokenizer.json is not a tokenizer ({reason}); {fix}") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise UsageError(
            f"{flag}: tokenizer.json has {size} tokens, the Llama 3.1 model needs "
            f"{vocab_size}; {fix}"
        )
    bos, eos = llama3_tokenizer.BOS_TOKEN, llama3_tokenizer.EOS_TOKEN
    missing = [token for token in (bos, eos) if tokenizer.token_to_id(token) is None]
    if missing:
        raise UsageError(f"{flag}: tokenizer.json has no {' or '.join(missing)}; {fix}")
    try:
        return llama3_tokenizer.gguf_vocab(tokenizer)
    except (KeyError, RuntimeError) as error:  # no BPE merges; ids with gaps
        reason = f"tokenizer.json has no GGUF vocabulary ({error})"
        raise UsageError(f"{flag}: {reason}; {fix}") from None


def _check_block_rows(encoding: str, hidden: int, intermediate: int) -> None:
    """Block-quantized encodings split every weight row into whole blocks.

    Each 2-D weight's rows are hidden or intermediate values long (q/k/v/gate/up and the
    embedding: hidden; down: intermediate; attn_output: n_heads * head_dim = hidden).
    """
    block = ROW_MULTIPLE.get(encoding)
    if block is None:
        return
    for flag, value in (("--hidden-dim", hidden), ("--intermediate-dim", intermediate)):
        if value % block:
            raise UsageError(
                f"{flag}={value} must be a multiple of {block} for "
                f"--quantization-encoding={encoding} ({encoding.upper()} blocks hold {block} "
                "values)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, output, vocab = validate(args)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    if vocab is None:  # build_tokenizer checks its size (128256: TinyLlamaConfig's)
        print("building the Llama 3.1 tokenizer from llama-models", file=sys.stderr)
        vocab = llama3_tokenizer.gguf_vocab(llama3_tokenizer.build_tokenizer())

    print(f"writing {args.quantization_encoding} checkpoint {config}", file=sys.stderr)
    try:
        with atomic_path(output) as tmp:
            write_gguf(tmp, config, args.quantization_encoding, args.seed, vocab)
    except PathError as error:  # a failure after the check: disk full, the folder changed
        print(f"{PROG}: error: --output={args.output}: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
