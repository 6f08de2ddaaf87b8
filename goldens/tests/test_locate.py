"""Where goldens are found outside Bazel: the pinned archive, checked and extracted to a cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from goldens import locate
from goldens.artifacts import archive, stanza
from goldens.artifacts.extract import ChecksumMismatch
from goldens.artifacts.publish import publish
from goldens.artifacts.sample_module import SAMPLE_MODULE
from goldens.artifacts.store import LOCAL_PUBLIC_URL_TEMPLATE, LocalStore

NAME = "test_llama_golden"
MEMBERS = {
    "llama3_1_float32_cpu_engine_golden.json": b'{"tokens": [791, 6864]}\n',
    "llama3_1_q4_k_cpu_engine_golden.json": b'{"tokens": [3]}\n',
}
DATA = archive.pack_members(MEMBERS)
SHA = archive.sha256_hex(DATA)


@pytest.fixture(autouse=True)
def outside_bazel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No runfiles variables, and a cache under tmp_path; returns the extraction root."""
    for _, env in locate.ARCHIVES.values():
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "llama-goldens" / "pinned"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch repository whose MODULE.bazel pins DATA, published as version 1."""
    root = tmp_path / "repo"
    root.mkdir()
    result = publish(LocalStore(root / "artifacts"), NAME, 1, DATA)
    _pin(root, result.url)
    return root


@pytest.fixture
def testdata(tmp_path: Path) -> Path:
    folder = tmp_path / "testdata"
    folder.mkdir()
    return folder


def _pin(root: Path, url: str, sha: str = SHA) -> None:
    text = stanza.set_pin(SAMPLE_MODULE, stanza.GoldenPin(NAME, sha, url))
    (root / "MODULE.bazel").write_text(text, encoding="utf-8")


def _url(version: int) -> str:
    key = f"artifacts/{NAME}/{version}/{SHA}/{NAME}.tar.gz"
    return LOCAL_PUBLIC_URL_TEMPLATE.format(key=key)


def _store_path(root: Path, version: int) -> Path:
    return root / "artifacts" / NAME / str(version) / SHA / f"{NAME}.tar.gz"


def test_the_pinned_archive_is_extracted_and_searched_before_testdata(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    sources = locate.golden_sources("own", testdata, repo_root=repo)
    assert [s.folder for s in sources] == [outside_bazel / SHA, testdata]
    archive_path = f"artifacts/{NAME}/1/{SHA}/{NAME}.tar.gz"
    assert sources[0].description == (
        f"pinned archive {archive_path} (extracted to {outside_bazel / SHA})"
    )
    assert {p.name: p.read_bytes() for p in sources[0].folder.iterdir()} == MEMBERS
    assert sorted(p.name for p in outside_bazel.iterdir()) == [SHA]


def test_a_second_lookup_reuses_the_extracted_folder(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    first = locate.golden_sources("own", testdata, repo_root=repo)[0].folder
    (first / "sentinel").write_bytes(b"kept")
    inode = first.stat().st_ino
    second = locate.golden_sources("own", testdata, repo_root=repo)[0].folder
    assert second == first
    assert second.stat().st_ino == inode
    assert (second / "sentinel").read_bytes() == b"kept"


def test_the_cache_root_follows_xdg_cache_home_at_call_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    assert locate.cache_root() == tmp_path / "elsewhere" / "llama-goldens" / "pinned"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for ignored in ["", "relative/cache"]:  # the XDG spec ignores empty and relative values
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert locate.cache_root() == tmp_path / "home" / ".cache" / "llama-goldens" / "pinned"


def test_a_damaged_archive_is_an_error_naming_it_not_a_silent_fallback(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    damaged = _store_path(repo, 1)
    data = bytearray(DATA)
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch) as raised:
        locate.golden_sources("own", testdata, repo_root=repo)
    message = str(raised.value)
    assert str(damaged) in message
    assert f"has sha256 {archive.sha256_hex(bytes(data))}" in message
    assert f"pinned sha256 is {SHA}" in message
    assert "git checkout --" in message
    assert not outside_bazel.exists() or list(outside_bazel.iterdir()) == []


# The pinned URL's version when the store has it; else the newest version holding the sha,
# compared as numbers (10 > 2, not "2" > "10").
@pytest.mark.parametrize(("pinned", "used"), [(2, 2), (7, 10)])
def test_the_version_used_when_several_hold_the_sha(
    repo: Path, testdata: Path, pinned: int, used: int
) -> None:
    for version in (2, 10):
        _store_path(repo, version).parent.mkdir(parents=True)
        _store_path(repo, version).write_bytes(DATA)
    _pin(repo, _url(pinned))
    source = locate.golden_sources("own", testdata, repo_root=repo)[0]
    assert f"artifacts/{NAME}/{used}/{SHA}/" in source.description


def test_without_a_pin_only_testdata_is_searched(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    unpinned = locate.golden_sources("torch", testdata, repo_root=repo)
    assert [s.folder for s in unpinned] == [testdata]
    assert not outside_bazel.exists()


def test_a_pinned_archive_deleted_from_the_store_is_an_error_naming_the_restore(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    """Not a silent fallback to the testdata folder, whose goldens nobody pinned."""
    _store_path(repo, 1).unlink()
    with pytest.raises(locate.PinnedArchiveMissing) as raised:
        locate.golden_sources("own", testdata, repo_root=repo)
    message = str(raised.value)
    assert message.startswith(f"{NAME}: MODULE.bazel pins {_url(1)} (sha256 {SHA}), which the ")
    assert f"git checkout -- {repo / 'artifacts' / NAME}" in message
    assert not outside_bazel.exists()


def test_a_pin_bazel_downloads_that_the_store_lacks_is_an_error_naming_the_fetch(
    repo: Path, testdata: Path, outside_bazel: Path
) -> None:
    """An S3 pin (upload_artifact --bucket=... --update-module) is downloaded by Bazel; plain
    pytest reads the local store only, so it says how to get the archive."""
    url = f"https://goldens.s3.amazonaws.com/artifacts/{NAME}/2/{SHA}/{NAME}.tar.gz"
    _pin(repo, url)
    shutil.rmtree(repo / "artifacts")
    with pytest.raises(locate.PinnedArchiveMissing) as raised:
        locate.golden_sources("own", testdata, repo_root=repo)
    message = str(raised.value)
    assert f"MODULE.bazel pins {url} (sha256 {SHA})" in message
    assert f"python3 -m tools.artifacts.upload_artifact fetch {NAME} --output-dir=DIR" in message
    assert 'TEST_LLAMA_GOLDENS="$(echo DIR/*)"' in message
    assert not outside_bazel.exists()


def test_runfiles_win_under_bazel(
    repo: Path, testdata: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runfiles = tmp_path / "runfiles"
    runfiles.mkdir()
    names = [str(runfiles / name) for name in MEMBERS]
    monkeypatch.setenv("TEST_LLAMA_GOLDENS", " ".join(names))
    sources = locate.golden_sources("own", testdata, repo_root=repo)
    assert [s.folder for s in sources] == [runfiles.resolve()]


def test_find_golden_takes_the_pinned_file_over_a_fresh_one_of_the_same_name(
    repo: Path, testdata: Path, outside_bazel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/architecture.md:546-548: a freshly regenerated golden in testdata/ is not what the
    tests compare against while the pinned archive holds a file of the same name; a name only
    testdata/ holds is found there (:542, source 2). Plant caught: find_golden searching
    the sources in another order (`reversed(sources)`: the fresh file wins)."""
    monkeypatch.setattr(locate, "checkout_root", lambda: repo)
    pinned, fresh_only = sorted(MEMBERS)[0], "llama3_1_bfloat16_cpu_engine_golden.json"
    (testdata / pinned).write_bytes(b'{"tokens": [0]}\n')  # regenerated, not published
    (testdata / fresh_only).write_bytes(b'{"tokens": [1]}\n')
    path, sources = locate.find_golden("own", pinned, testdata)
    assert path == outside_bazel / SHA / pinned
    assert path.read_bytes() == MEMBERS[pinned]
    assert [s.folder for s in sources] == [outside_bazel / SHA, testdata]
    assert locate.find_golden("own", fresh_only, testdata)[0] == testdata / fresh_only
    assert locate.find_golden("own", "absent_golden.json", testdata)[0] is None


