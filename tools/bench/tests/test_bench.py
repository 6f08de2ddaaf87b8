"""The bench's verdicts and printing from made-up sides: the --check bars (those of the modes
MODES has today, and ggml's against llama.cpp once it is a mode), a llama.cpp measured by
llama-bench (no load time, no tokens), the read-bandwidth line. No model runs here."""

from __future__ import annotations

import math
import re
import types

import pytest
import torch

from tools.bench import bench, constrained, serving, speculative

PROMPT, NEW = 10, 11  # 10 decode steps: decode tok/s = 10 / decode seconds


def _side(name, load=1.0, prefill_tps=100.0, decode_tps=10.0, tokens=(1, 2, 3)) -> bench.Side:
    side = bench.Side(name, load, weight_bytes=10**8, greedy=None)
    side.prefill_seconds = PROMPT / prefill_tps
    side.decode_seconds = (NEW - 1) / decode_tps
    side.tokens = list(tokens) if tokens is not None else None
    return side


def _verdicts(*sides: bench.Side) -> list[str]:
    return bench._acceptance({s.name: s for s in sides}, PROMPT, NEW)


def test_bars_of_todays_modes():
    verdicts = _verdicts(
        _side("eager", load=1.0, decode_tps=10.0),
        _side("quantized", decode_tps=50.0),
        _side("transformers", load=10.0, decode_tps=9.0),
        _side("llama.cpp", load=math.nan, decode_tps=60.0, tokens=None),
    )
    assert verdicts == [
        "PASS eager load >= 5.0x faster than transformers",
        "PASS eager/transformers: decode >= 1.0",
        "PASS quantized/transformers: decode >= 2.0",
        "PASS quantized/llama.cpp: decode >= 0.75",
        "PASS quantized greedy tokens = eager's",
    ]


def test_without_llama_cpp_its_bars_are_skipped_and_said():
    verdicts = _verdicts(_side("quantized", decode_tps=10.0), _side("transformers"))
    assert verdicts == [
        "FAIL quantized/transformers: decode >= 2.0",
        "SKIP quantized/llama.cpp: decode >= 0.75 (llama.cpp not measured)",
    ]


@pytest.mark.parametrize(
    ("prefill_tps", "decode_tps", "expected"),
    [
        (120.0, 65.0, ["PASS", "PASS"]),
        (120.0, 55.0, ["FAIL", "PASS"]),
        (90.0, 65.0, ["PASS", "FAIL"]),
    ],
)
def test_ggml_against_llama_cpp(prefill_tps, decode_tps, expected):
    """Once `ggml` is a mode: decode and prefill at least llama.cpp's (100 and 60 tok/s)."""
    verdicts = _verdicts(
        _side("ggml", prefill_tps=prefill_tps, decode_tps=decode_tps),
        _side("transformers"),
        _side("llama.cpp", load=math.nan, prefill_tps=100.0, decode_tps=60.0, tokens=None),
    )
    assert verdicts == [
        f"{expected[0]} ggml/llama.cpp: decode >= 1.0",
        f"{expected[1]} ggml/llama.cpp: prefill >= 1.0",
    ]


def test_a_bar_whose_peer_was_not_measured_is_said_skipped():
    """Not dropped (it was: --check then passed with no bar judged); `main` fails a --check
    run with a SKIP unless --no-llama-cpp asked for it."""
    assert _verdicts(_side("ggml"), _side("transformers")) == [
        "SKIP ggml/llama.cpp: decode >= 1.0 (llama.cpp not measured)",
        "SKIP ggml/llama.cpp: prefill >= 1.0 (llama.cpp not measured)",
    ]


def test_check_fails_on_a_bar_it_could_not_judge_unless_its_peer_was_left_out(capsys):
    skipped = ["PASS eager/transformers: decode >= 1.0", "SKIP ggml/llama.cpp: decode >= 1.0"]
    assert bench.check_status(skipped, no_llama_cpp=False) == 1
    assert "a bar could not be judged" in capsys.readouterr().err
    assert bench.check_status(skipped, no_llama_cpp=True) == 0
    assert bench.check_status(["PASS x", "FAIL y"], no_llama_cpp=True) == 1
    assert bench.check_status(["PASS x"], no_llama_cpp=False) == 0


