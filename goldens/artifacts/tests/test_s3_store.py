"""S3 through a real boto3 client against moto's server on loopback: real HTTP.

Errors S3 gives and moto does not (a 409 for racing conditional writes, a failed upload) are
answered by a botocore hook on the store's client, in place of the server.
"""

import urllib.error
import urllib.request

import boto3
import pytest
from botocore.awsrequest import AWSResponse

from goldens.artifacts import archive
from goldens.artifacts import store as store_module
from goldens.artifacts.publish import publish
from goldens.artifacts.store import ArchiveRef, PublishRefused, S3Store, StoreError

V1 = archive.pack_members({"a_golden.json": b"1\n"})
V1_OTHER = archive.pack_members({"a_golden.json": b"other\n"})
V2 = archive.pack_members({"a_golden.json": b"2\n"})


def _keys(endpoint: str, bucket: str) -> list[str]:
    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)
    return sorted(item["Key"] for item in listing.get("Contents", []))


def _body(endpoint: str, bucket: str, key: str) -> bytes:
    response = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=key)
    return response["Body"].read()


class _ErrorBody:
    def __init__(self, code: str) -> None:
        self.xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()

    def stream(self) -> list[bytes]:
        return [self.xml]


def _fail_puts(store: S3Store, status: int, code: str, count: int, key_end: str) -> list[str]:
    """The next `count` PUTs of keys ending in `key_end` get this error instead of the server."""
    failed: list[str] = []

    def answer(request: object, **_: object) -> AWSResponse | None:
        url = getattr(request, "url", "")
        if len(failed) == count or not url.endswith(key_end):
            return None
        failed.append(url)
        return AWSResponse(url, status, {}, _ErrorBody(code))

    store._client.meta.events.register("before-send.s3.PutObject", answer)
    return failed


def test_publish_uploads_under_the_prefix_and_reads_back(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    result = publish(store, "test_llama_golden", 3, V1)
    sha = archive.sha256_hex(V1)
    key = f"artifacts/test_llama_golden/3/{sha}/test_llama_golden.tar.gz"
    claim = "artifacts/test_llama_golden/3/claim"
    assert result.published
    assert _keys(s3_endpoint, s3_bucket) == sorted([key, claim])
    assert _body(s3_endpoint, s3_bucket, key) == V1
    assert _body(s3_endpoint, s3_bucket, claim) == f"{sha}\n".encode()
    assert result.url == f"{s3_endpoint}/{s3_bucket}/{key}"


def test_republishing_is_a_no_op_and_overwriting_is_refused(
    s3_endpoint: str, s3_bucket: str
) -> None:
    store = S3Store(s3_bucket, prefix="team/goldens", endpoint_url=s3_endpoint)
    publish(store, "g", 1, V1)
    assert not publish(store, "g", 1, V1).published
    with pytest.raises(PublishRefused, match="immutable"):
        publish(store, "g", 1, V1_OTHER)
    assert len(_keys(s3_endpoint, s3_bucket)) == 2  # the archive and its version's claim
    assert store.read(ArchiveRef("g", 1, archive.sha256_hex(V1))) == V1


def test_a_version_published_before_claims_still_refuses_other_bytes(
    s3_endpoint: str, s3_bucket: str
) -> None:
    key = f"artifacts/g/1/{archive.sha256_hex(V1)}/g.tar.gz"
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=V1)
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    assert not publish(store, "g", 1, V1).published
    with pytest.raises(PublishRefused, match="immutable: publish version 2 instead"):
        publish(store, "g", 1, V1_OTHER)
    assert _keys(s3_endpoint, s3_bucket) == [key]


