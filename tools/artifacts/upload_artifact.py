"""Publish golden files as a content-addressed archive and pin it in MODULE.bazel.

Commands (the first argument; `upload` when it is none of them, as the seed's script runs):
  upload NAME VERSION FILE...  pack FILEs into NAME.tar.gz, publish it as NAME/VERSION/SHA256,
                               print the http_archive stanza
  fetch NAME                   get the archive MODULE.bazel pins for NAME, check it, extract it
  add NAME FILE...             the pinned archive plus new or replaced FILEs, as the next version
  distdir                      regenerate third_party/golden_distdir.bazelrc from MODULE.bazel
  verify                       check every pinned archive in the local store against its sha256
                               (a pin at a URL Bazel downloads need not be there); offline,
                               so the S3 store flags are refused (exit 2), as by distdir

An archive uploaded to S3 is made public-read (--no-public-read leaves that to the bucket's
policy) and then fetched from the URL it is pinned at with an anonymous GET, as Bazel will fetch
it; unless those bytes have the archive's sha256, nothing is printed or pinned.

--update-module pins an archive of the local store only when that store is the folder
`artifacts/` beside --module-file: the distdir fragment names `artifacts/...` in the workspace.

Exit status: 0 done (also when identical bytes were already published), 1 a store or check
failed (also an anonymous GET of the pinned URL), 2 bad usage. The stanza goes to stdout,
progress to stderr.
"""

import argparse
import contextlib
import io
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from goldens.artifacts import archive, distdir, stanza
from goldens.artifacts.extract import download_pinned
from goldens.artifacts.publish import publish
from goldens.artifacts.stanza import GoldenPin
from goldens.artifacts.store import (
    DEFAULT_PREFIX,
    ArchiveRef,
    LocalStore,
    PublishRefused,
    S3Store,
    Store,
    StoreError,
    check_name,
    check_version,
    local_only,
    ref_from_url,
)
from goldens.artifacts.store_options import (
    CheckFailed,
    UsageError,
    add_store_arguments,
    local_store_from_args,
    store_from_args,
)
from goldens.cli_files import (
    OneLineParser,
    output_directory,
    repo_root,
    user_path,
    write_atomically,
)

COMMANDS = ("upload", "fetch", "add", "distdir", "verify")

EXAMPLES = """\
examples:
  tools/upload-public-bazel-artifact.sh test_llama_golden next *golden.json --update-module
  ./bazelw run //tools:upload_artifact -- upload test_llama_golden 3 a_golden.json b_golden.json
  python3 -m tools.artifacts.upload_artifact upload torch_llama_golden 2 torch_*_golden.json \\
      --store=s3 --bucket=my-goldens --endpoint-url=http://127.0.0.1:9000
  tools/upload-public-bazel-artifact.sh test_llama_golden 7 *golden.json --bucket=goldens \\
      --no-public-read --public-url-template='https://goldens.example.com/{key}' --update-module
  python3 -m tools.artifacts.upload_artifact fetch test_llama_golden --output-dir=/tmp/goldens
  python3 -m tools.artifacts.upload_artifact add test_llama_golden new_golden.json --update-module
"""


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    implicit = bool(args_list) and args_list[0] not in (*COMMANDS, "-h", "--help")
    if implicit:
        args_list.insert(0, "upload")
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            args = _parser().parse_args(args_list)
    except SystemExit as stop:  # usage errors and --help: return the code, let callers exit
        _progress_usage(usage.getvalue(), args_list[1] if implicit else None)
        return int(stop.code or 0)
    try:
        return args.run(args)
    except (UsageError, ValueError) as error:
        _progress(f"error: {error}")
        return 2
    except (CheckFailed, StoreError, PublishRefused) as error:
        _progress(f"error: {error}")
        return 1


