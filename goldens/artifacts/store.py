"""Content-addressed stores for golden archives: the repo's local folder and S3.

Both keep one layout under their root, `NAME/VERSION/SHA256/NAME.tar.gz`, where the root is
the repository's `artifacts/` folder or `s3://BUCKET/PREFIX/` (PREFIX defaults to
`artifacts`). A published object is immutable; `publish` enforces that and the version rule.

Checking that a version is free and then writing it would let two concurrent publishers of one
NAME/VERSION with different bytes both succeed, so each store's write claims the version
atomically and refuses other bytes once it is taken:
- the local store builds the VERSION folder beside its place and renames it there; rename(2)
  fails on a folder that already holds something, so one writer's folder wins, whole;
- S3 creates `NAME/VERSION/claim`, holding the sha256, with a conditional PUT (If-None-Match:
  *), which S3 applies atomically, before the archive, and deletes it again when the upload
  fails or is interrupted; a version published before claims existed has none, and `publish`
  still refuses other bytes there by listing the version.
The same bytes written twice, concurrently or not, succeed both times.
"""

import base64
import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from goldens.cli_files import repo_root, write_atomically

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
DEFAULT_PREFIX = "artifacts"
# A reserved top-level domain never resolves, so a pinned URL can never fetch something else;
# Bazel gets these archives from the local store through --distdir (third_party/*.bazelrc).
LOCAL_PUBLIC_URL_TEMPLATE = "https://llama-goldens.invalid/{key}"
# S3 answers 409 to a conditional PUT racing another on its key; each retry waits a bit longer.
_CONFLICT_ATTEMPTS = 5


class StoreError(RuntimeError):
    """The store could not be read or written (network, credentials, permissions)."""


class PublishRefused(RuntimeError):
    """Publishing would break immutability or the version order."""


def version_taken(store: "Store", name: str, version: int, sha256: str) -> PublishRefused:
    """The refusal for other bytes under NAME/VERSION, which the archive `sha256` holds."""
    return PublishRefused(
        f"{name} version {version} is already published with sha256 {sha256} in the "
        f"{store.description}; published versions are immutable: publish version "
        f"{max([*store.versions(name), version]) + 1} instead"
    )


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


def local_only(url: str) -> bool:
    """Whether `url` is on a reserved .invalid host, as LOCAL_PUBLIC_URL_TEMPLATE's are.

    Nothing can download such a URL, so its archive comes from the local store only: Bazel
    takes it through --distdir, the tools read it from artifacts/. An archive pinned at any
    other URL is downloaded from there.
    """
    return (urllib.parse.urlparse(url).hostname or "").endswith(".invalid")


def ref_from_url(url: str) -> ArchiveRef | None:
    """The store location a canonical URL names, whatever its host and prefix."""
    match = _URL_TAIL.search(url)
    if match is None:
        return None
    return ArchiveRef(match["name"], int(match["version"]), match["sha256"])


class Store(Protocol):
    """What `publish` and `fetch` need from a store; keys are ArchiveRef.relative_path.

    `write` is atomic against concurrent writers: it raises PublishRefused when other bytes
    hold NAME/VERSION already, and succeeds when these bytes do.
    """

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
        version_dir = self.root / ref.name / str(ref.version)
        created = [p for p in (version_dir.parent, *version_dir.parent.parents) if not p.exists()]
        try:
            placed = _place_version(version_dir, ref, data)
        except OSError as error:
            _remove_empty(created)
            raise StoreError(f"cannot write {self.path(ref)}: {error}") from error
        if not placed:
            self._check_taken_by(ref)

    def _check_taken_by(self, ref: ArchiveRef) -> None:
        """NAME/VERSION exists: fine when it holds these bytes, refused when it holds others."""
        published = self.digests(ref.name, ref.version)
        if ref.sha256 in published:
            return
        if published:
            raise version_taken(self, ref.name, ref.version, published[0])
        raise StoreError(
            f"{self.root / ref.name / str(ref.version)} holds no archive but is not empty; "
            "remove it or publish another version"
        )

    def delete(self, ref: ArchiveRef) -> None:
        target = self.path(ref)
        target.unlink(missing_ok=True)
        # SHA256, VERSION and NAME folders, when this archive was all they held.
        _remove_empty(list(target.parents)[:3])

    def url(self, ref: ArchiveRef) -> str:
        key = f"{DEFAULT_PREFIX}/{ref.relative_path}"
        return _format_url(self.public_url_template, ref, key)


def _place_version(version_dir: Path, ref: ArchiveRef, data: bytes) -> bool:
    """Builds VERSION/SHA256/NAME.tar.gz beside `version_dir` and renames it into place.

    False, leaving `version_dir` as it was, when `version_dir` already holds something.
    """
    staging = version_dir.parent / f".{ref.version}.{secrets.token_hex(8)}.tmp"
    try:
        (staging / ref.sha256).mkdir(parents=True)
        write_atomically(staging / ref.sha256 / ref.filename, data, fsync=True)
        try:
            os.rename(staging, version_dir)  # replaces an empty folder, fails on a full one
        except OSError as error:
            if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False
            raise
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_empty(folders: list[Path]) -> None:
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()