def test_a_conflict_between_conditional_writes_is_retried(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    conflicts = _fail_puts(store, 409, "ConditionalRequestConflict", 2, "/claim")
    assert publish(store, "g", 1, V1).published
    assert len(conflicts) == 2


def test_a_failed_upload_releases_the_versions_claim(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    _fail_puts(store, 500, "InternalError", 10, ".tar.gz")  # botocore's retries fail too
    with pytest.raises(StoreError, match=r"upload .* failed: InternalError"):
        publish(store, "g", 1, V1)
    assert _keys(s3_endpoint, s3_bucket) == []
    assert publish(S3Store(s3_bucket, endpoint_url=s3_endpoint), "g", 1, V1_OTHER).published


def test_an_interrupted_upload_releases_the_versions_claim(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """Ctrl-C during the archive's PUT: the claim goes too, so the version stays free (a claim
    left behind made a later publish of other bytes read "already published")."""
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)

    def interrupt(request: object, **_: object) -> None:
        if getattr(request, "url", "").endswith(".tar.gz"):
            raise KeyboardInterrupt

    store._client.meta.events.register("before-send.s3.PutObject", interrupt)
    with pytest.raises(KeyboardInterrupt):
        publish(store, "g", 1, V1)
    assert [key for key in _keys(s3_endpoint, s3_bucket) if key.startswith("artifacts/g/1/")] == []
    assert publish(S3Store(s3_bucket, endpoint_url=s3_endpoint), "g", 1, V1_OTHER).published


def test_a_claim_without_its_archive_is_refused_naming_the_claim(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """A claim whose archive never arrived (a publisher killed before it could release it) is
    not a published version: the refusal says so and names the claim to delete."""
    claim = "artifacts/g/1/claim"
    body = f"{archive.sha256_hex(V1)}\n".encode()
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key=claim, Body=body)
    with pytest.raises(PublishRefused) as refused:
        publish(S3Store(s3_bucket, endpoint_url=s3_endpoint), "g", 1, V1_OTHER)
    message = str(refused.value)
    assert "already published" not in message
    assert f"claimed for sha256 {archive.sha256_hex(V1)} but holds no archive" in message
    assert f"delete the claim s3://{s3_bucket}/{claim} and publish again" in message
    assert _keys(s3_endpoint, s3_bucket) == [claim]


def test_a_claim_released_while_claiming_asks_to_publish_again(
    s3_endpoint: str, s3_bucket: str
) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    _fail_puts(store, 412, "PreconditionFailed", 1, "/claim")  # taken, then gone when read
    with pytest.raises(StoreError, match=r"released while publishing .* publish again"):
        publish(store, "g", 1, V1)
    assert _keys(s3_endpoint, s3_bucket) == []


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


def _anonymous_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        with error:
            return error.code


def test_the_archive_is_public_read_and_its_claim_private(s3_endpoint: str, s3_bucket: str) -> None:
    result = publish(S3Store(s3_bucket, endpoint_url=s3_endpoint), "g", 1, V1)
    assert _anonymous_status(result.url) == 200
    assert _anonymous_status(f"{s3_endpoint}/{s3_bucket}/artifacts/g/1/claim") == 403
    private = publish(S3Store(s3_bucket, endpoint_url=s3_endpoint, public_read=False), "g", 2, V2)
    assert _anonymous_status(private.url) == 403
    S3Store(s3_bucket, endpoint_url=s3_endpoint).ensure_public(private.ref)
    assert _anonymous_status(private.url) == 200


def test_a_bucket_without_acls_asks_for_a_bucket_policy(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    _fail_puts(store, 400, "AccessControlListNotSupported", 1, ".tar.gz")
    with pytest.raises(StoreError, match=r"disables ACLs.*bucket policy and pass --no-public-r"):
        publish(store, "g", 1, V1)
    assert _keys(s3_endpoint, s3_bucket) == []  # the claim was released


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


def test_an_unreachable_endpoint_fails_fast(
    closed_port: int, fake_aws_credentials: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What bounds the wait is the client's configuration: a 5 s connect timeout and 3
    retries, 4 attempts in all (botocore's legacy default: 60 s timeouts). No wall-clock
    assert: a loaded machine must not fail a correct program."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    store = S3Store("goldens", endpoint_url=f"http://127.0.0.1:{closed_port}")
    config = store._client.meta.config
    assert config.connect_timeout == 5
    assert config.retries == {"mode": "standard", "total_max_attempts": 4}
    with pytest.raises(StoreError, match="Could not connect"):
        publish(store, "g", 1, V1)


def test_conditional_write_conflicts_are_retried_a_bounded_number_of_times(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """A 409 that never clears is a StoreError naming it after _CONFLICT_ATTEMPTS PUTs of the
    claim, not an endless loop, and the version is left unclaimed. Catches an off-by-one in
    the retry bound (`attempt > _CONFLICT_ATTEMPTS`, one PUT more, which then succeeds)."""
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    attempts = store_module._CONFLICT_ATTEMPTS
    conflicts = _fail_puts(store, 409, "ConditionalRequestConflict", attempts, "/claim")
    with pytest.raises(StoreError, match=r"upload .* failed: ConditionalRequestConflict"):
        publish(store, "g", 1, V1)
    assert len(conflicts) == attempts
    assert _keys(s3_endpoint, s3_bucket) == []


def test_deleting_an_archive_that_does_not_hold_the_claim_leaves_the_claim(
    s3_endpoint: str, s3_bucket: str
) -> None:
    """delete releases NAME/VERSION's claim only when the deleted archive's bytes hold it: a
    delete of other bytes under a taken version leaves the publisher's claim and archive as
    they were. Catches releasing the claim without checking its holder."""
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint)
    published = publish(store, "g", 1, V1).ref
    before = _keys(s3_endpoint, s3_bucket)
    store.delete(ArchiveRef("g", 1, archive.sha256_hex(V1_OTHER)))
    assert _keys(s3_endpoint, s3_bucket) == before
    claim = _body(s3_endpoint, s3_bucket, "artifacts/g/1/claim")
    assert claim == f"{published.sha256}\n".encode()
    store.delete(published)
    assert _keys(s3_endpoint, s3_bucket) == []
