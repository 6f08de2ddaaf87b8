"""The hot-ops bench on its tiny shape: every op per mode and build in the table and the
record, numbers that agree with each other, each build's modules on that build's library,
and one-line refusals of bad options. No assertion compares two timings."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
from collections import defaultdict

import pytest

from pipelines.llama3 import kernel_library
from tools.bench import hot_ops

DECODE_OPS = {"qkv", "decode_attn", "attn_out", "swiglu", "down", "head"}
PREFILL_OPS = {"qkv", "prefill_attn", "attn_out", "swiglu", "down", "head"}
ARGS = ["--shapes=tiny", "--rows=1,64", "--context=32", "--repeats=1", "--threads=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    """One run of every mode and build this CPU runs: the printed table and the record."""
    path = tmp_path_factory.mktemp("hot_ops") / "hot_ops.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert hot_ops.main([*ARGS, f"--json={path}"]) == 0
    return out.getvalue(), json.loads(path.read_text())


def _table(text: str) -> list[list[str]]:
    """The table's rows, split into cells (mode, build, op, rows, ms, MB, GB/s, GFLOP/s,
    share)."""
    rows = [line.split() for line in text.splitlines()]
    return [cells for cells in rows if len(cells) == 9 and cells[0] in hot_ops.MODES]


def _runs() -> list[tuple[str, str]]:
    builds = [b for b in hot_ops.BUILDS if kernel_library.runnable(b)]
    return [("eager", "torch")] + [(mode, b) for mode in ("quantized", "ggml") for b in builds]


def test_table_has_every_op_per_mode_and_build(run) -> None:
    ops = defaultdict(set)
    for mode, build, op, rows, *_ in _table(run[0]):
        ops[mode, build.rstrip("*"), int(rows)].add(op)
    for mode, build in _runs():
        assert ops[mode, build, 1] == DECODE_OPS, (mode, build)
        assert ops[mode, build, 64] == PREFILL_OPS, (mode, build)
    assert len(ops) == 2 * len(_runs())


def test_numbers_are_positive_and_consistent(run) -> None:
    results = run[1]["results"]
    assert len(results) == 12 * len(_runs())
    for r in results:
        assert r["seconds"] > 0 and r["bytes"] > 0 and r["flops"] > 0
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-9)
        assert r["gflop_per_s"] == pytest.approx(r["flops"] / r["seconds"] / 1e9, rel=1e-9)
    printed = {(c[0], c[1].rstrip("*"), c[2], int(c[3])): c for c in _table(run[0])}
    for r in results:
        cells = printed[r["mode"], r["build"], r["op"], r["rows"]]
        assert float(cells[4]) == pytest.approx(r["seconds"] * 1e3, abs=6e-4)
        assert float(cells[5]) == pytest.approx(r["bytes"] / 1e6, abs=6e-3)
        assert float(cells[6]) == pytest.approx(r["gb_per_s"], abs=6e-3)
        assert float(cells[7]) == pytest.approx(r["gflop_per_s"], abs=6e-3)


def test_decode_shares_sum_to_one_per_mode_and_build(run) -> None:
    shares, step = defaultdict(float), defaultdict(float)
    for r in run[1]["results"]:
        if r["rows"] == 1:
            shares[r["mode"], r["build"]] += r["share"]
            step[r["mode"], r["build"]] += r["seconds"] * r["per_step"]
        else:
            assert r["share"] is None and r["per_step"] == 0
    assert sorted(shares) == sorted(_runs())
    assert all(total == pytest.approx(1.0) for total in shares.values())
    for entry in run[1]["decode_steps"]:
        assert entry["seconds"] == pytest.approx(step[entry["mode"], entry["build"]])
    percent = defaultdict(float)
    for mode, build, _, rows, *cells in _table(run[0]):
        if rows == "1":
            percent[mode, build] += float(cells[-1].rstrip("%"))
    assert all(total == pytest.approx(100.0, abs=0.5) for total in percent.values())


def test_record_says_what_was_measured(run) -> None:
    record = run[1]
    assert record["kind"] == "hot_ops"
    assert record["setup"]["rows"] == [1, 64] and record["setup"]["threads"] == 1
    assert record["setup"]["modes"] == ["eager", "quantized", "ggml"]
    assert {"cpu_model", "cpu_count"} <= set(record["machine"])
    heads = [r for r in record["results"] if r["op"] == "head" and r["rows"] == 1]
    tiny = hot_ops.SHAPES["tiny"]
    assert all(r["flops"] == 2 * tiny.dim * tiny.vocab for r in heads)
    assert {r["per_step"] for r in heads} == {1}


def test_ratios_divide_each_packed_op_by_the_eager_one(run) -> None:
    """The record's ratios, what perf_regression compares: each packed mode's and build's op
    over the eager op of the same rows, and a record that perf_regression reads."""
    from tools.bench import perf_regression

    record = run[1]
    expected = {
        f"tiny/{mode}/{build}": {
            f"{r['op']}@{r['rows']}": r["seconds"] / r["peer_seconds"]
            for r in record["results"]
            if (r["mode"], r["build"]) == (mode, build)
        }
        for mode, build in _runs()
        if mode != "eager"
    }
    assert len(expected) == len(_runs()) - 1 and all(len(g) == 12 for g in expected.values())
    assert record["ratios"] == expected
    assert all((r["peer_seconds"] is None) == (r["mode"] == "eager") for r in record["results"])
    assert perf_regression.check_record(pathlib.Path("hot_ops.json"), record) is record


def test_without_the_eager_mode_a_record_has_no_ratios(tmp_path) -> None:
    path = tmp_path / "quantized.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            hot_ops.main([*ARGS, "--modes=quantized", "--builds=portable", f"--json={path}"]) == 0
        )
    record = json.loads(path.read_text())
    assert record["ratios"] == {}
    assert {r["peer_seconds"] for r in record["results"]} == {None}


@pytest.mark.parametrize("build", [b for b in hot_ops.BUILDS if kernel_library.runnable(b)])
def test_modules_keep_the_build_they_were_made_with(build) -> None:
    """The in-process switch the docstring claims: each module calls its own build's library,
    and $LLAMA_GOLDENS_KERNELS is as before afterwards."""
    before = os.environ.get(kernel_library.KERNELS_ENV)
    weights = hot_ops.random_weights(hot_ops.SHAPES["tiny"])
    for mode in ("quantized", "ggml"):
        with hot_ops.kernel_build(build):
            layer = hot_ops.packed_layer(mode, hot_ops.SHAPES["tiny"], weights)
        assert layer.products["qkv"][0]._lib is kernel_library.load(build)
        assert layer.attention._lib is kernel_library.load(build)
    assert os.environ.get(kernel_library.KERNELS_ENV) == before


@pytest.mark.parametrize(
    ("option", "mentions"),
    [
        ("--modes=fast", "--modes=fast: choose from eager, quantized, ggml"),
        ("--shapes=gpt2", "--shapes=gpt2: choose from"),
        ("--builds=sse9", "--builds=sse9: choose from"),
        ("--rows=0,1", "--rows=0,1: give positive row counts"),
        ("--rows=one", "--rows=one"),
        ("--repeats=0", "--repeats=0: must be at least 1"),
        ("--context=0", "--context=0: must be at least 1"),
        ("--threads=0", "--threads=0: must be at least 1"),
        ("--repeats=many", "--repeats"),
    ],
)
def test_bad_options_exit_2_with_one_line(option, mentions, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        hot_ops.main(["--shapes=tiny", option])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_hot_ops: error: ") and mentions in err


def test_a_build_this_cpu_cannot_run_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset())  # plain x86-64
    with pytest.raises(SystemExit) as exit_:
        hot_ops.main(["--shapes=tiny", "--builds=avx2"])
    assert exit_.value.code == 2
    assert "--builds=avx2: this CPU cannot run avx2; it runs portable" in capsys.readouterr().err


def test_json_into_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        hot_ops.main(["--shapes=tiny", f"--json={tmp_path / 'file' / 'out.json'}"])
    assert exit_.value.code == 2
    assert "--json=" in capsys.readouterr().err


def test_json_naming_a_folder_exits_2_before_any_timing(tmp_path, monkeypatch, capsys) -> None:
    """--json=FOLDER is refused by the parser, not by write_record after the timings
    (IsADirectoryError, exit 1, the record lost)."""

    def reached(*_):
        raise AssertionError("bench_hot_ops timed a shape before checking --json")

    monkeypatch.setattr(hot_ops, "run_shape", reached)
    with pytest.raises(SystemExit) as exit_:
        hot_ops.main(["--shapes=tiny", f"--json={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--json={tmp_path} is a directory; name the file to write" in err, err
    assert list(tmp_path.iterdir()) == []


def test_help_starts_with_the_summary(capsys) -> None:
    with pytest.raises(SystemExit):
        hot_ops.main(["--help"])
    out = capsys.readouterr().out
    assert hot_ops.__doc__.splitlines()[0] in out
    assert "bazel run //tools:bench_hot_ops" in out


def test_the_star_marks_the_build_the_engine_picks_by_itself(run, monkeypatch) -> None:
    """hot_ops.py:27 ("A star marks the build the engine picks by itself"): in each packed
    mode's rows exactly one build carries the star, the one the engine loads without
    $LLAMA_GOLDENS_KERNELS (kernel_library.chosen: avx2 before portable for quantized, vnni
    first for ggml); eager's rows carry none. Planted: ggml's star taken from the quantized
    mode's order (avx2 on a VNNI CPU)."""
    monkeypatch.delenv(kernel_library.KERNELS_ENV, raising=False)
    starred = defaultdict(set)
    for mode, build, *_ in _table(run[0]):
        if build.endswith("*"):
            starred[mode].add(build.rstrip("*"))
    assert starred == {
        "quantized": {kernel_library.chosen(kernel_library.DEFAULT_ORDER)},
        "ggml": {kernel_library.chosen(kernel_library.GGML_ORDER)},
    }


