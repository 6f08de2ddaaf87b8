"""gguf-py's `GGUFReader`, four times faster to open: the same code, fields and tensors.

GGUFReader keeps the file as an `np.memmap` and slices it once per part of every field:
about 950k slices for the Llama 3 vocabulary (128256 tokens, 280147 merges). A slice of a
memmap is a memmap, and numpy runs memmap's Python `__getitem__` and `__array_finalize__`
for each one; that is three quarters of the time transformers takes to load a tiny checkpoint
(`load_gguf_checkpoint` opens a GGUFReader), and of every test that reads a file with gguf-py.

`install()` makes GGUFReader map the file as before and keep it as a plain ndarray view of
the same mapped bytes (same dtype and flags, writable in mode "r+"; `flush(reader)` writes
back through the memmap underneath): measured on tiny_llama.gguf on the 2-core Xeon, 9.8 s ->
2.5 s to open (an ndarray subclass keeps half the cost: 4.0 s), every field and tensor equal
(testing/tests/test_gguf_reader.py). Nothing in gguf-py's parsing changes.
"""

from __future__ import annotations

import types

import numpy as np


def _memmap(*args, **kwargs) -> np.ndarray:
    return np.memmap(*args, **kwargs).view(np.ndarray)


def flush(reader) -> None:
    """Write a reader's edits (mode "r+") back to its file, with or without `install()`."""
    data = reader.data
    while data is not None and not isinstance(data, np.memmap):
        data = data.base
    if data is not None:
        data.flush()


def _array_parts(stock):
    """GGUFReader._get_field_parts with arrays of strings and of scalars parsed in one loop
    (gguf-py recurses once per element, and slices the file twice or three times for each:
    three quarters of what was left of opening a file with the Llama 3 vocabulary). The same
    parts, data indices, types and sizes: one (length, bytes) pair per string, one one-element
    view per scalar, in the file's byte order. Nested arrays stay with gguf-py."""
    from gguf.constants import GGUFValueType

    def field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return stock(self, orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, item = int(alen[0]), GGUFValueType(raw_itype[0])
        nptype = self.gguf_scalar_to_np.get(item)
        if count == 0 or (item != GGUFValueType.STRING and nptype is None):
            return stock(self, orig_offs, raw_type)
        offs, data, parts = orig_offs + 12, self.data, [raw_itype, alen]
        if item == GGUFValueType.STRING:
            length = np.dtype(np.uint64).newbyteorder(self.byte_order)
            chars = np.dtype(np.uint8).newbyteorder(self.byte_order)
            for _ in range(count):
                slen = data[offs : offs + 8].view(length)
                size = int(slen[0])
                parts += (slen, data[offs + 8 : offs + 8 + size].view(chars))
                offs += 8 + size
            indices = list(range(3, 2 + 2 * count, 2))
        else:
            dtype = np.dtype(nptype).newbyteorder(self.byte_order)
            block = data[offs : offs + count * dtype.itemsize].view(dtype)
            parts += [block[i : i + 1] for i in range(count)]
            offs += count * dtype.itemsize
            indices = list(range(2, 2 + count))
        return offs - orig_offs, parts, indices, [GGUFValueType.ARRAY, item]

    field_parts.stock = stock
    return field_parts


def install() -> None:
    """Make every GGUFReader opened from now on in this process map its file as a plain
    ndarray and parse its arrays in one loop each (module docstring)."""
    import gguf.gguf_reader

    if getattr(gguf.gguf_reader.np, "memmap", None) is _memmap:
        return
    proxy = types.ModuleType("numpy")  # gguf_reader's `np`: numpy itself but for memmap
    proxy.__dict__.update(np.__dict__)
    proxy.memmap = _memmap
    gguf.gguf_reader.np = proxy
    reader = gguf.gguf_reader.GGUFReader
    reader._get_field_parts = _array_parts(reader._get_field_parts)