def test_under_bazel_each_reference_reads_the_one_folder_of_its_own_archive(
    repo: Path, testdata: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/architecture.md:536-541: own (and the ggml mode's) goldens come from
    $TEST_LLAMA_GOLDENS, torch's from $TORCH_LLAMA_GOLDENS, each the one folder its archive's
    files are in; a variable naming files in several folders is an error naming it, not one
    folder picked. Plants caught: ARCHIVES' torch entry reading TEST_LLAMA_GOLDENS (torch
    judged against the engine's files), and _runfiles_source taking the first file's folder
    without the check."""
    own, torch = tmp_path / "own_runfiles", tmp_path / "torch_runfiles"
    own.mkdir()
    torch.mkdir()
    monkeypatch.setenv("TEST_LLAMA_GOLDENS", f"{own}/a_golden.json {own}/b_golden.json")
    monkeypatch.setenv("TORCH_LLAMA_GOLDENS", f"{torch}/torch_a_golden.json")
    folders = {
        reference: [s.folder for s in locate.golden_sources(reference, testdata, repo_root=repo)]
        for reference in ("own", "ggml", "torch")
    }
    assert folders == {"own": [own.resolve()], "ggml": [own.resolve()], "torch": [torch.resolve()]}
    monkeypatch.setenv("TORCH_LLAMA_GOLDENS", f"{torch}/torch_a_golden.json {own}/a_golden.json")
    with pytest.raises(ValueError, match=r"^\$TORCH_LLAMA_GOLDENS lists files in several folders"):
        locate.golden_sources("torch", testdata, repo_root=repo)
