"""Profiles as Chrome trace-event files (pipelines/llama3/profiling.py, `generate --profile`).

A trace must hold what a person opens it for: the prefill and every decode step as ranges,
the C kernels of the quantized and ggml modes (which torch.profiler alone does not see:
ctypes calls) inside those steps, and for the serving engine each scheduler step with its
forward inside. Every event must be one a trace viewer takes (the Trace Event Format: a name,
a phase, a timestamp, a process and a thread; a complete event's duration), and the file must
parse in a browser's JSON parser, which is stricter than Python's (no NaN, no Infinity): the
one Perfetto's UI and chrome://tracing both run. That browser check is headless chromium
(the golden report's browser test's), skipping without it unless CI_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import contextlib
import errno
import html
import json
import os
import pathlib
import re
import shutil
import subprocess

import gguf
import pytest
import torch

from pipelines.llama3 import Llama3Engine, generate, profiling, server
from pipelines.llama3.serving import Request, ServingEngine
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

NEW_TOKENS = 5
WEIGHT_TYPES = {
    "eager": gguf.GGMLQuantizationType.F32,
    "quantized": gguf.GGMLQuantizationType.Q4_0,
    "ggml": gguf.GGMLQuantizationType.Q4_0,
}
# What each mode's decode steps must contain (the C kernels by their region names).
KERNELS = {
    "eager": ("aten::linear",),
    "quantized": ("packed_decode_layers",),
    "ggml": ("ggml_decode_layers",),
}
# The quantized mode's kernels a verification forward (several rows at once) may call.
SPECULATIVE_KERNELS = ("q4_gemm", "swiglu_rows", "packed_decode_layers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("profiling")
    files = {}
    for mode, weight_type in WEIGHT_TYPES.items():
        files[mode] = folder / f"tiny_{weight_type.name}.gguf"
        if not files[mode].exists():
            write_tiny_llama(files[mode], dim=64, weight_type=weight_type)
    return files


# A range as the trace records it: (pid, tid, start, end), times in microseconds.
Range = tuple[object, object, float, float]


def _ranges(events: list[dict], name: str) -> list[Range]:
    return [
        (e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == name
    ]


def _inside(inner: Range, outers: list[Range]) -> bool:
    """`inner` lies within one of `outers` on the same thread of the same process: a range on
    another thread is not inside a step, whatever its times (a viewer draws it elsewhere)."""
    pid, tid, start, end = inner
    return any(
        (pid, tid) == (o_pid, o_tid) and o_start <= start and end <= o_end
        for o_pid, o_tid, o_start, o_end in outers
    )


def check_trace_events(events: list[dict]) -> None:
    """The Trace Event Format's rules a viewer needs, for every event."""
    assert events, "a trace without events"
    for event in events:
        assert isinstance(event.get("name"), str) and isinstance(event.get("ph"), str), event
        if event["ph"] == "M":  # metadata: process and thread names
            continue
        assert isinstance(event.get("ts"), (int, float)), event
        assert "pid" in event and "tid" in event, event
        if event["ph"] == "X":
            assert isinstance(event.get("dur"), (int, float)) and event["dur"] >= 0, event


@pytest.mark.parametrize("mode", list(WEIGHT_TYPES))
def test_generate_profile_holds_the_prefill_each_decode_step_and_the_kernels(
    mode, checkpoints, tmp_path, capsys
) -> None:
    trace = tmp_path / "trace.json"
    argv = [f"--gguf={checkpoints[mode]}", "--prompt=the cap", f"--mode={mode}"]
    argv += [f"--max-new-tokens={NEW_TOKENS}", f"--profile={trace}"]
    assert generate.main(argv) == 0
    assert f"profile: {trace}" in capsys.readouterr().out
    check_generate_trace(profiling.events(trace), mode)


def check_generate_trace(events: list[dict], mode: str) -> None:
    """A generate trace: one prefill, a range per decode step, each kernel call inside one."""
    check_trace_events(events)
    prefill, steps = _ranges(events, "prefill"), _ranges(events, "decode step")
    assert len(prefill) == 1
    assert len(steps) == NEW_TOKENS
    for kernel in KERNELS[mode]:
        calls = _ranges(events, kernel)
        assert calls, f"{mode}: no {kernel!r} in the trace"
        assert all(_inside(call, prefill + steps) for call in calls), kernel
        assert any(_inside(call, steps) for call in calls), f"{kernel}: in no decode step"


