"""Damaged GGUF files: the reader and loader either succeed or raise CheckpointError.

A checkpoint on disk can be truncated (an interrupted copy) or corrupted. The engine promises
one kind of failure for both: `CheckpointError`, one line naming the file. Any other exception
(struct.error, ValueError from numpy, RuntimeError from a reshape, ZeroDivisionError) means the
reader trusted a byte it should have checked, and reading past the end of a memory map is
exactly that kind of exception. A hang is a failure too: every example runs under a 5 s timer.

The file is the committed tiny_llama.gguf (16 MB: 128k-token vocabulary, then 8 MB of F32
weights). Mutations overwrite 1-8 bytes at 1-3 offsets before the tensor data, biased towards
the header, the first bytes of each metadata entry (key length, key, value type, array count,
small values) and the tensor index; truncations cut in the first 4 KiB, in the metadata and
tensor index, or in the tensor data (13 of the 30 drawn cuts, and one explicit example), so
that both the metadata reads' checks and the tensor extents' check are reached.

Deterministic (testing/fuzz.py's settings: `derandomize=True`, no example database). Examples
per test: truncation 30, mutation of the parser 40, mutation of parser + loader 40. A failure
prints `@reproduce_failure(...)` (`print_blob=True`): pasting that decorator onto the test
replays it. The `test_planted_*` tests prove each property can fail: each plants a bug with
monkeypatch and calls the hypothesis test directly, expecting it to raise anything but
CheckpointError (the hang plant: TimeLimitExceeded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import pathlib
import signal
import struct
import textwrap
from collections.abc import Callable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pipelines.llama3 import gguf_file
from pipelines.llama3.gguf_file import CheckpointError, GGUFFile
from pipelines.llama3.gguf_loader import load_weights, read_config
from testing.fuzz import first_failure, fuzz_settings

CHECKPOINT = pathlib.Path("max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf")
TIME_LIMIT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Layout:
    data: bytes
    data_offset: int  # where the tensor data starts
    tensor_index: int  # where the tensor index (after the metadata) starts
    entries: tuple[int, ...]  # where each metadata entry (its key's length) starts


@functools.cache
def layout() -> Layout:
    data = CHECKPOINT.read_bytes()
    reader = GGUFFile(CHECKPOINT)

    def length_prefixed(name: str) -> bytes:
        return struct.pack("<Q", len(name.encode())) + name.encode()

    first_tensor = next(iter(reader.tensors))
    return Layout(
        data=data,
        data_offset=reader.data_offset,
        tensor_index=data.rindex(length_prefixed(first_tensor), 0, reader.data_offset),
        entries=tuple(data.index(length_prefixed(key)) for key in reader.fields),
    )


@st.composite
def metadata_offsets(draw: st.DrawFn) -> int:
    """An offset before the tensor data, biased towards the bytes that steer the parser."""
    lay = layout()
    region = draw(st.sampled_from(["header", "entry", "tensor_index", "anywhere"]))
    if region == "header":
        return draw(st.integers(0, 23))
    if region == "entry":
        return draw(st.sampled_from(lay.entries)) + draw(st.integers(0, 48))
    if region == "tensor_index":
        return draw(st.integers(lay.tensor_index, lay.data_offset - 1))
    return draw(st.integers(0, lay.data_offset - 1))


mutations = st.lists(
    st.tuples(metadata_offsets(), st.binary(min_size=1, max_size=8)), min_size=1, max_size=3
)
# Three ranges, each drawn as often: hypothesis draws an integer of a wide range near its low
# end far more often than uniformly (cuts of 0..len - 1 all fell in the metadata), so the
# tensor data is a range of its own: a cut there leaves the metadata whole and some tensor
# short, which only the tensor-extent check refuses.
truncations = st.one_of(
    st.integers(0, 4096),  # header and the first metadata entries
    st.integers(0, layout().data_offset - 1),  # metadata and tensor index
    st.integers(layout().data_offset, len(layout().data) - 1),  # inside the tensor data
)


class TimeLimitExceeded(Exception):
    """An example ran past TIME_LIMIT_S: the reader loops on damaged input."""


def _on_alarm(signum: int, frame: object) -> None:
    raise TimeLimitExceeded(f"over {TIME_LIMIT_S} s")


@contextlib.contextmanager
def time_limit():
    """Fails the example (TimeLimitExceeded) when it runs past TIME_LIMIT_S."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_file_numbers = itertools.count()


