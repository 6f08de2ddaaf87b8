"""Profiles of the engine as Chrome trace-event files (Perfetto's UI, chrome://tracing).

`trace(path)` profiles what runs inside it with torch.profiler (every ATen operator on the
CPU; on CUDA its kernels too) and writes the Chrome trace-event JSON to `path` at the end.
The engine names its own parts in that trace with `region(name)`:

    prefill, decode step        Llama3Engine.generate: the prompt's forward; each new token
                                (the decoder's choice and the next forward)
    speculative decode          generate's decode under speculation (drafts and verification)
    verification step           one round of it (speculative.decode): the draft's proposals,
                                the forward that verifies them, the decoder's choices
    serving step                ServingEngine.step: admission, block tables, the decoder...
    serving forward             ...and the step's one forward over every running piece
    q4_gemm, q8_gemm,           the quantized mode's C kernels (packed.py): products,
    swiglu_rows,                SwiGLU, one-position attention, and one decode step
    decode_attention[_paged],   through every layer (a serving step of decode rows: the
    packed_decode_layers        _paged one)
    [_paged]
    ggml_gemm, ggml_attention,  the ggml mode's C kernels (ggml_mode.py); the last are one
    ggml_swiglu_rows,           decode step through every layer, and a serving step's
    ggml_decode_layers          decode rows through every layer
    ggml_decode_paged

so that time spent in a C kernel (which torch.profiler does not see: ctypes calls) is
attributed, and a serving step's scheduler cost is its range less its forward's.

While no trace is being taken a region is a shared no-op context: about 0.4 us a `with`
(measured on the Intel Xeon), so the ~150 kernel calls of a quantized SmolLM2 step decoded
module by module (a serving step's) pay about 60 us of its ~15 ms (0.4%); torch's
record_function costs tens of times that per call even with no profiler listening (15 us
measured here, beside a busy core).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
from collections.abc import Iterator

import torch

_NO_OP = contextlib.nullcontext()
_taking: Trace | None = None  # the trace being taken: one at a time (see `trace`)


def region(name: str):
    """A named range in the trace being taken; a no-op context when none is."""
    return torch.profiler.record_function(name) if _taking is not None else _NO_OP


class TraceError(ValueError):
    """A trace that cannot be taken (another is being taken) or written where asked."""


def check_writable(path: str | os.PathLike) -> pathlib.Path:
    """`path` as a file a trace can be written to, or TraceError saying why not (before any
    work is done: a profile asked for is not lost at the end of a long run)."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise TraceError(f"{path} is a folder; name a file, e.g. {path / 'trace.json'}")
    if path.parent.exists() and not path.parent.is_dir():
        raise TraceError(f"{path.parent} is a file, not a folder; name a file in a folder")
    if not path.parent.is_dir():
        raise TraceError(f"{path.parent} does not exist; create it or name a file in another")
    if not os.access(path.parent, os.W_OK):
        raise TraceError(f"{path.parent} is not writable")
    return path


def trace_file(value: str | os.PathLike) -> pathlib.Path:
    """argparse `type=` of a `--profile FILE` option: the file checked when the command line
    is read, so a bad one exits 2 ("argument --profile: PATH: why") before any work."""
    try:
        return check_writable(value)
    except TraceError as error:
        raise argparse.ArgumentTypeError(f"{value}: {error}") from None


@dataclasses.dataclass
class Trace:
    """A trace being taken: where it goes and, once written, how many events it holds."""

    path: pathlib.Path
    events: int = 0


@contextlib.contextmanager
def trace(path: str | os.PathLike) -> Iterator[Trace]:
    """Profile the block; write its Chrome trace-event file to `path` (through a temporary
    file beside it, renamed into place: a trace is whole or absent) and count its events
    into the Trace it yields. When the export or the count fails (a full disk, a file that
    does not parse), the temporary file is removed, an older file at `path` is left as it
    was, and the error propagates.

    One trace at a time: a trace inside another raises TraceError before profiling starts
    (torch.profiler sessions do not nest: the inner one's end stops the outer's, whose own
    end then crashed the process with a segmentation fault, its file never written)."""
    global _taking
    if _taking is not None:
        raise TraceError(
            f"cannot trace to {path} while the trace to {_taking.path} is being taken; "
            "traces do not nest: end that one first"
        )
    taken = Trace(check_writable(path))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        _taking = taken
        try:
            yield taken
        finally:
            _taking = None
    partial = taken.path.with_name(f".{taken.path.name}.partial")
    try:
        profile.export_chrome_trace(str(partial))
        taken.events = len(events(partial))
        os.replace(partial, taken.path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed export (a full disk) leaves no fragment
        raise


def events(path: str | os.PathLike) -> list[dict]:
    """The trace-event records of a trace file (its `traceEvents`)."""
    with open(path, encoding="utf-8") as file:
        document = json.load(file)
    return document["traceEvents"] if isinstance(document, dict) else document


__all__ = ["Trace", "TraceError", "check_writable", "events", "region", "trace", "trace_file"]
