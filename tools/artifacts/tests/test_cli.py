"""The command line as users run it: exit codes, stdout/stderr, files written or not."""

import difflib
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from goldens.artifacts import archive, stanza
from goldens.artifacts.sample_module import SAMPLE_MODULE
from tools.artifacts.upload_artifact import main

# Beside this file's package, not resolved: under Bazel that is the runfiles tree, which holds
# the script only as the target's data (resolving the symlink would find the source tree's).
SCRIPT = Path(__file__).parents[2] / "upload-public-bazel-artifact.sh"


def _repo_flags(repo: Path) -> list[str]:
    return [
        f"--artifacts-dir={repo / 'artifacts'}",
        f"--module-file={repo / 'MODULE.bazel'}",
        f"--distdir-bazelrc={repo / 'third_party' / 'golden_distdir.bazelrc'}",
    ]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _store_files(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "artifacts").rglob("*") if p.is_file())


@pytest.fixture(autouse=True)
def _caller_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    monkeypatch.delenv("BUILD_WORKSPACE_DIRECTORY", raising=False)
    monkeypatch.chdir(tmp_path)


def test_upload_is_the_default_command_and_takes_paths_from_the_callers_folder(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    os.chdir(goldens[0].parent)
    names = [p.name for p in goldens]
    code, out, err = _run(capsys, "test_llama_golden", "2", *names, *_repo_flags(scratch_repo))
    assert code == 0, err
    (published,) = _store_files(scratch_repo)
    sha = archive.sha256_hex(published.read_bytes())
    assert published.relative_to(scratch_repo).as_posix() == (
        f"artifacts/test_llama_golden/2/{sha}/test_llama_golden.tar.gz"
    )
    assert set(archive.unpack_members(published.read_bytes())) == set(names)
    assert out.startswith('http_archive(\n    name = "test_llama_golden",\n')
    assert f'    sha256 = "{sha}",\n' in out
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE  # no --update-module


def test_update_module_pins_the_archive_and_its_distdir(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    files = [str(p) for p in goldens]
    assert (
        _run(capsys, "upload", "test_llama_golden", "1", *files, *flags, "--update-module")[0] == 0
    )
    before = (scratch_repo / "MODULE.bazel").read_text()
    goldens[0].write_text('{"tokens": [9]}\n')
    code, out, _ = _run(capsys, "test_llama_golden", "2", *files, *flags, "--update-module")
    assert code == 0
    after = (scratch_repo / "MODULE.bazel").read_text()
    changed = [
        line[1:].split("=")[0].strip()
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == ["sha256", "url", "sha256", "url"]
    pin = stanza.parse(after)["test_llama_golden"]
    assert stanza.render(pin) + "\n" == out
    bazelrc = (scratch_repo / "third_party" / "golden_distdir.bazelrc").read_text()
    assert (
        bazelrc.splitlines()[-1] == f"common --distdir=artifacts/test_llama_golden/2/{pin.sha256}"
    )
    assert bazelrc.count("--distdir") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["test_llama_golden", "1", "missing_golden.json"], "missing_golden.json does not exist"),
        (["test_llama_golden", "1"], "the following arguments are required: FILE"),
        (["upload"], "the following arguments are required"),
        (["tests/llama", "1", "{golden}"], "Bazel repository name"),
        (["test llama", "1", "{golden}"], "Bazel repository name"),
        (["test_llama_golden", "three", "{golden}"], "positive integer"),
        (["test_llama_golden", "1.5", "{golden}"], "positive integer"),
        (["test_llama_golden", "1", "{golden}", "--store=s3"], "needs --bucket"),
    ],
)
def test_bad_usage_is_one_line_exit_2_and_publishes_nothing(
    args: list[str],
    message: str,
    scratch_repo: Path,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [a.replace("{golden}", str(goldens[0])) for a in args]
    code, out, err = _run(capsys, *args, *_repo_flags(scratch_repo), "--update-module")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and out == ""
    assert len(errors) == 1 and message in errors[0], err
    assert _store_files(scratch_repo) == []
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE


@pytest.mark.parametrize("where", ["no/such/folder/d.bazelrc", "third_party"])
def test_a_distdir_fragment_that_cannot_be_written_is_exit_2_before_publishing(
    where: str, scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--update-module writes MODULE.bazel, then the distdir fragment: a fragment path in a
    missing folder, or a folder, stops it before anything is published or pinned."""
    flags = [*_repo_flags(scratch_repo), f"--distdir-bazelrc={scratch_repo / where}"]
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")
    assert code == 2 and out == "", err
    assert err.splitlines()[-1].startswith(f"error: --distdir-bazelrc {scratch_repo / where}"), err
    assert _store_files(scratch_repo) == []
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE


def test_fetch_into_a_file_is_exit_2_naming_the_flag(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = scratch_repo / "notes.txt"
    a_file.write_text("keep")
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    code, _, err = _run(capsys, "fetch", "g", f"--output-dir={a_file}", *flags)
    assert code == 2
    assert f"--output-dir={a_file} exists and is not a directory" in err
    assert a_file.read_text() == "keep"


def test_a_module_file_that_does_not_parse_is_exit_2_before_publishing(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    module = scratch_repo / "MODULE.bazel"
    module.write_text(SAMPLE_MODULE + "http_archive(\n")
    flags = _repo_flags(scratch_repo)
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")
    line = SAMPLE_MODULE.count("\n") + 1
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith(f"error: MODULE.bazel line {line}: "), err
    assert _store_files(scratch_repo) == []


def test_help_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "tools/upload-public-bazel-artifact.sh test_llama_golden next *golden.json" in out


def test_overwriting_a_published_version_is_exit_1(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags)[0] == 0
    code, out, err = _run(capsys, "g", "1", str(goldens[1]), *flags)
    assert code == 1 and out == ""
    assert "immutable: publish version 2 instead" in err
    assert len(_store_files(scratch_repo)) == 1


def test_fetch_extracts_the_pinned_archive(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    files = [str(p) for p in goldens]
    assert _run(capsys, "test_llama_golden", "1", *files, *flags, "--update-module")[0] == 0
    code, out, _ = _run(capsys, "fetch", "test_llama_golden", "--output-dir=fetched", *flags)
    assert code == 0
    for golden in goldens:
        assert (Path("fetched") / golden.name).read_bytes() == golden.read_bytes()
    assert len(out.splitlines()) == len(goldens)


def test_fetch_and_verify_refuse_a_corrupted_local_archive(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    assert _run(capsys, "verify", *flags)[0] == 0
    (published,) = _store_files(scratch_repo)
    published.write_bytes(published.read_bytes() + b"\0")
    code, _, err = _run(capsys, "fetch", "g", *flags)
    assert code == 1 and "checksum mismatch" in err
    assert not Path("g").exists()
    code, _, err = _run(capsys, "verify", *flags)
    assert code == 1 and "checksum mismatch" in err


def test_verify_names_the_commands_that_bring_back_a_missing_pinned_archive(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    (published,) = _store_files(scratch_repo)
    published.unlink()
    code, _, err = _run(capsys, "verify", *flags)
    assert code == 1
    assert f"g: {published} is missing from the local store, so Bazel cannot fetch" in err
    assert f"git checkout -- {published.parent}" in err
    assert "./bazelw run //tools:golden_update -- --accept" in err


def test_add_publishes_the_pinned_files_plus_new_ones_as_the_next_version(
    scratch_repo: Path, goldens: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "4", str(goldens[0]), *flags, "--update-module")[0] == 0
    replaced = tmp_path / goldens[0].name
    replaced.write_text('{"tokens": [4]}\n')
    new = tmp_path / "torch_llama3_1_bfloat16_golden.json"
    new.write_text("{}\n")
    code, _, _ = _run(capsys, "add", "g", replaced.name, new.name, *flags, "--update-module")
    assert code == 0
    pin = stanza.parse((scratch_repo / "MODULE.bazel").read_text())["g"]
    assert f"/g/5/{pin.sha256}/g.tar.gz" in pin.url
    (v5,) = [p for p in _store_files(scratch_repo) if "/5/" in p.as_posix()]
    assert archive.unpack_members(v5.read_bytes()) == {
        replaced.name: replaced.read_bytes(),
        new.name: new.read_bytes(),
    }
    # The same files again: nothing new to publish.
    code, _, err = _run(capsys, "add", "g", str(new), *flags)
    assert code == 0 and "nothing to publish" in err
    assert len(_store_files(scratch_repo)) == 2


def test_next_publishes_the_version_after_the_newest_and_never_renumbers_the_same_files(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipes say `next`, not a number someone has to look up (and the store refuses)."""
    flags, files = _repo_flags(scratch_repo), [str(p) for p in goldens]
    assert _run(capsys, "test_llama_golden", "next", *files, *flags)[0] == 0
    assert _run(capsys, "test_llama_golden", "next", *files, *flags)[0] == 0
    (only,) = _store_files(scratch_repo)
    assert only.relative_to(scratch_repo).parts[:3] == ("artifacts", "test_llama_golden", "1")
    goldens[0].write_text('{"tokens": [9]}\n')
    code, _, err = _run(capsys, "test_llama_golden", "next", *files, *flags, "--update-module")
    assert code == 0, err
    assert "as the next version, 2" in err
    versions = {p.relative_to(scratch_repo).parts[2] for p in _store_files(scratch_repo)}
    assert versions == {"1", "2"}
    assert "/test_llama_golden/2/" in (scratch_repo / "MODULE.bazel").read_text()


def test_fetch_of_an_unpinned_name_is_bad_usage(
    scratch_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "fetch", "torch_llama_golden", *_repo_flags(scratch_repo))
    assert code == 2 and "is not pinned" in err


def test_update_module_with_a_store_elsewhere_is_exit_2_and_touches_nothing(
    scratch_repo: Path, goldens: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The distdir fragment names artifacts/ beside MODULE.bazel: pinning an archive published
    into another local store would pin one the repository does not have."""
    elsewhere = tmp_path / "elsewhere"
    flags = [f for f in _repo_flags(scratch_repo) if not f.startswith("--artifacts-dir")]
    fragment = scratch_repo / "third_party" / "golden_distdir.bazelrc"
    fragment.write_text("# as it was\n")
    args = ["g", "1", str(goldens[0]), f"--artifacts-dir={elsewhere}", *flags, "--update-module"]
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith(f"error: --update-module with --artifacts-dir={elsewhere}: "), err
    assert f"--module-file={scratch_repo / 'MODULE.bazel'}" in line
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE
    assert fragment.read_text() == "# as it was\n"
    assert _store_files(scratch_repo) == [] and not elsewhere.exists()


def test_verify_reports_a_stale_fragment(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    assert _run(capsys, "verify", *flags)[0] == 0
    fragment = scratch_repo / "third_party" / "golden_distdir.bazelrc"
    fragment.write_text(fragment.read_text().replace("/g/1/", "/g/2/"))
    code, out, err = _run(capsys, "verify", *flags)
    assert code == 1 and out == ""
    assert f"error: {fragment} is stale; regenerate it: upload_artifact distdir" in err


def test_distdir_check_reports_a_stale_fragment(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    assert _run(capsys, "distdir", "--check", *flags)[0] == 0
    (scratch_repo / "third_party" / "golden_distdir.bazelrc").write_text("")
    assert _run(capsys, "distdir", "--check", *flags)[0] == 1
    assert _run(capsys, "distdir", *flags)[0] == 0
    assert _run(capsys, "distdir", "--check", *flags)[0] == 0


def test_s3_upload_through_the_cli(
    s3_endpoint: str, s3_bucket: str, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["g", "1", str(goldens[0]), f"--bucket={s3_bucket}", f"--endpoint-url={s3_endpoint}"]
    code, out, err = _run(capsys, *args)
    assert code == 0, err
    assert f'url = "{s3_endpoint}/{s3_bucket}/artifacts/g/1/' in out
    code, out, err = _run(capsys, *args)
    assert code == 0 and "nothing to do" in err


def _anonymous_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, b""


def _s3_pin_flags(repo: Path, endpoint: str, bucket: str) -> list[str]:
    return [
        f"--bucket={bucket}",
        f"--endpoint-url={endpoint}",
        f"--module-file={repo / 'MODULE.bazel'}",
        f"--distdir-bazelrc={repo / 'third_party' / 'golden_distdir.bazelrc'}",
        "--update-module",
    ]


def test_an_s3_upload_is_public_read_and_pinned_after_an_anonymous_get(
    s3_endpoint: str,
    s3_bucket: str,
    scratch_repo: Path,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = _s3_pin_flags(scratch_repo, s3_endpoint, s3_bucket)
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags)
    assert code == 0, err
    pin = stanza.parse((scratch_repo / "MODULE.bazel").read_text())["g"]
    assert stanza.render(pin) + "\n" == out
    assert f"anonymous GET of {pin.url}: sha256 ok" in err
    status, data = _anonymous_get(pin.url)
    assert status == 200 and archive.sha256_hex(data) == pin.sha256
    assert _anonymous_get(f"{s3_endpoint}/{s3_bucket}/artifacts/g/1/claim")[0] == 403


def test_an_s3_pin_gets_no_distdir_line_and_verify_passes_without_a_local_copy(
    s3_endpoint: str,
    s3_bucket: str,
    scratch_repo: Path,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bazel downloads an S3 pin over HTTP: the fragment names no local folder for it, and
    verify (which .ci/run runs) passes, saying the pin is not in the local store."""
    flags = _s3_pin_flags(scratch_repo, s3_endpoint, s3_bucket)
    code, _, err = _run(capsys, "g", "1", str(goldens[0]), *flags)
    assert code == 0, err
    pin = stanza.parse((scratch_repo / "MODULE.bazel").read_text())["g"]
    fragment = (scratch_repo / "third_party" / "golden_distdir.bazelrc").read_text()
    assert "--distdir=" not in fragment
    code, out, err = _run(capsys, "verify", *_repo_flags(scratch_repo))
    assert code == 0, err
    assert out.splitlines() == [
        f"g 1: pinned at {pin.url}, not in the local store (fetched over HTTP)",
        f"0 pinned archives match their sha256 in {scratch_repo / 'artifacts'}",
    ]


def test_an_object_nobody_may_read_is_exit_1_and_pins_nothing_until_it_is_public(
    s3_endpoint: str,
    s3_bucket: str,
    scratch_repo: Path,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = _s3_pin_flags(scratch_repo, s3_endpoint, s3_bucket)
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags, "--no-public-read")
    url = f"{s3_endpoint}/{s3_bucket}/artifacts/g/1/"
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert code == 1 and out == ""
    assert line.startswith(f"error: an anonymous GET of {url}"), err
    assert "HTTP 403" in line and "--public-url-template" in line
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE
    assert not (scratch_repo / "third_party" / "golden_distdir.bazelrc").exists()
    # The reported bug's way out: the same command again, now public-read, pins it.
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags)
    assert code == 0 and "nothing to do" in err, err
    assert stanza.parse((scratch_repo / "MODULE.bazel").read_text())["g"].url.startswith(url)


def test_other_bytes_at_the_pinned_url_are_exit_1_and_pin_nothing(
    s3_endpoint: str,
    s3_bucket: str,
    scratch_repo: Path,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import boto3

    data = archive.pack_members(archive.read_members([goldens[0]]))
    key = f"artifacts/g/1/{archive.sha256_hex(data)}/g.tar.gz"
    mirror = s3_bucket + "-mirror"  # a stale mirror serving other bytes under the same key
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=mirror)
    client.put_object(Bucket=mirror, Key=key, Body=b"stale", ACL="public-read")
    template = f"--public-url-template={s3_endpoint}/{mirror}/{{key}}"
    flags = _s3_pin_flags(scratch_repo, s3_endpoint, s3_bucket)
    code, out, err = _run(capsys, "g", "1", str(goldens[0]), *flags, template)
    assert code == 1 and out == ""
    assert (
        f"error: checksum mismatch: an anonymous GET of {s3_endpoint}/{mirror}/{key} returned 5 "
        f"bytes with sha256 {archive.sha256_hex(b'stale')}"
    ) in err
    assert (scratch_repo / "MODULE.bazel").read_text() == SAMPLE_MODULE


def test_public_read_needs_the_s3_store(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = _repo_flags(scratch_repo)
    code, _, err = _run(capsys, "g", "1", str(goldens[0]), *flags, "--no-public-read")
    assert code == 2 and "--public-read/--no-public-read need --store=s3" in err
    assert _store_files(scratch_repo) == []


def test_missing_credentials_are_exit_1_with_a_clear_message(
    s3_endpoint: str, no_aws_config: None, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(
        capsys,
        "g",
        "1",
        str(goldens[0]),
        "--store=s3",
        "--bucket=goldens",
        f"--endpoint-url={s3_endpoint}",
    )
    assert code == 1 and out == ""
    assert err.splitlines()[-1].startswith("error: no AWS credentials for s3://goldens/artifacts")


def test_an_unreachable_endpoint_is_exit_1_naming_the_connection(
    closed_port: int,
    fake_aws_credentials: None,
    goldens: list[Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # How long it may wait is the client's configuration (test_s3_store checks it), not a
    # wall-clock bound here: a loaded machine must not fail a correct program.
    code, _, err = _run(
        capsys,
        "g",
        "1",
        str(goldens[0]),
        "--bucket=goldens",
        f"--endpoint-url=http://127.0.0.1:{closed_port}",
    )
    assert code == 1
    assert "Could not connect to the endpoint URL" in err.splitlines()[-1]


def test_the_shell_wrapper_runs_from_the_callers_folder(
    scratch_repo: Path, goldens: list[Path]
) -> None:
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: cli_test needs it as data (BUILD.bazel)"
    result = subprocess.run(
        [
            str(SCRIPT),
            "test_llama_golden",
            "3",
            *[p.name for p in goldens],
            *_repo_flags(scratch_repo),
        ],
        cwd=goldens[0].parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("http_archive(\n")
    assert len(_store_files(scratch_repo)) == 1


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("verify", "--store=s3"),
        ("verify", "--bucket=goldens"),
        ("verify", "--endpoint-url=http://127.0.0.1:9"),
        ("verify", "--prefix=elsewhere"),
        ("distdir", "--bucket=goldens"),
    ],
)
def test_verify_and_distdir_refuse_the_s3_store_flags_they_would_ignore(
    command: str, flag: str, scratch_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify checks the local store only (offline, as .ci/run runs it): `verify --store=s3`
    used to check the local store and exit 0, as if the bucket had been checked."""
    fragment = scratch_repo / "third_party" / "golden_distdir.bazelrc"
    before = fragment.read_bytes() if fragment.exists() else None
    code, out, err = _run(capsys, command, flag, *_repo_flags(scratch_repo))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {flag.split('=')[0]}"), err
    assert "is not used here" in err and len(err.splitlines()) == 1, err
    assert (fragment.read_bytes() if fragment.exists() else None) == before


@pytest.mark.parametrize(
    ("args", "lacks"), [(["frobnicate"], "VERSION, FILE"), (["frobnicate", "3"], "FILE")]
)
def test_an_unknown_command_is_named_with_the_commands(
    args: list[str], lacks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, *args)
    assert (code, out) == (2, "")
    assert err == (
        "upload_artifact: error: frobnicate is not a command (commands: upload, fetch, add, "
        "distdir, verify); read as `upload frobnicate ...`, the following arguments are "
        f"required: {lacks} (see --help)\n"
    )


def test_a_folder_given_as_file_is_called_a_folder(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = goldens[0].parent
    code, out, err = _run(capsys, "g", "1", str(folder), *_repo_flags(scratch_repo))
    assert (code, out) == (2, "")
    assert err == (
        f"error: FILE {folder} is a folder (resolved to {folder}); give the golden files in "
        f"it, e.g. {folder}/*_golden.json\n"
    )
    assert _store_files(scratch_repo) == []


def test_add_publishes_after_the_newest_stored_version_not_the_pinned_one(
    scratch_repo: Path, goldens: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/goldens.md:962, 973-975: `add` puts the pinned files plus the new ones in the
    store as the next version: the newest stored version + 1, also when that newest one is
    unpinned (version 3 here, pinned 1: 4, which the store takes). Planted: the pinned version
    + 1 (2, which the store refuses as below 3: exit 1)."""
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    assert _run(capsys, "g", "3", str(goldens[1]), *flags)[0] == 0  # published, never pinned
    new = tmp_path / "torch_llama3_1_bfloat16_golden.json"
    new.write_text("{}\n")
    code, _, err = _run(capsys, "add", "g", str(new), *flags, "--update-module")
    assert code == 0, err
    pin = stanza.parse((scratch_repo / "MODULE.bazel").read_text())["g"]
    assert f"/g/4/{pin.sha256}/g.tar.gz" in pin.url
    (v4,) = [p for p in _store_files(scratch_repo) if "/g/4/" in p.as_posix()]
    assert archive.unpack_members(v4.read_bytes()) == {
        goldens[0].name: goldens[0].read_bytes(),
        new.name: new.read_bytes(),
    }


def test_distdir_check_on_a_stale_fragment_is_exit_1_and_writes_nothing(
    scratch_repo: Path, goldens: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`distdir --check` (its --help: "exit 1 if it is stale, write nothing"): a stale fragment
    is exit 1 with the one line naming it and the command that regenerates it, and the
    fragment keeps its bytes; `distdir` then writes the fresh one. Planted: the fresh fragment
    written before the --check exit (CI would fail yet leave the fix in the working tree), or
    the --check test dropped (written, exit 0)."""
    flags = _repo_flags(scratch_repo)
    assert _run(capsys, "g", "1", str(goldens[0]), *flags, "--update-module")[0] == 0
    fragment = scratch_repo / "third_party" / "golden_distdir.bazelrc"
    fresh = fragment.read_bytes()
    stale = fresh.replace(b"/g/1/", b"/g/2/")
    assert stale != fresh
    fragment.write_bytes(stale)
    code, out, err = _run(capsys, "distdir", "--check", *flags)
    assert (code, out) == (1, "")
    assert err == f"error: {fragment} is stale; regenerate it: upload_artifact distdir\n"
    assert fragment.read_bytes() == stale
    assert _run(capsys, "distdir", *flags)[0] == 0
    assert fragment.read_bytes() == fresh
