"""Fixtures shared by the store tests (here and in tools/artifacts): a loopback S3 endpoint and a
scratch repository. Each test folder's conftest.py imports them."""

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from goldens.artifacts.sample_module import SAMPLE_MODULE

# Names of every variable through which boto3 could find real credentials or settings.
_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3 protocol endpoint on loopback (moto's threaded server).

    S3 checks a conditional PUT (If-None-Match: *) and stores the object in one step; moto
    checks, then stores, so two racing PUTs of one key can both pass its check. One lock
    around moto's PUT handler gives the loopback server S3's atomicity, which the tests of
    racing publishers rely on.
    """
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    put_object = S3Response.put_object
    lock = threading.Lock()

    def atomic_put_object(self: S3Response) -> object:
        with lock:
            return put_object(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S3Response, "put_object", atomic_put_object)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


@pytest.fixture
def no_aws_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment where boto3 finds no credentials: no variables, files or metadata."""
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws/config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws/credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")


@pytest.fixture
def fake_aws_credentials(no_aws_config: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


@pytest.fixture
def s3_bucket(s3_endpoint: str, fake_aws_credentials: None, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket per test."""
    import boto3

    name = "goldens-" + str(abs(hash(request.node.nodeid)))[:12]
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def closed_port() -> int:
    """A loopback port nobody listens on: connections are refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def scratch_repo(tmp_path: Path) -> Path:
    """A repository stand-in: MODULE.bazel, third_party/ and an empty artifacts/ store."""
    (tmp_path / "MODULE.bazel").write_text(SAMPLE_MODULE)
    (tmp_path / "third_party").mkdir()
    (tmp_path / "artifacts").mkdir()
    return tmp_path


@pytest.fixture
def goldens(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "goldens"
    folder.mkdir()
    files = []
    for name, text in [
        ("llama3_1_float32_cpu_golden.json", '{"tokens": [1, 2]}\n'),
        ("llama3_1_q4_k_cpu_golden.json", '{"tokens": [3]}\n'),
    ]:
        (folder / name).write_text(text)
        files.append(folder / name)
    return files
