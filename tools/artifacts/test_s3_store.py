"""S3 through a real boto3 client against moto's server on loopback: real HTTP, no patches."""

import time

import boto3
import pytest

from tools.artifacts import archive
from tools.artifacts.publish import publish
from tools.artifacts.store import ArchiveRef, PublishRefused, S3Store, StoreError

V1 = archive.pack_members({"a_golden.json": b"1\n"})
V1_OTHER = archive.pack_members({"a_golden.json": b"other\n"})


def _keys(endpoint: str, bucket: str) -> list[str]:
    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listing.get("Contents", []))


def test_publish_uploads_under_the_prefix_and_reads_back(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    result = publish(store, "test_llama_golden", 3, V1)
    sha = archive.sha256_hex(V1)
    key = f"artifacts/test_llama_golden/3/{sha}/test_llama_golden.tar.gz"
    assert result.published
    assert _keys(s3_endpoint, s3_bucket) == [key]
    body = boto3.client("s3", endpoint_url=s3_endpoint).get_object(Bucket=s3_bucket, Key=key)
    assert body["Body"].read() == V1
    assert result.url == f"{s3_endpoint}/{s3_bucket}/{key}"


def test_republishing_is_a_no_op_and_overwriting_is_refused(
    s3_endpoint: str, s3_bucket: str
) -> None:
    store = S3Store(s3_bucket, prefix="team/goldens", endpoint_url=s3_endpoint)
    publish(store, "g", 1, V1)
    assert not publish(store, "g", 1, V1).published
    with pytest.raises(PublishRefused, match="immutable"):
        publish(store, "g", 1, V1_OTHER)
    assert len(_keys(s3_endpoint, s3_bucket)) == 1
    assert store.read(ArchiveRef("g", 1, archive.sha256_hex(V1))) == V1


def test_a_version_below_the_newest_is_refused(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    publish(store, "g", 2, V1)
    publish(store, "g", 10, V1_OTHER)  # numeric, not lexical, order: 10 > 2
    assert store.versions("g") == [2, 10]
    with pytest.raises(PublishRefused, match="below the newest published version 10"):
        publish(store, "g", 9, V1)


class _CorruptingS3Store(S3Store):
    """Bytes damaged after the checks (a proxy rewriting bodies, say): read-back must catch it."""

    def write(self, ref: ArchiveRef, data: bytes) -> None:
        super().write(ref, data + b"trailing garbage")


def test_a_failed_read_back_deletes_the_object(s3_endpoint: str, s3_bucket: str) -> None:
    store = _CorruptingS3Store(s3_bucket, endpoint_url=s3_endpoint)
    with pytest.raises(StoreError, match=r"read-back .* was deleted"):
        publish(store, "g", 1, V1)
    assert _keys(s3_endpoint, s3_bucket) == []


def test_a_missing_object_reads_as_none(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    assert store.read(ArchiveRef("g", 1, "0" * 64)) is None


def test_a_missing_bucket_is_a_store_error(s3_endpoint: str, fake_aws_credentials: None) -> None:
    store = S3Store("no-such-bucket", endpoint_url=s3_endpoint)
    with pytest.raises(StoreError, match="NoSuchBucket"):
        publish(store, "g", 1, V1)


def test_missing_credentials_are_a_clear_store_error(s3_endpoint: str, no_aws_config: None) -> None:
    store = S3Store("goldens", endpoint_url=s3_endpoint)
    with pytest.raises(StoreError, match=r"no AWS credentials .* AWS_ACCESS_KEY_ID"):
        publish(store, "g", 1, V1)


def test_an_unreachable_endpoint_fails_fast(closed_port: int, fake_aws_credentials: None) -> None:
    store = S3Store("goldens", endpoint_url=f"http://127.0.0.1:{closed_port}")
    started = time.monotonic()
    with pytest.raises(StoreError, match="Could not connect"):
        publish(store, "g", 1, V1)
    assert time.monotonic() - started < 5
