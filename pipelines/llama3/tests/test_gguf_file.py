"""The fast GGUF parser against gguf-py's GGUFReader, and its one-line errors for bad files."""

import pathlib

import gguf
import numpy as np
import pytest

from pipelines.llama3.gguf_file import CheckpointError, GGUFFile
from testing import gguf_files, gguf_reader, required
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

# gguf-py's reader, the reference here, opened 4x faster (same parsing: testing/gguf_reader.py)
gguf_reader.install()

TESTDATA = pathlib.Path("max_tests/integration/architectures/llama3/testdata")


def assert_same_as_gguf_py(path: pathlib.Path) -> None:
    ours = GGUFFile(path)
    reference = gguf.GGUFReader(path)
    # GGUFReader adds the header as pseudo-fields "GGUF.*".
    expected_fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected_fields)
    for key, field in expected_fields.items():
        value, expected = ours.fields[key], field.contents()
        assert ours.field_types[key] == tuple(field.types), key
        if len(field.types) > 2:
            continue  # arrays of arrays: gguf-py's contents() flattens them; checked separately
        if isinstance(value, np.ndarray):
            assert not value.flags.writeable
            assert value.tolist() == list(expected), key
        elif isinstance(value, tuple):
            assert list(value) == list(expected), key
        else:
            assert value == expected and type(value) is type(expected), key
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert info.tensor_type == tensor.tensor_type
        assert (info.offset, info.n_bytes, info.n_elements) == (
            tensor.data_offset,
            tensor.n_bytes,
            tensor.n_elements,
        )
        data = ours.tensor_data(tensor.name)
        assert not data.flags.writeable
        assert data.tobytes() == tensor.data.tobytes()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, weight_type=gguf.GGMLQuantizationType.Q8_0, ffn_dim=256)
    return path


