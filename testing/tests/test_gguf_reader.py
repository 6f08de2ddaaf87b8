"""testing/gguf_reader.py: gguf-py's GGUFReader after `install()` opens a file exactly as it
did before (every field's parts and contents, every tensor's metadata and bytes), and edits
made in mode "r+" reach the file through `flush`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np

from testing import gguf_files, gguf_reader


def _write(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 5e5)
    writer.add_string("general.name", "tiny ü")
    writer.add_array("tokenizer.ggml.tokens", ["a", "", "ĠParis", "<|eot_id|>"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0] * 100)
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 6, 1] * 50)
    writer.add_array("tokenizer.ggml.merges", ["Ġ t", "a b", "Ġ ü"] * 40)
    writer.add_array("general.tags", [])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 16)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(16).astype(np.float16))
    gguf_files.finish(writer)


def _snapshot(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    fields = {
        key: (
            [(np.asarray(p).tobytes(), np.asarray(p).dtype.str, p.shape) for p in f.parts],
            f.types,
            f.data,
            f.offset,
            f.contents(),
        )
        for key, f in reader.fields.items()
    }
    tensors = [
        (t.name, t.tensor_type, list(t.shape), t.n_bytes, np.asarray(t.data).tobytes())
        for t in reader.tensors
    ]
    return {"fields": fields, "tensors": tensors}


def test_installed_reader_opens_every_field_and_tensor_as_gguf_py(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    # gguf-py unpatched, in a process of its own (install() is process-wide).
    stock = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import pickle, sys
            from testing.tests.test_gguf_reader import _snapshot
            sys.stdout.buffer.write(pickle.dumps(_snapshot({str(path)!r})))
        """)],
        capture_output=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    import pickle

    expected = pickle.loads(stock.stdout)
    gguf_reader.install()
    assert gguf.gguf_reader.np.memmap is gguf_reader._memmap
    assert type(gguf.GGUFReader(path).data) is np.ndarray
    assert _snapshot(path) == expected
    assert expected["fields"]["general.name"][-1] == "tiny ü"
    assert len(expected["fields"]["tokenizer.ggml.tokens"][-1]) == 200


def test_edits_in_r_plus_mode_reach_the_file(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    gguf_reader.install()
    reader = gguf.GGUFReader(path, "r+")
    (tensor,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    tensor.data[0, 0] = 42.0
    gguf_reader.flush(reader)
    del reader, tensor
    (tensor,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"]
    assert tensor.data[0, 0] == 42.0
