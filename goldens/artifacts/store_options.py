"""The store a command works on, chosen by the same flags in every command.

`add_store_arguments(parser)` adds --store, --artifacts-dir, --bucket, --prefix,
--endpoint-url, --region and (for commands that publish) --public-url-template;
`store_from_args(args)` turns them into a LocalStore or an S3Store. The upload command
(tools/artifacts) and golden_diff (tools/golden_diff) both use them, so a flag means the same
thing everywhere.
"""

from __future__ import annotations

import argparse

from goldens.artifacts.store import (
    DEFAULT_PREFIX,
    LOCAL_PUBLIC_URL_TEMPLATE,
    LocalStore,
    S3Store,
    Store,
)
from goldens.cli_files import user_path


class UsageError(Exception):
    """Bad input: exit 2."""


class CheckFailed(Exception):
    """A store, download or checksum failed: exit 1."""


def add_store_arguments(
    parser: argparse.ArgumentParser,
    title: str = "store (default: the repository's artifacts/ folder)",
    publishes: bool = True,
) -> None:
    """The store flags, as one argument group of `parser`.

    `publishes=False` (a command that only reads) leaves out --public-url-template, the URL a
    new pin would get."""
    stores = parser.add_argument_group(title)
    stores.add_argument(
        "--store", choices=["local", "s3"], help="local, or s3 (default when --bucket is given)"
    )
    stores.add_argument("--artifacts-dir", help="root of the local store (default: REPO/artifacts)")
    stores.add_argument("--bucket", help="S3 bucket")
    stores.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help="S3 key prefix (default: %(default)s)"
    )
    stores.add_argument("--endpoint-url", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    stores.add_argument("--region", help="S3 region (default: boto3's configuration)")
    if publishes:
        stores.add_argument(
            "--public-url-template",
            help="URL pinned in MODULE.bazel; fields {name} {version} {sha256} {key} "
            f"(local default: {LOCAL_PUBLIC_URL_TEMPLATE})",
        )
    else:
        parser.set_defaults(public_url_template=None)


def store_from_args(args: argparse.Namespace) -> Store:
    """The store the flags of `add_store_arguments` name; UsageError for a bad combination."""
    kind = args.store or ("s3" if args.bucket else "local")
    public_read = getattr(args, "public_read", None)  # only publishing commands have it
    if kind == "local":
        if args.bucket or args.endpoint_url:
            raise UsageError("--bucket/--endpoint-url need --store=s3")
        if public_read is not None:
            raise UsageError("--public-read/--no-public-read need --store=s3")
        return local_store_from_args(args)
    if not args.bucket:
        raise UsageError("--store=s3 needs --bucket=NAME")
    try:
        return S3Store(
            args.bucket,
            prefix=args.prefix,
            endpoint_url=args.endpoint_url,
            public_url_template=args.public_url_template,
            region=args.region,
            public_read=public_read is not False,
        )
    except ImportError as error:
        raise CheckFailed(f"--store=s3 needs boto3 ({error}); pip install boto3") from error


def local_store_from_args(args: argparse.Namespace) -> LocalStore:
    """The local store of --artifacts-dir (default: the repository's artifacts/ folder)."""
    root = user_path(args.artifacts_dir) if args.artifacts_dir else None
    return LocalStore(root, args.public_url_template or LOCAL_PUBLIC_URL_TEMPLATE)