def test_llama_bench_side_prints_n_a_for_load_and_is_not_token_compared(capsys):
    eager = _side("eager")
    transformers = _side("transformers", load=10.0)
    llama = _side("llama.cpp", load=math.nan, decode_tps=20.0, tokens=None)
    llama.no_tokens = "llama-bench times its own random token ids and returns no tokens"
    bench._print_table([eager, transformers, llama], PROMPT, NEW)
    bench._print_ratios([eager], [transformers, llama], PROMPT, NEW)
    bench._print_tokens([eager, transformers, llama])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["load", "seconds", "1.00", "10.00", "n/a"]
    assert "eager/transformers: load 0.100  prefill 1.000  decode 1.000" in lines
    assert "eager/llama.cpp: load n/a  prefill 1.000  decode 0.500" in lines
    assert "greedy tokens identical to eager: transformers 3/3" in lines
    assert (
        "greedy tokens not compared: llama.cpp (llama-bench times its own random token ids "
        "and returns no tokens)"
    ) in lines


def test_bandwidth_lines(capsys):
    # 1e8 bytes a token at 10 tok/s: 1 GB/s, a quarter of 4 GB/s
    bench._print_bandwidth([_side("quantized")], NEW, 4.0, 0.3, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("measured read bandwidth: 4.00 GB/s (torch sum over a 512 MiB")
    assert out[1] == "quantized: decode at 25% of measured read bandwidth"


def test_read_bandwidth_is_measured():
    gb_per_s, seconds = bench.measure_read_bandwidth(mib=8, repeats=2)
    assert gb_per_s > 0 and math.isfinite(gb_per_s)
    assert seconds > 0


def test_the_sampled_decode_section_names_each_side_and_its_ratios():
    from tools.bench import sampled

    rows = [
        sampled.Row("quantized", greedy=40.0, sampled=30.0),
        sampled.Row("llama-server", greedy=80.0, sampled=60.0),
    ]
    out = sampled.lines(rows, {"temperature": 0.8, "top_k": 40}, 3)
    assert out[0] == "sampled decode (temperature=0.8, top_k=40, seed 0), tok/s, fastest of 3:"
    assert out[2].split() == ["quantized", "40.00", "30.00", "0.750"]
    assert out[-1] == "quantized/llama-server sampled decode: 0.500 (greedy 0.500)"
    without = sampled.lines(rows[:1], {"temperature": 0.8}, 1, skipped="--no-llama-cpp")
    assert without[-1] == "  llama-server: skipped: --no-llama-cpp"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("temp=1", "KEY one of temperature, top_k, top_p, min_p"),
        ("top_k=x", "'x' is not a number"),
        ("top_p=1.5", "top_p=1.5 must lie in (0, 1]"),
    ],
)
def test_a_bad_sampler_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        bench.settings_from_text(text)


@pytest.mark.parametrize("threads", ["0", "-1", "two"])
@pytest.mark.parametrize("tool", ["bench", "serving", "speculative", "constrained"])
def test_a_thread_count_below_one_exits_2_naming_the_flag(tool, threads, capsys) -> None:
    """Before anything loads (torch.set_num_threads(0) stops in a traceback)."""
    main = {"bench": bench, "serving": serving, "speculative": speculative}.get(tool, constrained)
    with pytest.raises(SystemExit) as exit_info:
        main.main([f"--threads={threads}"])
    assert exit_info.value.code == 2
    assert "argument --threads: " in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["bench", "speculative", "constrained"])
