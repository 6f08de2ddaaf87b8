"""golden_unreferenced: unread goldens fail, unpinned versions are history, --delete keeps it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from goldens.artifacts import archive
from goldens.artifacts.sample_module import SAMPLE_MODULE
from tools.artifacts import upload_artifact
from tools.golden_update import unreferenced


def _golden(model: str, encoding: str, cases: list[str], producer: str = "engine") -> bytes:
    provenance = {"producer": producer, "model": model, "encoding": encoding, "hardware": "all"}
    return json.dumps({"provenance": provenance, "cases": [{"id": c} for c in cases]}).encode()


SHORT = ["prose", "code", "question", "translation"]


def test_the_repositorys_pinned_goldens_are_all_read() -> None:
    """CI's check: every file and case of the pinned archives is one a golden test reads."""
    assert unreferenced.main(["--repository=/nonexistent"]) == 0


def test_a_file_of_a_checkpoint_that_left_the_variants_is_unread() -> None:
    members = {
        "tinyllama_float32_all_golden.json": _golden("tinyllama", "float32", SHORT),
        "tinyllama_q8_0_all_golden.json": _golden("tinyllama", "q8_0", SHORT),
    }
    assert unreferenced.unread_goldens(members, "test_llama_golden") == [
        "test_llama_golden: tinyllama_q8_0_all_golden.json: checkpoint tinyllama q8_0 is not "
        "a variant the tests read (variants.py)"
    ]


def test_a_case_that_left_cases_yaml_is_unread() -> None:
    members = {
        "torch_smollm2_q4_1_golden.json": _golden("smollm2", "q4_1", [*SHORT, "old"], "torch")
    }
    (problem,) = unreferenced.unread_goldens(members, "torch_llama_golden")
    assert problem.endswith("cases ['old'] are not in cases.yaml for smollm2")


def test_a_users_llama3_1_golden_of_any_encoding_is_read() -> None:
    members = {"llama3_1_q4_k_all_golden.json": _golden("llama3_1", "q4_k", SHORT)}
    assert unreferenced.unread_goldens(members, "test_llama_golden") == []


def test_the_eval_slice_archive_holds_only_the_file_its_test_reads() -> None:
    good = json.dumps({"schema": 1, "setup": {}, "rows": {}}).encode()
    assert unreferenced.unread_goldens({"eval_slice_golden.json": good}, "eval_slice_golden") == []
    problems = unreferenced.unread_goldens(
        {"eval_slice_golden.json": b'{"schema": 1}', "old.json": good}, "eval_slice_golden"
    )
    assert problems == [
        "eval_slice_golden: old.json: not the file its test reads (eval_slice_golden.json)",
        "eval_slice_golden: eval_slice_golden.json lacks setup, rows",
    ]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.mark.skipif(not shutil.which("git"), reason="needs git")
def test_delete_removes_only_versions_no_commit_ever_pinned(tmp_path: Path, capsys) -> None:
    repo = tmp_path / "repo"
    (repo / "third_party").mkdir(parents=True)
    (repo / "MODULE.bazel").write_text(SAMPLE_MODULE)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    flags = [
        f"--artifacts-dir={repo / 'artifacts'}",
        f"--module-file={repo / 'MODULE.bazel'}",
        f"--distdir-bazelrc={repo / 'third_party' / 'golden_distdir.bazelrc'}",
    ]
    golden = tmp_path / "tinyllama_float32_all_golden.json"
    for version, cases in ((1, SHORT), (2, [*SHORT, "long_8k"])):
        golden.write_bytes(_golden("tinyllama", "float32", cases))
        upload = ["upload", "g", str(version), str(golden), "--update-module", *flags]
        assert upload_artifact.main(upload) == 0
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"v{version}")
    golden.write_bytes(_golden("tinyllama", "float32", ["abandoned"]))
    assert upload_artifact.main(["upload", "g", "3", str(golden), *flags]) == 0  # never pinned
    common = [f"--artifacts-dir={repo / 'artifacts'}", f"--module-file={repo / 'MODULE.bazel'}"]
    assert unreferenced.main([*common, f"--repository={repo}"]) == 0
    out = capsys.readouterr().out
    assert "unpinned: g/1/" in out and "(kept: an earlier commit pins it)" in out
    assert "unpinned: g/3/" in out and "(never pinned)" in out
    assert unreferenced.main([*common, f"--repository={repo}", "--delete"]) == 0
    versions = sorted(p.name for p in (repo / "artifacts" / "g").iterdir())
    assert versions == ["1", "2"]
    (kept,) = (repo / "artifacts" / "g" / "1").rglob("*.tar.gz")
    assert archive.sha256_hex(kept.read_bytes()) in kept.parent.name
    # A shallow clone holds only the last commit's pin: version 1 would read as never
    # pinned. --delete refuses (exit 2) and deletes nothing.
    shallow = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow))
    module = f"--module-file={shallow / 'MODULE.bazel'}"
    flags = [f"--artifacts-dir={shallow / 'artifacts'}", module, f"--repository={shallow}"]
    assert unreferenced.main([*flags, "--delete"]) == 2
    assert "a shallow clone: git fetch --unshallow" in capsys.readouterr().err
    assert sorted(p.name for p in (shallow / "artifacts" / "g").iterdir()) == ["1", "2"]