@contextlib.contextmanager
def damaged_copy(tmp_dir: pathlib.Path, data: bytes):
    """A fresh file per example: an earlier reader may still map the previous one."""
    path = tmp_dir / f"damaged_{next(_file_numbers)}.gguf"
    path.write_bytes(data)
    try:
        yield path
    finally:
        path.unlink()


def assert_loads_or_refuses(path: pathlib.Path, load: bool = True) -> None:
    """Parse (and with `load`, read the config and every weight, as from_gguf does): success,
    or a CheckpointError whose message is one line starting with the file's path."""
    try:
        reader = GGUFFile(path)
        if load:
            load_weights(reader, read_config(reader, path), path)
    except CheckpointError as error:
        message = str(error)
        assert message.startswith(f"{path}: "), message
        assert "\n" not in message, message


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("damaged")


def _mutated(changes: list[tuple[int, bytes]]) -> bytes:
    data = bytearray(layout().data)
    for offset, replacement in changes:
        data[offset : offset + len(replacement)] = replacement
    return bytes(data)


@fuzz_settings(30)
@given(length=truncations)
@example(length=layout().data_offset + 100_000)  # inside the tensor data
def test_truncated_file_loads_or_raises_checkpoint_error(tmp_dir: pathlib.Path, length: int):
    with time_limit(), damaged_copy(tmp_dir, layout().data[:length]) as path:
        assert_loads_or_refuses(path)


@fuzz_settings(40)
@given(changes=mutations)
def test_mutated_metadata_parses_or_raises_checkpoint_error(
    tmp_dir: pathlib.Path, changes: list[tuple[int, bytes]]
):
    """The parser alone (header, metadata, tensor index)."""
    with time_limit(), damaged_copy(tmp_dir, _mutated(changes)) as path:
        assert_loads_or_refuses(path, load=False)


def _value_offset(key: str) -> int:
    """Where a scalar metadata value starts: after the key's length, the key and its type."""
    return layout().data.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key) + 4


def _first_dimension_offset(tensor: str) -> int:
    """Where a tensor's first dimension (GGUF's ne[0], a u64) starts in the tensor index:
    after the name's length, the name and the count of dimensions."""
    entry = struct.pack("<Q", len(tensor)) + tensor.encode()
    return layout().data.index(entry) + len(entry) + 4


@fuzz_settings(40)
@given(changes=mutations)
@example(changes=[(_value_offset("llama.attention.head_count"), b"\x00")])
@example(changes=[(_value_offset("llama.attention.head_count_kv"), b"\x00")])
@example(changes=[(_value_offset("llama.block_count") + 3, b"\x10")])
@example(changes=[(7822891, b"\x17")])  # a tensor name length: a 1 MB name
@example(changes=[(_first_dimension_offset("rope_freqs.weight") + 7, b"\x80")])
def test_mutated_metadata_loads_or_raises_checkpoint_error(
    tmp_dir: pathlib.Path, changes: list[tuple[int, bytes]]
):
    """Parser, config and weights: the loader's checks of the values it reads. The examples
    are the bugs this property and an audit found (head_count 0 and head_count_kv 0 divided by
    zero, a huge block_count built names for 268M layers before checking any tensor, a damaged
    tensor-name length put a megabyte of binary with newlines into the error message; a
    dimension of 2**63 and more wrapped the byte count negative in int64, past the end-of-file
    check, into reshape's TypeError)."""
    with time_limit(), damaged_copy(tmp_dir, _mutated(changes)) as path:
        assert_loads_or_refuses(path)


def test_rope_factors_for_another_head_size_are_refused_at_load(tmp_dir: pathlib.Path) -> None:
    """rope_freqs with 4 factors where the head rotates 8 pairs: loaded without a word, the
    first forward raised the rope's RuntimeError (llama.cpp names it: check_tensor_dims)."""
    changes = [(_first_dimension_offset("rope_freqs.weight"), b"\x04")]
    refused = pytest.raises(CheckpointError, match="holds 4 factors; a head of 16 dimensions")
    with damaged_copy(tmp_dir, _mutated(changes)) as path, refused:
        read_config(GGUFFile(path), path)


