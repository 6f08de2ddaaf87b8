"""trace_tokens: where two runs' top tokens flip, and by how much (tools/trace_tokens)."""

from __future__ import annotations

import json
import math
import pathlib

import gguf
import pytest
import torch

from pipelines.llama3 import Llama3Engine
from tools.gen_tiny_model.tiny_llama import write_tiny_llama
from tools.trace_tokens import trace_tokens

TINY_128K = pathlib.Path("max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf")
PROMPT = "the cap the"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("trace_tokens")
    paths = {
        "f32": folder / "f32.gguf",
        "other_seed": folder / "other_seed.gguf",
        "q4_0": folder / "q4_0.gguf",
    }
    write_tiny_llama(paths["f32"], seed=0)
    write_tiny_llama(paths["other_seed"], seed=1)
    write_tiny_llama(paths["q4_0"], seed=0, weight_type=gguf.GGMLQuantizationType.Q4_0)
    return paths


def test_compare_reports_the_flip_the_margins_the_change_and_the_kl() -> None:
    a = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    b = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    same, flipped = trace_tokens.compare(a, b, [0, 1])
    assert not same.flipped and same.delta == 0 and same.kl == pytest.approx(0, abs=1e-15)
    assert same.margin == pytest.approx(1.0) and same.against_margin == pytest.approx(1.0)
    assert flipped.flipped and (flipped.token, flipped.against_top) == (1, 0)
    log_a = torch.log_softmax(a[1].double(), 0)
    log_b = torch.log_softmax(b[1].double(), 0)
    assert flipped.margin == pytest.approx(2.0)
    assert flipped.delta == pytest.approx(float(log_b[1] - log_a[1]))  # B less sure of A's token
    assert flipped.delta < 0
    assert flipped.kl == pytest.approx(float((log_a.exp() * (log_a - log_b)).sum()))


def _summary(steps: list[dict]) -> str:
    """The summary line the --json steps make: the first flip, the largest |Δ log-p| (its
    step), the largest KL and the smallest margin of A."""
    flips = [s["step"] for s in steps if s["flipped"]]
    worst = max(steps, key=lambda s: abs(s["delta"]))
    first = f" (first at step {flips[0]})" if flips else ""
    return (
        f"{len(steps)} steps, {len(flips)} flipped{first}; max |Δ log-p| "
        f"{abs(worst['delta']):.3g} at step {worst['step']}, max KL "
        f"{max(s['kl'] for s in steps):.3g}, smallest A margin "
        f"{min(s['margin'] for s in steps):.3g}"
    )


def test_a_run_against_itself_moves_nothing(files, capsys) -> None:
    assert trace_tokens.main([f"--gguf={files['f32']}", f"--prompt={PROMPT}"]) == 0
    out = capsys.readouterr().out
    assert "0 flipped; max |Δ log-p| 0 at step 0, max KL 0" in out


def test_another_checkpoint_flips_where_its_own_greedy_choice_differs(
    files, tmp_path, capsys
) -> None:
    record = tmp_path / "steps.json"
    argv = [f"--gguf={files['f32']}", f"--prompt={PROMPT}", f"--json={record}"]
    assert trace_tokens.main([*argv, f"--against-gguf={files['other_seed']}"]) == 1
    steps = json.loads(record.read_text())["steps"]
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary == _summary(steps)
    # these steps tell a wrong summary apart: flips at more than one step, a largest |Δ| that
    # is not the largest signed Δ, margins that differ
    flips = [s["step"] for s in steps if s["flipped"]]
    assert flips[0] != flips[-1]
    deltas = [s["delta"] for s in steps]
    assert max(deltas, key=abs) != max(deltas)
    assert summary.startswith("32 steps, 32 flipped (first at step 0); max |Δ log-p| 57.9 at ")
    # independently: A's greedy tokens, and B's own greedy choice fed A's tokens
    a = Llama3Engine.from_gguf(files["f32"])
    b = Llama3Engine.from_gguf(files["other_seed"])
    prompt = a.tokenizer.encode(PROMPT)
    tokens = list(a.generate(prompt, 32).tokens)
    fed = b.generate(prompt, len(tokens), stop_on_eos=False, forced_tokens=tokens)
    b_choices = list(fed.tokens)
    assert [s["token"] for s in steps] == tokens
    assert [s["flipped"] for s in steps] == [x != y for x, y in zip(tokens, b_choices, strict=True)]
    assert any(s["flipped"] for s in steps)
    assert all(math.isfinite(s["kl"]) and s["kl"] >= 0 for s in steps)
    assert max(abs(s["delta"]) for s in steps) > 0.1


