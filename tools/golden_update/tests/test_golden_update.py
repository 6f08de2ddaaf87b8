"""golden_update in a scratch repository: review first, publish only what changed, on purpose.

The goldens are synthetic (the regeneration is injected), the store, MODULE.bazel and the
distdir fragment are scratch copies, so every test checks what was published and pinned.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from goldens import schema
from goldens.artifacts import archive, stanza
from goldens.artifacts.sample_module import SAMPLE_MODULE
from goldens.artifacts.store import LocalStore, StoreError, ref_from_url
from tools.artifacts import upload_artifact
from tools.golden_update import golden_update

VOCAB, STEPS, TOP_K = 64, 4, 20
FLOAT32 = "tinyllama_float32_all_golden.json"
Q4_K = "tinyllama_q4_k_all_golden.json"
TORCH = "torch_tinyllama_float32_golden.json"
GGML = "ggml_tinyllama_q4_k_golden.json"


def _provenance(producer: str, encoding: str) -> schema.Provenance:
    return schema.Provenance(
        producer=producer,
        producer_version="llama3-engine/2" if producer == "engine" else "transformers/5",
        model="tinyllama",
        encoding=encoding,
        hardware="all",
        device="cpu",
        dtype="float32",
        checkpoint="tiny_llama.gguf",
        checkpoint_sha256="a" * 64,
        torch_version="2.13.0",
        logits_dtype="float32",
    )


def _logits(seed: int) -> np.ndarray:
    rows = np.cos(np.arange(VOCAB)[None, :] * (np.arange(STEPS)[:, None] + 1) * 0.7 + seed)
    logits = rows.astype(np.float32) * 2.0
    for i in range(STEPS):
        logits[i, 3 * i + 1] = 8.0
    return logits


def _golden(producer: str, encoding: str, logits: np.ndarray) -> schema.Golden:
    steps = [
        schema.step_from_logits(row, int(np.argmax(row)), f" t{int(np.argmax(row))}", TOP_K)
        for row in logits
    ]
    case = schema.Case("prose", "The capital of France is", [128000, 791], steps)
    return schema.Golden(_provenance(producer, encoding), [case])


BASE = {
    FLOAT32: _golden("engine", "float32", _logits(0)),
    Q4_K: _golden("engine", "q4_k", _logits(1)),
    TORCH: _golden("torch", "float32", _logits(0)),
    GGML: _golden("engine-ggml", "q4_k", _logits(2)),
}


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch repository whose store holds version 1 of both archives, pinned."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(golden_update, "_torch_inputs_changed", lambda pinned: [])
    root = tmp_path / "repo"
    (root / "third_party").mkdir(parents=True)
    (root / "MODULE.bazel").write_text(SAMPLE_MODULE)
    files = tmp_path / "v1"
    files.mkdir()
    for name, golden in BASE.items():
        schema.write(golden, files / name)
    for name, members in (
        ("test_llama_golden", [FLOAT32, Q4_K, GGML]),
        ("torch_llama_golden", [TORCH]),
    ):
        paths = [str(files / m) for m in members]
        code = upload_artifact.main(
            ["upload", name, "1", *paths, "--update-module", *_flags(root)[1:]]
        )
        assert code == 0
    return root


def _flags(root: Path) -> list[str]:
    return [
        f"--pending-dir={root / '.goldens-pending'}",
        f"--artifacts-dir={root / 'artifacts'}",
        f"--module-file={root / 'MODULE.bazel'}",
        f"--distdir-bazelrc={root / 'third_party' / 'golden_distdir.bazelrc'}",
    ]


def _regenerating(goldens: dict[str, schema.Golden]):
    """A regeneration that writes `goldens` (the engine's; torch's when asked) into pending."""
    calls = []

    def regenerate(pending: Path, args, with_torch: bool) -> None:
        calls.append(with_torch)
        for name, golden in goldens.items():
            if with_torch or not name.startswith("torch_"):
                schema.write(golden, pending / name)

    regenerate.calls = calls
    return regenerate


def _moved() -> dict[str, schema.Golden]:
    logits = _logits(0)
    logits[2, 12] += 0.5  # over own/float32/cpu's 1e-4, greedy token unchanged
    return BASE | {FLOAT32: _golden("engine", "float32", logits)}


def _pins(root: Path) -> dict[str, int]:
    pins = stanza.parse((root / "MODULE.bazel").read_text())
    return {name: ref_from_url(pin.url).version for name, pin in pins.items()}


def _store(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "artifacts").rglob("*.tar.gz"))


def test_an_unchanged_engine_publishes_nothing_and_says_so(repo: Path, capsys) -> None:
    before = (repo / "MODULE.bazel").read_text(), _store(repo)
    assert golden_update.main(["--accept", *_flags(repo)], _regenerating(BASE)) == 0
    out = capsys.readouterr().out
    assert "test_llama_golden: nothing to publish (identical)" in out
    assert ((repo / "MODULE.bazel").read_text(), _store(repo)) == before


def test_a_header_only_change_is_noise_and_publishes_nothing(repo: Path, capsys) -> None:
    changed = BASE[FLOAT32]
    other_cpu = schema.Golden(
        schema.Provenance(**{**changed.provenance.__dict__, "torch_version": "2.14.0"}),
        changed.cases,
    )
    assert (
        golden_update.main(["--accept", *_flags(repo)], _regenerating(BASE | {FLOAT32: other_cpu}))
        == 0
    )
    assert "test_llama_golden: nothing to publish (noise)" in capsys.readouterr().out
    assert _pins(repo) == {"test_llama_golden": 1, "torch_llama_golden": 1}


def test_dry_run_names_the_next_version_and_writes_nothing(repo: Path, capsys) -> None:
    before = _store(repo)
    assert golden_update.main(["--dry-run", *_flags(repo)], _regenerating(_moved())) == 0
    out = capsys.readouterr().out
    assert f"{FLOAT32}: changed [over tolerance]" in out
    assert f"would publish test_llama_golden version 2 with {FLOAT32} (dry run" in out
    assert _store(repo) == before and _pins(repo)["test_llama_golden"] == 1


def test_accept_publishes_the_next_version_of_the_changed_archive_only(repo: Path) -> None:
    regenerate = _regenerating(_moved())
    assert golden_update.main(["--accept", "--no-test", *_flags(repo)], regenerate) == 0
    assert regenerate.calls == [False]  # torch's inputs did not change: not regenerated
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 1}
    pin = stanza.parse((repo / "MODULE.bazel").read_text())["test_llama_golden"]
    (published,) = (repo / "artifacts" / "test_llama_golden" / "2").rglob("*.tar.gz")
    assert archive.sha256_hex(published.read_bytes()) == pin.sha256
    members = archive.unpack_members(published.read_bytes())
    assert sorted(members) == [GGML, FLOAT32, Q4_K]
    assert members[FLOAT32] == schema.to_json(_moved()[FLOAT32]).encode()
    assert pin.sha256 in (repo / "third_party" / "golden_distdir.bazelrc").read_text()


def test_without_accept_the_review_is_printed_and_nothing_published(repo: Path, capsys) -> None:
    assert golden_update.main(_flags(repo), _regenerating(_moved())) == 1  # stdin is no tty
    assert "nothing accepted; publish with --accept" in capsys.readouterr().out
    assert _pins(repo)["test_llama_golden"] == 1


def test_under_ci_nothing_is_ever_published(repo: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert golden_update.main(["--accept", *_flags(repo)], _regenerating(_moved())) == 2
    assert "CI=true: golden_update never publishes under CI" in capsys.readouterr().err
    assert _pins(repo)["test_llama_golden"] == 1


def test_torch_goldens_are_regenerated_when_their_inputs_changed(repo: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        golden_update, "_torch_inputs_changed", lambda pinned: ["made by transformers/4"]
    )
    regenerate = _regenerating(BASE)
    assert golden_update.main(["--dry-run", *_flags(repo)], regenerate) == 0
    assert regenerate.calls == [True]


def _outputs(tmp_path: Path, golden: schema.Golden) -> Path:
    outputs = tmp_path / "outputs.zip"
    with zipfile.ZipFile(outputs, "w") as zipped:
        zipped.writestr(FLOAT32, schema.to_json(golden))
        zipped.writestr("golden_report_tiny-float32-llama3_1_x.html", "<html></html>")
    return outputs


def test_a_failing_tests_kept_run_is_accepted_without_recomputing(repo: Path, tmp_path) -> None:
    outputs = _outputs(tmp_path, _moved()[FLOAT32])
    never = _regenerating({})
    args = ["--accept", "--no-test", f"--from={outputs}", *_flags(repo)]
    assert golden_update.main(args, never) == 0
    assert never.calls == []
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 1}


def test_a_kept_run_whose_tokens_changed_is_shown_not_accepted(
    repo: Path, tmp_path, capsys
) -> None:
    logits = _logits(0)
    logits[1] = -logits[1]  # another greedy token at step 1: later steps were teacher-forced
    outputs = _outputs(tmp_path, _golden("engine", "float32", logits))
    args = ["--accept", "--no-test", f"--from={outputs}", *_flags(repo)]
    assert golden_update.main(args, _regenerating({})) == 0
    out = capsys.readouterr().out
    assert f"{FLOAT32}: tokens changed" in out and "without --from to recompute it" in out
    assert _pins(repo)["test_llama_golden"] == 1


def test_help_shows_the_examples(capsys) -> None:
    assert golden_update.main(["--help"]) == 0
    assert "./bazelw run //tools:golden_update -- --accept" in capsys.readouterr().out


def test_a_pending_folder_never_holds_a_previous_run(repo: Path) -> None:
    stale = repo / ".goldens-pending"
    stale.mkdir()
    (stale / "tinyllama_bfloat16_all_golden.json").write_text(json.dumps({"old": True}))
    assert golden_update.main(["--dry-run", *_flags(repo)], _regenerating(BASE)) == 0
    assert not (stale / "tinyllama_bfloat16_all_golden.json").exists()


@pytest.mark.parametrize(("flag", "value"), [("--model", "tinylama"), ("--encoding", "float23")])
def test_a_misspelt_selection_exits_2_and_keeps_the_pending_goldens(
    repo: Path, capsys, flag: str, value: str
) -> None:
    """evaluate_llama's choices, checked before the pending folder is emptied: a misspelt
    --model used to delete the previous run's goldens, then stop in evaluate_llama's parser."""
    pending = repo / ".goldens-pending"
    pending.mkdir()
    kept = pending / "tinyllama_float32_golden.json"
    kept.write_text('{"kept": true}')
    regenerate = _regenerating(BASE)
    assert golden_update.main(["--dry-run", f"{flag}={value}", *_flags(repo)], regenerate) == 2
    assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err
    assert kept.read_text() == '{"kept": true}'
    assert regenerate.calls == []


def test_a_pending_dir_holding_anything_else_is_refused_and_left_as_it_was(
    repo: Path, tmp_path: Path, capsys
) -> None:
    """--pending-dir may name any folder (under `bazel run`, `.` is the user's checkout): one
    holding files other than goldens, or a plain file, exits 2 naming the flag, untouched."""
    flags = [flag for flag in _flags(repo) if not flag.startswith("--pending-dir")]
    regenerate = _regenerating(BASE)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep")
    (mine / "old_golden.json").write_text("{}")
    assert golden_update.main(["--dry-run", f"--pending-dir={mine}", *flags], regenerate) == 2
    assert f"--pending-dir={mine} holds precious.txt: " in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["old_golden.json", "precious.txt"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    assert golden_update.main(["--dry-run", f"--pending-dir={a_file}", *flags], regenerate) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert a_file.read_text() == "keep"
    assert regenerate.calls == []


def test_a_reverted_change_pins_the_earlier_version_again_and_publishes_nothing(
    repo: Path, capsys
) -> None:
    assert (
        golden_update.main(["--accept", "--no-test", *_flags(repo)], _regenerating(_moved())) == 0
    )
    assert _pins(repo)["test_llama_golden"] == 2
    stored = _store(repo)
    # The dry run names the version --accept pins (it said max + 1, 3, for a version it reuses).
    assert golden_update.main(["--dry-run", *_flags(repo)], _regenerating(BASE)) == 0
    (dry,) = re.findall(
        r"would (?:publish|pin) test_llama_golden version (\d+)", capsys.readouterr().out
    )
    assert golden_update.main(["--accept", "--no-test", *_flags(repo)], _regenerating(BASE)) == 0
    assert _pins(repo)["test_llama_golden"] == 1  # version 1 holds these files
    assert int(dry) == 1
    assert _store(repo) == stored  # nothing new in the store


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--store=s3"], "--store=s3 needs --bucket=NAME"),
        (["--endpoint-url=http://127.0.0.1:{port}"], "--bucket/--endpoint-url need --store=s3"),
        (["--bucket=goldens", "--endpoint-url=http://127.0.0.1:{port}"], "http://127.0.0.1:{port}"),
    ],
)
def test_bad_store_flags_and_an_unreachable_store_are_one_line_exit_2(
    flags: list[str],
    named: str,
    repo: Path,
    closed_port: int,
    fake_aws_credentials: None,
    capsys,
) -> None:
    """A store flag store_from_args refuses, or an S3 endpoint nobody listens on, exits 2 with
    one line naming it (they were a traceback, exit 1), before anything is regenerated."""
    regenerate = _regenerating(_moved())
    store_flags = [flag.format(port=closed_port) for flag in flags]
    assert golden_update.main(["--dry-run", *_flags(repo), *store_flags], regenerate) == 2
    err = capsys.readouterr().err
    assert err.startswith("golden_update: error: ") and err.count("\n") == 1, err
    assert named.format(port=closed_port) in err
    assert regenerate.calls == []


def test_a_store_elsewhere_than_beside_module_bazel_is_refused_before_anything_is_done(
    repo: Path, tmp_path: Path, capsys
) -> None:
    """golden_update pins what it publishes, and the distdir fragment names artifacts/ beside
    MODULE.bazel: a pin of an archive published elsewhere would name one Bazel cannot find."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(repo / "artifacts", elsewhere)
    fragment = repo / "third_party" / "golden_distdir.bazelrc"
    before = (repo / "MODULE.bazel").read_bytes(), fragment.read_bytes(), _store(repo)
    elsewhere_before = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    flags = [f for f in _flags(repo) if not f.startswith("--artifacts-dir")]
    regenerate = _regenerating(_moved())
    args = ["--accept", "--no-test", f"--artifacts-dir={elsewhere}", *flags]
    assert golden_update.main(args, regenerate) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--artifacts-dir={elsewhere}" in err
    assert f"--module-file={repo / 'MODULE.bazel'}" in err
    assert ((repo / "MODULE.bazel").read_bytes(), fragment.read_bytes(), _store(repo)) == before
    assert sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == elsewhere_before
    assert regenerate.calls == []


def test_the_ggml_goldens_are_regenerated_beside_the_eager_ones(tmp_path, monkeypatch) -> None:
    """After eager's, evaluate_llama --mode=ggml on each selected encoding with ggml goldens
    (a ggml-mode change is reviewed and published like any other)."""
    calls = []
    monkeypatch.setattr(golden_update, "ggml_encodings", lambda model, encoding: ["q4_k", "q4_1"])
    args = golden_update._parser().parse_args(["--model=all"])
    golden_update._regenerate(tmp_path, args, False, lambda argv: calls.append(argv) or 0)
    out = ["--output-dir", str(tmp_path)]
    assert calls == [
        ["--model", "all", "--encoding", "all", *out],
        ["--model", "all", "--encoding", "q4_k", "--mode", "ggml", *out],
        ["--model", "all", "--encoding", "q4_1", "--mode", "ggml", *out],
    ]
    failing = iter([0, 1])
    with pytest.raises(golden_update.UpdateError, match="--mode=ggml failed"):
        golden_update._regenerate(tmp_path, args, False, lambda argv: next(failing))


def test_a_failing_ggml_tests_kept_run_is_accepted(repo: Path, tmp_path) -> None:
    """A kept run of producer engine-ggml is a golden of the engine's archive: accepted."""
    logits = _logits(2)
    logits[2, 12] += 0.5  # over ggml/q4_k/cpu's entry, greedy token unchanged
    outputs = tmp_path / "outputs.zip"
    with zipfile.ZipFile(outputs, "w") as zipped:
        zipped.writestr(GGML, schema.to_json(_golden("engine-ggml", "q4_k", logits)))
        zipped.writestr("golden_report_tiny-q4_k-llama3_1-ggml_x.html", "<html></html>")
    args = ["--accept", "--no-test", f"--from={outputs}", *_flags(repo)]
    assert golden_update.main(args, _regenerating({})) == 0
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 1}


