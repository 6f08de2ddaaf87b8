"""The eval slice judged against its golden: SmolLM2's float32 base and its Q8_0, Q4_0 and Q4_1
members over the first two 512-token chunks of the slice, each quantized member in the eager
and ggml modes; and a planted bug of each kind the slice can suffer (scoring, statistics, a
changed checkpoint), each failing the same check."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import gguf
import numpy as np
import pytest

from harness.llama3 import checkpoint_mutations
from testing import gguf_files
from tools.eval_slice import checkpoints, eval_slice, slice_stats
from tools.eval_slice.tests.conftest import CHUNKS

MODES = ("eager", "ggml")


@pytest.fixture(scope="module")
def logits() -> dict:
    """The models' scored logits, computed once in this module (engine_rows' `memo`): the
    planted scoring bugs score the same forwards again, under the planted scoring."""
    return {}


@pytest.fixture(scope="module")
def run(family, text, logits):
    rows, count = eval_slice.engine_rows(family, text, eval_slice.N_CTX, CHUNKS, MODES, logits)
    return eval_slice.setup_of(family, text, eval_slice.N_CTX, count), rows


def test_the_engine_passes_the_eval_slice_golden(run, golden) -> None:
    setup, rows = run
    print(eval_slice.table(rows, {}))
    assert eval_slice.setup_failures(golden, setup) == []
    assert eval_slice.row_failures(golden, rows) == []
    assert len(rows) == 1 + 3 * len(MODES)  # the base, three quantized members in two modes
    # What the slice shows, as a reader of the table would check it: quantization costs
    # perplexity in order of bits, and Q4_1 in the eager mode is its own base (the base is
    # its weights dequantized), so it diverges from it by nothing.
    base = rows["f32/eager"]["ppl"]
    assert base < rows["q8_0/ggml"]["ppl"] < rows["q4_0/ggml"]["ppl"]
    assert rows["q8_0/ggml"]["kld_mean"] < rows["q4_0/ggml"]["kld_mean"]
    assert rows["q4_1/eager"]["kld_max"] < 1e-9 and rows["q4_1/eager"]["same_top"] == 1.0


# --- planted bugs: each moves a figure outside its bound --------------------------------------

PLANT_ROWS = ("f32/eager", "q4_0/ggml")


def _off_by_one_targets(piece, n_ctx):  # each row scored against its own token
    rows = slice_stats.scored(n_ctx)
    return list(piece[rows.start : rows.stop])


def _reversed_kl(base, logp):  # KL(model || base)
    return (logp.exp() * (logp - base)).sum(dim=1)


def _unnormalized(logits):  # log-softmax left out
    return logits.double()


def _nearest_percentile(sorted_values, fraction):  # no interpolation
    return float(sorted_values[round(fraction * (len(sorted_values) - 1))])


def _error_over_n(values):  # the standard error's variance over N, not N - 1
    n = len(values)
    mean = float(values.mean())
    variance = float((values.astype("float64") ** 2).mean()) - mean * mean
    return mean, (variance / n) ** 0.5 if n > 10 and variance > 0 else 0.0


PLANTS = {
    "error_over_n": ("mean_and_error", _error_over_n),
    "targets_off_by_one": ("targets", _off_by_one_targets),
    "kl_reversed": ("kl_divergence", _reversed_kl),
    "no_log_softmax": ("log_probs", _unnormalized),
    "percentile_not_interpolated": ("percentile", _nearest_percentile),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_scoring_bug_fails_the_golden(
    plant, family, text, golden, logits, monkeypatch
) -> None:
    name, replacement = PLANTS[plant]
    monkeypatch.setattr(slice_stats, name, replacement)
    subset = {key: family[key] for key in ("f32", "q4_0")}
    rows, _ = eval_slice.engine_rows(subset, text, eval_slice.N_CTX, CHUNKS, ["ggml"], logits)
    failures = eval_slice.row_failures(golden, rows, partial=True)
    print("\n".join(failures))
    assert failures, f"{plant}: the golden check let it through"


def test_a_changed_checkpoint_fails_the_golden(family, text, golden, logits, tmp_path) -> None:
    """One weight matrix of the Q4_0 member scaled by 1.002 (checkpoint_mutations.weight_scaled):
    its row's figures move, the base's do not (the changed file is another checkpoint: its
    forwards are computed, the base's read from the module's)."""
    mutation = checkpoint_mutations.BY_NAME["weight_scaled"]
    changed = checkpoint_mutations.mutated_copy(family["q4_0"], mutation, tmp_path)
    subset = {"f32": family["f32"], "q4_0": changed}
    rows, _ = eval_slice.engine_rows(subset, text, eval_slice.N_CTX, CHUNKS, ["ggml"], logits)
    failures = eval_slice.row_failures(golden, rows, partial=True)
    print("\n".join(failures))
    assert failures and all(failure.startswith("q4_0/ggml ") for failure in failures)


def test_a_moved_figure_is_named_with_its_bound(golden) -> None:
    rows = {key: dict(row) for key, row in golden["rows"].items()}
    assert eval_slice.row_failures(golden, rows) == []
    rows["q8_0/ggml"]["kld_p99"] *= 1 + 2 * eval_slice.RELATIVE
    rows["q4_0/eager"]["same_top"] += 3 / golden["rows"]["q4_0/eager"]["tokens"]
    del rows["q4_1/ggml"]
    failures = eval_slice.row_failures(golden, rows)
    assert {failure.split(":")[0] for failure in failures} == {
        "q8_0/ggml kld_p99",
        "q4_0/eager same_top",
        "q4_1/ggml",
    }
    assert len(failures) == 3


def test_a_golden_from_another_setup_is_refused(run, golden) -> None:
    setup, _ = run
    other = dataclasses.replace(setup, chunks=setup.chunks + 1)
    (failure,) = eval_slice.setup_failures(golden, other)
    assert failure.startswith("setup chunks: golden 2, this run 3")


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gguf=/nonexistent.gguf"], "--gguf=/nonexistent.gguf: no such file"),
        ([f"--gguf={eval_slice.TEXT}"], f"--gguf={eval_slice.TEXT}: not a GGUF checkpoint"),
        (["--text=/nonexistent.txt"], "--text=/nonexistent.txt: no such file"),
        (["--modes=fast"], "--modes=fast: choose from eager, quantized, ggml"),
        (["--n-ctx=2"], "--n-ctx=2: give at least 4"),
        (["--check=/nonexistent.json"], "--check=/nonexistent.json: [Errno 2]"),
        ([f"--check={eval_slice.TEXT}"], f"--check={eval_slice.TEXT}: Expecting value"),
        (["--json=/nonexistent/rows.json"], "--json=/nonexistent/rows.json: /nonexistent is not"),
        (["--write-golden=/tmp"], "--write-golden=/tmp: /tmp is a folder; name a file"),
        (["--threads=0"], "argument --threads: 0: give at least 1"),
    ],
)
def test_bad_input_exits_2_naming_it(argv, says, tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.eval_slice.eval_slice", f"--cache={tmp_path}", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_a_text_shorter_than_a_chunk_is_refused(family, tmp_path) -> None:
    with pytest.raises(eval_slice.SliceError, match="fewer than one chunk of --n-ctx=512"):
        eval_slice.engine_rows({"f32": family["f32"]}, "Too short.", 512, 0, ["ggml"])


def test_llama_perplexity_output_missing_its_figures_is_run_once_more(tmp_path) -> None:
    """llama-perplexity's logging thread can lose its last lines at exit: a run without the
    figures is run again; a second run without them is an error naming what is missing."""
    counter = tmp_path / "runs"
    final = 'echo "Final estimate: PPL = 4.5 +/- 0.25"'
    flaky = f'echo x >> {counter}; [ "$(wc -l < {counter})" -ge 2 ] && {final}; true'
    output = eval_slice._run_printing(["sh", "-c", flaky], eval_slice._BASE_FIGURES)
    assert eval_slice._FINAL.search(output).groups() == ("4.5", "0.25")
    assert counter.read_text().count("x") == 2
    with pytest.raises(eval_slice.SliceError, match=r"printed no Final estimate \(twice\)"):
        eval_slice._run_printing(["sh", "-c", "echo '[1]28.7,'"], eval_slice._BASE_FIGURES)


def _refused_before_work(argv: list[str], monkeypatch, capsys) -> str:
    """eval_slice's exit status and stderr for `argv`, with the family's files and the scoring
    replaced by an AssertionError: bad input must be refused before either."""

    def no_family(*args, **kwargs):
        raise AssertionError("the family was built")

    def no_scoring(*args, **kwargs):
        raise AssertionError("the slice was scored")

    monkeypatch.setattr(eval_slice.checkpoints, "family", no_family)
    monkeypatch.setattr(eval_slice, "engine_rows", no_scoring)
    try:
        code = eval_slice.main(argv)
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("chunks", ["-1", "0"])
def test_chunks_below_one_is_refused_naming_chunks(chunks, tmp_path, monkeypatch, capsys) -> None:
    """--chunks=-1 used to reach the scoring and blame --n-ctx (0.01 s)."""
    argv = [f"--cache={tmp_path}", "--no-llama-cpp", f"--chunks={chunks}"]
    err = _refused_before_work(argv, monkeypatch, capsys)
    assert f"argument --chunks: {chunks}: give at least 1" in err


@pytest.mark.parametrize(
    ("file", "says"),
    [
        ("tiny_llama.gguf", "is ALL_F32 with weight rows of 16 values (blk.0.attn_q.weight)"),
        (
            "tiny_llama_q4_k.gguf",
            "is MOSTLY_Q4_K_S (weights Q4_K); the slice builds its family "
            "from F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights",
        ),
    ],
)
def test_a_checkpoint_the_family_cannot_be_built_from_is_refused_first(
    file, says, tmp_path, monkeypatch, capsys
) -> None:
    """The tiny checkpoints used to fail after 20-30 s in gguf-py's quantizers (QuantError on
    16-value rows, NotImplementedError for Q4_K), members left in the cache: now exit 2 naming
    the file's type, nothing in the cache (0.05 s each)."""
    from harness.llama3.variants import testdata_directory

    source = testdata_directory() / file
    cache = tmp_path / "cache"
    err = _refused_before_work(
        [f"--gguf={source}", f"--cache={cache}", "--no-llama-cpp"], monkeypatch, capsys
    )
    assert f"eval_slice: error: --gguf={source} {says}" in err
    assert not cache.exists()