def _drop_a_decode_step(monkeypatch) -> None:
    """The third decode step records no range (its kernel calls then lie in no step)."""
    real, seen = profiling.region, []

    def region(name: str):
        if name == "decode step":
            seen.append(name)
            if len(seen) == 3:
                return contextlib.nullcontext()
        return real(name)

    monkeypatch.setattr(profiling, "region", region)


def _close_each_step_before_its_forward(monkeypatch) -> None:
    """Each decode step's range closes as it opens: the step's kernel calls come after it."""
    real = profiling.region

    @contextlib.contextmanager
    def closed_at_once(name: str):
        with real(name):
            pass
        yield

    def region(name: str):
        return closed_at_once(name) if name == "decode step" else real(name)

    monkeypatch.setattr(profiling, "region", region)


def _record_the_kernel_on_another_thread(monkeypatch) -> None:
    """The decode kernel's calls recorded on another thread at the same times: inside their
    steps by the clock, outside them by thread. (torch.profiler did not record a range opened
    on a thread started during the trace, so the plant moves the recorded events instead.)"""
    real, kernel = profiling.events, KERNELS["quantized"][0]

    def events(path):
        return [{**e, "tid": e["tid"] + 1} if e.get("name") == kernel else e for e in real(path)]

    monkeypatch.setattr(profiling, "events", events)


@pytest.mark.parametrize(
    "plant",
    [
        _drop_a_decode_step,
        _close_each_step_before_its_forward,
        _record_the_kernel_on_another_thread,
    ],
)
def test_the_generate_trace_check_fails_on_a_planted_profiling_bug(
    plant, monkeypatch, checkpoints, tmp_path, capsys
) -> None:
    """check_generate_trace catches a step left out and kernel calls outside their steps, by
    the clock or by thread (the nesting check compared times across threads)."""
    plant(monkeypatch)
    trace = tmp_path / "trace.json"
    argv = [f"--gguf={checkpoints['quantized']}", "--prompt=the cap", "--mode=quantized"]
    assert generate.main([*argv, f"--max-new-tokens={NEW_TOKENS}", f"--profile={trace}"]) == 0
    capsys.readouterr()
    with pytest.raises(AssertionError):
        check_generate_trace(profiling.events(trace), "quantized")


def test_speculative_generate_profiles_one_range_per_verification_forward(
    checkpoints, tmp_path, capsys
) -> None:
    """Under --speculate the decode is a run of verification steps (the draft's proposals, the
    forward that verifies them, the decoder's choices): one range each, as many as the forwards
    the speculation summary counts, inside the speculative decode; every kernel call, the
    draft's (a 1-layer self draft) among them, inside the prefill or a step. (The whole decode
    was one range with no step inside it.)"""
    trace = tmp_path / "trace.json"
    argv = [f"--gguf={checkpoints['quantized']}", "--prompt=the cap", "--mode=quantized"]
    argv += ["--max-new-tokens=12", "--speculate=4", "--draft-layers=1", f"--profile={trace}"]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    summary = re.search(r"(\d+) verification forwards, (\d+)/\d+ proposals accepted", out)
    assert summary and int(summary[2]) > 0, f"no accepted proposal to verify: {out}"
    events = profiling.events(trace)
    check_trace_events(events)
    prefill, steps = _ranges(events, "prefill"), _ranges(events, "verification step")
    assert len(prefill) == 1 and len(steps) == int(summary[1]) > 0
    assert _ranges(events, "decode step") == []
    decode = _ranges(events, "speculative decode")
    assert len(decode) == 1 and all(_inside(step, decode) for step in steps)
    calls = [c for kernel in SPECULATIVE_KERNELS for c in _ranges(events, kernel)]
    assert calls and all(_inside(call, prefill + steps) for call in calls)
    assert any(_inside(call, steps) for call in calls), "no kernel call in a verification step"


