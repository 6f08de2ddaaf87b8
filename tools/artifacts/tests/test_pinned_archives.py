"""Every archive MODULE.bazel pins sits in the local store with exactly that sha256.

Bazel itself cannot say this: it skips a --distdir file whose sha256 does not match and falls
back to the pinned URL, so a corrupted archive surfaces as an unreachable download. This test
turns it into a checksum failure inside `bazel test //...`.
"""

from pathlib import Path

from tools.artifacts import upload_artifact


def test_pinned_archives_match_their_sha256(capsys):
    root = Path.cwd()  # the runfiles tree mirrors the repository
    code = upload_artifact.main(
        [
            "verify",
            "--module-file",
            str(root / "MODULE.bazel"),
            "--artifacts-dir",
            str(root / "artifacts"),
            "--distdir-bazelrc",
            str(root / "third_party" / "golden_distdir.bazelrc"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "pinned archives match their sha256" in out