def test_the_defaults_are_the_readmes(monkeypatch) -> None:
    """README.md:90: decode attention over `--context` cached positions (default 1024), at 1,
    64 and 512 rows, on SmolLM2-135M's and Llama-3-8B's shapes, in every mode and every build
    this CPU runs. Planted: another default context (512), rows (1,64) or shapes (smollm2)."""

    def reached(name, args):
        raise SystemExit((name, args))

    monkeypatch.setattr(hot_ops, "run_shape", reached)
    monkeypatch.setattr(hot_ops.torch, "set_num_threads", lambda threads: None)
    with pytest.raises(SystemExit) as stop:
        hot_ops.main([])
    name, args = stop.value.code
    assert name == "smollm2" and args.shape_list == ["smollm2", "llama3_8b"]
    assert (args.context, args.rows_list) == (1024, [1, 64, 512])
    assert args.mode_list == ["eager", "quantized", "ggml"]
    assert args.build_list == [b for b in hot_ops.BUILDS if kernel_library.runnable(b)]


def test_bytes_and_flops_are_the_docstrings(run) -> None:
    """hot_ops.py's docstring: a product reads its weights (eager: float32) and its input
    rows and does 2 x rows x in x out FLOPs (swiglu's gate and up: out 2 x ffn); attention
    reads q, k, v and the cached keys and values of the positions it sees (decode: --context
    cached and the new one; prefill: its rows) and does 4 x heads x head_dim per query and
    key it sees (prefill: causal, rows x (rows + 1) / 2 pairs). Planted: swiglu's out ffn,
    the values' cache left out of the bytes, prefill counting rows x rows pairs."""
    tiny = hot_ops.SHAPES["tiny"]
    heads, kv_heads, head_dim = tiny.n_heads, tiny.n_kv_heads, tiny.head_dim
    qkv_width = (heads + 2 * kv_heads) * head_dim
    eager = {(r["op"], r["rows"]): r for r in run[1]["results"] if r["mode"] == "eager"}
    for rows in (1, 64):
        swiglu = eager["swiglu", rows]
        assert swiglu["flops"] == 2 * rows * tiny.dim * 2 * tiny.ffn_dim
        assert swiglu["bytes"] == 2 * tiny.ffn_dim * tiny.dim * 4 + rows * tiny.dim * 4
        qkv = eager["qkv", rows]
        assert qkv["bytes"] == qkv_width * tiny.dim * 4 + rows * tiny.dim * 4
    for op, rows, keys, seen in (("decode_attn", 1, 33, 33), ("prefill_attn", 64, 64, 2080)):
        for r in run[1]["results"]:
            if (r["op"], r["rows"]) == (op, rows):
                assert r["context"] == keys
                assert r["flops"] == 4 * heads * head_dim * seen
                assert r["bytes"] == rows * qkv_width * 4 + 2 * kv_heads * keys * head_dim * 4


def test_an_ops_time_is_its_fastest_batch(monkeypatch) -> None:
    """hot_ops.py's docstring: an op's time is the fastest of --repeats batches (per call),
    one batch when its untimed call was slow; time_pair keeps each side's fastest of its
    alternating batches. Made-up batches. Planted: the mean of the batches kept."""
    batches = iter([0.3, 0.1, 0.2])
    monkeypatch.setattr(hot_ops, "_calibrate", lambda run: (4, False))
    monkeypatch.setattr(hot_ops, "_batch", lambda run, calls: next(batches))
    assert hot_ops.time_call(lambda: None, 3) == 0.1
    times = {"op": iter([0.3, 0.1, 0.2]), "peer": iter([0.5, 0.6, 0.4])}
    monkeypatch.setattr(hot_ops, "_batch", lambda run, calls: next(times[run()]))
    assert hot_ops.time_pair(lambda: "op", lambda: "peer", 3) == (0.1, 0.4)
    monkeypatch.setattr(hot_ops, "_calibrate", lambda run: (1, True))
    batches = iter([0.7, 0.01])
    monkeypatch.setattr(hot_ops, "_batch", lambda run, calls: next(batches))
    assert hot_ops.time_call(lambda: None, 3) == 0.7
