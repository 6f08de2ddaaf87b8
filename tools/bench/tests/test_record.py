"""The record `bench --json` writes, built from fake timings (the benchmark itself never runs
in tests), and read back by perf_regression: writer and reader agree on the schema."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest

from goldens import cli_files
from goldens.cli_files import OneLineParser
from goldens.machine import cpu_model
from tools.bench import perf_regression, record
from tools.bench.record import Timings, build_record, machine_info, write_record

ENGINE = Timings(load_seconds=1.0, prefill_tokens_per_second=200.0, decode_tokens_per_second=10.0)
PEER = Timings(load_seconds=20.0, prefill_tokens_per_second=100.0, decode_tokens_per_second=25.0)
SETUP = {
    "checkpoint": "model.gguf",
    "device": "cpu",
    "dtype": "float32",
    "new_tokens": 32,
    "prompt_tokens": 17,
    "threads": 2,
}


def _record(engine: dict[str, Timings] | None = None) -> dict:
    return build_record(
        engine or {"eager": ENGINE},
        PEER,
        machine={"cpu_model": "Fake CPU", "cpu_count": 2},
        versions={"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.0.0"},
        setup=SETUP,
        conditions={"load_average_start": 0.5, "load_average_end": 2.1},
    )


def test_record_layout_and_ratios():
    data = _record()
    assert set(data) == {
        "schema_version",
        "conditions",
        "machine",
        "versions",
        "setup",
        "engine",
        "peers",
        "ratios",
    }
    assert data["schema_version"] == 1
    assert data["engine"] == {
        "eager": {
            "load_seconds": 1.0,
            "prefill_tokens_per_second": 200.0,
            "decode_tokens_per_second": 10.0,
        }
    }
    assert data["peers"]["transformers"]["load_seconds"] == 20.0
    assert data["ratios"] == {"eager": {"load": 0.05, "prefill": 2.0, "decode": 0.4}}
    assert data["setup"]["threads"] == 2


def test_another_mode_is_another_entry():
    data = _record({"eager": ENGINE, "compiled": Timings(1.0, 400.0, 30.0)})
    assert sorted(data["engine"]) == ["compiled", "eager"]
    assert data["ratios"]["compiled"] == {"load": 0.05, "prefill": 4.0, "decode": 1.2}


def test_written_record_has_sorted_keys_and_perf_regression_reads_it(tmp_path: Path):
    path = tmp_path / "bench.json"
    write_record(path, _record())
    text = path.read_text()
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert list(data["engine"]["eager"]) == sorted(data["engine"]["eager"])
    assert text.endswith("\n")
    assert perf_regression.check_record(path, data) == data
    write_record(path, _record())
    assert path.read_text() == text  # same data, same bytes
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary left behind


def test_cpu_model_from_cpuinfo(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: Fake\nmodel name\t: Fake CPU 9000\n")
    assert cpu_model(cpuinfo) == "Fake CPU 9000"
    assert machine_info(cpuinfo)["cpu_model"] == "Fake CPU 9000"
    assert machine_info(cpuinfo)["cpu_count"] >= 1


@pytest.mark.parametrize("content", [None, "processor\t: 0\n"])
def test_cpu_model_without_a_model_name_is_still_a_name(tmp_path: Path, content):
    cpuinfo = tmp_path / "cpuinfo"
    if content is not None:
        cpuinfo.write_text(content)
    assert cpu_model(cpuinfo)


def test_a_llama_bench_peer_has_null_load_and_perf_regression_reads_it(tmp_path: Path):
    """llama-bench reports no load time: NaN in the bench, null in the record (NaN is no
    JSON), and the record stays one perf_regression reads (it compares engine/transformers)."""
    llama_bench = Timings(math.nan, 300.0, 110.0)
    about = "llama-bench /usr/bin/llama-bench, version 0.7.0, build_number 11669"
    data = build_record(
        {"quantized": ENGINE},
        PEER,
        machine={"cpu_model": "Fake CPU", "cpu_count": 2},
        versions={"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.0.0"},
        setup=SETUP,
        conditions={"load_average_start": 0.5, "read_bandwidth_gb_per_s": 13.8},
        other_peers={"llama.cpp": llama_bench},
        peer_versions={"llama.cpp": about},
    )
    path = tmp_path / "bench.json"
    write_record(path, data)
    text = path.read_text()
    assert "NaN" not in text
    assert json.loads(text)["peers"]["llama.cpp"] == {
        "load_seconds": None,
        "prefill_tokens_per_second": 300.0,
        "decode_tokens_per_second": 110.0,
    }
    read = json.loads(text)
    assert read["peer_versions"] == {"llama.cpp": about}
    assert read["ratios"] == {"quantized": {"load": 0.05, "prefill": 2.0, "decode": 0.4}}
    assert perf_regression.check_record(path, read) == read
    assert "peer_versions" not in _record()  # only when a peer was described


def test_json_output_accepts_a_new_file_and_leaves_its_folder_as_it_was(tmp_path: Path):
    """The writability check's temporary file is gone after the check; the folder is made."""
    path = record.json_output(str(tmp_path / "sub" / "out.json"), OneLineParser(prog="b"))
    assert path == tmp_path / "sub" / "out.json"
    assert list(tmp_path.iterdir()) == [tmp_path / "sub"]
    assert list((tmp_path / "sub").iterdir()) == []


def test_json_output_in_a_folder_it_cannot_write_exits_2(tmp_path: Path, monkeypatch, capsys):
    """A folder without write permission (tests run as root here, which chmod cannot stop,
    so creating a file is made to fail as it does for a user) is refused naming --json and the
    folder, before the bench times anything."""

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cli_files.tempfile, "TemporaryFile", denied)
    with pytest.raises(SystemExit) as exit_info:
        record.json_output(str(tmp_path / "out.json"), OneLineParser(prog="bench"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"bench: error: --json={tmp_path / 'out.json'}: cannot create files in {tmp_path} "
        "(Permission denied); name a folder you can write (see --help)\n"
    )


def test_the_machine_names_the_cpu_flags_that_choose_the_kernels(tmp_path: Path):
    """README.md:542-544: records name the CPU flags that choose the kernels (`cpu_features`),
    which perf_regression compares (a record without them is compared by the model string
    alone, with a warning): the kernel flags of cpuinfo's first "flags" line, in
    KERNEL_FLAGS' order, no others. Planted: `cpu_features` left out of machine_info."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Fake CPU\n"
        "flags\t\t: fpu sse2 avx512_vnni fma avx2 avx512f ssse3\n"
        "processor\t: 1\nflags\t\t: fpu amx_tile\n"
    )
    assert machine_info(cpuinfo)["cpu_features"] == ["avx2", "fma", "avx512f", "avx512_vnni"]
