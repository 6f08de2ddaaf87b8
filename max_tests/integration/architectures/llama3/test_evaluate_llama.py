"""evaluate_llama's command line: a run that can produce nothing exits 2 saying why, the
output folder is created unless the path is a file, and --modular-path picks the testdata
folder the tiny checkpoints come from and the goldens go to."""

from __future__ import annotations

import json

import pytest
import torch

from goldens import schema
from goldens.tolerances import tolerance
from harness.llama3.golden_files import golden_file_name
from harness.llama3.variants import (
    LLAMA3_1_ENV,
    TESTDATA_REL,
    encoding_of_file_type,
    references,
    testdata_directory,
    variants,
)
from max_tests.integration.architectures.llama3 import evaluate_llama
from pipelines.llama3.engine import MODES


def _exit_code(argv: list[str]) -> int:
    try:
        return evaluate_llama.main(argv)
    except SystemExit as exit:
        return exit.code


def test_llama3_1_without_a_checkpoint_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(LLAMA3_1_ENV, raising=False)
    output = tmp_path / "goldens"
    assert _exit_code(["--model=llama3_1", f"--output-dir={output}"]) == 2
    captured = capsys.readouterr()
    assert "nothing to run: llama3_1 unknown: no Llama-3.1-8B-Instruct GGUF given" in captured.err
    assert f"--llama3-1-gguf or ${LLAMA3_1_ENV}" in captured.err
    assert "written" not in captured.out
    assert not output.exists()


def test_missing_llama3_1_file_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(LLAMA3_1_ENV, raising=False)
    absent = tmp_path / "absent.gguf"
    assert _exit_code(["--model=llama3_1", f"--llama3-1-gguf={absent}"]) == 2
    assert f"{absent} does not exist" in capsys.readouterr().err


def test_output_dir_is_created_with_its_parents_and_a_rerun_writes_the_same_bytes(tmp_path, capsys):
    output = tmp_path / "a" / "b"
    argv = ["--model=tinyllama", "--encoding=float32", f"--output-dir={output}"]
    assert _exit_code(argv) == 0
    written = sorted(p.name for p in output.iterdir())
    assert written == ["tinyllama_float32_all_golden.json"]
    golden = json.loads((output / written[0]).read_text())
    assert golden["provenance"]["model"] == "tinyllama" and len(golden["cases"]) > 0
    assert capsys.readouterr().out.splitlines()[-1] == f"1 goldens written to {output}"
    # Regenerated on the same machine, a golden is byte-identical (docs/goldens.md, "Every
    # CPU"): no timings, no dates, one torch thread.
    again = tmp_path / "again"
    assert _exit_code([*argv[:-1], f"--output-dir={again}"]) == 0
    assert (again / written[0]).read_bytes() == (output / written[0]).read_bytes()


def test_output_dir_that_is_a_file_exits_2_and_keeps_the_file(tmp_path, capsys):
    existing = tmp_path / "goldens.json"
    existing.write_text("keep")
    argv = ["--model=tinyllama", "--encoding=float32", f"--output-dir={existing}"]
    assert _exit_code(argv) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert existing.read_text() == "keep"


def test_help_names_the_examples(capsys):
    with pytest.raises(SystemExit) as exit:
        evaluate_llama.main(["--help"])
    assert exit.value.code == 0
    assert "--encoding=all --model=all" in capsys.readouterr().out


def test_a_non_eager_mode_never_writes_into_the_testdata_folder(capsys):
    assert _exit_code(["--model=tinyllama", "--encoding=q4_k", "--mode=quantized"]) == 2
    assert "--mode=quantized does not make goldens (eager and ggml do)" in capsys.readouterr().err


def test_the_ggml_mode_writes_its_own_goldens_on_its_encodings_only(tmp_path, capsys):
    """q4_k: `ggml_tinyllama_q4_k_golden.json`, producer engine-ggml; a float file has none
    (the mode computes eager's numbers there): exit 2, naming the encodings it makes."""
    argv = ["--model=tinyllama", "--mode=ggml", f"--output-dir={tmp_path}"]
    assert _exit_code([*argv, "--encoding=float32"]) == 2
    assert "--mode=ggml makes goldens for --encoding in q4_k, q4_1 only" in capsys.readouterr().err
    assert _exit_code([*argv, "--encoding=q4_k"]) == 0
    golden = schema.read(tmp_path / "ggml_tinyllama_q4_k_golden.json")
    assert golden.provenance.producer == "engine-ggml"
    assert [p.name for p in tmp_path.iterdir()] == ["ggml_tinyllama_q4_k_golden.json"]