def _progress_usage(message: str, word: str | None) -> None:
    """argparse's message on stderr; when an implicit upload lacks its arguments, the first
    word was as likely a mistyped command (`upload_artifact frobnicate`), so the message names
    it and the commands before upload's missing arguments."""
    if (
        word is not None
        and not word.startswith("-")
        and "the following arguments are required" in message
    ):
        missing = message[message.index("the following arguments are required") :]
        message = (
            f"upload_artifact: error: {word} is not a command (commands: {', '.join(COMMANDS)}); "
            f"read as `upload {word} ...`, {missing}"
        )
    sys.stderr.write(message)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="upload_artifact",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = OneLineParser(add_help=False)
    add_store_arguments(common)
    files = common.add_argument_group("repository files")
    files.add_argument(
        "--module-file", help="MODULE.bazel to read or rewrite (default: REPO/MODULE.bazel)"
    )
    files.add_argument(
        "--distdir-bazelrc", help=f"distdir fragment (default: REPO/{distdir.BAZELRC_PATH})"
    )

    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    update = OneLineParser(add_help=False)
    update.add_argument(
        "--update-module",
        action="store_true",
        help="pin the archive in MODULE.bazel and regenerate the distdir bazelrc",
    )
    update.add_argument(
        "--public-read",
        action=argparse.BooleanOptionalAction,
        help="S3, on by default: give the archive the public-read ACL, as Bazel downloads "
        "pins anonymously; --no-public-read when the bucket policy makes it readable. Either "
        "way an anonymous GET of the pinned URL must return the archive before it is pinned",
    )

    upload = commands.add_parser(
        "upload",
        parents=[common, update],
        help="publish FILEs as NAME/VERSION",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    upload.add_argument("name", metavar="NAME", help="repository name, e.g. test_llama_golden")
    upload.add_argument(
        "version",
        metavar="VERSION",
        help="positive integer above older ones, or 'next' (the newest stored version + 1; "
        "nothing new when the newest already holds these files)",
    )
    upload.add_argument(
        "files", metavar="FILE", nargs="+", help="golden files (basenames must differ)"
    )
    upload.set_defaults(run=_upload)

    fetch = commands.add_parser(
        "fetch", parents=[common], help="extract the pinned archive of NAME"
    )
    fetch.add_argument("name", metavar="NAME")
    fetch.add_argument("--output-dir", help="where to extract (default: ./NAME)")
    fetch.set_defaults(run=_fetch)

    add = commands.add_parser(
        "add",
        parents=[common, update],
        help="pinned archive of NAME plus FILEs, as the next version",
    )
    add.add_argument("name", metavar="NAME")
    add.add_argument(
        "files", metavar="FILE", nargs="+", help="files to add or replace (by basename)"
    )
    add.set_defaults(run=_add)

    sync = commands.add_parser("distdir", parents=[common], help="regenerate the distdir bazelrc")
    sync.add_argument("--check", action="store_true", help="exit 1 if it is stale, write nothing")
    sync.set_defaults(run=_distdir)

    verify = commands.add_parser("verify", parents=[common], help="check pinned archives locally")
    verify.set_defaults(run=_verify)
    return parser


# --- commands ---------------------------------------------------------------------------


def _upload(args: argparse.Namespace) -> int:
    name = check_name(args.name)
    version = None if args.version == "next" else check_version(args.version)
    files = [_existing_file(f) for f in args.files]
    module_file = _module_file(args, must_exist=args.update_module)
    store = store_from_args(args)
    data = _pack(archive.read_members(files), name)
    if version is None:
        newest = max(store.versions(name), default=0)
        same = stored_with_same_files(store, name, newest, data)
        if same is not None:
            # `next` of what is already the newest version would only renumber it.
            _progress(
                f"{name} version {newest} already holds these files; nothing to publish "
                f"({same.relative_path})"
            )
            return _publish_and_pin(args, store, name, newest, data, module_file)
        version = newest + 1
        _progress(f"publishing {name} as the next version, {version}")
    return _publish_and_pin(args, store, name, version, data, module_file)


def stored_with_same_files(store: Store, name: str, version: int, data: bytes) -> ArchiveRef | None:
    """The archive at NAME/VERSION holding the same files as `data`, if there is one."""
    if version < 1:
        return None
    members = archive.unpack_members(data)
    for sha256 in store.digests(name, version):
        ref = ArchiveRef(name, version, sha256)
        stored = store.read(ref)
        if stored is not None and archive.unpack_members(stored) == members:
            return ref
    return None


def _fetch(args: argparse.Namespace) -> int:
    name = check_name(args.name)
    pin = _pinned(args, name)
    output_dir = user_path(args.output_dir or name)
    if output_dir.exists() and not output_dir.is_dir():  # refused before the download
        output_directory(output_dir, "--output-dir")
    members = archive.unpack_members(download_pinned(store_from_args(args), pin))
    output_directory(output_dir, "--output-dir")  # created once the archive checks out
    for member, content in sorted(members.items()):
        write_atomically(output_dir / member, content)
        print(output_dir / member)
    _progress(f"extracted {len(members)} files of {name} (sha256 {pin.sha256}) into {output_dir}")
    return 0


def _add(args: argparse.Namespace) -> int:
    name = check_name(args.name)
    files = [_existing_file(f) for f in args.files]
    module_file = _module_file(args, must_exist=True)
    pin = _pinned(args, name)
    store = store_from_args(args)
    members = archive.unpack_members(download_pinned(store, pin))
    added = archive.read_members(files)
    for member in sorted(added):
        _progress(f"{member}: {'replaces the pinned one' if member in members else 'new'}")
    members.update(added)
    data = _pack(members, name)
    if archive.sha256_hex(data) == pin.sha256:
        _progress(f"the pinned {name} already holds these files; nothing to publish")
        print(stanza.render(pin))
        return 0
    pinned = ref_from_url(pin.url)
    version = max(store.versions(name) + ([pinned.version] if pinned else []), default=0) + 1
    _progress(f"publishing {name} version {version}")
    return _publish_and_pin(args, store, name, version, data, module_file)


def _distdir(args: argparse.Namespace) -> int:
    _refuse_remote_store_flags(
        args, "distdir reads only MODULE.bazel, no store; leave the store flags out"
    )
    module_file = _module_file(args, must_exist=True)
    bazelrc = _bazelrc_path(args)
    expected = distdir.render(stanza.parse(module_file.read_text(encoding="utf-8")).values())
    current = bazelrc.read_text(encoding="utf-8") if bazelrc.exists() else None
    if current == expected:
        _progress(f"{bazelrc} is up to date")
        return 0
    if args.check:
        raise CheckFailed(f"{bazelrc} is stale; regenerate it: upload_artifact distdir")
    write_atomically(bazelrc, expected)
    _progress(f"wrote {bazelrc}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    _refuse_remote_store_flags(
        args,
        "verify checks only the local store (--artifacts-dir), offline; leave the S3 store "
        "flags out (`upload_artifact fetch NAME --bucket=...` checks an archive in S3)",
    )
    module_file = _module_file(args, must_exist=True)
    local = local_store_from_args(args)
    problems = []
    pins = stanza.parse(module_file.read_text(encoding="utf-8"))
    checked = 0
    for pin in pins.values():
        ref = ref_from_url(pin.url)
        if ref is None:
            continue
        path = local.path(ref)
        if ref.sha256 == pin.sha256 and not local_only(pin.url) and not path.is_file():
            # Bazel downloads this pin from its URL (no distdir line) and checks its sha256
            # itself. verify stays offline (.ci/run runs it before any test): it names the pin
            # and goes on.
            where = f"pinned at {pin.url}, not in the local store"
            print(f"{pin.name} {ref.version}: {where} (fetched over HTTP)")
            continue
        checked += 1
        if ref.sha256 != pin.sha256:
            problems.append(f"{pin.name}: sha256 {pin.sha256} differs from its URL's {ref.sha256}")
        elif not path.is_file():
            problems.append(
                f"{pin.name}: {path} is missing from the local store, so Bazel cannot fetch the "
                f"pinned archive; restore it (git checkout -- {path.parent}), fetch it from "
                f"the store it was published to (upload_artifact fetch {pin.name} --bucket=...), "
                "or rebuild and pin the goldens (./bazelw run //tools:golden_update -- --accept)"
            )
        elif (actual := archive.sha256_hex(path.read_bytes())) != pin.sha256:
            problems.append(
                f"{pin.name}: checksum mismatch: {path} has sha256 {actual}, MODULE.bazel pins "
                f"{pin.sha256}; restore it (git checkout) or fetch it from the store it came from"
            )
    bazelrc = _bazelrc_path(args)
    expected = distdir.render(pins.values())
    if not bazelrc.exists() or bazelrc.read_text(encoding="utf-8") != expected:
        problems.append(f"{bazelrc} is stale; regenerate it: upload_artifact distdir")
    for problem in problems:
        _progress(f"error: {problem}")
    if problems:
        return 1
    print(f"{checked} pinned archives match their sha256 in {local.root}")
    return 0


# --- shared steps -----------------------------------------------------------------------


def _pack(members: dict[str, bytes], name: str) -> bytes:
    data = archive.pack_members(members)
    _progress(
        f"packed {len(members)} files into {name}.tar.gz: {len(data)} bytes, "
        f"sha256 {archive.sha256_hex(data)}"
    )
    return data


def _publish_and_pin(
    args: argparse.Namespace, store: Store, name: str, version: int, data: bytes, module_file: Path
) -> int:
    if args.update_module:
        # A MODULE.bazel the rewrite cannot handle, or a distdir fragment that cannot be
        # written, must stop us before anything is published.
        stanza.set_pin(module_file.read_text(encoding="utf-8"), GoldenPin(name, "0" * 64, "x"))
        _writable_file(_bazelrc_path(args), "--distdir-bazelrc")
        check_pinnable(store, module_file, "--update-module")
    result = publish(store, name, version, data)
    pin = GoldenPin(name, result.ref.sha256, result.url)
    if isinstance(store, S3Store):
        if not result.published:
            store.ensure_public(result.ref)
        check_anonymous_get(pin, store)
    print(stanza.render(pin))
    if args.update_module:
        changed = stanza.update_module_file(module_file, pin)
        _progress(f"{'pinned' if changed else 'already pinned'} {name} in {module_file}")
        bazelrc = _bazelrc_path(args)
        text = distdir.render(stanza.parse(module_file.read_text(encoding="utf-8")).values())
        write_atomically(bazelrc, text)
        _progress(f"wrote {bazelrc}")
    return 0


def check_pinnable(store: Store, module_file: Path, pinning: str) -> None:
    """UsageError unless what `store` publishes can be pinned in `module_file`.

    A pin on the reserved .invalid host (the local store's default) is resolved by Bazel from
    the distdir fragment, which names `artifacts/...` in the workspace: the local store must
    be the folder `artifacts/` beside MODULE.bazel, or the pin names an archive Bazel cannot
    find. `pinning` names what pins, for the message.
    """
    if not isinstance(store, LocalStore):
        return
    if not local_only(store.url(ArchiveRef("golden", 1, "0" * 64))):
        return  # pinned at a URL Bazel downloads, wherever the local copy is
    beside = module_file.parent / DEFAULT_PREFIX
    if store.root.resolve() != beside.resolve():
        raise UsageError(
            f"{pinning} with --artifacts-dir={store.root}: the pin would name an archive that "
            f"Bazel looks for in {beside}, beside --module-file={module_file}; publish into "
            f"{beside} (leave out --artifacts-dir) or name the MODULE.bazel beside the store"
        )


def check_anonymous_get(pin: GoldenPin, store: Store) -> None:
    """The pinned URL, fetched with no credentials as Bazel fetches it, serves the archive."""
    where = f"the archive stays in the {store.description}; fix that and run this again"
    fix = (
        "make the object publicly readable (--public-read, the default, sets its ACL; the "
        "bucket policy or Block Public Access may still deny it) or pass "
        "--public-url-template pointing at a URL that serves it"
    )
    try:
        with urllib.request.urlopen(pin.url, timeout=30) as response:
            data = response.read()
    except urllib.error.HTTPError as error:
        error.close()
        raise CheckFailed(
            f"an anonymous GET of {pin.url} returned HTTP {error.code} {error.reason}, so "
            f"Bazel cannot fetch it and nothing was pinned: {fix}; {where}"
        ) from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise CheckFailed(
            f"an anonymous GET of {pin.url} failed ({reason}), so Bazel cannot fetch it and "
            f"nothing was pinned: pass --public-url-template pointing at a reachable URL; {where}"
        ) from error
    actual = archive.sha256_hex(data)
    if actual != pin.sha256:
        raise CheckFailed(
            f"checksum mismatch: an anonymous GET of {pin.url} returned {len(data)} bytes with "
            f"sha256 {actual}, not the archive's {pin.sha256}, so Bazel would refuse it and "
            f"nothing was pinned: pass --public-url-template pointing at a URL that serves "
            f"this archive; {where}"
        )
    _progress(f"anonymous GET of {pin.url}: sha256 ok")


def _pinned(args: argparse.Namespace, name: str) -> GoldenPin:
    module_file = _module_file(args, must_exist=True)
    pins = stanza.parse(module_file.read_text(encoding="utf-8"))
    if name not in pins:
        known = ", ".join(sorted(pins)) or "none"
        raise UsageError(
            f"{name} is not pinned in {module_file} (pinned: {known}); publish it first: "
            f"upload_artifact upload {name} 1 FILE... --update-module"
        )
    return pins[name]


def _module_file(args: argparse.Namespace, must_exist: bool) -> Path:
    path = user_path(args.module_file) if args.module_file else repo_root() / "MODULE.bazel"
    if must_exist and not path.is_file():
        raise UsageError(f"--module-file {path} does not exist; point it at MODULE.bazel")
    return path


def _bazelrc_path(args: argparse.Namespace) -> Path:
    if args.distdir_bazelrc:
        return user_path(args.distdir_bazelrc)
    return repo_root() / distdir.BAZELRC_PATH


def _refuse_remote_store_flags(args: argparse.Namespace, why: str) -> None:
    """UsageError naming the first S3 store flag given to a command that never reads a remote
    store (`why`: what the command reads, and the fix). Ignored, the flag would mislead:
    `verify --store=s3` passed on the local store's archives and exited 0."""
    given = [
        ("--store=s3", args.store == "s3"),
        ("--bucket", args.bucket),
        ("--endpoint-url", args.endpoint_url),
        ("--region", args.region),
        ("--prefix", args.prefix != DEFAULT_PREFIX),
        ("--public-url-template", args.public_url_template),
    ]
    for flag, value in given:
        if value:
            raise UsageError(f"{flag} is not used here: {why}")


def _writable_file(path: Path, flag: str) -> None:
    """`path` can be written as a file: its folder exists and it is not a folder itself."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: its folder {path.parent} does not exist; create it")


def _existing_file(name: str) -> Path:
    path = user_path(name)
    if path.is_dir():
        raise UsageError(
            f"FILE {name} is a folder (resolved to {path}); give the golden files in it, "
            f"e.g. {name.rstrip('/')}/*_golden.json"
        )
    if not path.is_file():
        raise UsageError(f"FILE {name} does not exist (resolved to {path}); give a golden file")
    return path


def _progress(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
