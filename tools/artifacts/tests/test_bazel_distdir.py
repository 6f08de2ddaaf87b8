"""Bazel itself resolves pinned archives, from the local store or over HTTP, never corrupted.

Runs real Bazel in a throwaway workspace (batch mode, its own output base, no repository
cache, so nothing is shared with the repository's server).
The HTTP case publishes to moto's S3 server on loopback, so it too runs offline. Needs `bazel`
on PATH. Under `bazel test` only as //tools/artifacts:bazel_distdir_test (unsandboxed, local:
NESTED_BAZEL_OK), which CI runs with the rest; elsewhere in a sandbox it skips. About 15 s:
    ./bazelw test //tools/artifacts:bazel_distdir_test
    python3 -m pytest tools/artifacts/tests/test_bazel_distdir.py -m slow
"""

import subprocess
from pathlib import Path

from goldens.artifacts import archive, stanza
from testing import nested_bazel
from tools.artifacts.upload_artifact import main

pytestmark = nested_bazel.marks("//tools/artifacts:bazel_distdir_test")

MODULE = """\
bazel_dep(name = "zlib", version = "")
bazel_dep(name = "protobuf", version = "")
bazel_dep(name = "buildozer", version = "")
bazel_dep(name = "apple_support", version = "")
"""


def _bazel(workspace: Path, output_base: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bazel", "--batch", f"--output_base={output_base}", "build", "--repository_cache=",
         "@test_llama_golden//:test_llama_golden"],
        cwd=workspace, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _publish(workspace: Path, version: str, golden: Path, *store: str) -> str:
    code = main([
        "upload", "test_llama_golden", version, str(golden), "--update-module",
        *(store or [f"--artifacts-dir={workspace / 'artifacts'}"]),
        f"--module-file={workspace / 'MODULE.bazel'}",
        f"--distdir-bazelrc={workspace / 'third_party' / 'golden_distdir.bazelrc'}",
    ])  # fmt: skip
    assert code == 0
    return stanza.parse((workspace / "MODULE.bazel").read_text())["test_llama_golden"].sha256


def _workspace(tmp_path: Path) -> Path:
    workspace = nested_bazel.workspace(tmp_path / "ws", "distdir_check", MODULE)
    (workspace / "third_party").mkdir()
    return workspace


def test_bazel_takes_the_pinned_archive_from_the_store_and_refuses_a_corrupted_one(
    tmp_path: Path,
) -> None:
    workspace = _workspace(tmp_path)
    golden = tmp_path / "llama3_1_float32_cpu_golden.json"
    golden.write_text('{"version": 1}\n')
    old_sha = _publish(workspace, "1", golden)
    golden.write_text('{"version": 2}\n')
    new_sha = _publish(workspace, "2", golden)
    # A stale distdir holding another test_llama_golden.tar.gz comes first: Bazel must match
    # by sha256, not by basename alone.
    (workspace / ".bazelrc").write_text(
        nested_bazel.BAZELRC + f"common --distdir=artifacts/test_llama_golden/1/{old_sha}\n"
        "try-import %workspace%/third_party/golden_distdir.bazelrc\n"
    )

    fetched = _bazel(workspace, tmp_path / "ob")
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    repo = tmp_path / "ob" / "external" / "_main~_repo_rules~test_llama_golden"
    assert (repo / golden.name).read_text() == '{"version": 2}\n'

    archive = workspace / f"artifacts/test_llama_golden/2/{new_sha}/test_llama_golden.tar.gz"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    corrupted = _bazel(workspace, tmp_path / "ob2")
    # Bazel 7 skips a distdir file whose sha256 differs and falls back to the pinned URL,
    # whose reserved .invalid host never resolves: the build fails, never uses the bytes.
    assert corrupted.returncode != 0
    assert f"test_llama_golden/2/{new_sha}/test_llama_golden.tar.gz" in corrupted.stderr
    assert "llama-goldens.invalid" in corrupted.stderr


def test_bazel_downloads_an_s3_pin_anonymously_and_refuses_other_bytes(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    import boto3

    workspace = _workspace(tmp_path)
    golden = tmp_path / "llama3_1_float32_cpu_golden.json"
    golden.write_text('{"over": "http"}\n')
    sha = _publish(workspace, "1", golden, f"--bucket={s3_bucket}", f"--endpoint-url={s3_endpoint}")
    pin = stanza.parse((workspace / "MODULE.bazel").read_text())["test_llama_golden"]
    assert pin.url == f"{s3_endpoint}/{s3_bucket}/artifacts/test_llama_golden/1/{sha}/" + (
        "test_llama_golden.tar.gz"
    )
    # No distdir and no repository cache: the pinned URL is the only place to get it from.
    (workspace / ".bazelrc").write_text(nested_bazel.BAZELRC)

    fetched = _bazel(workspace, tmp_path / "ob")
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    repo = tmp_path / "ob" / "external" / "_main~_repo_rules~test_llama_golden"
    assert (repo / golden.name).read_text() == '{"over": "http"}\n'

    key = pin.url.removeprefix(f"{s3_endpoint}/{s3_bucket}/")
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=s3_bucket, Key=key, Body=b"other bytes", ACL="public-read"
    )
    corrupted = _bazel(workspace, tmp_path / "ob2")
    assert corrupted.returncode != 0
    assert f"Checksum was {archive.sha256_hex(b'other bytes')} but wanted {sha}" in (
        corrupted.stderr
    ), corrupted.stderr[-3000:]