class S3Store:
    """An S3 (or S3-compatible, via endpoint_url) bucket, credentials from boto3's chain.

    Bazel downloads a pinned URL with no credentials, so with `public_read` (the default) each
    archive is written with the canned ACL public-read: one object is made readable, not the
    whole bucket through its policy, and uploading needs no bucket-level permission. Claims stay
    private. A bucket that disables ACLs must grant the read in its policy (public_read=False).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = DEFAULT_PREFIX,
        endpoint_url: str | None = None,
        public_url_template: str | None = None,
        region: str | None = None,
        public_read: bool = True,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.public_read = public_read
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
            if detail.get("Code") == "AccessControlListNotSupported":
                raise StoreError(
                    f"{action} on {self.description} failed: the bucket disables ACLs, so the "
                    "object cannot be made public-read; grant s3:GetObject to everyone in the "
                    "bucket policy and pass --no-public-read"
                ) from error
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
        return self._get(ref.relative_path)

    def write(self, ref: ArchiveRef, data: bytes) -> None:
        self._claim(ref)
        try:
            self._create(ref.relative_path, data, "application/gzip", public=self.public_read)
        except BaseException:
            # Any failure of the upload, an interrupt (Ctrl-C) included, frees the version: a
            # claim left without its archive would refuse every later publisher of it.
            with contextlib.suppress(StoreError):
                self._release(ref)
            raise

    def delete(self, ref: ArchiveRef) -> None:
        self._delete(ref.relative_path)
        self._release(ref)

    def ensure_public(self, ref: ArchiveRef) -> None:
        """With `public_read`, sets the ACL of an archive published before, maybe private."""
        if self.public_read:
            self._call(
                "setting the public-read ACL",
                lambda: self._client.put_object_acl(
                    Bucket=self.bucket, Key=self.key(ref.relative_path), ACL="public-read"
                ),
            )

    def _claim(self, ref: ArchiveRef) -> None:
        """Takes NAME/VERSION for `ref`'s bytes, or finds it taken by them; else refuses."""
        if self._create(_claim_path(ref), f"{ref.sha256}\n".encode(), "text/plain"):
            return
        holder = self._claimant(ref)
        if holder is None:
            raise StoreError(
                f"the claim on {ref.name} version {ref.version} in the {self.description} was "
                "released while publishing (another publisher failed); publish again"
            )
        if holder == ref.sha256:
            return
        if holder in self.digests(ref.name, ref.version):
            raise version_taken(self, ref.name, ref.version, holder)
        # A claim whose archive never arrived: another publisher is uploading it now, or one
        # was killed before it could release the claim. Nothing is published under it.
        claim = f"s3://{self.bucket}/{self.key(_claim_path(ref))}"
        raise PublishRefused(
            f"{ref.name} version {ref.version} in the {self.description} is claimed for sha256 "
            f"{holder} but holds no archive: another publisher is uploading it, or one was "
            f"interrupted; if none is running, delete the claim {claim} and publish again"
        )

    def _claimant(self, ref: ArchiveRef) -> str | None:
        claim = self._get(_claim_path(ref))
        return None if claim is None else claim.decode("ascii", "replace").strip()

    def _release(self, ref: ArchiveRef) -> None:
        """Deletes NAME/VERSION's claim when `ref`'s bytes hold it, so the version is free."""
        if self._claimant(ref) == ref.sha256:
            self._delete(_claim_path(ref))

    def _get(self, relative: str) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self.key(relative))
            except ClientError as error:
                if _error_code(error) in {"NoSuchKey", "404"}:
                    return None
                raise
            return response["Body"].read()

        return self._call("download", get)  # type: ignore[return-value]

    def _create(self, relative: str, body: bytes, content_type: str, public: bool = False) -> bool:
        """PUTs a new object, public-read if `public`; False, writing nothing, if the key exists.

        If-None-Match: * makes S3 check and write in one step. S3 answers 409 to a conditional
        PUT that races another on the same key and asks for a retry, which gets 412 or 200.
        Content-MD5 makes the server reject bytes damaged on the way; a PUT is all or nothing.
        """
        from botocore.exceptions import ClientError

        digest = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        acl = {"ACL": "public-read"} if public else {}

        def put() -> bool:
            attempt = 1
            while True:
                try:
                    self._client.put_object(
                        Bucket=self.bucket,
                        Key=self.key(relative),
                        Body=body,
                        ContentMD5=digest,
                        ContentType=content_type,
                        IfNoneMatch="*",
                        **acl,
                    )
                    return True
                except ClientError as error:
                    code = _error_code(error)
                    if code == "PreconditionFailed":
                        return False
                    if code != "ConditionalRequestConflict" or attempt == _CONFLICT_ATTEMPTS:
                        raise
                time.sleep(0.1 * attempt)
                attempt += 1

        return self._call("upload", put)  # type: ignore[return-value]

    def _delete(self, relative: str) -> None:
        self._call(
            "delete",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=self.key(relative)),
        )

    def url(self, ref: ArchiveRef) -> str:
        return _format_url(
            self.public_url_template, ref, self.key(ref.relative_path), bucket=self.bucket
        )


def _claim_path(ref: ArchiveRef) -> str:
    """The S3 object whose content, a sha256, says which archive holds NAME/VERSION."""
    return f"{ref.name}/{ref.version}/claim"


def _error_code(error: "ClientError") -> str | None:
    return error.response.get("Error", {}).get("Code")
