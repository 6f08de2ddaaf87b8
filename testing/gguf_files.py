"""Small GGUF files for the parser's and loader's tests, written by gguf-py.

The tests build a writer, add the metadata and tensors a case needs, and call `finish`,
which writes the file as llama.cpp's converter does: header, metadata, then the tensor data
only where there are tensors (gguf-py pads a metadata-only file to the alignment otherwise,
and a test of such a file wants it to end at its last value).
"""

from __future__ import annotations

from gguf import GGUFWriter


def finish(writer: GGUFWriter) -> None:
    """Write `writer`'s header, metadata and any tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if any(writer.tensors):
        writer.write_tensors_to_file()
    writer.close()
