"""bench_constrained's table from made-up figures, llama-server's outputs judged, and its
refusals; no model runs."""

import argparse
import json

import pytest

from tools.bench import constrained

ARGS = argparse.Namespace(new_tokens=64, threads=2, repeats=2, mode="quantized")


def test_the_table_gives_mask_times_and_both_ratios() -> None:
    masks = [constrained.MaskTimes("tiny", 128256, 144, 180.0, 950.5)]
    rows = [
        constrained.DecodeRow("engine", False, 60.0),
        constrained.DecodeRow("engine", True, 45.0),
        constrained.DecodeRow("llama-server", False, 80.0),
        constrained.DecodeRow("llama-server", True, 50.0, "2 valid, 0 cut at 64 tokens, of 2"),
    ]
    text = "\n".join(constrained._lines(masks, rows, ARGS))
    assert "tiny     vocabulary 128256:  144 steps, p50   180.0 us, p99   950.5 us" in text
    assert "engine        schema     45.0 0.75x unconstrained" in text
    assert "engine / llama-server decode tok/s without: 0.75" in text
    assert "engine / llama-server decode tok/s with the schema: 0.90" in text


def test_outputs_are_judged_against_the_schema() -> None:
    good = json.dumps(list(range(48)))
    verdict = constrained._validity([good, "[1,2,3", "[1,2]", "{}"], 64)
    assert verdict == "1 valid, 1 cut at 64 tokens, of 4"


@pytest.mark.parametrize("argv", [["--new-tokens", "1"], ["--mask-steps", "0"]])
def test_bad_arguments_exit_2(argv, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        constrained.main(argv)
    assert refused.value.code == 2
    assert "at least" in capsys.readouterr().err


def test_a_relative_checkpoint_is_read_from_the_users_folder(user_folder, no_load) -> None:
    with pytest.raises(no_load) as accepted:
        constrained.main(["--gguf=rel.gguf"])
    assert accepted.value.args == (str(user_folder / "rel.gguf"),)


def test_a_missing_checkpoint_exits_2_naming_the_flag(user_folder, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        constrained.main(["--gguf=missing.gguf"])
    assert refused.value.code == 2
    assert f"--gguf={user_folder}/missing.gguf is not a file" in capsys.readouterr().err


def test_a_truncated_checkpoint_exits_2_with_the_loaders_message(user_folder, capsys) -> None:
    assert constrained.main(["--gguf=trunc.gguf"]) == 2
    error = capsys.readouterr().err
    assert f"--gguf: {user_folder / 'trunc.gguf'}: not a readable GGUF file" in error, error
