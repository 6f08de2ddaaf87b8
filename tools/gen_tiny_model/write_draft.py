"""Write a draft checkpoint for speculative decoding of a GGUF Llama: the target's bigram.

The draft keeps the target's token embedding, rope factors, final norm and head byte for byte
and puts one block between them whose weights are zero, so its attention and its MLP add
nothing to the residual stream: the draft computes head(norm(embedding(token))), exactly what
`speculative.self_draft(target, 0)` computes, in a file of its own that any engine loads
(llama.cpp's `llama-server --model-draft` among them; it loads no file of 0 layers). The same
target gives the same bytes.

    ./bazelw run //tools/gen_tiny_model:write_draft -- \
        --target=$PWD/max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf \
        --output=$PWD/max_tests/integration/architectures/llama3/testdata/tiny_llama_draft.gguf

The block's norms are ones and its matrices float32 zeros of the target's attention shapes and
an MLP --intermediate-dim wide (16 by default): the draft's work per token is the head's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from goldens.cli_files import OneLineParser, PathError, atomic_path, output_directory, user_path
from pipelines.llama3.gguf_file import CheckpointError, GGUFFile
from tools.gen_tiny_model.gen_tiny_model import UsageError, positive_int

PROG = "write_draft"
# The target's tensors the draft keeps (those present: a tied head has no output.weight)
KEPT = ("token_embd.weight", "rope_freqs.weight", "output_norm.weight", "output.weight")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Write the draft checkpoint of a GGUF Llama for speculative decoding: its "
        "embedding and head around one block of zeros (the target's bigram).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./bazelw run //tools/gen_tiny_model:write_draft -- "
        "--target=$PWD/tiny_llama.gguf --output=$PWD/tiny_llama_draft.gguf",
    )
    parser.add_argument("--target", required=True, help="the GGUF Llama checkpoint to draft for")
    parser.add_argument("--output", required=True, help="GGUF file to write")
    parser.add_argument(
        "--intermediate-dim", type=positive_int, default=16, help="MLP width (%(default)s)"
    )
    return parser


def _shapes(reader: GGUFFile, target: Path, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
    """The block's tensors and their numpy shapes (rows, columns) for the target's sizes."""
    arch = reader.get("general.architecture")
    if arch != "llama":
        raise UsageError(f"--target={target} is a {arch!r} checkpoint; give a llama one")
    dim = reader.get(f"{arch}.embedding_length")
    heads = reader.get(f"{arch}.attention.head_count")
    kv_heads = reader.get(f"{arch}.attention.head_count_kv") or heads
    if not dim or not heads:
        raise UsageError(f"--target={target} records no embedding length or head count")
    head_dim = reader.get(f"{arch}.attention.key_length") or dim // heads
    return [
        ("blk.0.attn_norm.weight", (dim,)),
        ("blk.0.attn_q.weight", (heads * head_dim, dim)),
        ("blk.0.attn_k.weight", (kv_heads * head_dim, dim)),
        ("blk.0.attn_v.weight", (kv_heads * head_dim, dim)),
        ("blk.0.attn_output.weight", (dim, heads * head_dim)),
        ("blk.0.ffn_norm.weight", (dim,)),
        ("blk.0.ffn_gate.weight", (ffn, dim)),
        ("blk.0.ffn_up.weight", (ffn, dim)),
        ("blk.0.ffn_down.weight", (dim, ffn)),
    ]


def write_draft(target: Path, output: Path, ffn: int = 16) -> None:
    """Write the draft of `target` to `output` (see the module docstring), creating `output`'s
    folder only once the target has been read and checked: a bad target leaves no folder."""
    try:
        reader = GGUFFile(target)
    except CheckpointError as error:
        raise UsageError(f"--target={error}") from None
    block = _shapes(reader, target, ffn)
    if "token_embd.weight" not in reader.tensors or "output_norm.weight" not in reader.tensors:
        raise UsageError(f"--target={target} has no token_embd.weight or output_norm.weight")
    arch = reader.get("general.architecture")
    try:
        output_directory(output.parent, "--output's folder")
    except PathError as error:
        raise UsageError(str(error)) from error
    with atomic_path(output) as partial:
        writer = GGUFWriter(partial, arch)
        for key, value in reader.fields.items():
            if key == "general.architecture":
                continue  # the writer writes it itself
            if key == f"{arch}.block_count":
                value = 1
            elif key == f"{arch}.feed_forward_length":
                value = ffn
            elif key == "general.name":
                value = f"{value} draft"
            if isinstance(value, np.ndarray):
                value = value.tolist()  # the writer packs sequences
            kind, *sub = reader.field_types[key]
            writer.add_key_value(key, value, kind, sub[0] if kind == GGUFValueType.ARRAY else None)
        for name in ("token_embd.weight", "rope_freqs.weight"):
            if name in reader.tensors:
                _copy(writer, reader, name)
        for name, shape in block:
            fill = np.ones if len(shape) == 1 else np.zeros
            writer.add_tensor(name, fill(shape, dtype=np.float32))
        for name in ("output_norm.weight", "output.weight"):
            if name in reader.tensors:
                _copy(writer, reader, name)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _copy(writer: GGUFWriter, reader: GGUFFile, name: str) -> None:
    """A tensor of the target, its bytes as stored."""
    info, data = reader.tensors[name], reader.tensor_data(name)
    if info.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if info.tensor_type == GGMLQuantizationType.F32 else np.float16
        writer.add_tensor(name, data.view(dtype).reshape(info.shape))
    else:  # rows of blocks (bfloat16 and the quantized types): the shape from the bytes
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        writer.add_tensor(name, data.reshape(rows, -1), raw_dtype=info.tensor_type)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        target, output = user_path(args.target), user_path(args.output)
        if not target.is_file():
            raise UsageError(f"--target={args.target} is not a file; give a GGUF checkpoint")
        if output.is_dir():
            raise UsageError(f"--output={args.output} is a directory; name the .gguf to write")
        if output.exists() and output.samefile(target):  # symlinks and hard links included
            # The draft is written beside the output and renamed over it: the target's bytes
            # would be replaced by its own draft.
            raise UsageError(
                f"--output={args.output} is the --target file; name another file to write"
            )
        write_draft(target, output, args.intermediate_dim)  # checks the target, then the folder
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
