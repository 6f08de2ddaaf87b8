"""The bench's verdicts and printing from made-up sides: the --check bars (those of the modes
MODES has today, and ggml's against llama.cpp once it is a mode), a llama.cpp measured by
llama-bench (no load time, no tokens), the read-bandwidth line. No model runs here."""

from __future__ import annotations

import json
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


def _fake_batched_bench(tmp_path, monkeypatch):
    """A llama-batched-bench on the PATH that prints BATCHED_TABLE and writes its arguments
    to the file it returns; bench_serving's SmolLM2 file a name in tmp_path."""
    argv = tmp_path / "argv"
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {argv}\ncat <<'EOF'\n{BATCHED_TABLE}\nEOF\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(serving, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    return argv


def test_llama_cpp_runs_the_engines_forwards_and_is_counted_as_the_engine_is(
    tmp_path, monkeypatch
) -> None:
    """The served rows run a prefill (whose logits choose the first new token) and NEW - 1
    decode steps for PROMPT + NEW tokens a request; llama-batched-bench runs TG decode steps
    after its prefill and its S t/s counts PROMPT + TG. It gets -ntg NEW - 1 and its rate is
    B x (PROMPT + NEW) over its T s: the same forwards, the same tokens (it got -ntg NEW, one
    decode step more than the engine, before)."""
    argv = _fake_batched_bench(tmp_path, monkeypatch)
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
    _fake_bench(monkeypatch, quantized_tps)
    base = [f"--gguf={tmp_path / 'model.gguf'}", "--modes=quantized,ggml", "--no-sampling"]
    return bench.main([*base, "--repeats=1", "--new-tokens=3", *argv])


def _fake_bench(monkeypatch, quantized_tps: float) -> None:
    """_fake_bench_run's sides, patched in; bench.main not run."""

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


def test_sides_alternate_and_each_keeps_its_fastest_generation() -> None:
    """README.md:152-153 ("alternately in one process ... fastest of 3 alternating
    generations"): each round runs every side once, in turn, and each side keeps its fastest
    prefill and decode, not its last or first. Planted: the loops swapped (a side's repeats
    back to back), the last generation's time kept."""
    calls = []

    def side(name, prefill, decode):
        times = iter(zip(prefill, decode, strict=True))

        def greedy(ids, n):
            calls.append(name)
            return [1] * n, *next(times)

        return bench.Side(name, 1.0, 10**8, greedy)

    a = side("eager", (0.3, 0.1, 0.2), (2.0, 3.0, 1.0))
    b = side("transformers", (0.5, 0.6, 0.4), (4.0, 5.0, 6.0))
    bench._alternate([a, b], [1, 2, 3], NEW, 3)
    assert calls == ["eager", "transformers"] * 3
    assert (a.prefill_seconds, a.decode_seconds) == (0.1, 1.0)
    assert (b.prefill_seconds, b.decode_seconds) == (0.4, 4.0)


def test_the_bench_defaults_are_the_readmes() -> None:
    """README.md:84 and :152-153: every engine mode, 32 new tokens, fastest of 3, 2 threads;
    the sampled decode at temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, seed 0 on both
    sides (the engine's SamplerSettings and llama-server's request). Planted: --repeats 1,
    top_k 50 in DEFAULT_SAMPLER, the engine's or llama-server's seed left unset."""
    from pipelines.llama3.engine import MODES
    from tools.bench import sampled

    args = bench._parser().parse_args([])
    assert (args.new_tokens, args.repeats, args.threads) == (32, 3, 2)
    assert args.modes.split(",") == list(MODES)
    sampler = bench.settings_from_text(args.sampler)
    assert sampler == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    seen = []

    def generate(ids, n, stop_on_eos, sampling=None):
        seen.append(sampling)
        return types.SimpleNamespace(tokens=[1] * n, decode_seconds=1.0)

    engine = types.SimpleNamespace(generate=generate)
    sampled.measure({"quantized": engine}, None, [1, 2], 3, 1, sampler)
    assert seen[0] is None  # greedy first
    assert (seen[1].seed, seen[1].temperature, seen[1].top_k) == (0, 0.8, 40)
    server = sampled.LlamaServerSide.__new__(sampled.LlamaServerSide)
    asked = []
    server.completion = lambda ids, n, **fields: (
        asked.append(fields) or {"timings": {"predicted_per_second": 50.0}}
    )
    assert server.decode_tps([1, 2], 3, sampler) == 50.0
    assert asked == [{**sampler, "seed": 0}]


def _fake_llama_bench_side(name: str, decode_tps: float) -> bench.Side:
    """A llama.cpp side as llama-bench gives it: no load time (nan), no tokens."""
    made = bench.Side(name, math.nan, 96 * 10**6, lambda ids, n: (None, 0.02, (n - 1) / decode_tps))
    made.peer = types.SimpleNamespace(describe=lambda: f"llama-bench /usr/bin/llama-bench ({name})")
    made.no_tokens = "llama-bench times its own random token ids and returns no tokens"
    return made


@pytest.mark.parametrize("level", [None, "avx2"])
def test_the_json_record_holds_what_the_readme_lists(level, tmp_path, monkeypatch, capsys):
    """README.md:91 (`bench --json`: machine, versions, setup, load average and read
    bandwidth, per-mode timings, ratios), :158-159 (llama-bench's load null in the record),
    :221 (`llama.cpp-no-repack` a side of its own), :155 and :230-233 (`--cpu-level` runs
    llama.cpp through Debian's tools, never the binding, and a record of a level says so),
    through `bench.main` on made-up sides. Planted: the read bandwidth or the end load left
    out of `conditions`, the no-repack peer dropped from the record, the llama.cpp line not
    printed, `--cpu-level` not recorded in `setup`, the binding asked for at a level."""
    import sys

    _fake_bench(monkeypatch, 40.0)
    binding = []

    def llama_cpp_side(path, threads, context, use_binding=True):
        binding.append(use_binding)
        return _fake_llama_bench_side(bench.LLAMA_CPP, 20.0)

    monkeypatch.setattr(bench, "_llama_cpp_side", llama_cpp_side)
    no_repack = _fake_llama_bench_side(bench.LLAMA_CPP_NO_REPACK, 10.0)
    monkeypatch.setattr(bench, "_llama_cpp_no_repack_side", lambda *args: no_repack)
    loads = iter([1.5, 2.5])
    monkeypatch.setattr(bench, "load_average", lambda: next(loads))
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="9.9"))
    monkeypatch.setenv(bench.cpu_level.ENV, level or "")
    path = tmp_path / "bench.json"
    argv = [f"--gguf={tmp_path / 'model.gguf'}", "--modes=quantized,ggml", "--no-sampling"]
    argv += ["--repeats=1", "--new-tokens=3", "--threads=1", f"--json={path}"]
    assert bench.main(argv + ([f"--cpu-level={level}"] if level else [])) == 0
    assert binding == [level is None]
    out = capsys.readouterr().out.splitlines()
    assert "llama.cpp: llama-bench /usr/bin/llama-bench (llama.cpp)" in out
    assert ("cpu level avx2: this engine with " in "\n".join(out)) == (level is not None)
    data = json.loads(path.read_text())
    assert data["setup"] == {
        "checkpoint": "model.gguf",
        "device": "cpu",
        "dtype": "float32",
        "new_tokens": 3,
        "prompt_tokens": 3,
        "repeats": 1,
        "threads": 1,
        **({"cpu_level": level} if level else {}),
    }
    assert data["conditions"] == {
        "load_average_start": 1.5,
        "load_average_end": 2.5,
        "read_bandwidth_gb_per_s": 10.0,
    }
    assert {"cpu_model", "cpu_features", "cpu_count"} <= set(data["machine"])
    assert data["versions"]["transformers"] == "9.9"
    assert data["engine"]["quantized"]["decode_tokens_per_second"] == pytest.approx(40.0)
    assert sorted(data["peers"]) == ["llama.cpp", "llama.cpp-no-repack", "transformers"]
    assert data["peers"]["llama.cpp"]["load_seconds"] is None
    assert data["peers"]["llama.cpp"]["decode_tokens_per_second"] == pytest.approx(20.0)
    assert data["peers"]["llama.cpp-no-repack"]["decode_tokens_per_second"] == pytest.approx(10.0)
    assert sorted(data["peer_versions"]) == ["llama.cpp", "llama.cpp-no-repack"]
    assert data["ratios"]["quantized"] == pytest.approx(
        {"load": 1.0, "prefill": 1.0, "decode": 4.0}
    )
    assert data["ratios"]["ggml"]["decode"] == pytest.approx(5.0)