def test_the_serving_engine_traces_each_scheduler_step_with_its_forward(checkpoints, tmp_path):
    engine = Llama3Engine.from_gguf(checkpoints["quantized"], mode="quantized")
    serving = ServingEngine(engine, block_size=4)
    requests = [Request(f"r{i}", [1, 2, 3 + i, 4], max_new_tokens=3 + i) for i in range(3)]
    trace = tmp_path / "serving.json"
    with profiling.trace(trace):
        serving.serve(requests)
    events = profiling.events(trace)
    check_trace_events(events)
    steps, forwards = _ranges(events, "serving step"), _ranges(events, "serving forward")
    assert len(steps) == 3 + 2  # prefill with the first token, then decode to the longest
    assert len(forwards) == len(steps)
    assert all(_inside(forward, steps) for forward in forwards)
    assert all(_inside(call, forwards) for call in _ranges(events, "q4_gemm"))


def test_without_a_trace_a_region_records_nothing(checkpoints, tmp_path) -> None:
    """Outside `trace`, a region is the shared no-op context (no record_function per kernel
    call on the hot path); inside, a range of its own."""
    assert profiling.region("q4_gemm") is profiling.region("decode step")
    with profiling.trace(tmp_path / "t.json"):
        assert profiling.region("q4_gemm") is not profiling.region("decode step")
    assert profiling.region("q4_gemm") is profiling.region("decode step")


def test_a_trace_inside_another_raises_and_the_outer_trace_is_written(tmp_path) -> None:
    """torch.profiler sessions do not nest: a trace inside another is refused, one line, before
    it starts, and the outer one goes on recording (the inner trace was written, then the
    process died of a segmentation fault, the outer trace lost)."""
    outer, inner = tmp_path / "outer.json", tmp_path / "inner.json"
    with profiling.trace(outer) as taken:
        with pytest.raises(profiling.TraceError) as refused, profiling.trace(inner):
            pytest.fail("the nested trace ran its block")
        with profiling.region("after the refusal"):
            pass
    message = str(refused.value)
    assert "do not nest" in message and str(outer) in message and "\n" not in message
    assert not inner.exists()
    events = profiling.events(outer)
    assert taken.events == len(events) and _ranges(events, "after the refusal")
    with profiling.trace(inner):  # the refusal leaves nothing behind: the next trace runs
        pass
    assert profiling.events(inner)


def _export_a_fragment_then_fill_the_disk(self, path) -> None:
    pathlib.Path(path).write_text('{"traceEvents": [{"name": "x"')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _export_a_fragment(self, path) -> None:  # "succeeds", but the file does not parse
    pathlib.Path(path).write_text('{"traceEvents": [{"name": "x"')


@pytest.mark.parametrize("older", [False, True], ids=["no-older-file", "older-file"])
@pytest.mark.parametrize(
    "export, error",
    [(_export_a_fragment_then_fill_the_disk, OSError), (_export_a_fragment, ValueError)],
    ids=["disk-full", "unparsable"],
)
def test_a_failed_export_leaves_the_path_as_it_was_and_no_fragment(
    export, error, older, tmp_path, monkeypatch
) -> None:
    """A trace is written whole or not at all: when the export fails (a full disk) or its file
    does not parse, the error propagates, an older file at the path keeps its bytes (or no
    file appears) and the temporary file beside it is removed. Planted: the export straight
    to the path left the fragment there; the temporary file not removed was left behind."""
    path = tmp_path / "t.json"
    if older:
        path.write_text('{"traceEvents": []}')
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    with pytest.raises(error), profiling.trace(path):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == (["t.json"] if older else [])
    if older:
        assert path.read_text() == '{"traceEvents": []}'


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_negative_thread_count_exits_2_before_loading(command, capsys) -> None:
    main, argv = (generate.main, ["--prompt=x"]) if command == "generate" else (server.main, [])
    with pytest.raises(SystemExit) as exit_:
        main(["--gguf=/nonexistent.gguf", *argv, "--threads=-1"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "--threads=-1" in error and "loading" not in error


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta"])
def test_a_device_torch_cannot_run_exits_2_before_loading(device, capsys) -> None:
    """--device=tpu was a traceback (rc 1) from inside the load."""
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--gguf=/nonexistent.gguf", "--prompt=x", f"--device={device}"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"--device={device} is not a device here" in error and "loading" not in error


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("missing/trace.json", "missing does not exist"),
        (".", "is a folder"),
        ("afile/trace.json", "afile is a file, not a folder"),
    ],
)
def test_a_profile_that_cannot_be_written_exits_2_before_loading(
    where, message, tmp_path, capsys
) -> None:
    (tmp_path / "afile").write_text("")
    target = tmp_path / where
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--gguf=/nonexistent.gguf", "--prompt=x", f"--profile={target}"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --profile: {target}: " in error and message in error
    assert "loading" not in error  # refused before the checkpoint is read