def _one_matrix_gguf(path, width: int, file_type: int | None):
    """A GGUF of one F32 matrix [width, width] and `file_type` as general.file_type (None:
    none recorded): what family_of reads before it builds anything."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        writer.add_uint32("general.file_type", file_type)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((width, width), np.float32))
    gguf_files.finish(writer)
    return path


def test_a_member_is_named_by_its_file_type_and_an_unknown_one_by_its_number(
    tmp_path, monkeypatch
) -> None:
    """The source's member name: a file type gguf-py does not name (a newer writer's) used to
    raise ValueError in family_of, which reported the checkpoint as "not a GGUF checkpoint".
    family_of on such a file (one F32 matrix of whole blocks; the family's writing skipped)
    names the source file_type_9999."""
    assert checkpoints.member_name(3) == "q4_1"  # MOSTLY_Q4_1
    assert checkpoints.member_name(0) == "f32"  # ALL_F32
    assert checkpoints.member_name(None) == "source"
    assert checkpoints.member_name(9999) == "file_type_9999"
    source = _one_matrix_gguf(tmp_path / "newer.gguf", 32, file_type=9999)
    monkeypatch.setattr(eval_slice.checkpoints, "family", lambda source, folder, skip: {})
    assert eval_slice.family_of(source, tmp_path / "cache") == {"file_type_9999": source}
    # no general.file_type, rows of 16 values: refused, saying it records none
    ragged = _one_matrix_gguf(tmp_path / "ragged.gguf", 16, file_type=None)
    with pytest.raises(eval_slice.SliceError, match="is of no recorded file type with weight rows"):
        eval_slice.family_of(ragged, tmp_path / "cache")


def test_an_unwritable_json_path_is_refused_before_scoring(tmp_path, monkeypatch, capsys) -> None:
    """--json=/sys/e.json used to traceback after the scoring: now exit 2 naming --json before
    it (no file can be created in /sys, by root or not; 0.01 s)."""
    argv = [f"--cache={tmp_path}", "--no-llama-cpp", "--json=/sys/e.json"]
    err = _refused_before_work(argv, monkeypatch, capsys)
    assert "eval_slice: error: --json=/sys/e.json" in err
    assert "cannot create files in /sys" in err


def test_a_write_that_fails_after_scoring_exits_2(tmp_path, monkeypatch, capsys) -> None:
    """A --json write that fails after the up-front check passed (a disk filled during the run)
    is one line and exit 2, not a traceback with exit 1, the status of a failed golden. The
    family and the scoring are replaced by one made-up row (0.01 s)."""
    row = {"ppl": 2.0, "ppl_err": 0.1, "tokens": 255.0}
    monkeypatch.setattr(eval_slice, "family_of", lambda source, cache: {})
    monkeypatch.setattr(eval_slice, "engine_rows", lambda *args: ({"f32/eager": row}, 1))
    monkeypatch.setattr(eval_slice, "setup_of", lambda *args: eval_slice.Setup("t", 512, 1, {}))

    def disk_full(path, content):
        raise eval_slice.PathError(f"cannot write {path} (No space left on device)")

    monkeypatch.setattr(eval_slice, "write_atomically", disk_full)
    out = tmp_path / "rows.json"
    code = eval_slice.main([f"--cache={tmp_path}", "--no-llama-cpp", f"--json={out}"])
    assert code == 2
    assert (
        f"eval_slice: error: cannot write {out} (No space left on device)"
        in capsys.readouterr().err
    )


# --- the statistics, the chunking and the family on made-up values (no forwards) ---------------


def test_percentiles_interpolate_at_fraction_times_n_minus_1_even_for_one_value() -> None:
    """slice_stats' docstring: percentiles by linear interpolation on the sorted values at
    fraction * (N - 1). One value is every percentile (a one-token slice, --n-ctx=4
    --chunks=1: the top index is clamped, not read past the end). Catches `high = low + 1`
    without the clamp (IndexError at N = 1), interpolation at fraction * N, and the two
    weights swapped (0.01 s)."""
    tens = np.arange(11, dtype=np.float64) * 10  # 0, 10, ..., 100
    assert slice_stats.percentile(tens, 0.99) == pytest.approx(99.0)
    assert slice_stats.percentile(tens, 0.999) == pytest.approx(99.9)
    assert slice_stats.percentile(tens, 0.5) == 50.0
    assert slice_stats.percentile(np.array([1.0, 3.0]), 0.99) == pytest.approx(2.98)
    assert slice_stats.percentile(np.array([0.25]), 0.99) == 0.25
    assert slice_stats.percentile(np.array([0.25]), 0.999) == 0.25


def test_the_standard_error_is_0_up_to_ten_values_and_over_n_minus_1_above() -> None:
    """mean_and_error's docstring: llama-perplexity's standard error, 0 when N <= 10, else
    sqrt(variance / (N - 1)). Ten values of variance 0.25 have none; 0..10 (variance 10) have
    exactly 1. Catches `n < 10` (ten values: 0.1667) (0.01 s)."""
    assert slice_stats.mean_and_error(np.array([0.0, 1.0] * 5)) == (0.5, 0.0)
    mean, error = slice_stats.mean_and_error(np.arange(11, dtype=np.float64))
    assert mean == 5.0 and error == pytest.approx(1.0)


def test_chunks_are_whole_and_at_most_max_chunks_each_starting_with_bos() -> None:
    """chunks' docstring: whole `n_ctx` pieces (the remainder dropped), at most `max_chunks`,
    all when it is 0, each piece's first token replaced by BOS. A --chunks above what the text
    holds gives the whole chunks there are, never a short one. Catches `count = max_chunks`
    without the min (a short and two empty chunks) (0.01 s)."""
    tokens = list(range(10))
    assert slice_stats.chunks(tokens, 4, 5, bos=-1) == [[-1, 1, 2, 3], [-1, 5, 6, 7]]
    assert slice_stats.chunks(tokens, 4, 0, bos=None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert slice_stats.chunks(tokens, 4, 1, bos=-1) == [[-1, 1, 2, 3]]
    assert slice_stats.chunks(tokens, 11, 0, bos=-1) == []


def test_a_figure_missing_from_a_row_fails_the_golden(golden) -> None:
    """row_failures: a figure the golden has and the row lacks is compared as NaN and fails
    (a member scored without the base has no KLD figures). Catches the comparison written
    `abs(value - golden) > bound`, which NaN passes (0.01 s)."""
    rows = {key: dict(row) for key, row in golden["rows"].items()}
    del rows["q4_0/ggml"]["kld_mean"]
    (failure,) = eval_slice.row_failures(golden, rows)
    assert failure.startswith("q4_0/ggml kld_mean: nan, golden 0.282756")


@pytest.mark.parametrize(
    ("option", "content", "says"),
    [
        ("--modes=,", None, "choose from eager, quantized, ggml"),
        ("--check", '{"schema": 1}', "not an eval-slice golden (eval_slice --write-golden)"),
        ("--check", "[1, 2]", "not an eval-slice golden (eval_slice --write-golden)"),
        # rows without the setup: a KeyError after the scoring, exit 1, before it was refused
        ("--check", '{"schema": 1, "rows": {}}', "not an eval-slice golden (eval_slice"),
        ("--text", "folder", "no such file"),
    ],
)
def test_more_bad_input_is_refused_before_the_family_is_built(
    option, content, says, tmp_path, monkeypatch, capsys
) -> None:
    """Exit 2 naming the option, before the family's files and the scoring: --modes naming no
    mode, a --check file that is JSON but not a golden (it used to be read as one after the
    minutes of scoring: KeyError, exit 1, the status of a failed golden), a --text that is a
    folder. Catches the `not modes` test dropped, the golden's "rows" or "setup" test dropped, and
    --text checked with exists() instead of is_file() (0.01 s each)."""
    if content is None:
        given = option
    elif content == "folder":
        given = f"{option}={tmp_path}"
    else:
        path = tmp_path / "golden.json"
        path.write_text(content, encoding="utf-8")
        given = f"{option}={path}"
    err = _refused_before_work(
        [f"--cache={tmp_path}", "--no-llama-cpp", given], monkeypatch, capsys
    )
    assert f"{given}: {says}" in err


def test_n_ctx_4_the_least_accepted_is_scored(tmp_path, monkeypatch, capsys) -> None:
    """--n-ctx: "give at least 4" means 4 itself is taken (one scored token a chunk) and
    reaches the scoring with it. The family and the scoring are replaced by one made-up row.
    Catches the refusal written `<= 4` (0.01 s)."""
    seen = []
    row = {"ppl": 2.0, "ppl_err": 0.0, "tokens": 1.0}

    def scoring(family, text, n_ctx, max_chunks, modes):
        seen.append((n_ctx, max_chunks, modes))
        return {"f32/eager": row}, 1

    monkeypatch.setattr(eval_slice, "family_of", lambda source, cache: {})
    monkeypatch.setattr(eval_slice, "engine_rows", scoring)
    argv = [f"--cache={tmp_path}", "--no-llama-cpp", "--n-ctx=4", "--chunks=1", "--modes=ggml"]
    assert eval_slice.main(argv) == 0
    assert seen == [(4, 1, ["ggml"])]
    assert "1 chunks of 4 tokens, 1 tokens scored" in capsys.readouterr().out


def test_the_family_is_written_once_per_folder_without_the_sources_own_type(
    tmp_path, monkeypatch
) -> None:
    """checkpoints' docstring: the files are written once per folder and reused; no member of
    the source's own type (`skip`). write_member replaced by one that writes a marker. Catches
    family() writing every member on every call (0.01 s)."""
    written = []

    def write(source, name, out):
        written.append(name)
        out.write_text(name)
        return out

    monkeypatch.setattr(checkpoints, "write_member", write)
    source = tmp_path / "Model.Q8_0.gguf"
    first = checkpoints.family(source, tmp_path / "family", skip="q8_0")
    assert first == {name: tmp_path / "family" / f"Model.{name}.gguf" for name in ("f32", "q4_0")}
    assert checkpoints.family(source, tmp_path / "family", skip="q8_0") == first
    assert written == ["f32", "q4_0"]


def test_a_member_records_its_file_type_and_keeps_norms_and_the_embeddings_type(tmp_path) -> None:
    """checkpoints' docstring, on a made-up source (Q8_0 embedding and matrix, an F32 norm,
    general.file_type MOSTLY_Q8_0): the Q4_0 member records MOSTLY_Q4_0, its matrix is Q4_0,
    its embedding keeps the source's Q8_0, its norm stays F32; the base records ALL_F32 and
    holds every value the source holds, dequantized exactly. Catches the source's
    general.file_type copied into every member (the Bazel family's bytes, and so the golden's
    file digests, move only in the slow lanes) (0.1 s)."""
    Q8_0, Q4_0, F32 = (getattr(gguf.GGMLQuantizationType, t) for t in ("Q8_0", "Q4_0", "F32"))
    rng = np.random.default_rng(0)
    matrix, embedding = rng.standard_normal((2, 32, 64), dtype=np.float32)
    source = tmp_path / "tiny.q8_0.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor(checkpoints.EMBEDDING, gguf.quants.quantize(embedding, Q8_0), raw_dtype=Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(matrix, Q8_0), raw_dtype=Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    gguf_files.finish(writer)

    def read(name):
        reader = gguf.GGUFReader(checkpoints.write_member(source, name, tmp_path / f"{name}.gguf"))
        file_type = int(reader.fields["general.file_type"].contents())
        return file_type, {t.name: t for t in reader.tensors}

    file_type, tensors = read("q4_0")
    assert file_type == gguf.LlamaFileType.MOSTLY_Q4_0
    assert tensors["blk.0.attn_q.weight"].tensor_type == Q4_0
    assert tensors[checkpoints.EMBEDDING].tensor_type == Q8_0
    assert tensors["blk.0.attn_norm.weight"].tensor_type == F32
    file_type, tensors = read("f32")
    assert file_type == gguf.LlamaFileType.ALL_F32
    assert {t.tensor_type for t in tensors.values()} == {F32}
    exact = gguf.quants.dequantize(gguf.quants.quantize(matrix, Q8_0), Q8_0)
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), exact)