def test_the_quantized_kernels_against_eager_move_only_by_summation_order(files, tmp_path, capsys):
    record = tmp_path / "steps.json"
    argv = [f"--gguf={files['q4_0']}", f"--prompt={PROMPT}", "--against-mode=quantized"]
    assert trace_tokens.main([*argv, f"--json={record}"]) == 0
    steps = json.loads(record.read_text())["steps"]
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary == _summary(steps) and " 0 flipped; " in summary
    assert 0 < max(abs(s["delta"]) for s in steps) < 1e-4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gguf=/nonexistent.gguf"], "--gguf=/nonexistent.gguf: no such file"),
        (["--gguf=/tmp"], "--gguf=/tmp is a folder; name the .gguf file in it"),
        ([f"--gguf={TINY_128K}", "--against-gguf=F32"], "not --gguf's 128256"),
        (["--gguf=F32", "--max-new-tokens=0"], "must be at least 1"),
        (["--gguf=F32", "--json=/nonexistent/steps.json"], "/nonexistent does not exist"),
        (["--gguf=F32", "--json=/tmp"], "--json=/tmp is a directory"),
    ],
)
def test_bad_input_exits_2_naming_it(args, message, files, capsys) -> None:
    args = [a.replace("F32", str(files["f32"])) for a in args]
    with pytest.raises(SystemExit) as exit_:
        trace_tokens.main([*args, f"--prompt={PROMPT}"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_record_that_cannot_be_written_exits_2_not_a_flip(files, tmp_path, capsys, monkeypatch):
    """--json written at the end: a write that fails is one line naming the file and exit 2
    (exit 1 means a token flipped)."""
    record = tmp_path / "steps.json"
    argv = [f"--gguf={files['f32']}", f"--prompt={PROMPT}", f"--json={record}"]

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", no_space)
    assert trace_tokens.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trace_tokens: error: cannot write {record}") and not record.exists()


def test_run_b_takes_as_mode_and_dtype_unless_told_otherwise(files, tmp_path, capsys) -> None:
    """README.md:80 and trace_tokens' options: run B is run A's checkpoint, mode and dtype
    unless `--against-gguf`, `--against-mode` or `--against-dtype` says otherwise. `--mode=
    quantized` alone compares the quantized mode with itself (nothing moves); `--against-dtype=
    bfloat16` runs B in bfloat16 (A's token log-probabilities move). Planted: B's mode
    defaulting to eager instead of --mode; --against-dtype ignored."""
    record = tmp_path / "steps.json"
    argv = [f"--gguf={files['q4_0']}", f"--prompt={PROMPT}", "--max-new-tokens=6"]
    assert trace_tokens.main([*argv, "--mode=quantized", f"--json={record}"]) == 0
    out = capsys.readouterr().out
    assert "B: q4_0.gguf (quantized, float32), fed A's tokens" in out
    written = json.loads(record.read_text())
    assert written["b"] == {"gguf": str(files["q4_0"]), "mode": "quantized", "dtype": "float32"}
    assert all(s["delta"] == 0 and s["kl"] == 0 for s in written["steps"])
    trace_tokens.main([*argv, "--against-dtype=bfloat16", f"--json={record}"])
    assert "B: q4_0.gguf (eager, bfloat16), fed A's tokens" in capsys.readouterr().out
    written = json.loads(record.read_text())
    assert written["b"]["dtype"] == "bfloat16"
    assert max(abs(s["delta"]) for s in written["steps"]) > 1e-4


def test_compare_gives_each_run_its_own_top_and_margin() -> None:
    """B's top token and margin are B's own ranking (log p(top) - log p(second) of B's row),
    not A's: here A is sure of token 0 by 2 nats, B of token 2 by 3 nats. Planted: B's margin
    taken from A's top value (a_top where b_top was meant) passed the other compare test,
    whose first row has equal margins and whose second row's B margin was not checked."""
    a = torch.tensor([[3.0, 1.0, 0.0]])
    b = torch.tensor([[0.0, 1.0, 4.0]])
    (step,) = trace_tokens.compare(a, b, [0])
    assert (step.token, step.against_top, step.flipped) == (0, 2, True)
    assert step.margin == pytest.approx(2.0)
    assert step.against_margin == pytest.approx(3.0)


def test_one_flip_exits_1_and_the_table_shows_both_tokens_marking_that_step(
    files, tmp_path, capsys
) -> None:
    """README.md:80: per step both tokens, the flip marked; exit 1 when a token flips. Against
    its Q4_0 copy the F32 checkpoint keeps step 0 (B's margin 2.2 nats) and flips step 1 (A
    sure by 5.5 nats, B's own choice another token): one flip, so exit 1; each table row names
    A's token and B's top token (id, and text as the tokenizer decodes it: byte tokens all
    decode to the same replacement character) and only the flipped row ends
    "<- flip". Planted: exit 1 only for more than one flip; the mark put on a negative Δ
    log-p instead of a flip; B's column printing A's token (the other tests read only the
    summary line and --json)."""
    record = tmp_path / "steps.json"
    argv = [f"--gguf={files['f32']}", f"--prompt={PROMPT}", "--max-new-tokens=2"]
    argv += [f"--against-gguf={files['q4_0']}", f"--json={record}"]
    assert trace_tokens.main(argv) == 1
    steps = json.loads(record.read_text())["steps"]
    assert [s["flipped"] for s in steps] == [False, True]
    assert steps[0]["delta"] < 0  # the mark must follow the flip, not the sign of Δ log-p
    decode = Llama3Engine.from_gguf(files["f32"]).tokenizer.decode
    rows = capsys.readouterr().out.splitlines()[3:-1]
    assert len(rows) == len(steps)
    for row, s in zip(rows, steps, strict=True):
        a_text = f"{s['token']} {decode([s['token']])!r}"
        b_text = f"{s['against_top']} {decode([s['against_top']])!r}"
        assert row.startswith(f"{s['step']:>4}  {a_text:<22} {b_text:<22} "), row
        assert f"{s['margin']:>9.4f} {s['against_margin']:>9.4f}" in row, row
        assert row.endswith("  <- flip") == s["flipped"], row