def _pinned_repo(tmp_path: Path) -> tuple[Path, list[str]]:
    """A scratch repository pinning archive g (one read golden); its flags."""
    repo = tmp_path / "repo"
    (repo / "third_party").mkdir(parents=True)
    (repo / "MODULE.bazel").write_text(SAMPLE_MODULE)
    golden = tmp_path / "tinyllama_float32_all_golden.json"
    golden.write_bytes(_golden("tinyllama", "float32", SHORT))
    upload = [
        "upload",
        "g",
        "1",
        str(golden),
        "--update-module",
        f"--artifacts-dir={repo / 'artifacts'}",
        f"--module-file={repo / 'MODULE.bazel'}",
        f"--distdir-bazelrc={repo / 'third_party' / 'golden_distdir.bazelrc'}",
    ]
    assert upload_artifact.main(upload) == 0
    flags = [
        f"--artifacts-dir={repo / 'artifacts'}",
        f"--module-file={repo / 'MODULE.bazel'}",
        "--repository=/nonexistent",
    ]
    return repo, flags


@pytest.mark.parametrize(
    "damage",
    [
        b"not an archive",
        # Another golden archive: it unpacks, and was read as if it were the pinned one.
        archive.pack_members({"tinyllama_q8_0_all_golden.json": _golden("tinyllama", "q8_0", [])}),
    ],
)
def test_a_damaged_pinned_archive_is_one_line_exit_2_naming_it(
    damage: bytes, tmp_path: Path, capsys
) -> None:
    repo, flags = _pinned_repo(tmp_path)
    assert unreferenced.main(flags) == 0
    capsys.readouterr()
    (pinned,) = (repo / "artifacts").rglob("*.tar.gz")
    pinned.write_bytes(damage)
    assert unreferenced.main(flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"golden_unreferenced: error: checksum mismatch: {pinned} has")


def test_a_module_file_that_does_not_parse_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    repo, flags = _pinned_repo(tmp_path)
    module = repo / "MODULE.bazel"
    module.write_text(module.read_text() + "http_archive(\n")
    line = module.read_text().count("\n")
    capsys.readouterr()
    assert unreferenced.main(flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"golden_unreferenced: error: MODULE.bazel line {line}: ")


@pytest.mark.parametrize("where", ["nonexistent", "afile"])
def test_an_artifacts_dir_that_is_not_a_folder_is_one_line_exit_2(
    where: str, tmp_path: Path, capsys
) -> None:
    """A missing store used to read as "every stored archive is pinned", exit 0."""
    _, flags = _pinned_repo(tmp_path)
    (tmp_path / "afile").write_text("")
    flags = [f for f in flags if not f.startswith("--artifacts-dir=")]
    capsys.readouterr()
    assert unreferenced.main([*flags, f"--artifacts-dir={tmp_path / where}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"golden_unreferenced: error: --artifacts-dir={tmp_path / where} is not a folder; "
        "point it at the local store (default: REPO/artifacts)\n"
    )