def test_a_kept_run_of_another_mode_is_not_accepted(repo: Path, tmp_path, capsys) -> None:
    outputs = tmp_path / "outputs.zip"
    logits = _logits(0)
    logits[2, 12] += 0.5
    with zipfile.ZipFile(outputs, "w") as zipped:
        zipped.writestr(FLOAT32, schema.to_json(_golden("engine-quantized", "float32", logits)))
        zipped.writestr("golden_report_tiny-float32-llama3_1_x.html", "<html></html>")
    args = ["--accept", "--no-test", f"--from={outputs}", *_flags(repo)]
    assert golden_update.main(args, _regenerating({})) == 0
    assert "producer 'engine-quantized', not a golden" in capsys.readouterr().out
    assert _pins(repo)["test_llama_golden"] == 1


def test_the_next_version_follows_the_newest_not_the_count_of_versions(
    repo: Path, tmp_path: Path, capsys
) -> None:
    """With versions 1 and 5 of test_llama_golden stored (5 unpinned, other files), a changed
    golden is published as the newest version + 1, 6, and the dry run names it too. Catches
    counting the versions (`len(versions) + 1`, 3), which the store refuses as below 5."""
    other = tmp_path / "v5"
    other.mkdir()
    schema.write(BASE[Q4_K], other / Q4_K)
    flags = [f for f in _flags(repo)[1:] if not f.startswith("--module-file")]
    assert (
        upload_artifact.main(["upload", "test_llama_golden", "5", str(other / Q4_K), *flags]) == 0
    )
    capsys.readouterr()
    assert golden_update.main(["--dry-run", *_flags(repo)], _regenerating(_moved())) == 0
    assert "would publish test_llama_golden version 6 with" in capsys.readouterr().out
    assert (
        golden_update.main(["--accept", "--no-test", *_flags(repo)], _regenerating(_moved())) == 0
    )
    assert _pins(repo) == {"test_llama_golden": 6, "torch_llama_golden": 1}


