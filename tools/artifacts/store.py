"""Content-addressed stores for golden archives: the repo's local folder and S3.

Both keep one layout under their root, `NAME/VERSION/SHA256/NAME.tar.gz`, where the root is
the repository's `artifacts/` folder or `s3://BUCKET/PREFIX/` (PREFIX defaults to
`artifacts`). A published object is immutable; `publish` enforces that and the version rule.
"""

import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tools.cli_files import repo_root, write_atomically

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
DEFAULT_PREFIX = "artifacts"
# A reserved top-level domain never resolves, so a pinned URL can never fetch something else;
# Bazel gets these archives from the local store through --distdir (third_party/*.bazelrc).
LOCAL_PUBLIC_URL_TEMPLATE = "https://llama-goldens.invalid/{key}"


class StoreError(RuntimeError):
    """The store could not be read or written (network, credentials, permissions)."""


class PublishRefused(RuntimeError):
    """Publishing would break immutability or the version order."""


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"NAME {name!r} must be a Bazel repository name: a letter, then letters, digits, "
            "'_', '-' or '.' (no path separators or spaces), e.g. test_llama_golden"
        )
    return name


def check_version(version: str | int) -> int:
    text = str(version)
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise ValueError(f"VERSION {text!r} must be a positive integer, e.g. 3")
    return int(text)


@dataclass(frozen=True)
class ArchiveRef:
    """Where one archive lives: NAME/VERSION/SHA256/NAME.tar.gz under a store's root."""

    name: str
    version: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.tar.gz"

    @property
    def relative_dir(self) -> str:
        return f"{self.name}/{self.version}/{self.sha256}"

    @property
    def relative_path(self) -> str:
        return f"{self.relative_dir}/{self.filename}"


_URL_TAIL = re.compile(
    r"/(?P<name>[A-Za-z][A-Za-z0-9_.-]*)/(?P<version>[0-9]+)/(?P<sha256>[0-9a-f]{64})"
    r"/(?P=name)\.tar\.gz$"
)


def ref_from_url(url: str) -> ArchiveRef | None:
    """The store location a canonical URL names, whatever its host and prefix."""
    match = _URL_TAIL.search(url)
    if match is None:
        return None
    return ArchiveRef(match["name"], int(match["version"]), match["sha256"])


class Store(Protocol):
    """What `publish` and `fetch` need from a store; keys are ArchiveRef.relative_path."""

    description: str

    def versions(self, name: str) -> list[int]: ...
    def digests(self, name: str, version: int) -> list[str]: ...
    def read(self, ref: ArchiveRef) -> bytes | None: ...
    def write(self, ref: ArchiveRef, data: bytes) -> None: ...
    def delete(self, ref: ArchiveRef) -> None: ...
    def url(self, ref: ArchiveRef) -> str: ...


def _format_url(template: str, ref: ArchiveRef, key: str, **extra: str) -> str:
    try:
        url = template.format(
            name=ref.name, version=ref.version, sha256=ref.sha256, key=key, **extra
        )
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"--public-url-template {template!r} is not usable ({error!r}); use the fields "
            "{name}, {version}, {sha256}, {key}"
        ) from error
    # Bazel's --distdir matches a file by the URL's basename, so the URL must end in it.
    if not url.endswith("/" + ref.filename):
        raise ValueError(
            f"--public-url-template {template!r} gives {url!r}, which must end in "
            f"'/{ref.filename}' (use .../{{key}} or .../{{name}}.tar.gz)"
        )
    return url