def _fake_llama_bench_binary(tmp_path) -> str:
    """A `llama-bench` that answers --version only (LlamaBenchPeer probes it once)."""
    script = tmp_path / "llama-bench"
    script.write_text("#!/bin/sh\necho 'version: 0.7.0 (build 11669, commit Debian)' >&2\n")
    script.chmod(0o755)
    return str(script)


def test_the_no_repack_side_is_the_same_llama_bench_with_repack_0_and_no_bar(tmp_path):
    """README.md:84 (`llama-bench --repack 0` too) and :221 (`llama.cpp-no-repack`, no bar):
    the llama.cpp side's own llama-bench again with `--repack 0` under its own name, its
    weights and no load or tokens like it, the llama.cpp side left as it was; and no --check
    bar is judged against it. Planted: the same peer reused (`--repack 1` twice), the side
    named llama.cpp (it then replaced llama.cpp's own in the bars)."""
    from tools.bench import llama_cpp_peer

    binary = _fake_llama_bench_binary(tmp_path)
    peer = llama_cpp_peer.LlamaBenchPeer(binary, tmp_path / "model.gguf", 2)
    llama = bench._peer_side(bench.LLAMA_CPP, peer, tmp_path / "model.gguf", file_bytes=123)
    side = bench._llama_cpp_no_repack_side(tmp_path / "model.gguf", 2, llama)
    assert (side.name, side.weight_bytes, side.no_tokens) == (
        "llama.cpp-no-repack",
        123,
        llama_cpp_peer.LlamaBenchPeer.NO_TOKENS,
    )
    assert math.isnan(side.load_seconds)
    command = side.peer.command(17, 31)
    assert command[command.index("--repack") + 1] == "0"
    assert side.peer.describe().endswith("--repack 0")
    assert llama.peer.command(17, 31)[command.index("--repack") + 1] == "1"
    no_repack = _side("llama.cpp-no-repack", load=math.nan, prefill_tps=1.0, decode_tps=1.0)
    assert _verdicts(_side("ggml"), _side("transformers"), no_repack) == [
        "SKIP ggml/llama.cpp: decode >= 1.0 (llama.cpp not measured)",
        "SKIP ggml/llama.cpp: prefill >= 1.0 (llama.cpp not measured)",
    ]


