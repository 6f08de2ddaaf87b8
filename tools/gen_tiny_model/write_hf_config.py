"""Write the Hugging Face config.json of the model gen_tiny_model writes for the same flags.

    ./bazelw run //tools/gen_tiny_model:write_hf_config -- --output=$PWD/config.json \
        --quantization-encoding=float32 --n-layers=1 --n-heads=1 --n-kv-heads=1 --hidden-dim=16

transformers' GGUF loader drops Llama 3.1 rope scaling, so readers pass this file as `config=`
next to `gguf_file=`. For --quantization-encoding=nvfp4 it also carries a `quantization_config`
saying which tensors are NVFP4 and how the format is laid out.
"""

from __future__ import annotations

import json
import sys

from goldens.cli_files import write_atomically
from tools.gen_tiny_model.gen_tiny_model import UsageError, build_parser, validate
from tools.gen_tiny_model.tiny_llama import hf_config_for


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.prog = "write_hf_config"
    parser.description = "Write the config.json (Hugging Face LlamaConfig) matching gen_tiny_model"
    args = parser.parse_args(argv)
    try:
        config, output, _ = validate(args)
    except UsageError as err:
        print(f"write_hf_config: error: {err}", file=sys.stderr)
        return 2
    hf_config = hf_config_for(config, args.quantization_encoding)
    text = json.dumps(hf_config, indent=2, sort_keys=True) + "\n"
    write_atomically(output, text.encode("utf-8"))
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
