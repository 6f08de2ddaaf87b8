"""A fast, read-only GGUF parser over one memory map (GGUF v2 and v3, little-endian).

gguf-py's `GGUFReader` builds a numpy view per array element, which takes seconds for a
128k-token vocabulary with 280k merges. This parser reads the header, metadata and tensor
index with `struct` and numpy over an `mmap` instead:

- numeric arrays are zero-copy, read-only `np.frombuffer` views into the map;
- string arrays are decoded in one pass (one UTF-8 decode of the whole array) into a tuple;
- tensor data is a zero-copy, read-only uint8 view; `private_tensor_data` maps the file
  copy-on-write, so a caller may write into its weights without touching the file or any
  other reader's view.

Type ids and block sizes come from gguf-py's constants; only the wire layout lives here.
"""

import dataclasses
import math
import mmap
import os
import pathlib
import struct
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths and counts; nobody writes it any more
ALIGNMENT_KEY = "general.alignment"

# Fixed-size GGUF value types: struct format (little-endian) and numpy dtype of one element.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_STRUCTS = {kind: struct.Struct(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_NUMPY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<IIQQ")  # magic, version, tensor count, metadata count


GGML_MAX_NAME = 64  # ggml.h: a tensor name and its terminating NUL fit in 64 bytes


class CheckpointError(ValueError):
    """A checkpoint file this engine cannot use; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = pathlib.Path(path)
        self.problem = problem


class _Truncated(Exception):
    """Internal: a read ran past the end of the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, slowest dimension first (GGUF's ne reversed)
    tensor_type: GGMLQuantizationType
    offset: int  # absolute byte position of the data in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def tensor_nbytes(shape: tuple[int, ...], tensor_type: GGMLQuantizationType) -> int:
    """Bytes a tensor of `shape` (numpy order) takes in `tensor_type`: in Python integers, so
    a damaged dimension makes a huge count (past the file's end, refused) and never one that
    wrapped around 64 bits to a small or negative one."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    return math.prod(int(d) for d in shape) // block_size * type_size


class GGUFFile:
    """A parsed GGUF file: `fields` (metadata), `tensors` (index) and views of tensor data.

    Everything it returns is read-only (tuples, read-only arrays, a mapping proxy), so one
    parsed file can be shared by every engine of a process.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as file:
                self.file_size = os.fstat(file.fileno()).st_size
                if self.file_size == 0:
                    raise CheckpointError(self.path, "not a readable GGUF file: it is empty")
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CheckpointError(self.path, "no such file") from None
        except IsADirectoryError:
            raise CheckpointError(self.path, "is a directory, not a GGUF file") from None
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._parse()
        except _Truncated:
            raise CheckpointError(
                self.path, "not a readable GGUF file: truncated inside the metadata"
            ) from None

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._map
        self._pos = 0
        if self.file_size < _HEADER.size:
            # Too short for the header (magic, version and two counts, 24 bytes): say whether
            # even the bytes there are not GGUF's, rather than "inside the metadata".
            head = bytes(buf[:4])
            if head != GGUF_MAGIC.to_bytes(4, "little")[: len(head)]:
                raise CheckpointError(self.path, f"not a readable GGUF file: bad magic {head!r}")
            raise CheckpointError(
                self.path,
                f"not a readable GGUF file: {self.file_size} bytes, shorter than the "
                f"{_HEADER.size}-byte GGUF header (truncated?)",
            )
        magic, version, n_tensors, n_fields = self._unpack(_HEADER)
        if magic != GGUF_MAGIC:
            raise CheckpointError(
                self.path, f"not a readable GGUF file: bad magic {bytes(buf[:4])!r}"
            )
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            problem = (
                "big-endian GGUF is not supported"
                if swapped in SUPPORTED_VERSIONS
                else f"GGUF version {version} is not supported (versions 2 and 3 are)"
            )
            raise CheckpointError(self.path, problem)
        self.version = version
        # Each metadata entry and tensor info takes well over 8 bytes: larger counts are damage.
        if n_fields > self.file_size // 8 or n_tensors > self.file_size // 8:
            raise CheckpointError(
                self.path,
                f"not a readable GGUF file: header claims {n_fields} metadata entries and "
                f"{n_tensors} tensors in {self.file_size} bytes (corrupted?)",
            )

        fields: dict[str, object] = {}
        field_types: dict[str, tuple[GGUFValueType, ...]] = {}
        for _ in range(n_fields):
            key = self._string()
            kind = self._value_type()
            fields[key], field_types[key] = self._value(kind, key)
        self.fields: Mapping[str, object] = MappingProxyType(fields)
        self.field_types: Mapping[str, tuple[GGUFValueType, ...]] = MappingProxyType(field_types)

        alignment = fields.get(ALIGNMENT_KEY, GGUF_DEFAULT_ALIGNMENT)
        # a bool is an int to Python: True would align to 1 (the spec's type is uint32)
        integer = isinstance(alignment, int) and not isinstance(alignment, bool)
        if not integer or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(
                self.path, f"{ALIGNMENT_KEY}={alignment!r} is not a positive power of two"
            )
        self.alignment = alignment

        raw_tensors = []
        for _ in range(n_tensors):
            name = self._tensor_name()
            (n_dims,) = self._unpack(_U32)
            if n_dims > 8:
                raise CheckpointError(
                    self.path, f"tensor {name!r} claims {n_dims} dimensions (corrupted?)"
                )
            ne = struct.unpack_from(f"<{n_dims}Q", buf, self._advance(8 * n_dims))
            type_id, relative_offset = self._unpack(struct.Struct("<IQ"))
            raw_tensors.append((name, tuple(reversed(ne)), type_id, relative_offset))
        self.data_offset = -(-self._pos // alignment) * alignment

        tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, relative_offset in raw_tensors:
            try:
                tensor_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise CheckpointError(
                    self.path, f"tensor {name!r} has unknown type id {type_id}"
                ) from None
            block_size, _ = GGML_QUANT_SIZES[tensor_type]
            if shape and shape[-1] % block_size:
                raise CheckpointError(
                    self.path,
                    f"tensor {name!r} has {shape[-1]} values per row, not a multiple of "
                    f"{tensor_type.name}'s block of {block_size}",
                )
            info = TensorInfo(
                name=name,
                shape=shape,
                tensor_type=tensor_type,
                offset=self.data_offset + relative_offset,
                n_bytes=tensor_nbytes(shape, tensor_type),
            )
            if info.offset + info.n_bytes > self.file_size:
                raise CheckpointError(
                    self.path,
                    f"tensor {name!r} needs bytes {info.offset}..{info.offset + info.n_bytes}, "
                    f"file has {self.file_size} (truncated?)",
                )
            if name in tensors:
                raise CheckpointError(self.path, f"tensor {name!r} appears twice in the index")
            tensors[name] = info
        self.tensors: Mapping[str, TensorInfo] = MappingProxyType(tensors)

    def _advance(self, n_bytes: int) -> int:
        start = self._pos
        if n_bytes < 0 or start + n_bytes > self.file_size:
            raise _Truncated
        self._pos = start + n_bytes
        return start

    def _unpack(self, layout: struct.Struct) -> tuple:
        return layout.unpack_from(self._map, self._advance(layout.size))

    def _string(self) -> str:
        (length,) = self._unpack(_U64)
        start = self._advance(length)
        return self._map[start : start + length].decode("utf-8", errors="replace")

    def _tensor_name(self) -> str:
        """A tensor's name; ggml keeps names under GGML_MAX_NAME bytes, so a longer one is a
        damaged length field (and would make every later message a megabyte of binary)."""
        start = self._pos
        name = self._string()
        if len(name.encode()) >= GGML_MAX_NAME:
            raise CheckpointError(
                self.path,
                f"tensor name at byte {start} is {self._pos - start - 8} bytes long, ggml allows "
                f"under {GGML_MAX_NAME} (corrupted?)",
            )
        return name

    def _value_type(self) -> GGUFValueType:
        (type_id,) = self._unpack(_U32)
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise CheckpointError(
                self.path, f"not a readable GGUF file: unknown value type {type_id} (corrupted?)"
            ) from None

    def _value(self, kind: GGUFValueType, key: str) -> tuple[object, tuple[GGUFValueType, ...]]:
        """One metadata value and its type chain ([ARRAY, item type] for arrays)."""
        if kind == GGUFValueType.STRING:
            return self._string(), (kind,)
        if kind != GGUFValueType.ARRAY:
            (value,) = self._unpack(_SCALAR_STRUCTS[kind])
            return value, (kind,)
        item_kind = self._value_type()
        (count,) = self._unpack(_U64)
        if item_kind in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[item_kind]
            start = self._advance(count * dtype.itemsize)
            return np.frombuffer(self._map, dtype, count, start), (kind, item_kind)
        if item_kind == GGUFValueType.STRING:
            return self._string_array(count), (kind, item_kind)
        # Arrays of arrays: rare (no llama key uses them); parsed element by element.
        items, item_types = [], (item_kind,)
        for _ in range(count):
            value, item_types = self._value(item_kind, key)
            items.append(value)
        return tuple(items), (kind, *item_types)

    def _string_array(self, count: int) -> tuple[str, ...]:
        """`count` length-prefixed strings, decoded with one UTF-8 decode of the whole array."""
        if count > (self.file_size - self._pos) // 8:
            raise _Truncated
        begin = self._pos
        prefixes = self._string_prefixes(begin, count)
        if prefixes is None:
            prefixes = self._walk_string_prefixes(begin, count)
        if count == 0:
            return ()
        last = int(prefixes[-1])
        self._pos = end = last + 8 + _U64.unpack_from(self._map, last)[0]
        # Delete the first 7 bytes of each 8-byte length prefix; the 8th, the length's top
        # byte, is NUL (no string is 2**56 bytes long) and separates the strings.
        region = self._bytes[begin:end]
        keep = np.ones(len(region), dtype=bool)
        keep[(prefixes[:, None] - begin + np.arange(7)).ravel()] = False
        try:
            strings = region[keep].tobytes().decode("utf-8").split("\x00")
        except UnicodeDecodeError:
            strings = []
        if len(strings) == count + 1:
            return tuple(strings[1:])
        # A string holds NUL or is not valid UTF-8: decode one by one, replacing bad bytes.
        return tuple(
            self._map[start + 8 : start + 8 + _U64.unpack_from(self._map, start)[0]].decode(
                "utf-8", errors="replace"
            )
            for start in prefixes.tolist()
        )

    def _walk_string_prefixes(self, begin: int, count: int) -> np.ndarray:
        """Positions of the `count` length prefixes, following them one by one."""
        buf, unpack_length, pos = self._map, _U64.unpack_from, begin
        prefixes = [0] * count
        for i in range(count):
            if pos + 8 > self.file_size:
                raise _Truncated
            prefixes[i] = pos
            pos += 8 + unpack_length(buf, pos)[0]
        if pos > self.file_size:
            raise _Truncated
        return np.asarray(prefixes, dtype=np.int64)

    def _string_prefixes(self, begin: int, count: int) -> np.ndarray | None:
        """Positions of the `count` length prefixes found without a Python loop, or None.

        A prefix of a non-empty string shorter than 16 MiB ends in a run of at least five
        zero bytes followed by the string's first byte, which is not zero in any real
        vocabulary. Every such run end in a window is a candidate; the first `count` are
        accepted only if each one's length leads exactly to the next, which proves them right
        by induction from `begin`. Anything unusual (empty or NUL-holding strings) returns
        None and the caller walks the prefixes instead.
        """
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        window = 32 * count
        while True:
            stop = min(begin + window, self.file_size)
            is_zero = self._bytes[begin:stop] == 0
            run_ends = np.flatnonzero(is_zero[:-1] & ~is_zero[1:])
            run_ends = run_ends[run_ends >= 7]
            long_run = np.ones(len(run_ends), dtype=bool)
            for back in range(1, 5):
                long_run &= is_zero[run_ends - back]
            candidates = run_ends[long_run] - 7 + begin
            if len(candidates) >= count or stop == self.file_size:
                break
            window *= 2
        if len(candidates) < count or candidates[0] != begin:
            return None
        candidates = candidates[:count]
        lengths = self._bytes[candidates[:, None] + np.arange(8)].view("<u8").ravel()
        if not np.array_equal(candidates[1:], candidates[:-1] + 8 + lengths[:-1].astype(np.int64)):
            return None
        if int(candidates[-1]) + 8 + int(lengths[-1]) > self.file_size:
            raise _Truncated
        return candidates

    # -- access ----------------------------------------------------------------------------

    def get(self, key: str, default: object = None) -> object:
        return self.fields.get(key, default)

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name`: a read-only uint8 view into the shared map."""
        info = self.tensors[name]
        return self._bytes[info.offset : info.offset + info.n_bytes]

    def private_tensor_data(self) -> dict[str, np.ndarray]:
        """Writable uint8 views of every tensor over a fresh copy-on-write map of the file.

        Pages are shared with the OS page cache until written: a caller that changes a weight
        gets its own copy of that page, and the file and other readers never see the change.
        """
        with open(self.path, "rb") as file:
            private = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(private) != self.file_size:
            raise CheckpointError(self.path, "changed size while being read")
        data = np.frombuffer(private, dtype=np.uint8)
        return {
            name: data[info.offset : info.offset + info.n_bytes]
            for name, info in self.tensors.items()
        }
