"""Publishers racing for one NAME/VERSION, on the local store and on S3 (moto on loopback).

Each publisher gets its own store object over the same root or bucket, as two processes would;
a barrier releases them together, so both mostly pass `publish`'s listing before either
writes, and the store's atomic claim decides. (Without the claim, these races publish both.)
"""

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from goldens.artifacts import archive
from goldens.artifacts.publish import PublishResult, publish
from goldens.artifacts.store import ArchiveRef, LocalStore, PublishRefused, S3Store, Store

V1 = archive.pack_members({"a_golden.json": b"1\n"})
V1_OTHER = archive.pack_members({"a_golden.json": b"other\n"})


@pytest.fixture(params=["local", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """Makes stores over one shared root (a folder, or a bucket on moto's loopback server)."""
    if request.param == "local":
        return lambda: LocalStore(tmp_path / "artifacts")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return lambda: S3Store(bucket, endpoint_url=endpoint)


def _race(*calls: Callable[[], object]) -> list[object]:
    """Runs `calls` in threads released together; each one's result or exception."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], object]) -> object:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, call) for call in calls]
        return [future.exception() or future.result() for future in futures]


@pytest.mark.parametrize("name", ["g", "h", "i"])  # a few rounds: each race may order itself
def test_of_two_publishers_with_other_bytes_exactly_one_wins(
    make_store: Callable[[], Store], name: str
) -> None:
    first, second = make_store(), make_store()
    results = _race(lambda: publish(first, name, 1, V1), lambda: publish(second, name, 1, V1_OTHER))
    won = [r for r in results if isinstance(r, PublishResult)]
    refused = [r for r in results if isinstance(r, PublishRefused)]
    assert len(won) == 1 and len(refused) == 1, results
    winner = won[0].ref
    assert f"{name} version 1 is already published with sha256 {winner.sha256}" in str(refused[0])
    assert "publish version 2 instead" in str(refused[0])
    store = make_store()
    assert store.digests(name, 1) == [winner.sha256]
    assert store.read(winner) in (V1, V1_OTHER)
    assert archive.sha256_hex(store.read(winner) or b"") == winner.sha256


def test_publishers_with_the_same_bytes_both_succeed(make_store: Callable[[], Store]) -> None:
    first, second = make_store(), make_store()
    results = _race(lambda: publish(first, "g", 1, V1), lambda: publish(second, "g", 1, V1))
    assert all(isinstance(r, PublishResult) for r in results), results
    ref = ArchiveRef("g", 1, archive.sha256_hex(V1))
    assert make_store().digests("g", 1) == [ref.sha256]
    assert make_store().read(ref) == V1


def test_the_store_itself_refuses_other_bytes_for_a_taken_version(
    make_store: Callable[[], Store],
) -> None:
    store = make_store()
    first = ArchiveRef("g", 1, archive.sha256_hex(V1))
    store.write(first, V1)
    store.write(first, V1)  # the same bytes again: nothing to refuse
    with pytest.raises(PublishRefused, match=f"already published with sha256 {first.sha256}"):
        store.write(ArchiveRef("g", 1, archive.sha256_hex(V1_OTHER)), V1_OTHER)
    assert store.digests("g", 1) == [first.sha256]
    assert store.read(first) == V1
