"""LlamaBenchPeer against a fake `llama-bench` (a script printing its JSON): the command line,
the seconds read back, the build and backend it names, and every way a run can fail. The
real binary runs in the bench itself, never here."""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path

import pytest

from tools.bench import llama_cpp_peer
from tools.bench.llama_cpp_peer import LlamaBenchError, LlamaBenchPeer

BACKEND_LINE = (
    "load_backend: loaded CPU backend from /usr/lib/x86_64-linux-gnu/ggml/backends0/"
    "libggml-cpu-icelake.so"
)


def _test(n_prompt: int, n_gen: int, avg_ts: float) -> dict:
    return {
        "build_commit": "Debian",
        "build_number": 11669,
        "backends": "CPU",
        "cpu_info": "Fake CPU",
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": 0,
        "avg_ts": avg_ts,
        "samples_ts": [avg_ts],
    }


def _fake(tmp_path: Path, stdout: str, exit_code: int = 0, stderr: str = BACKEND_LINE) -> Path:
    """A llama-bench that logs its arguments, prints `stdout` for a test run and exits."""
    script = tmp_path / "llama-bench"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"print({stderr!r}, file=sys.stderr)\n"
        "if sys.argv[1:] == ['--version']:\n"
        "    print('version: 0.7.0 (build 11669, commit Debian)', file=sys.stderr)\n"
        "    sys.exit(0)\n"
        f"open({str(tmp_path / 'argv.txt')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"sys.stdout.write({stdout!r})\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _peer(tmp_path: Path, stdout: str, **kwargs) -> LlamaBenchPeer:
    script = _fake(tmp_path, stdout, **kwargs)
    return LlamaBenchPeer(str(script), tmp_path / "model.gguf", threads=2)


def test_seconds_from_its_json_and_no_tokens(tmp_path: Path):
    peer = _peer(tmp_path, json.dumps([_test(17, 0, 170.0), _test(0, 31, 62.0)]))
    tokens, prefill_seconds, decode_seconds = peer.greedy(list(range(17)), 32)
    assert tokens is None
    assert prefill_seconds == pytest.approx(17 / 170.0)
    assert decode_seconds == pytest.approx(31 / 62.0)
    assert not peer.compares_tokens
    assert math.isnan(peer.load_seconds)  # not reported, not measured
    argv = (tmp_path / "argv.txt").read_text().split()
    assert argv == [
        "-m",
        str(tmp_path / "model.gguf"),
        "-t",
        "2",
        "-p",
        "17",
        "-n",
        "31",
        "-r",
        "1",
        "-ngl",
        "0",
        "-fa",
        "0",
        "--repack",
        "1",
        "-o",
        "json",
    ]


def test_without_repack_it_runs_repack_0_and_says_so(tmp_path: Path):
    """The bench's llama.cpp-no-repack side: the weights as the file holds them."""
    script = _fake(tmp_path, json.dumps([_test(5, 0, 100.0), _test(0, 3, 50.0)]))
    peer = LlamaBenchPeer(str(script), tmp_path / "model.gguf", threads=2, repack=False)
    peer.greedy([1, 2, 3, 4, 5], 4)
    argv = (tmp_path / "argv.txt").read_text().split()
    assert argv[argv.index("--repack") + 1] == "0"
    assert peer.describe().endswith("backend CPU libggml-cpu-icelake.so, --repack 0")


def test_describe_names_binary_version_build_and_backend(tmp_path: Path):
    peer = _peer(tmp_path, json.dumps([_test(5, 0, 100.0), _test(0, 3, 50.0)]))
    assert peer.version == "0.7.0"
    peer.greedy([1, 2, 3, 4, 5], 4)
    about = peer.describe()
    assert about.startswith(f"llama-bench {tmp_path / 'llama-bench'}")
    assert "version 0.7.0" in about
    assert "build_number 11669, build_commit Debian" in about
    assert "backend CPU libggml-cpu-icelake.so" in about


def test_a_build_without_a_backend_line_says_so(tmp_path: Path):
    peer = _peer(tmp_path, json.dumps([_test(5, 0, 100.0), _test(0, 3, 50.0)]), stderr="")
    peer.greedy([1, 2, 3, 4, 5], 4)
    assert peer.describe().endswith("backend not reported")


@pytest.mark.parametrize(
    ("stdout", "exit_code", "message"),
    [
        ("", 1, "exited 1: " + BACKEND_LINE),
        ("not json", 0, "printed no JSON"),
        ('{"avg_ts": 1}', 0, "not a test list"),
        (json.dumps([_test(5, 0, 100.0)]), 0, "no test with n_prompt 0 and n_gen 3"),
        (json.dumps([_test(5, 0, 100.0), _test(0, 3, 0.0)]), 0, "avg_ts 0.0"),
    ],
)
def test_a_failed_or_unreadable_run_is_an_error(tmp_path, stdout, exit_code, message):
    peer = _peer(tmp_path, stdout, exit_code=exit_code)
    with pytest.raises(LlamaBenchError, match=message):
        peer.greedy([1, 2, 3, 4, 5], 4)


def test_a_binary_that_does_not_start_is_an_error(tmp_path: Path):
    with pytest.raises(LlamaBenchError, match="No such file"):
        LlamaBenchPeer(str(tmp_path / "missing"), tmp_path / "model.gguf", threads=1)


def test_found_on_the_path_or_not(tmp_path: Path, monkeypatch):
    _fake(tmp_path, "[]")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llama_cpp_peer.find_llama_bench() == str(tmp_path / "llama-bench")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert llama_cpp_peer.find_llama_bench() is None


def test_the_binding_is_reported_missing_with_a_pointer(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, as when not installed
    monkeypatch.delenv(llama_cpp_peer.FOLDER_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # it may append its folder
    module, why = llama_cpp_peer.import_llama_cpp()
    assert module is None
    assert why.startswith("llama_cpp not importable") and "llama_cpp_peer.py" in why
