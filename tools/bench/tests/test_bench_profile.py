"""`bench --profile FILE`: one generation of each engine mode under the profiler, in one Chrome
trace-event file, on a small random checkpoint; and a file it cannot write refused before any
checkpoint loads."""

from __future__ import annotations

import json

import gguf
import pytest

from pipelines.llama3 import profiling
from tools.bench import bench
from tools.gen_tiny_model.tiny_llama import write_tiny_llama


def test_each_mode_is_a_range_of_one_trace_with_its_steps_and_kernels(tmp_path) -> None:
    checkpoint = tmp_path / "tiny_q8_0.gguf"
    write_tiny_llama(checkpoint, weight_type=gguf.GGMLQuantizationType.Q8_0)
    sides = [bench._engine_side(checkpoint, mode) for mode in ("eager", "quantized")]
    trace = tmp_path / "bench.json"
    count = bench.profile_engines(trace, sides, [5, 17, 200, 33], new_tokens=3)
    events = profiling.events(trace)
    assert count == len(events) == len(json.loads(trace.read_text())["traceEvents"])
    names = [event.get("name") for event in events]
    assert names.count("bench eager") == 1 and names.count("bench quantized") == 1
    assert names.count("prefill") == 2  # one generation of each mode
    assert names.count("q8_gemm") > 0  # the quantized mode's kernel calls are attributed
    (eager,) = [e for e in events if e.get("name") == "bench eager"]
    (quantized,) = [e for e in events if e.get("name") == "bench quantized"]
    assert eager["ts"] + eager["dur"] <= quantized["ts"]  # one after the other


@pytest.mark.parametrize(
    ("name", "says"), [("missing/bench.json", "does not exist"), (".", "is a folder")]
)
def test_a_profile_it_cannot_write_is_refused_before_loading(tmp_path, capsys, name, says) -> None:
    with pytest.raises(SystemExit) as stop:
        bench.main(["--gguf", str(tmp_path / "absent.gguf"), f"--profile={tmp_path / name}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --profile: {tmp_path / name}: " in err and says in err
    assert "loading" not in err
