"""The eval slice's checkpoint family: a float32 base and its quantizations, from one GGUF file.

The project ships SmolLM2 as Q4_1 only, so the base is that file's weights dequantized to
float32 (every value the Q4_1 file holds, exactly), and each other member quantizes the base
again with gguf-py's reference quantizers: every tensor byte for byte what llama.cpp's
`llama-quantize --allow-requantize` writes from the same base (checked by
tests/test_eval_slice_llama_cpp.py). Metadata and the tokenizer are copied field by field;
norms and other float32 tensors stay as they are; the token embedding keeps the source's type
in the quantized members (llama-quantize keeps this tied embedding at Q8_0 too) and is
float32 in the base.
The same source gives the same bytes: the files are written once per folder and reused.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

# name -> (file type recorded in general.file_type, the type of the layers' weight matrices)
MEMBERS = {
    "f32": (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, GGMLQuantizationType.Q4_0),
}
EMBEDDING = "token_embd.weight"


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: LlamaFileType) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these itself
        if field.name == "general.file_type":
            writer.add_file_type(file_type)
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub)


def _weights(tensor, target: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor's data in `target` (float32 data dequantized first), and the type it got."""
    kind = tensor.tensor_type
    if kind == GGMLQuantizationType.F32 and tensor.data.ndim == 1:
        return np.asarray(tensor.data), kind  # a norm: float32 in every member
    values = quants.dequantize(tensor.data, kind).astype(np.float32)
    if target == GGMLQuantizationType.F32:
        return values, target
    return quants.quantize(values, target), target


def write_member(source: Path, name: str, out: Path) -> Path:
    """Write member `name` of `source`'s family to `out` (through a temporary file)."""
    file_type, layers = MEMBERS[name]
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    partial = out.with_name(f".{out.name}.partial")
    writer = GGUFWriter(partial, arch)
    _copy_metadata(reader, writer, file_type)
    for tensor in reader.tensors:
        target = layers
        if tensor.name == EMBEDDING and layers != GGMLQuantizationType.F32:
            target = tensor.tensor_type  # the source's embedding type in a quantized member
        data, kind = _weights(tensor, target)  # rows x bytes for a quantized type
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)
    return out


def source_name(source: Path) -> str:
    """The member name of the source file itself (`member_name` of its general.file_type)."""
    field = GGUFReader(source).fields.get("general.file_type")
    return member_name(None if field is None else int(field.contents()))


def member_name(file_type: int | None) -> str:
    """The member name of a file of general.file_type `file_type`: "q4_1" for MOSTLY_Q4_1,
    "f32" for ALL_F32; "source" for a file that records none, "file_type_N" for a number
    gguf-py does not name (a newer writer's)."""
    if file_type is None:
        return "source"
    try:
        kind = LlamaFileType(file_type).name
    except ValueError:
        return f"file_type_{file_type}"
    return kind.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def family(source: Path, folder: Path, skip: str = "") -> dict[str, Path]:
    """The derived members' files in `folder` (`STEM.NAME.gguf`), written where absent; none
    named `skip` (the source's own type: the source is that member)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = source.name.split(".")[0]
    files = {}
    for name in (name for name in MEMBERS if name != skip):
        path = folder / f"{stem}.{name}.gguf"
        files[name] = path if path.exists() else write_member(source, name, path)
    return files


__all__ = ["MEMBERS", "family", "main", "member_name", "source_name", "write_member"]


def main(argv: list[str] | None = None) -> int:
    """`checkpoints SOURCE FOLDER`: write the derived members (the Bazel action's command)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: checkpoints SOURCE.gguf FOLDER", file=sys.stderr)
        return 2
    source, folder = Path(args[0]), Path(args[1])
    for name, path in family(source, folder, skip=source_name(source)).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