class LocalStore:
    """The repository's `artifacts/` folder; the default store, so everything works offline."""

    def __init__(
        self, root: Path | None = None, public_url_template: str = LOCAL_PUBLIC_URL_TEMPLATE
    ) -> None:
        self.root = Path(root) if root is not None else repo_root() / DEFAULT_PREFIX
        self.public_url_template = public_url_template
        self.description = f"local store {self.root}"

    def path(self, ref: ArchiveRef) -> Path:
        return self.root / ref.relative_path

    def versions(self, name: str) -> list[int]:
        folder = self.root / name
        if not folder.is_dir():
            return []
        return sorted(
            int(entry.name)
            for entry in folder.iterdir()
            if entry.name.isdigit() and self.digests(name, int(entry.name))
        )

    def digests(self, name: str, version: int) -> list[str]:
        folder = self.root / name / str(version)
        if not folder.is_dir():
            return []
        return sorted(
            entry.name
            for entry in folder.iterdir()
            if SHA256_PATTERN.fullmatch(entry.name) and (entry / f"{name}.tar.gz").is_file()
        )

    def read(self, ref: ArchiveRef) -> bytes | None:
        try:
            return self.path(ref).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, ref: ArchiveRef, data: bytes) -> None:
        target = self.path(ref)
        created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(target, data, fsync=True)
        except OSError as error:
            _remove_empty(created)
            raise StoreError(f"cannot write {target}: {error}") from error

    def delete(self, ref: ArchiveRef) -> None:
        target = self.path(ref)
        target.unlink(missing_ok=True)
        # SHA256, VERSION and NAME folders, when this archive was all they held.
        _remove_empty(list(target.parents)[:3])

    def url(self, ref: ArchiveRef) -> str:
        key = f"{DEFAULT_PREFIX}/{ref.relative_path}"
        return _format_url(self.public_url_template, ref, key)


def _remove_empty(folders: list[Path]) -> None:
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()


class S3Store:
    """An S3 (or S3-compatible, via endpoint_url) bucket, credentials from boto3's chain."""

    def __init__(
        self,
        bucket: str,
        prefix: str = DEFAULT_PREFIX,
        endpoint_url: str | None = None,
        public_url_template: str | None = None,
        region: str | None = None,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.public_url_template = public_url_template or (
            f"{endpoint_url.rstrip('/')}/{bucket}/{{key}}"
            if endpoint_url
            else f"https://{bucket}.s3.amazonaws.com/{{key}}"
        )
        self.description = f"s3://{bucket}/{self.prefix}" + (
            f" at {endpoint_url}" if endpoint_url else ""
        )
        # Fail fast on an unreachable endpoint; AWS_MAX_ATTEMPTS still overrides the retries.
        config = Config(
            connect_timeout=5,
            read_timeout=60,
            retries={
                "mode": "standard",
                "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", 3)),
            },
        )
        session = boto3.session.Session(region_name=region)
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def _call(self, action: str, call: Callable[[], object]) -> object:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return call()
        except NoCredentialsError as error:
            raise StoreError(
                f"no AWS credentials for {self.description}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or use --store=local"
            ) from error
        except ClientError as error:
            detail = error.response.get("Error", {})
            raise StoreError(
                f"{action} on {self.description} failed: {detail.get('Code')} "
                f"{detail.get('Message', '')}".rstrip()
            ) from error
        except BotoCoreError as error:
            raise StoreError(f"{action} on {self.description} failed: {error}") from error

    def _subfolders(self, relative: str) -> list[str]:
        prefix = self.key(relative) + "/"
        paginator = self._client.get_paginator("list_objects_v2")

        def listing() -> list[str]:
            names = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    names.append(common["Prefix"][len(prefix) :].rstrip("/"))
            return names

        return self._call("listing", listing)  # type: ignore[return-value]

    def versions(self, name: str) -> list[int]:
        return sorted(int(v) for v in self._subfolders(name) if v.isdigit())

    def digests(self, name: str, version: int) -> list[str]:
        folders = self._subfolders(f"{name}/{version}")
        return sorted(d for d in folders if SHA256_PATTERN.fullmatch(d))

    def read(self, ref: ArchiveRef) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=self.key(ref.relative_path)
                )
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                    return None
                raise
            return response["Body"].read()

        return self._call("download", get)  # type: ignore[return-value]

    def write(self, ref: ArchiveRef, data: bytes) -> None:
        import base64
        import hashlib

        # Content-MD5 makes the server reject bytes damaged on the way; a PUT is all or nothing.
        digest = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        self._call(
            "upload",
            lambda: self._client.put_object(
                Bucket=self.bucket,
                Key=self.key(ref.relative_path),
                Body=data,
                ContentMD5=digest,
                ContentType="application/gzip",
            ),
        )

    def delete(self, ref: ArchiveRef) -> None:
        self._call(
            "delete",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=self.key(ref.relative_path)),
        )

    def url(self, ref: ArchiveRef) -> str:
        return _format_url(
            self.public_url_template, ref, self.key(ref.relative_path), bucket=self.bucket
        )
