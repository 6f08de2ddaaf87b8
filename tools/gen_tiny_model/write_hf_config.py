"""Write the Hugging Face config.json of the model gen_tiny_model writes for the same flags.

    ./bazelw run //tools/gen_tiny_model:write_hf_config -- --output=$PWD/config.json \
        --quantization-encoding=float32 --n-layers=1 --n-heads=1 --n-kv-heads=1 --hidden-dim=16

transformers' GGUF loader drops Llama 3.1 rope scaling, so readers pass this file as `config=`
next to `gguf_file=`. For --quantization-encoding=nvfp4 it also carries a `quantization_config`
saying which tensors are NVFP4 and how the format is laid out.
"""

from __future__ import annotations

import argparse
import json
import sys

from goldens.cli_files import PathError, write_atomically
from tools.gen_tiny_model import gen_tiny_model
from tools.gen_tiny_model.tiny_llama import hf_config_for

PROG = "write_hf_config"
EPILOG = (
    "example:\n  ./bazelw run //tools/gen_tiny_model:write_hf_config -- "
    "--output=$PWD/config.json --quantization-encoding=float32 \\\n"
    "      --n-layers=1 --n-heads=1 --n-kv-heads=1 --hidden-dim=16"
)


def build_parser() -> argparse.ArgumentParser:
    """gen_tiny_model's parser (the same model flags) with this tool's name, description,
    example and --output: a JSON file, not the GGUF file."""
    parser = gen_tiny_model.build_parser()
    parser.prog = PROG
    parser.description = "Write the config.json (Hugging Face LlamaConfig) matching gen_tiny_model"
    parser.epilog = EPILOG
    for action in parser._actions:
        if "--output" in action.option_strings:
            action.help = "config.json file to write (folder created)"
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, output, _ = gen_tiny_model.validate(args)
    except gen_tiny_model.UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    hf_config = hf_config_for(config, args.quantization_encoding)
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    try:
        write_atomically(output, text.encode("utf-8"))
    except PathError as error:
        print(f"{PROG}: error: --output={args.output}: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