REQUIRE_ENV = "CI_REQUIRE_BROWSER"
INSTALL = "tools/chromium/install.sh (as root; it runs: apt-get install -y chromium)"


def _browser_verdict(chromium: str, text: str, work: pathlib.Path) -> str:
    """What the browser's JSON.parse makes of a trace file's text: the page parses it and
    writes the count of events and the engine's ranges it found into the DOM, which headless
    chromium dumps."""
    script = """
      let verdict;
      try {
        const trace = JSON.parse(document.getElementById('trace').textContent);
        const events = Array.isArray(trace) ? trace : trace.traceEvents;
        const names = new Set(events.map(e => e.name));
        verdict = 'parsed ' + events.length + ' events; ' +
          ['prefill', 'decode step', 'q4_gemm'].filter(n => names.has(n)).join(',');
      } catch (error) { verdict = 'error: ' + error.message; }
      document.getElementById('verdict').textContent = verdict;
    """
    # A script element's text is not HTML-decoded: only "</" must not appear in it ("<\\/" is
    # JSON's own escape of the same characters).
    payload = text.replace("</", "<\\/")
    page = work / "page.html"
    page.write_text(
        "<!doctype html><html><body>"
        f'<script type="application/json" id="trace">{payload}</script>'
        f'<p id="verdict">not run</p><script>{script}</script></body></html>'
    )
    command = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu"]
    command += ["--disable-dev-shm-usage", f"--user-data-dir={work / 'profile'}"]
    done = subprocess.run(
        [*command, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(work)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start = done.stdout.index('<p id="verdict">') + len('<p id="verdict">')
    return html.unescape(done.stdout[start : done.stdout.index("</p>", start)])


def test_the_trace_parses_in_a_browser(checkpoints, tmp_path) -> None:
    """A generate trace parses in the browser, all its events and ranges there; the same trace
    with one NaN duration (which Python's json writes and reads) does not."""
    chromium = shutil.which("chromium")
    if chromium is None:
        message = f"chromium is not installed; install it with {INSTALL}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} (${REQUIRE_ENV}=1: the browser tests must run)")
        pytest.skip(message)
    trace = tmp_path / "trace.json"
    argv = [f"--gguf={checkpoints['quantized']}", "--prompt=the", "--mode=quantized"]
    assert generate.main([*argv, "--max-new-tokens=2", f"--profile={trace}"]) == 0
    events = profiling.events(trace)
    verdict = _browser_verdict(chromium, trace.read_text(), tmp_path)
    assert verdict == f"parsed {len(events)} events; prefill,decode step,q4_gemm"
    planted = [{**events[-1], "dur": float("nan")}, *events[:-1]]
    planted_text = json.dumps({"traceEvents": planted})
    assert len(json.loads(planted_text)["traceEvents"]) == len(events)  # Python's json takes it
    assert _browser_verdict(chromium, planted_text, tmp_path).startswith("error: ")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-new-tokens=0"], "--max-new-tokens=0 must be at least 1"),
        (["--seed=3"], "--seed sample: give --temperature too"),
        (["--draft-layers=0"], "--draft-layers drafts for speculative decoding: give --speculate"),
    ],
)
def test_bad_generate_options_exit_2_naming_the_option_before_loading(
    options, message, capsys
) -> None:
    """Options the command cannot honour are refused by the parser (exit 2, the option named)
    before the checkpoint is read. Planted: --max-new-tokens checked as `< 0`, --seed dropped
    from the sampler flags that need --temperature, the --draft-layers-without---speculate
    check removed: each reached the load (here a missing file: a returned 2, no SystemExit;
    with a real checkpoint a silently ignored seed, or a TypeError traceback, exit 1)."""
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--gguf=/nonexistent.gguf", "--prompt=x", *options])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "loading" not in error, error