def test_tiny_checkpoint_reads_like_gguf_py(
    tiny_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def walk(*args: object) -> None:
        raise AssertionError("a plain vocabulary must take the vectorized path")

    monkeypatch.setattr(GGUFFile, "_walk_string_prefixes", walk)
    assert_same_as_gguf_py(tiny_gguf)


TESTDATA_CHECKPOINTS = [
    "tiny_llama.gguf",
    "tiny_llama_bf16.gguf",
    "tiny_llama_q4_k.gguf",
    "tiny_llama_nvfp4.gguf",
]


@pytest.mark.parametrize("name", TESTDATA_CHECKPOINTS)
@pytest.mark.slow  # gguf-py needs seconds for the 128k-token vocabulary
def test_testdata_checkpoints_read_like_gguf_py(name: str) -> None:
    path = TESTDATA / name
    if not path.is_file():
        required.missing(f"{path} not generated yet (see its folder's README.md)")
    assert_same_as_gguf_py(path)


def test_missing_testdata_checkpoint_fails_where_required(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shipped checkpoint that is not there fails the test under GOLDENS_REQUIRED=1 (`bazel
    test`), where a skip would let a lost input go green; plain pytest skips with its path."""
    monkeypatch.setitem(globals(), "TESTDATA", tmp_path)  # an empty folder
    monkeypatch.setenv(required.REQUIRED_ENV, "1")
    for name in TESTDATA_CHECKPOINTS:
        with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as outcome:
            test_testdata_checkpoints_read_like_gguf_py(name)
        assert outcome.type is pytest.fail.Exception, f"{name}: {outcome.value!r}"
        assert str(tmp_path / name) in str(outcome.value)
    monkeypatch.delenv(required.REQUIRED_ENV)
    with pytest.raises(pytest.skip.Exception, match=str(tmp_path / "tiny_llama.gguf")):
        test_testdata_checkpoints_read_like_gguf_py("tiny_llama.gguf")


@pytest.mark.slow
def test_smollm2_reads_like_gguf_py() -> None:
    from pipelines.checkpoints import smollm2_gguf

    try:
        path = smollm2_gguf()
    except FileNotFoundError as error:
        required.missing(str(error))
    assert_same_as_gguf_py(path)


def test_unusual_strings_and_every_value_type(tmp_path: pathlib.Path) -> None:
    # Empty strings, NUL inside a string and multi-byte characters take the slow decoding path;
    # alignment 64 moves the tensor data.
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_array("test.strings", ["", "a\x00b", "", "東京", "x" * 300, ""])
    writer.add_array("test.plain", ["Ġthe", "he", "x" * 70000])
    writer.add_array("test.empty", [])
    writer.add_array("test.floats", [1.5, -2.25])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_bool("test.bool", True)
    writer.add_int8("test.int8", -3)
    writer.add_uint16("test.uint16", 65535)
    writer.add_int64("test.int64", -(2**40))
    writer.add_uint64("test.uint64", 2**63)
    writer.add_float64("test.float64", 0.1)
    writer.add_string("test.string", "")
    writer.add_tensor("a", np.arange(3, dtype=np.float32))
    writer.add_tensor("b", np.arange(12, dtype=np.float16).reshape(3, 4))
    gguf_files.finish(writer)
    assert_same_as_gguf_py(path)
    ours = GGUFFile(path)
    assert ours.alignment == 64 and ours.tensors["b"].offset % 64 == 0
    assert ours.fields["test.strings"] == ("", "a\x00b", "", "東京", "x" * 300, "")
    assert [item.tolist() for item in ours.fields["test.nested"]] == [[1, 2], [3]]


def _data_end(path: pathlib.Path) -> int:
    """Where the last tensor's data ends (the file may go on with alignment padding)."""
    return max(info.offset + info.n_bytes for info in GGUFFile(path).tensors.values())


def _assert_one_line_error(path: pathlib.Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as error:
        GGUFFile(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message


def test_truncated_anywhere_is_a_one_line_error(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    data = tiny_gguf.read_bytes()
    metadata_end = GGUFFile(tiny_gguf).data_offset
    cuts = sorted({*range(1, metadata_end, 97), metadata_end - 1, _data_end(tiny_gguf) - 1, 0})
    for cut in cuts:
        path = tmp_path / f"cut_{cut}.gguf"
        path.write_bytes(data[:cut])
        _assert_one_line_error(path, "truncated|empty|tensor")


def test_wrong_magic_and_version(tiny_gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + data[4:])
    _assert_one_line_error(path, "bad magic")
    path = tmp_path / "version.gguf"
    path.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    _assert_one_line_error(path, "GGUF version 7 is not supported")
    path = tmp_path / "big_endian.gguf"
    path.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    _assert_one_line_error(path, "big-endian")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"hello", r"bad magic b'hell'"),
        (b"X", r"bad magic b'X'"),
        (b"GG", r"2 bytes, shorter than the 24-byte GGUF header"),
        (b"GGUF\x03\x00", r"6 bytes, shorter than the 24-byte GGUF header \(truncated\?\)"),
        (b"GGUF" + bytes(19), r"23 bytes, shorter than the 24-byte GGUF header"),
    ],
)
def test_a_file_shorter_than_the_header_is_named_for_what_it_is(
    tmp_path: pathlib.Path, content: bytes, message: str
) -> None:
    """Under 24 bytes there is no metadata to be truncated inside: other bytes are not GGUF,
    GGUF's own are a cut-off header."""
    path = tmp_path / "short.gguf"
    path.write_bytes(content)
    _assert_one_line_error(path, f"not a readable GGUF file: {message}")


def test_tensor_data_past_the_end_is_reported(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    data = tiny_gguf.read_bytes()
    path = tmp_path / "short.gguf"
    path.write_bytes(data[: _data_end(tiny_gguf) - 1])
    _assert_one_line_error(path, r"tensor \S+ needs bytes .* \(truncated\?\)")


def test_missing_file_and_directory(tmp_path: pathlib.Path) -> None:
    _assert_one_line_error(tmp_path / "absent.gguf", "no such file")
    _assert_one_line_error(tmp_path, "is a directory")


def test_private_tensor_data_is_copy_on_write(tiny_gguf: pathlib.Path) -> None:
    reader = GGUFFile(tiny_gguf)
    name = "output_norm.weight"
    before = tiny_gguf.read_bytes()
    private = reader.private_tensor_data()[name]
    private[:4] = 0xFF
    assert tiny_gguf.read_bytes() == before
    assert reader.tensor_data(name)[:4].tolist() != [0xFF] * 4
    assert reader.private_tensor_data()[name][:4].tolist() != [0xFF] * 4


def test_gguf_version_1_is_refused(tiny_gguf: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """GGUF v1 used 32-bit string lengths and counts: read with v2's 64-bit layout it would
    be garbage, so it is refused by name, not parsed. Planted: SUPPORTED_VERSIONS with 1."""
    data = tiny_gguf.read_bytes()
    path = tmp_path / "v1.gguf"
    path.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    _assert_one_line_error(path, "GGUF version 1 is not supported")


@pytest.mark.parametrize(
    ("kind", "alignment"),
    [("uint32", 0), ("uint32", 3), ("uint32", 48), ("uint32", 96), ("bool", True)],
)
def test_alignment_that_is_not_a_power_of_two_is_refused(
    tmp_path: pathlib.Path, kind: str, alignment: int
) -> None:
    """general.alignment must be a positive power of two (ggml rounds offsets with a mask);
    any other value is refused with the key and the value. Planted: the power-of-two test
    (`alignment & (alignment - 1)`) dropped, which took 48 and 96 as alignments. Its type is
    uint32: a BOOL true is no alignment of 1 (Python's True is an int, which the check took
    as one until the GGUF parser's mutation sweep found it)."""
    path = tmp_path / "alignment.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    getattr(writer, f"add_{kind}")("general.alignment", alignment)
    gguf_files.finish(writer)
    _assert_one_line_error(path, rf"general\.alignment={alignment} is not a positive power of two")


@pytest.mark.parametrize("last", ["uint32", "strings"])
def test_a_file_without_tensors_ending_at_its_last_value_parses(
    tmp_path: pathlib.Path, last: str
) -> None:
    """A metadata-only GGUF (llama.cpp's vocab-only files hold no tensors) whose last value
    ends on the file's last byte is whole: a read that ends exactly at the end of the file is
    in bounds. Cut anywhere it is truncated, also where no tensor index follows to run into
    the end. Planted: `_advance` refusing `start + n_bytes >= file_size` (a scalar last); the
    vectorized string array's check of its last string against the end dropped."""
    path = tmp_path / "metadata_only.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    if last == "strings":
        writer.add_uint32("llama.block_count", 7)
        writer.add_array("tokenizer.ggml.tokens", ["abc", "def"])
    else:
        writer.add_array("tokenizer.ggml.tokens", ["abc", "def"])
        writer.add_uint32("llama.block_count", 7)
    gguf_files.finish(writer)
    ours = GGUFFile(path)
    assert ours.fields["llama.block_count"] == 7
    assert ours.fields["tokenizer.ggml.tokens"] == ("abc", "def")
    assert ours.tensors == {}
    data = path.read_bytes()
    for cut in range(1, len(data)):
        cut_path = tmp_path / f"cut_{cut}.gguf"
        cut_path.write_bytes(data[:cut])
        _assert_one_line_error(cut_path, "truncated|empty")


def test_rows_that_split_a_quantization_block_are_refused(tmp_path: pathlib.Path) -> None:
    """A tensor's row must hold whole blocks of its type: 16 values per row labelled Q8_0
    (blocks of 32) would be read as half a block, so the index is refused with the tensor,
    its row length and the block. Planted: the row-length check dropped (the tensor then
    "loaded" as 34 bytes, the size of one block)."""
    path = tmp_path / "split_block.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", np.zeros((2, 16), np.float32))
    gguf_files.finish(writer)
    reader = gguf.GGUFReader(path)
    tensor = reader.tensors[0]
    # tensor info: name, n_dims, dims, type (uint32), offset (uint64)
    type_offset = tensor.field.offset + sum(int(p.nbytes) for p in tensor.field.parts[:-2])
    del reader
    data = bytearray(path.read_bytes())
    data[type_offset : type_offset + 4] = int(gguf.GGMLQuantizationType.Q8_0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    _assert_one_line_error(
        path, r"tensor 'w' has 16 values per row, not a multiple of Q8_0's block of 32"
    )


def _write_tensors(path: pathlib.Path, names: list[str]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name in names:
        writer.add_tensor(name, np.zeros(4, np.float32))
    gguf_files.finish(writer)


def test_tensor_names_stay_under_ggml_max_name(tmp_path: pathlib.Path) -> None:
    """ggml keeps a name and its NUL in GGML_MAX_NAME (64) bytes: 63 bytes are read, 64 are
    a damaged length, refused with where the name starts. Planted: `>` for `>=`."""
    path = tmp_path / "name_63.gguf"
    _write_tensors(path, ["x" * 63])
    assert list(GGUFFile(path).tensors) == ["x" * 63]
    path = tmp_path / "name_64.gguf"
    _write_tensors(path, ["x" * 64])
    _assert_one_line_error(path, r"tensor name at byte \d+ is 64 bytes long, ggml allows under 64")


def test_a_tensor_named_twice_in_the_index_is_refused(tmp_path: pathlib.Path) -> None:
    """Two index entries with one name would leave one tensor's data unreachable (the second
    silently wins): refused with the name. Planted: the duplicate check dropped."""
    path = tmp_path / "twice.gguf"
    _write_tensors(path, ["wa", "wb"])
    data = path.read_bytes()
    assert data.count(b"wb") == 1
    path.write_bytes(data.replace(b"wb", b"wa"))
    _assert_one_line_error(path, r"tensor 'wa' appears twice in the index")


@pytest.mark.parametrize("count", [3, 2**40, 2**63])
def test_a_string_array_count_past_the_end_is_truncation(
    tmp_path: pathlib.Path, count: int
) -> None:
    """A string array whose count claims more strings than the rest of the file can hold (each
    takes at least its 8-byte length) is a truncated file, said in one line, however large the
    count: never a MemoryError or OverflowError from making room for them. Planted: the check
    of the count against the bytes left dropped."""
    path = tmp_path / "count.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.strings", ["a", "b"])
    gguf_files.finish(writer)
    data = bytearray(path.read_bytes())
    at = data.index(b"test.strings") + len(b"test.strings") + 8  # past array and item types
    assert int.from_bytes(data[at : at + 8], "little") == 2
    data[at : at + 8] = count.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    _assert_one_line_error(path, "truncated inside the metadata")