def test_a_quantized_run_is_marked_and_matches_the_eager_golden_within_tolerance(tmp_path):
    argv = ["--model=tinyllama", "--encoding=q4_k"]
    assert _exit_code([*argv, f"--output-dir={tmp_path / 'eager'}"]) == 0
    assert _exit_code([*argv, "--mode=quantized", f"--output-dir={tmp_path / 'q'}"]) == 0
    name = "tinyllama_q4_k_all_golden.json"
    eager = json.loads((tmp_path / "eager" / name).read_text())
    quantized = json.loads((tmp_path / "q" / name).read_text())
    assert (eager["provenance"]["producer"], quantized["provenance"]["producer"]) == (
        "engine",
        "engine-quantized",
    )
    for a, b in zip(eager["cases"], quantized["cases"], strict=True):
        assert [s["token_id"] for s in a["steps"]] == [s["token_id"] for s in b["steps"]]
        first_a, first_b = a["steps"][0]["topk_logits"], b["steps"][0]["topk_logits"]
        assert max(abs(x - y) for x, y in zip(first_a, first_b, strict=True)) < 1e-3


@pytest.mark.parametrize(
    ("file_type", "encoding"),
    [(0, "float32"), (32, "bfloat16"), (3, "q4_1"), (14, "q4_k"), (15, "q4_k"), (39, "nvfp4")],
)
def test_a_users_checkpoint_is_named_by_its_file_type(file_type: int, encoding: str) -> None:
    """general.file_type (gguf.LlamaFileType) names a user's Llama 3.1 checkpoint's encoding,
    which picks its tolerance entry; a number gguf does not know stays visible."""
    assert encoding_of_file_type(file_type) == encoding
    assert encoding_of_file_type(999) == "ftype999"


class _EngineLoaded(Exception):
    """Raised in place of loading the engine: the test needs the run's inputs, not its goldens."""


def test_modular_path_picks_the_testdata_folder(tmp_path, monkeypatch, capsys):
    """--modular-path names the checkout whose testdata folder the run reads the tiny
    checkpoints from and writes the goldens into: a path without that folder exits 2 naming
    it, a folder without the checkpoint exits 2 naming the file missing there, and with the
    file the engine is given that file and the output folder is that folder. The engine load
    is stopped at every step, so a run never writes goldens (0.01 s)."""
    seen = {}
    output_folder = evaluate_llama.golden_files.output_folder

    def record_output(output_dir, folder):
        seen["output"] = output_folder(output_dir, folder)
        return seen["output"]

    def stop(variant, device, mode):
        seen["checkpoint"] = variant.path
        raise _EngineLoaded

    monkeypatch.setattr(evaluate_llama.golden_files, "output_folder", record_output)
    monkeypatch.setattr(evaluate_llama.engine_runs, "load_engine", stop)
    shipped = testdata_directory() / "tiny_llama.gguf"
    monkeypatch.setenv("PIPELINES_TESTDATA", str(testdata_directory()))  # main() changes it
    checkout = tmp_path.resolve() / "checkout"
    checkout.mkdir()
    argv = ["--model=tinyllama", "--encoding=float32", f"--modular-path={checkout}"]
    assert _exit_code(argv) == 2
    message = f"--modular-path={checkout} has no {TESTDATA_REL}; pass a checkout"
    assert message in capsys.readouterr().err

    testdata = checkout / TESTDATA_REL
    testdata.mkdir(parents=True)
    assert _exit_code(argv) == 2
    missing = f"nothing to run: tinyllama float32: {testdata / 'tiny_llama.gguf'} is missing"
    assert missing in capsys.readouterr().err
    assert seen == {}

    (testdata / "tiny_llama.gguf").symlink_to(shipped)
    with pytest.raises(_EngineLoaded):
        evaluate_llama.main(argv)
    assert seen == {"output": testdata, "checkpoint": testdata / "tiny_llama.gguf"}


