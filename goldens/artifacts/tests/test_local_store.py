import errno
from pathlib import Path

import pytest

from goldens.artifacts import archive
from goldens.artifacts import store as store_module
from goldens.artifacts.publish import publish
from goldens.artifacts.store import (
    ArchiveRef,
    LocalStore,
    PublishRefused,
    StoreError,
    check_name,
    check_version,
    ref_from_url,
)

V1 = archive.pack_members({"a_golden.json": b"1\n"})
V1_OTHER = archive.pack_members({"a_golden.json": b"other\n"})


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_publish_writes_the_layout_and_the_canonical_url(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    result = publish(store, "test_llama_golden", 3, V1)
    sha = archive.sha256_hex(V1)
    assert result.published
    assert _files(tmp_path) == [f"test_llama_golden/3/{sha}/test_llama_golden.tar.gz"]
    assert (tmp_path / result.ref.relative_path).read_bytes() == V1
    assert result.url == (
        f"https://llama-goldens.invalid/artifacts/test_llama_golden/3/{sha}/test_llama_golden.tar.gz"
    )
    assert ref_from_url(result.url) == ArchiveRef("test_llama_golden", 3, sha)


def test_publishing_identical_bytes_again_is_a_no_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = LocalStore(tmp_path)
    publish(store, "g", 1, V1)
    before = (tmp_path / publish(store, "g", 1, V1).ref.relative_path).stat().st_mtime_ns
    again = publish(store, "g", 1, V1)
    assert not again.published
    assert "nothing to do" in capsys.readouterr().err
    assert (tmp_path / again.ref.relative_path).stat().st_mtime_ns == before


def test_different_bytes_under_a_published_version_are_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    publish(store, "g", 1, V1)
    with pytest.raises(PublishRefused, match="immutable: publish version 2"):
        publish(store, "g", 1, V1_OTHER)
    assert len(_files(tmp_path)) == 1


def test_a_version_below_the_newest_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    publish(store, "g", 5, V1)
    with pytest.raises(PublishRefused, match="below the newest published version 5"):
        publish(store, "g", 4, V1_OTHER)
    assert store.versions("g") == [5]


def test_same_members_compressed_differently_count_as_published(tmp_path: Path) -> None:
    import gzip

    store = LocalStore(tmp_path)
    publish(store, "g", 1, V1)
    # Another zlib (level) gives other gzip bytes around the same tar stream.
    recompressed = gzip.compress(archive.uncompressed_tar(V1), compresslevel=1, mtime=0)
    assert recompressed != V1
    result = publish(store, "g", 1, recompressed)
    assert not result.published and result.ref.sha256 == archive.sha256_hex(V1)


class _CorruptingStore(LocalStore):
    """A disk that flips a byte on write: what the read-back check exists for."""

    def write(self, ref: ArchiveRef, data: bytes) -> None:
        super().write(ref, data[:-1] + bytes([data[-1] ^ 0xFF]))


def test_a_failed_read_back_deletes_the_object(tmp_path: Path) -> None:
    store = _CorruptingStore(tmp_path)
    with pytest.raises(StoreError, match=r"read-back .* was deleted"):
        publish(store, "g", 1, V1)
    assert _files(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_writes_leave_no_temp_files(tmp_path: Path) -> None:
    publish(LocalStore(tmp_path), "g", 1, V1)
    assert not [p for p in tmp_path.rglob(".*")]


def test_a_refused_write_leaves_the_published_version_as_it_was(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    published = publish(store, "g", 1, V1).ref
    with pytest.raises(PublishRefused, match=f"already published with sha256 {published.sha256}"):
        store.write(ArchiveRef("g", 1, archive.sha256_hex(V1_OTHER)), V1_OTHER)
    assert _files(tmp_path) == [published.relative_path]
    assert not [p for p in tmp_path.rglob(".*")]


def test_a_version_folder_without_an_archive_blocks_that_version(tmp_path: Path) -> None:
    (tmp_path / "g" / "7" / ("0" * 64)).mkdir(parents=True)
    with pytest.raises(StoreError, match="g/7 holds no archive but is not empty; remove it"):
        publish(LocalStore(tmp_path), "g", 7, V1)


def test_versions_ignore_folders_without_an_archive(tmp_path: Path) -> None:
    (tmp_path / "g" / "7" / ("0" * 64)).mkdir(parents=True)
    store = LocalStore(tmp_path)
    publish(store, "g", 2, V1)
    assert store.versions("g") == [2]


@pytest.mark.parametrize("name", ["a/b", "a b", "", "1abc", "../x", "a\\b"])
def test_names_that_are_not_repository_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="Bazel repository name"):
        check_name(name)


@pytest.mark.parametrize("version", ["x", "1.5", "-1", "0", "", "٣"])
def test_versions_that_are_not_positive_integers_are_refused(version: str) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        check_version(version)


def test_url_template_must_end_in_the_archive_basename(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, public_url_template="https://example.invalid/{sha256}")
    with pytest.raises(ValueError, match=r"must end in '/g\.tar\.gz'"):
        store.url(ArchiveRef("g", 1, "0" * 64))


def test_a_failed_write_leaves_the_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails (a full disk) is a StoreError naming the archive's path, and leaves
    no half-written archive, staging folder or empty NAME folder behind: the store is as it
    was, the version still free. Catches dropping the removal of the folders the write
    created (`_remove_empty(created)`), which left an empty NAME folder."""
    root = tmp_path / "artifacts"
    store = LocalStore(root)
    other = publish(store, "other", 1, V1).ref
    before = _files(root)

    def disk_full(path: Path, data: bytes, **_: object) -> None:
        path.write_bytes(data[:10])  # what a full disk leaves of a direct write
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(store_module, "write_atomically", disk_full)
    ref = ArchiveRef("g", 1, archive.sha256_hex(V1))
    with pytest.raises(StoreError, match=rf"cannot write {root / ref.relative_path}: .*No space"):
        publish(store, "g", 1, V1)
    assert sorted(p.name for p in root.iterdir()) == ["other"]
    assert _files(root) == before == [other.relative_path]
    assert store.versions("g") == []
    monkeypatch.undo()
    assert publish(store, "g", 1, V1).published