def test_llama_cpp_is_the_binding_then_llama_bench_then_none_with_a_line(
    tmp_path, monkeypatch, capsys
):
    """README.md:154-156: llama.cpp is its Python binding when that imports, else Debian's
    `llama-bench` on the PATH, else none with one line saying why; `--cpu-level` asks for no
    binding (bench.main passes binding=False), and llama-bench stands in even where the
    binding imports. A made-up binding and llama-bench stand in. Planted: the binding's
    condition inverted (llama-bench first), the line dropped."""
    import numpy as np

    from tools.bench import llama_cpp_peer

    model = types.SimpleNamespace(n_vocab=lambda: 32)
    binding = types.SimpleNamespace(__version__="0.3.36", Llama=lambda *a, **k: model)
    imports = [(binding, "llama-cpp-python 0.3.36")]
    monkeypatch.setattr(llama_cpp_peer, "import_llama_cpp", lambda: imports[-1])
    monkeypatch.setenv("PATH", str(tmp_path))
    _fake_llama_bench_binary(tmp_path)
    reader = types.SimpleNamespace(tensors=["w"], tensor_data=lambda name: np.zeros(10, np.int8))
    monkeypatch.setattr(bench, "GGUFFile", lambda path: reader)
    gguf = tmp_path / "model.gguf"
    assert isinstance(bench._llama_cpp_side(gguf, 2, 64).peer, llama_cpp_peer.LlamaCppPeer)
    at_level = bench._llama_cpp_side(gguf, 2, 64, binding=False)
    assert isinstance(at_level.peer, llama_cpp_peer.LlamaBenchPeer)
    assert (at_level.name, at_level.weight_bytes) == ("llama.cpp", 10)
    imports.append((None, "llama_cpp not importable (no module)"))
    assert isinstance(bench._llama_cpp_side(gguf, 2, 64).peer, llama_cpp_peer.LlamaBenchPeer)
    capsys.readouterr()
    (tmp_path / "llama-bench").unlink()
    assert bench._llama_cpp_side(gguf, 2, 64) is None
    assert capsys.readouterr().err == (
        "llama.cpp: skipped: llama_cpp not importable (no module); and no llama-bench on the "
        "PATH (tools/llama_cpp/install.sh installs it)\n"
    )