def test_a_store_that_fails_while_naming_the_version_is_one_line_exit_2(
    repo: Path, monkeypatch, capsys
) -> None:
    """The pinned archives read, but listing the store's versions fails (S3 with GetObject
    allowed and ListBucket denied): exit 2 with one line naming the failure, nothing published.
    Catches StoreError missing from the errors main reports (a traceback, exit 1)."""

    def denied(self: LocalStore, name: str) -> list[int]:
        raise StoreError(f"listing on the {self.description} failed: AccessDenied")

    monkeypatch.setattr(LocalStore, "versions", denied)
    before = _store(repo)
    assert golden_update.main(["--dry-run", *_flags(repo)], _regenerating(_moved())) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("golden_update: error: listing on the local store ") and err.count("\n") == 1
    )
    assert err.rstrip().endswith("failed: AccessDenied")
    assert _store(repo) == before and _pins(repo)["test_llama_golden"] == 1


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 1)])
def test_after_publishing_the_golden_tests_rerun_and_give_the_exit_status(
    repo: Path, monkeypatch, returncode: int, status: int
) -> None:
    """Without --no-test, publishing is followed by `bazelw test` of the golden tests in the
    repository; exit 0 when they pass, 1 (the documented status, whatever Bazel's code) when
    they fail. Catches returning Bazel's own exit code (3 for failed tests)."""
    runs = []

    def run(command: list[str], cwd: Path, check: bool):
        runs.append((command, cwd))
        return subprocess.CompletedProcess(command, returncode)

    monkeypatch.setattr(golden_update, "subprocess", SimpleNamespace(run=run))
    assert golden_update.main(["--accept", *_flags(repo)], _regenerating(_moved())) == status
    root = golden_update.repo_root()
    assert runs == [([str(root / "bazelw"), "test", *golden_update.GOLDEN_TESTS], root)]
    assert _pins(repo)["test_llama_golden"] == 2


