"""golden_check end to end without llama.cpp: a loopback OpenAI-compatible server that serves
this engine's own numbers passes the pinned goldens; the same server on a mutated checkpoint
fails them; an address where nothing listens, a checkpoint that does not exist and an engine x
encoding that is not judged exit 2 with one line. (llama.cpp itself: test_llama_cpp.)"""

from __future__ import annotations

import dataclasses
import socket

import pytest

from goldens.engines.tests.fake_server import FakeServer
from harness.llama3 import checkpoint_mutations, engine_runs
from tools.golden_check import golden_check


def _served(path):
    """A fake server whose model is this engine on the GGUF at `path`."""
    (variant,) = [v for v in golden_check.checkpoints().values() if v.encoding == "float32"]
    engine = engine_runs.load_engine(dataclasses.replace(variant, path=path))

    def logits(prefix):
        return engine.generate(list(prefix), 1).logits[0].float().numpy()

    return variant, FakeServer("token_ids", logits=logits)


def _check(url: str, *extra: str) -> int:
    argv = ["--engine=openai", f"--url={url}", "--checkpoint=tinyllama-float32", "--lane=short"]
    return golden_check.main([*argv, "--report-dir", *extra])


def test_a_server_with_this_engines_numbers_passes_and_a_mutated_checkpoint_fails(tmp_path, capsys):
    variant, server = _served(golden_check.checkpoints()["tinyllama-float32"].path)
    with server:
        assert _check(server.url, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "own/float32/external" in out and "torch/float32/external" in out
    assert "input ids: not checked" in out  # a bare OpenAI server cannot tokenize
    assert out.strip().endswith("verdict: PASS")
    assert len(list(tmp_path.glob("golden_report_*.html"))) == 2

    mutation = checkpoint_mutations.BY_NAME["weight_scaled"]
    copy = checkpoint_mutations.mutated_copy(variant.path, mutation, tmp_path)
    _, server = _served(copy)
    with server:
        assert _check(server.url, str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "golden mismatch in case 'prose'" in out
    assert out.strip().endswith("verdict: FAIL")


def test_nothing_listening_exits_2_with_one_line_naming_the_url(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    assert (
        golden_check.main(["--engine=openai", f"--url={url}", "--checkpoint=tinyllama-float32"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"nothing answers at {url}" in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine=openai", "--checkpoint=nope", "--url=http://x/v1"], "is not one of"),
        (["--engine=openai", "--checkpoint=tinyllama-float32"], "needs --url"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-q4_k"], "is not judged"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--mutations"], "--mutations needs"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--sampling"], "--sampling needs --engine=llama_cpp"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=top_k=50"], "give a top_k from 1 to 20"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=temp=2"], "KEY one of temperature, top_k, top_p, min_p"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling",
          "--sampler=top_k=5,temperature=0"], "temperature=0.0 must be > 0"),
        # Checked by the parser: each reached the engine and stopped in a traceback, exit 1.
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=-5"], "argument --timeout: -5: give a number of seconds above 0"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=nan"], "argument --timeout: nan: give a number of seconds above 0"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--batch=0"], "argument --batch: 0: give at least 1"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--batch=-1"], "argument --batch: -1: give at least 1"),
        (["--engine=this", "--checkpoint=tinyllama-float32", "--mode=turbo"],
         "argument --mode: invalid choice: 'turbo'"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = golden_check.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err


def test_a_report_that_cannot_be_written_exits_2_not_a_verdict(tmp_path, monkeypatch, capsys):
    """A failed report write (here mkstemp refused) is one line, exit 2: exit 1 means FAIL."""
    from goldens import cli_files

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def judge(args, variant, gguf, goldens, column, report_dir=None):
        cli_files.write_atomically(report_dir / "golden_report_x.html", "<html>")
        raise AssertionError("the write above must fail")

    monkeypatch.setattr(cli_files.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(golden_check, "_judge", judge)
    assert _check("http://x/v1", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"golden_check: cannot write {tmp_path / 'golden_report_x.html'} (Permission denied); "
        f"free space or grant write permission in {tmp_path}, or name another path"
    ]


def test_transformers_passes_this_engines_golden_and_every_mutation_fails_it(tmp_path, capsys):
    argv = ["--engine=transformers", "--checkpoint=tinyllama-float32", "--lane=short"]
    assert (
        golden_check.main([*argv, "--golden=own", "--mutations", f"--report-dir={tmp_path}"]) == 0
    )
    out = capsys.readouterr().out
    assert "own/float32/cpu" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for mutation in checkpoint_mutations.MUTATIONS:
        line = lines[mutation.name]
        if mutation.name == "rope_theta":  # transformers rebuilds rope from Llama 3.1's recipe
            assert "not applicable: the engine refuses the file" in line, line
        else:
            assert " FAIL: " in line, line
    assert out.strip().endswith("verdict: PASS")


def test_list_names_every_checkpoint(capsys):
    assert golden_check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "tinyllama-float32" in out and "tiny_llama.gguf" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--timeout=0"], "argument --timeout: 0: give a number of seconds above 0"),
        (["--engine=llama_cpp", "--checkpoint=tinyllama-float32", "--sampling", "--draws=0"],
         "--draws=0: give at least 1"),
        (["--engine=llama_cpp", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--mutations"], "--mutations needs an engine this command starts"),
        (["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32",
          "--report-dir=REPORT_FILE"], "exists and is not a directory; name a folder"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_before_any_engine_is_started(
    argv, message, tmp_path, monkeypatch, capsys
):
    """Each of these is refused (exit 2, naming the option) before an engine is built or a
    llama-server started: the engine is replaced by one that fails the test. Planted: --timeout
    checked as `>= 0`, --draws as `< 0`, --mutations refused for openai only (a --url server
    cannot be restarted on each mutated copy), --report-dir not checked before the judging (it
    failed after every case had run)."""
    report_file = tmp_path / "report_file"
    report_file.write_text("")
    argv = [a.replace("REPORT_FILE", str(report_file)) for a in argv]

    def started(*args, **kwargs):
        raise AssertionError("an engine was started for a command that must be refused")

    monkeypatch.setattr(golden_check, "_target", started)
    monkeypatch.setattr(golden_check, "_judge", started)
    with pytest.raises(SystemExit) as exit_info:
        code = golden_check.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unavailable_checkpoint_and_an_unpinned_golden_exit_2_with_one_line(monkeypatch, capsys):
    """A checkpoint whose file is not on this machine, and a golden that is not pinned, are bad
    input: exit 2 and one line naming them (exit 1 means a verdict failed). Planted: either
    branch returning 1."""
    table = golden_check.checkpoints()
    absent = dataclasses.replace(
        table["tinyllama-float32"], path=None, unavailable_reason="not downloaded here"
    )
    monkeypatch.setattr(golden_check, "checkpoints", lambda: {**table, "tinyllama-float32": absent})
    argv = ["--engine=openai", "--url=http://x/v1", "--checkpoint=tinyllama-float32"]
    assert golden_check.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "golden_check: tinyllama-float32: not downloaded here"
    ]
    monkeypatch.setattr(golden_check, "checkpoints", lambda: table)
    monkeypatch.setattr(golden_check.golden_files, "find_golden", lambda *args: None)
    assert golden_check.main([*argv, "--golden=own"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("golden_check: no own golden "), err
    assert err[0].endswith(" is pinned"), err


def test_sampling_with_nothing_listening_exits_2_with_one_line_naming_the_url(capsys):
    """--sampling's engine failure is bad input too (exit 2), not a FAIL (exit 1). Planted: its
    EngineError branch returning 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    argv = ["--engine=llama_cpp", f"--url={url}", "--checkpoint=tinyllama-float32", "--sampling"]
    assert golden_check.main([*argv, "--lane=short", "--draws=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing answers at http://127.0.0.1:" in err[0], err