# -- each property fails on a planted bug --------------------------------------------------


# What each planted bug lets escape instead of a CheckpointError (any exception counted, so a
# plant broken by a refactor, raising AttributeError at its first example, read as caught).
READ_PAST_THE_END = (struct.error, "unpack_from requires a buffer of at least")
UNKNOWN_TYPE = (ValueError, "is not a valid GGUFValueType")
TENSOR_PAST_THE_END = (RuntimeError, r"shape .* is invalid for input of size")


def _fails_without_checkpoint_error(
    monkeypatch: pytest.MonkeyPatch,
    prop: Callable[..., None],
    tmp_dir: pathlib.Path,
    escaping: tuple[type[Exception], str],
) -> None:
    """The property raises the planted bug's own error (`escaping`: its type and message)."""
    expected, match = escaping
    first_failure(
        monkeypatch,
        prop,
        expected=expected,
        unexpected=CheckpointError,
        match=match,
        tmp_dir=tmp_dir,
    )


def test_planted_unchecked_metadata_reads_break_truncation(monkeypatch, tmp_dir):
    """`_advance` without its end-of-file check: reads past the end of the map."""

    def unchecked(self: GGUFFile, n_bytes: int) -> int:
        start = self._pos
        self._pos = start + n_bytes
        return start

    monkeypatch.setattr(GGUFFile, "_advance", unchecked)
    prop = test_truncated_file_loads_or_raises_checkpoint_error
    _fails_without_checkpoint_error(monkeypatch, prop, tmp_dir, READ_PAST_THE_END)


def test_planted_unchecked_tensor_extent_breaks_truncation(monkeypatch, tmp_dir):
    """`_parse` without the check of each tensor's bytes against the end of the file (its
    source edited, every other check kept): a file cut inside the tensor data parses, and
    the loader's view of the missing bytes raises torch's RuntimeError."""
    check = "if info.offset + info.n_bytes > self.file_size:"
    source = textwrap.dedent(inspect.getsource(GGUFFile._parse))
    assert source.count(check) == 1, f"{check!r} is not in GGUFFile._parse once: update the plant"
    namespace = dict(vars(gguf_file))
    exec(compile(source.replace(check, "if False:"), gguf_file.__file__, "exec"), namespace)
    monkeypatch.setattr(GGUFFile, "_parse", namespace["_parse"])
    prop = test_truncated_file_loads_or_raises_checkpoint_error
    _fails_without_checkpoint_error(monkeypatch, prop, tmp_dir, TENSOR_PAST_THE_END)


def test_planted_hang_on_truncation_fails_by_the_timer(monkeypatch, tmp_dir):
    """`_advance` waits for bytes past the end instead of refusing them (a Python loop that
    never ends): the timer raises TimeLimitExceeded in the example, which fails the property.
    The limit is cut to 0.5 s here so that the hang costs half a second, not five."""

    def waiting(self: GGUFFile, n_bytes: int) -> int:
        start = self._pos
        while start + n_bytes > self.file_size:
            pass
        self._pos = start + n_bytes
        return start

    monkeypatch.setitem(globals(), "TIME_LIMIT_S", 0.5)
    monkeypatch.setattr(GGUFFile, "_advance", waiting)
    prop = test_truncated_file_loads_or_raises_checkpoint_error
    escaping = (TimeLimitExceeded, r"^over 0\.5 s$")
    _fails_without_checkpoint_error(monkeypatch, prop, tmp_dir, escaping)


def test_planted_unknown_value_type_breaks_mutation(monkeypatch, tmp_dir):
    """`_value_type` lets GGUFValueType's ValueError for an unknown type id escape."""

    def unchecked(self: GGUFFile) -> gguf_file.GGUFValueType:
        (type_id,) = self._unpack(gguf_file._U32)
        return gguf_file.GGUFValueType(type_id)

    monkeypatch.setattr(GGUFFile, "_value_type", unchecked)
    prop = test_mutated_metadata_parses_or_raises_checkpoint_error
    _fails_without_checkpoint_error(monkeypatch, prop, tmp_dir, UNKNOWN_TYPE)