def _no_engine(monkeypatch) -> None:
    """Any engine load fails the test: the bad input must be refused before it."""

    def stop(variant, device, mode):
        raise AssertionError(f"the engine was loaded for {variant.model} on {device}")

    monkeypatch.setattr(evaluate_llama.engine_runs, "load_engine", stop)


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("tpu", "--device=tpu is not a device here: the engine runs on cpu or cuda[:N]"),
        ("cuda:x", "--device=cuda:x is not a device here: the engine runs on cpu or cuda[:N]"),
    ],
)
def test_an_unusable_device_exits_2_before_the_output_folder(
    device, says, tmp_path, monkeypatch, capsys
):
    """--device=tpu used to reach the engine load (a traceback, exit 1) after the output folder
    was created: now it is refused first, and no folder appears (0.01 s)."""
    _no_engine(monkeypatch)
    output = tmp_path / "goldens"
    argv = ["--model=tinyllama", "--encoding=float32", f"--device={device}"]
    assert _exit_code([*argv, f"--output-dir={output}"]) == 2
    assert says in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
@pytest.mark.parametrize("given_by", ["flag", "environment"])
def test_a_bad_llama3_1_file_exits_2_naming_how_it_was_given(
    damage, given_by, tmp_path, monkeypatch, capsys
):
    """A truncated or non-GGUF Llama 3.1 file used to stop variants() in a traceback (exit 1):
    now the message names --llama3-1-gguf or $LLAMA3_1_GGUF, the file and what is wrong, exit
    2, nothing written (0.01 s each)."""
    _no_engine(monkeypatch)
    bad = tmp_path / "llama.gguf"
    if damage == "truncated":
        bad.write_bytes((testdata_directory() / "tiny_llama.gguf").read_bytes()[:1000])
        reason = "not a readable GGUF file: truncated inside the metadata"
    else:
        bad.write_text("hello, not a checkpoint")
        reason = "not a readable GGUF file: bad magic"
    output = tmp_path / "goldens"
    argv = ["--model=all", f"--output-dir={output}"]
    if given_by == "flag":
        monkeypatch.delenv(LLAMA3_1_ENV, raising=False)
        argv.append(f"--llama3-1-gguf={bad}")
        given = f"--llama3-1-gguf={bad}: {bad}: {reason}"
    else:
        monkeypatch.setenv(LLAMA3_1_ENV, str(bad))
        given = f"${LLAMA3_1_ENV}={bad}: {bad}: {reason}"
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert given in err and "give a whole Llama-3.1-8B-Instruct GGUF file" in err
    assert not output.exists()


def test_goldens_are_computed_on_one_torch_thread(tmp_path, monkeypatch):
    """docs/goldens.md:546: goldens are made on one torch thread, as the tests run, so that
    regenerating one on the same machine gives the same bytes whatever its core count
    (test_output_dir_is_created_... reruns at the test's own thread count, and so cannot
    tell). The engine load is stopped: the thread count is read where the run would start,
    from a process at 2 threads (0.01 s). Plant: evaluate_llama without its
    torch.set_num_threads(engine_runs.GOLDEN_THREADS)."""
    seen = {}

    def stop(variant, device, mode):
        seen["threads"] = torch.get_num_threads()
        raise _EngineLoaded

    monkeypatch.setattr(evaluate_llama.engine_runs, "load_engine", stop)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(_EngineLoaded):
            evaluate_llama.main(
                ["--model=tinyllama", "--encoding=float32", f"--output-dir={tmp_path}"]
            )
    finally:
        torch.set_num_threads(threads)
    assert seen == {"threads": 1}


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_is_held_to_the_goldens_of_its_numerics(mode):
    """docs/goldens.md:395-396: test_llama holds the ggml mode on q4_k and q4_1 to the ggml
    goldens alone (the files evaluate_llama --mode=ggml writes, judged under ggml/ENC/cpu),
    and every other variant x mode (the ggml mode on a float file computes eager's numbers) to
    the engine's and transformers' goldens under own/ENC/cpu and torch/ENC/cpu. Plant:
    variants.references without its encoding condition (the ggml mode on float32 then looks
    for a ggml golden no one makes: a skip outside Bazel) (0.01 s)."""
    for variant in variants():
        if variant.model == "llama3_1":  # the user's file, of any encoding (or none given)
            continue
        ggml = mode == "ggml" and variant.encoding in ("q4_k", "q4_1")
        held_to = references(variant, mode)
        assert held_to == (("ggml",) if ggml else ("own", "torch")), (variant.test_id, mode)
        for reference in held_to:
            entry = tolerance(reference, variant.encoding, "cpu")
            assert entry.key == f"{reference}/{variant.encoding}/cpu"
        if ggml:
            name = golden_file_name("ggml", variant)
            assert name == f"ggml_{variant.model}_{variant.encoding}_golden.json"