def test_after_publishing_the_four_golden_tests_the_guide_names_rerun() -> None:
    """docs/goldens.md, "Changing a golden legitimately": with --accept, `test_llama`,
    `test_llama_constrained`, `test_llama_long` and `test_golden_sanity` run again. The rerun
    test above compares with GOLDEN_TESTS itself, so a target dropped from that list passed it
    (planted: test_llama_long removed)."""
    package = "//max_tests/integration/architectures/llama3"
    rerun = list(golden_update.GOLDEN_TESTS)
    assert rerun == [
        f"{package}:test_llama",
        f"{package}:test_llama_constrained",
        f"{package}:test_llama_long",
        f"{package}:test_golden_sanity",
    ]


def test_torch_regenerates_transformers_goldens_whose_inputs_did_not_change(repo: Path) -> None:
    """docs/goldens.md:909: transformers' goldens are regenerated with --torch, not only
    when their inputs changed (planted: --torch ignored, `with_torch = bool(reasons)`)."""
    regenerate = _regenerating(BASE)
    assert golden_update.main(["--dry-run", "--torch", *_flags(repo)], regenerate) == 0
    assert regenerate.calls == [True]


def test_torch_goldens_are_due_when_transformers_the_checkpoint_or_the_cases_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/goldens.md:909-911: transformers' goldens are regenerated on their own when their
    inputs changed: the transformers version, a checkpoint's sha256, the cases. Every other
    test replaces _torch_inputs_changed, so a dropped check passed them (planted: the
    checkpoint check, or the version check, made `False`)."""
    from goldens import diff, record
    from harness.llama3 import variants

    checkpoint = tmp_path / "tiny_llama.gguf"
    checkpoint.write_bytes(b"weights")
    monkeypatch.setitem(sys.modules, "transformers", SimpleNamespace(__version__="5.0.0"))
    tiny = SimpleNamespace(model="tinyllama", encoding="float32", path=checkpoint)
    monkeypatch.setattr(variants, "variants", lambda: [tiny])
    prompt = BASE[TORCH].cases[0].prompt
    monkeypatch.setattr(
        record, "case_specs", lambda model: [SimpleNamespace(id="prose", prompt=prompt)]
    )

    def reasons(**changed: str) -> list[str]:
        made = {
            "producer_version": "transformers/5.0.0",
            "checkpoint_sha256": record.file_sha256(checkpoint),
        }
        golden = BASE[TORCH]
        provenance = schema.Provenance(**(golden.provenance.__dict__ | made | changed))
        data = schema.to_json(schema.Golden(provenance, golden.cases)).encode()
        pinned = diff.GoldenSet("pinned", {TORCH: diff.parse_golden(data, TORCH)})
        return golden_update._torch_inputs_changed(pinned)

    assert reasons() == []
    assert reasons(producer_version="transformers/4.57.1") == [
        f"{TORCH} was made by transformers/4.57.1, this is transformers/5.0.0"
    ]
    assert reasons(checkpoint_sha256="b" * 64) == [f"{TORCH}: checkpoint tiny_llama.gguf changed"]
    monkeypatch.setattr(
        record, "case_specs", lambda model: [SimpleNamespace(id="prose", prompt="Paris is")]
    )
    assert reasons() == [f"{TORCH}: its cases are not cases.yaml's"]


def _tokens_changed(producer: str, encoding: str, seed: int) -> schema.Golden:
    logits = _logits(seed)
    logits[1] = -logits[1]  # another greedy token from step 1: publishable, "tokens changed"
    return _golden(producer, encoding, logits)


def test_in_a_terminal_each_file_is_accepted_rejected_skipped_or_diffed(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """docs/goldens.md:914: without --accept, in a terminal, file by file: accept, reject,
    skip, diff; only the accepted files are published (the rest stay the pinned ones), and
    diff asks again. Planted: 'r' read as accept; 'd' printing the diff and moving on."""
    changed = _moved() | {
        Q4_K: _tokens_changed("engine", "q4_k", 1),
        GGML: _tokens_changed("engine-ggml", "q4_k", 2),
    }
    answers = {FLOAT32: ["d", "x", "a"], Q4_K: ["r"], GGML: ["s"]}
    asked = []

    def answer(prompt: str) -> str:
        (file_name,) = [name for name in answers if f": {name} [" in prompt]
        asked.append(file_name)
        return answers[file_name].pop(0)

    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr("builtins.input", answer)
    assert golden_update.main(["--no-test", *_flags(repo)], _regenerating(changed)) == 0
    assert sorted(asked) == sorted([FLOAT32] * 3 + [Q4_K, GGML])
    assert capsys.readouterr().out.count(f"{FLOAT32}: changed [over tolerance]") == 2  # + diff
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 1}
    (published,) = (repo / "artifacts" / "test_llama_golden" / "2").rglob("*.tar.gz")
    members = archive.unpack_members(published.read_bytes())
    assert members == {
        FLOAT32: schema.to_json(changed[FLOAT32]).encode(),
        Q4_K: schema.to_json(BASE[Q4_K]).encode(),
        GGML: schema.to_json(BASE[GGML]).encode(),
    }


def test_under_ci_a_terminal_is_never_asked_and_nothing_is_published(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """docs/goldens.md:920: under CI=true it never publishes, even in a terminal without
    --accept: exit 1 (changes pending), nobody asked (planted: the CI check before the
    questions removed, so an 'a' published version 2)."""
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: True))
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "a")
    before = _store(repo)
    assert golden_update.main(["--no-test", *_flags(repo)], _regenerating(_moved())) == 1
    assert "CI=true: nothing is published under CI" in capsys.readouterr().err
    assert asked == []
    assert _store(repo) == before and _pins(repo)["test_llama_golden"] == 1


def test_a_failing_tests_extracted_outputs_folder_is_accepted_like_its_zip(
    repo: Path, tmp_path: Path
) -> None:
    """docs/goldens.md:925: `golden_update --from=` takes the outputs.zip or its
    extracted folder; the folder's run is published as the next version (planted: the
    folder branch of _new_bytes dropped, so the folder was opened as a zip)."""
    folder = tmp_path / "extracted"
    with zipfile.ZipFile(_outputs(tmp_path, _moved()[FLOAT32])) as zipped:
        zipped.extractall(folder)
    args = ["--accept", "--no-test", f"--from={folder}", *_flags(repo)]
    assert golden_update.main(args, _regenerating({})) == 0
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 1}
    (published,) = (repo / "artifacts" / "test_llama_golden" / "2").rglob("*.tar.gz")
    members = archive.unpack_members(published.read_bytes())
    assert members[FLOAT32] == (folder / FLOAT32).read_bytes()


def test_every_archive_with_an_accepted_file_gets_its_next_version(repo: Path) -> None:
    """docs/goldens.md:914-915: each archive with an accepted file is published as its next
    version and pinned: with --torch, an engine and a transformers change pin version 2 of
    both (planted: publishing stops after the first archive)."""
    logits = _logits(0)
    logits[2, 12] += 0.5
    changed = _moved() | {TORCH: _golden("torch", "float32", logits)}
    args = ["--accept", "--torch", "--no-test", *_flags(repo)]
    assert golden_update.main(args, _regenerating(changed)) == 0
    assert _pins(repo) == {"test_llama_golden": 2, "torch_llama_golden": 2}
    (published,) = (repo / "artifacts" / "torch_llama_golden" / "2").rglob("*.tar.gz")
    members = archive.unpack_members(published.read_bytes())
    assert members == {TORCH: schema.to_json(changed[TORCH]).encode()}