def test_json_naming_a_folder_exits_2_before_any_timing(tool, tmp_path, monkeypatch, capsys):
    """--json=FOLDER is refused by the parser (bench ran 93 s, then stopped in
    IsADirectoryError, exit 1, its numbers lost). torch.set_num_threads, the first step of
    the work after the checks, raises here if it is reached."""

    def reached(*_):
        raise AssertionError("the bench went past its argument checks")

    main = {"bench": bench, "speculative": speculative, "constrained": constrained}[tool]
    monkeypatch.setattr(torch, "set_num_threads", reached)
    monkeypatch.setattr(bench, "freeze_imported_objects", lambda: None)  # keeps pytest's gc
    with pytest.raises(SystemExit) as exit_info:
        main.main([f"--json={tmp_path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--json={tmp_path} is a directory; name the file to write" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("clients", [-1, 23])
def test_bench_serving_refuses_clients_its_prompts_cannot_keep_apart(clients, capsys) -> None:
    """The server rows need a prompt per client and per warm-up twin (rotations of a 44-word
    text): past 22 clients a warm-up prompt would be a measured one, so it exits 2 first."""
    with pytest.raises(SystemExit) as exit_info:
        serving.main(["--modes=", f"--clients={clients}"])
    assert exit_info.value.code == 2
    assert f"--clients={clients}: " in capsys.readouterr().err


# llama-batched-bench's table as Debian's build prints it (-npp 8 -ntg 3 -npl 1,2)
BATCHED_TABLE = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      3 |    1 |     11 |    0.327 |    24.48 |    0.026 |   116.05 |    0.353 |    31.19 |
|     8 |      3 |    2 |     22 |    0.029 |   561.07 |    0.520 |    11.53 |    0.549 |    40.07 |
"""


def test_llama_cpp_runs_the_engines_forwards_and_is_counted_as_the_engine_is(
    tmp_path, monkeypatch
) -> None:
    """The served rows run a prefill (whose logits choose the first new token) and NEW - 1
    decode steps for PROMPT + NEW tokens a request; llama-batched-bench runs TG decode steps
    after its prefill and its S t/s counts PROMPT + TG. It gets -ntg NEW - 1 and its rate is
    B x (PROMPT + NEW) over its T s: the same forwards, the same tokens (it got -ntg NEW, one
    decode step more than the engine, before)."""
    argv = tmp_path / "argv"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {argv}\ncat <<'EOF'\n{BATCHED_TABLE}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(serving, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    args = serving._parser().parse_args(["--prompt-tokens=8", "--new-tokens=4"])
    totals, why = serving.llama_cpp_batched(args, [1, 2])
    assert why == "" and "-npp 8 -ntg 3 " in argv.read_text() + " "
    assert totals == pytest.approx({1: 12 / 0.353, 2: 24 / 0.549}, rel=1e-12)


def test_bench_serving_prompts_are_as_long_as_asked() -> None:
    """Each prompt has exactly --prompt-tokens tokens, past what four rotations of the text
    give (SmolLM2's tokenizer: 184; longer ones were cut there silently), and the prompts
    differ. A tokenizer of one id per word stands in (four rotations: 176 ids)."""
    words = {word: i for i, word in enumerate(serving.WORDS)}
    tokenizer = types.SimpleNamespace(encode=lambda text: [words[w] for w in text.split(" ")])
    prompts = serving._prompts(types.SimpleNamespace(tokenizer=tokenizer), 3, 700)
    assert [len(p) for p in prompts] == [700, 700, 700]
    assert len({tuple(p) for p in prompts}) == 3


def test_bench_serving_needs_two_new_tokens(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serving.main(["--modes=", "--new-tokens=1"])
    assert exit_info.value.code == 2
    assert "argument --new-tokens: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--batches=-4", "argument --batches: '-4': give whole numbers of at least 1"),
        ("--batches=0", "argument --batches: '0': give whole numbers of at least 1"),
        ("--batches=1,x", "argument --batches: '1,x': give whole numbers of at least 1"),
        ("--batches=", "argument --batches: '': give whole numbers of at least 1"),
        ("--prompt-tokens=-4", "argument --prompt-tokens: -4: give at least 1"),
        ("--prompt-tokens=0", "argument --prompt-tokens: 0: give at least 1"),
        ("--prompt-tokens=8170", "--prompt-tokens=8170 and --new-tokens=16 do not fit SmolLM2's"),
        ("--modes=eager,turbo", "argument --modes: turbo is no mode; choose from eager, "),
        ("--server-modes=ggml,fast", "argument --server-modes: fast is no mode; choose from "),
    ],
)
def test_bench_serving_checks_its_lists_and_lengths_before_any_timing(
    option, message, monkeypatch, capsys
) -> None:
    """Each exits 2 from the parser (they ran minutes of rows first, then a traceback, or
    printed rows of a "-4 prompt"). torch.set_num_threads, the first step of the work after
    the checks, raises here if it is reached."""

    def reached(*_):
        raise AssertionError("bench_serving went past its argument checks")

    monkeypatch.setattr(torch, "set_num_threads", reached)
    with pytest.raises(SystemExit) as exit_info:
        serving.main([option])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_serving_parses_its_lists() -> None:
    """The values the rows use: batches as numbers, modes as names, an empty list as none."""
    args = serving._parser().parse_args(["--batches=2,8", "--modes=", "--server-modes=eager,ggml"])
    assert (args.batches, args.modes, args.server_modes) == ([2, 8], [], ["eager", "ggml"])
    defaults = serving._parser().parse_args([])
    assert defaults.batches == [1, 4, 16] and defaults.server_modes == ["ggml", "quantized"]
    assert defaults.modes == ["eager", "quantized", "ggml", "compiled"]


def test_the_token_bar_holds_every_float_mode_to_eager_and_not_ggml() -> None:
    """README.md:251-254 (`--check`: "the greedy tokens of every float mode equal to eager's")
    and :182 (ggml's tokens are llama.cpp's program, "not a bar"): compiled and quantized
    each get a token bar that fails when their tokens leave eager's; ggml, whose tokens differ
    too, gets none. Planted: compiled left out of the bar (`not in ("eager", "ggml",
    "compiled")`), ggml held to it (`not in ("eager",)`), the bar always passing."""
    verdicts = _verdicts(
        _side("eager", tokens=(1, 2, 3)),
        _side("compiled", tokens=(1, 2, 3)),
        _side("quantized", tokens=(1, 2, 4)),
        _side("ggml", tokens=(1, 5, 6)),
    )
    token_bars = [v for v in verdicts if "greedy tokens" in v]
    assert token_bars == [
        "PASS compiled greedy tokens = eager's",
        "FAIL quantized greedy tokens = eager's",
    ]


def test_ggmls_token_line_says_it_is_no_bar(capsys) -> None:
    """README.md:182: the ggml mode's token comparison line carries "(llama.cpp's numerics:
    another program, not a bar)"; the other modes' lines do not. Planted: the note keyed to
    another name (dropped)."""
    bench._print_tokens(
        [_side("eager"), _side("ggml", tokens=(1, 9, 9)), _side("quantized", tokens=(1, 2, 3))]
    )
    assert capsys.readouterr().out.splitlines() == [
        "greedy tokens identical to eager: ggml 1/3 (llama.cpp's numerics: another program, "
        "not a bar)",
        "greedy tokens identical to eager: quantized 3/3",
    ]


def test_a_ratio_exactly_at_its_bar_passes() -> None:
    """README.md:251-253: the bars are "at least" (quantized decode at least 2x transformers'
    and 0.75x llama.cpp's, ggml's decode and prefill at least llama.cpp's, eager's load 5x
    faster): a side exactly at a bar passes (the ratios here are exact in binary). Planted:
    `ratio > least`."""
    verdicts = _verdicts(
        _side("eager", load=1.0, decode_tps=10.0),
        _side("quantized", decode_tps=30.0),
        _side("ggml", prefill_tps=100.0, decode_tps=40.0),
        _side("transformers", load=5.0, decode_tps=10.0),
        _side("llama.cpp", load=math.nan, prefill_tps=100.0, decode_tps=40.0, tokens=None),
    )
    assert [v.split()[0] for v in verdicts] == ["PASS"] * len(verdicts), verdicts
    assert len(verdicts) == 7  # load, 5 ratio bars, quantized's tokens


def _fake_bench_run(monkeypatch, tmp_path, argv: list[str], quantized_tps: float) -> int:
    """bench.main on made-up sides: quantized and ggml engines (3 tokens in 0.2 s at
    `quantized_tps`, ggml at 50 tok/s), transformers at 10 tok/s, no llama.cpp found."""

    def side(name, decode_tps):
        made = bench.Side(name, 1.0, 10**8, lambda ids, n: ([1] * n, 0.01, (n - 1) / decode_tps))
        made.engine = types.SimpleNamespace(
            tokenizer=types.SimpleNamespace(encode=lambda text: [1, 2, 3]), config=None
        )
        return made

    speeds = {"quantized": quantized_tps, "ggml": 50.0}
    monkeypatch.setattr(bench, "freeze_imported_objects", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(bench, "_engine_side", lambda path, mode: side(mode, speeds[mode]))
    monkeypatch.setattr(bench, "_transformers_side", lambda path, config: side(bench.PEER, 10.0))
    monkeypatch.setattr(bench, "_llama_cpp_side", lambda *args: None)
    monkeypatch.setattr(bench, "_llama_cpp_no_repack_side", lambda *args: None)
    monkeypatch.setattr(bench, "measure_read_bandwidth", lambda: (10.0, 0.1))
    base = [f"--gguf={tmp_path / 'model.gguf'}", "--modes=quantized,ggml", "--no-sampling"]
    return bench.main([*base, "--repeats=1", "--new-tokens=3", *argv])


@pytest.mark.parametrize(
    ("argv", "quantized_tps", "status"),
    [
        (["--check", "--no-llama-cpp"], 40.0, 0),  # llama.cpp's bars SKIP, on purpose
        (["--check"], 40.0, 1),  # llama.cpp's bars SKIP: not judged, a failure
        (["--check", "--no-llama-cpp"], 15.0, 1),  # quantized below 2x transformers
        ([], 15.0, 0),  # without --check the bars are printed only
    ],
)
def test_main_exits_by_its_check(argv, quantized_tps, status, tmp_path, monkeypatch, capsys):
    """README.md:251-255 through `bench.main`: `--check` exits 1 below a bar, and 1 when a
    bar's peer (llama.cpp) was not measured, unless `--no-llama-cpp` left it out; without
    `--check`, 0. Planted: main passing `no_llama_cpp=True` (or False) to check_status
    whatever the flag, or returning 0 whatever the verdicts."""
    assert _fake_bench_run(monkeypatch, tmp_path, argv, quantized_tps) == status
    out = capsys.readouterr().out
    quantized_bar = "quantized/transformers: decode >= 2.0"
    assert f"{'PASS' if quantized_tps >= 20 else 'FAIL'} {quantized_bar}" in out
    assert "SKIP ggml/llama.cpp: decode >= 1.0 (llama.cpp not measured)" in out


@pytest.mark.parametrize("modes", ["eager,turbo", ","])
def test_bench_refuses_an_unknown_or_empty_mode_list_before_any_timing(
    modes, monkeypatch, capsys
) -> None:
    """README.md:139 (`bench --modes`, of the engine's four modes): a name that is no mode, or
    no name at all, exits 2 naming the choices before anything loads. Planted: the check
    reduced to `if not modes` (turbo reached the load), or to `if unknown` (an empty list
    reached `engines[0]`, an IndexError traceback). torch.set_num_threads raises if reached."""

    def reached(*_):
        raise AssertionError("the bench went past its argument checks")

    monkeypatch.setattr(torch, "set_num_threads", reached)
    monkeypatch.setattr(bench, "freeze_imported_objects", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        bench.main([f"--modes={modes}"])
    assert exit_info.value.code == 2
    assert f"--modes={modes}: choose from eager, compiled, quantized, ggml" in (
        capsys.readouterr().err
    )
