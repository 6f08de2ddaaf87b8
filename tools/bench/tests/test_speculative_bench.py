"""bench_speculative's table from made-up rows, and its refusals; no model runs."""

import argparse

import pytest

from tools.bench import speculative

ARGS = argparse.Namespace(new_tokens=65, k=4, threads=2, repeats=2)


def test_the_table_gives_speed_ups_acceptance_and_ratios_per_draft() -> None:
    rows = [
        speculative.Row("engine", "none", tps=50.0),
        speculative.Row("engine", "n-gram", tps=100.0, proposed=40, accepted=30, forwards=16),
        speculative.Row("llama-server", "none", tps=80.0),
        speculative.Row("llama-server", "n-gram", tps=40.0, proposed=10, accepted=0, forwards=64),
    ]
    text = "\n".join(speculative._lines(rows, ARGS, "quantized"))
    assert "engine        n-gram    100.0     2.00x       30/40 (0.75)            4.00" in text
    assert "llama-server  n-gram     40.0     0.50x        0/10 (0.00)            1.00" in text
    assert "engine / llama-server decode tok/s, same draft: none 0.62, n-gram 2.50" in text
    assert "model" not in text.split("same draft:")[1]  # no ratio without both sides


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--k", "9"], "--k=9: speculation drafts 1 to 8"), (["--new-tokens", "1"], "at least 2")],
)
def test_bad_arguments_exit_2_naming_them(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        speculative.main(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def test_relative_checkpoints_are_read_from_the_users_folder(user_folder, no_load) -> None:
    with pytest.raises(no_load) as accepted:
        speculative.main(["--gguf=rel.gguf", "--draft=rel.gguf"])
    assert accepted.value.args == (str(user_folder / "rel.gguf"),)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gguf=missing.gguf"], "--gguf={folder}/missing.gguf is not a file"),
        (["--gguf=rel.gguf", "--draft=missing.gguf"], "--draft={folder}/missing.gguf is not a"),
    ],
)
def test_a_missing_checkpoint_exits_2_naming_its_flag(argv, message, user_folder, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        speculative.main(argv)
    assert refused.value.code == 2
    assert message.format(folder=user_folder) in capsys.readouterr().err


def test_a_truncated_checkpoint_exits_2_with_the_loaders_message(user_folder, capsys) -> None:
    assert speculative.main(["--gguf=trunc.gguf"]) == 2
    error = capsys.readouterr().err
    assert f"--gguf: {user_folder / 'trunc.gguf'}: not a readable GGUF file" in error, error