def test_the_read_bandwidth_is_the_best_of_its_sums(monkeypatch) -> None:
    """README.md:159-160 and the printed line ("best of 3"): the bandwidth is the tensor's
    bytes over the fastest of the timed sums, not the last or the slowest. Planted: the last
    sum's time kept. The clock is made up: 0.3, 0.1 and 0.2 s sums."""
    ticks = iter([0.0, 1.0, 1.3, 2.0, 2.1, 3.0, 3.2, 4.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    gb_per_s, seconds = bench.measure_read_bandwidth(mib=1, repeats=3)
    assert gb_per_s == pytest.approx(2**20 / 0.1 / 1e9)
    assert seconds == 4.0


def test_bench_serving_defaults_are_the_readmes() -> None:
    """README.md:87: 2 threads, 32 prompt + 16 new tokens a request, 16 concurrent HTTP
    clients (`--clients`). Planted: --clients 8, --threads 1."""
    args = serving._parser().parse_args([])
    assert (args.threads, args.prompt_tokens, args.new_tokens, args.clients) == (2, 32, 16, 16)


def test_bench_serving_runs_llama_batched_bench_again_with_no_repack(tmp_path, monkeypatch):
    """README.md:87 (the `no-repack` column: llama-batched-bench again with `--no-repack`):
    the default run passes no `--no-repack`, the no-repack run does. Planted: the condition
    inverted (the llama.cpp column then measured without repacking)."""
    argv = _fake_batched_bench(tmp_path, monkeypatch)
    args = serving._parser().parse_args(["--prompt-tokens=8", "--new-tokens=4"])
    assert serving.llama_cpp_batched(args, [1, 2])[1] == ""
    assert "--no-repack" not in argv.read_text().split()
    totals, why = serving.llama_cpp_batched(args, [1, 2], repack=False)
    assert why == "" and argv.read_text().split()[-1] == "--no-repack"
    assert sorted(totals) == [1, 2]


def test_bench_serving_servers_get_new_then_repeated_prompts_and_llama_server_16_slots(
    tmp_path, monkeypatch, capsys
):
    """README.md:87: llama-server with `--parallel 16` (one slot a client) and an f16 KV
    cache on the bench's threads; each server answers 16 clients in two rounds after a
    warm-up of other prompts, `new prompts` then `repeated prompts` (the same again), and
    the ratio this engine / llama-server per round. Made-up servers and rounds. Planted:
    the repeated round given the warm-up's prompts (as before), f32 caches, one slot."""
    import contextlib

    from goldens.engines import llama_server

    words = {word: i for i, word in enumerate(serving.WORDS)}
    tokenizer = types.SimpleNamespace(encode=lambda text: [words[w] for w in text.split(" ")])
    engine = types.SimpleNamespace(tokenizer=tokenizer)
    monkeypatch.setattr(serving.Llama3Engine, "from_gguf", lambda *a, **k: engine)
    monkeypatch.setattr(serving, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(serving.shutil, "which", lambda name: f"/usr/bin/{name}")
    started, rounds = [], {}

    class FakeServer:
        url = "http://llama-server/v1"

        def __init__(self, gguf, extra_args):
            started.append(extra_args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    @contextlib.contextmanager
    def own_server(mode, args):
        yield f"http://{mode}/v1"

    def server_rows(name, url, prompts, args):
        rounds[name] = prompts
        return {"new prompts": 150.0, "repeated prompts": 100.0}

    def llama_rows(name, url, prompts, args):
        return {"new prompts": 100.0, "repeated prompts": 200.0}

    monkeypatch.setattr(llama_server, "LlamaServer", FakeServer)
    monkeypatch.setattr(serving, "_own_server", own_server)
    monkeypatch.setattr(
        serving,
        "_server_rows",
        lambda name, *rest: (server_rows if name != "llama-server" else llama_rows)(name, *rest),
    )
    serving.servers(serving._parser().parse_args(["--modes=", "--server-modes=ggml"]))
    (extra,) = started
    pairs = dict(zip(extra[::2], extra[1::2], strict=True))
    assert pairs == {
        "--threads": "2",
        "--threads-batch": "2",
        "--parallel": "16",
        "--ctx-size": str(16 * 256),
        "--cache-type-k": "f16",
        "--cache-type-v": "f16",
    }
    prompts = rounds["this engine (ggml)"]
    assert list(prompts) == ["warm-up", "new prompts", "repeated prompts"]
    assert [len(p) for p in prompts.values()] == [16, 16, 16]
    assert prompts["repeated prompts"] == prompts["new prompts"]
    assert not {tuple(p) for p in prompts["warm-up"]} & {tuple(p) for p in prompts["new prompts"]}
    out = capsys.readouterr().out
    assert "this engine (ggml) / llama-server: new prompts 1.50, repeated prompts 0.50" in out


def test_bench_speculative_defaults_and_llama_servers_drafts(tmp_path, monkeypatch, capsys):
    """README.md:89: greedy, 64 tokens, K = 4, in the quantized mode; the self-draft of all
    layers by default; llama-server without a draft, with `--spec-type ngram-simple` and with
    the same file as `--model-draft` (`--spec-type draft-simple`), each up to K drafted.
    Made-up engine and rows. Planted: K 8 or 128 tokens by default, the self-draft one layer
    short, `draft-simple` or the K limit left out of llama-server's flags."""
    args = speculative._parser().parse_args([])
    assert (args.new_tokens, args.k, args.mode, args.draft_layers) == (64, 4, "quantized", None)
    config = types.SimpleNamespace(n_layers=30)
    tokenizer = types.SimpleNamespace(encode=lambda text: [1, 2, 3])
    engine = types.SimpleNamespace(config=config, tokenizer=tokenizer)
    gguf = str(tmp_path / "model.gguf")
    drafted, extras = [], []
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(speculative, "smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(speculative.Llama3Engine, "from_gguf", lambda *a, **k: engine)
    monkeypatch.setattr(
        speculative.speculative, "self_draft", lambda path, n, mode: drafted.append(n)
    )
    monkeypatch.setattr(
        speculative, "_engine_row", lambda e, d, name, ids, a: speculative.Row("engine", name, 1.0)
    )
    monkeypatch.setattr(speculative, "llama_server_missing", lambda not_wanted: "")

    def llama_row(path, name, extra, ids, a):
        extras.append((name, extra))
        return speculative.Row("llama-server", name, 1.0)

    monkeypatch.setattr(speculative, "_llama_row", llama_row)
    assert speculative.main([]) == 0
    assert drafted == [30]
    k = ("--spec-draft-n-max", "4")
    assert extras == [
        ("none", ()),
        ("n-gram", ("--spec-type", "ngram-simple", *k)),
        ("model", ("--model-draft", gguf, "--spec-type", "draft-simple", *k)),
    ]
    out = capsys.readouterr().out
    assert "greedy, 64 new tokens, K=4, 2 threads (engine mode quantized)" in out
    assert "30-layer self-draft" in out


def test_the_table_rows_are_each_sides_rates_weights_and_bandwidth(capsys) -> None:
    """bench.py's docstring (the table gives load seconds, prefill and decode tokens/s, the
    bytes of weights one decoded token reads and the bandwidth that implies): prefill is
    prompt tokens over the prefill's seconds, decode is NEW - 1 steps over the decode's seconds
    (the prefill chose the first token), MB at 1e6 bytes, GB/s at 1e9. Two sides whose
    numbers all differ. Planted: decode over NEW tokens (an off-by-one), prefill over the
    decode's seconds (a column swap)."""
    eager = _side("eager", prefill_tps=100.0, decode_tps=10.0)
    transformers = _side("transformers", load=10.0, prefill_tps=200.0, decode_tps=5.0)
    transformers.weight_bytes = 4 * 10**8
    bench._print_table([eager, transformers], PROMPT, NEW)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [
        ["load", "seconds", "1.00", "10.00"],
        ["prefill", "tok/s", "100.00", "200.00"],
        ["decode", "tok/s", "10.00", "5.00"],
        ["weights", "MB/token", "100.00", "400.00"],
        ["implied", "GB/s", "1.00", "2.00"],
    ]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--repeats=0", "--repeats=0 must be at least 1"),
        ("--new-tokens=1", "--new-tokens=1 must be at least 2 (one prefill, then decode steps)"),
    ],
)
def test_bench_refuses_no_repeats_or_no_decode_step_before_any_timing(
    option, message, monkeypatch, capsys
) -> None:
    """bench.main's checks: no alternating generation (--repeats=0 left every side's time
    inf, a table of 0.00) or no decode step (--new-tokens=1: decode tok/s 0 / 0) exits 2
    naming the flag before anything loads. Planted: `args.repeats < 0`, `args.new_tokens <
    1`. torch.set_num_threads raises if it is reached."""

    def reached(*_):
        raise AssertionError("the bench went past its argument checks")

    monkeypatch.setattr(torch, "set_num_threads", reached)
    monkeypatch.setattr(bench, "freeze_imported_objects", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        bench.main([option])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_sampled_section_keeps_each_sides_fastest_and_compares_like_with_like() -> None:
    """sampled.py's docstring: each side keeps its fastest of `repeats` alternating runs, the
    engine's decode rate is its new tokens after the first over the decode seconds, and each
    mode's line gives sampled over llama-server's sampled and greedy over llama-server's
    greedy. Made-up engine (5 tokens, 4 decode steps) and llama-server. Planted: the slowest
    run kept (`min` in _max), len(tokens) steps counted, the greedy ratio taken on the
    sampled rates."""
    from tools.bench import sampled

    engine_seconds = iter([2.0, 4.0, 0.5, 1.0, 1.0, 2.0])  # greedy, sampled, per round

    def generate(ids, n, stop_on_eos, sampling=None):
        return types.SimpleNamespace(tokens=[1] * n, decode_seconds=next(engine_seconds))

    server_rates = {False: iter([50.0, 70.0, 60.0]), True: iter([30.0, 20.0, 40.0])}
    llama = types.SimpleNamespace(
        decode_tps=lambda ids, n, sampler=None: next(server_rates[sampler is not None])
    )
    sampler = {"temperature": 0.8, "top_k": 40}
    engine = types.SimpleNamespace(generate=generate)
    rows = sampled.measure({"quantized": engine}, llama, [1, 2], 5, 3, sampler)
    assert [(r.name, r.greedy, r.sampled) for r in rows] == [
        ("quantized", 8.0, 4.0),
        ("llama-server", 70.0, 40.0),
    ]
    out = sampled.lines(rows, sampler, 3)
    assert out[-1] == "quantized/llama-server sampled decode: 0.100 (greedy 0.114)"


def test_bench_serving_server_rows_count_prompt_and_new_tokens(monkeypatch, capsys) -> None:
    """serving.py's docstring: each server round's total tokens/s is its clients' prompt and
    generated tokens over the round's wall time, with p50/p99 latency; the warm-up round is
    not counted. Made-up clients: 2 prompts of 8 + 4 tokens, 2 s then 1 s. Planted: the
    generated tokens alone counted."""
    times = iter([(9.0, [9.0, 9.0]), (2.0, [0.3, 0.1]), (1.0, [0.05, 0.25])])
    monkeypatch.setattr(serving, "_clients", lambda url, prompts, new: next(times))
    args = serving._parser().parse_args(["--prompt-tokens=8", "--new-tokens=4"])
    rounds = {name: [[1] * 8, [2] * 8] for name in ("warm-up", *serving.ROUNDS)}
    totals = serving._server_rows("llama-server", "http://x/v1", rounds, args)
    assert totals == {"new prompts": 12.0, "repeated prompts": 24.0}
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        ["llama-server", "new", "prompts", "2", "12.0", "200", "300"],
        ["llama-server", "repeated", "prompts", "2", "24.0", "150", "250"],
    ]


def test_bench_serving_batch_rows_give_each_rate_and_the_served_ratios(
    tmp_path, monkeypatch, capsys
) -> None:
    """serving.py's docstring: per mode and batch, total tokens/s (B x (prompt + new) over
    the wall time) served, sequential, llama.cpp and no-repack, then served/sequential,
    served/llama.cpp, served/no-repack and the scheduler's ms a step. Made-up engine, runs
    and llama-batched-bench (no no-repack number at batch 2: '-'). Planted: the ratio
    inverted (sequential/served)."""
    engine = types.SimpleNamespace()
    monkeypatch.setattr(serving.Llama3Engine, "from_gguf", lambda *a, **k: engine)
    monkeypatch.setattr(serving, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(serving, "_ggml_backend", lambda: "CPU")
    monkeypatch.setattr(serving, "_prompts", lambda e, count, length: [[1] * length] * count)
    monkeypatch.setattr(serving, "_sequential", lambda e, prompts, new: 2.0 * len(prompts))
    monkeypatch.setattr(serving, "_served", lambda e, prompts, new: (1.0 * len(prompts), 0.004))
    peers = {True: ({1: 20.0, 2: 40.0}, ""), False: ({1: 10.0}, "")}
    monkeypatch.setattr(serving, "llama_cpp_batched", lambda a, b, repack=True: peers[repack])
    args = serving._parser().parse_args(["--prompt-tokens=8", "--new-tokens=4", "--batches=1,2"])
    serving.batched(args, ["quantized"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert rows == [
        ["quantized", "1", "12.0", "6.0", "20.0", "10.0", "2.00", "0.60", "1.20", "4.00"],
        ["quantized", "2", "12.0", "6.0", "40.0", "nan", "2.00", "0.30", "-", "4.00"],
    ]


@pytest.mark.parametrize(("clients", "served"), [(22, [22]), (0, [])])
def test_bench_serving_accepts_22_clients_and_0_for_no_server_rows(
    clients, served, monkeypatch
) -> None:
    """--clients help ("at most 22 (0: no server rows)"): 22 clients are accepted and reach
    the server rows, 0 runs none. Planted: `args.clients < len(WORDS) // 2` (22 refused)."""
    reached = []
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(serving, "servers", lambda args: reached.append(args.clients))
    assert serving.main(["--modes=", f"--clients={clients}"]) == 0
    assert reached == served