def test_a_checkpoint_that_cannot_be_read_exits_2_naming_it(tmp_path, capsys) -> None:
    """A --gguf that is not there is bad input: exit 2 and one error line naming the file
    (exit 1 would read as a crash). Planted: the CheckpointError branch returning 1."""
    missing = tmp_path / "missing.gguf"
    assert generate.main([f"--gguf={missing}", "--prompt=x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: {missing}: no such file" in captured.err


def test_a_folder_it_cannot_write_in_exits_2_before_loading(tmp_path, capsys, monkeypatch):
    """README's profiling_test row: an unwritable --profile exits 2 before the checkpoint loads,
    and check_writable says the folder is not writable (the other cases here are a missing
    folder, a folder given as the file, a file given as the folder). As root a read-only mode
    does not stop a write, so there os.access is told the folder is read-only. Planted: the
    os.access check dropped (the profile asked for is then lost at the end of the run)."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    if os.access(folder, os.W_OK):  # root: its writes ignore the mode
        real = os.access

        def access(path, mode, *args, **kwargs):
            if pathlib.Path(path) == folder and mode & os.W_OK:
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    target = folder / "trace.json"
    with pytest.raises(profiling.TraceError, match="is not writable"):
        profiling.check_writable(target)
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--gguf=/nonexistent.gguf", "--prompt=x", f"--profile={target}"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --profile: {target}: {folder} is not writable" in error
    assert "loading" not in error


def _raise_in_the_block(monkeypatch) -> None:
    pass


def _profiler_that_cannot_start(monkeypatch) -> None:
    def refuse(self):
        raise RuntimeError("the profiler cannot start")

    monkeypatch.setattr(torch.profiler.profile, "__enter__", refuse)


@pytest.mark.parametrize("failure", [_raise_in_the_block, _profiler_that_cannot_start])
def test_a_trace_that_fails_leaves_no_trace_being_taken(failure, tmp_path, monkeypatch) -> None:
    """When the traced block raises (a generation that fails inside `generate --profile`, a
    bench mode that crashes) or the profiler cannot start, the error propagates, no file or
    fragment is written, and no trace is left being taken: regions are the shared no-op again
    and the next trace runs and is written. Planted: `_taking` reset after the yield without
    `finally` (every later region recorded into nothing and every later trace refused as
    nested); `_taking` set before the profiler started."""
    failure(monkeypatch)
    path = tmp_path / "failed.json"
    with pytest.raises(RuntimeError), profiling.trace(path):
        raise RuntimeError("the generation failed")
    assert list(tmp_path.iterdir()) == []
    assert profiling.region("q4_gemm") is profiling.region("decode step")
    monkeypatch.undo()
    with profiling.trace(tmp_path / "next.json") as taken, profiling.region("after the failure"):
        pass
    assert taken.events and _ranges(profiling.events(taken.path), "after the failure")


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_the_profiler_records_cuda_kernels_only_where_cuda_is(cuda, tmp_path, monkeypatch):
    """profiling's docstring: every ATen operator on the CPU; on CUDA its kernels too. The
    profiler is asked for the CUDA activity exactly when CUDA is available (on this CPU machine
    the answer is stubbed; the profile still runs on the CPU alone). Planted: the condition
    inverted (on a GPU no kernel in the trace, on a CPU a profiler warning per trace), which
    no CPU test saw."""
    asked, real = [], torch.profiler.profile

    def profile(*, activities, **kwargs):
        asked.append(list(activities))
        return real(activities=[torch.profiler.ProfilerActivity.CPU], **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.profiler, "profile", profile)
    with profiling.trace(tmp_path / "t.json") as taken:
        torch.ones(2) + 1
    cpu, gpu = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    assert asked == [[cpu, gpu] if cuda else [cpu]]
    assert taken.events > 0


@pytest.mark.parametrize("form", ["object", "array"])
def test_events_reads_both_forms_of_a_trace_file(form, tmp_path) -> None:
    """The Trace Event Format has two forms: an object with `traceEvents` (torch writes it) and
    a bare array of events (other tools'); `events` returns the records of either. Planted:
    the array form dropped (`document["traceEvents"]` on a list: TypeError)."""
    records = [{"name": "prefill", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": records} if form == "object" else records))
    assert profiling.events(path) == records
