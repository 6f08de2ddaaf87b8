"""golden_unreferenced: goldens nothing reads, and store versions nothing pins.

Lists (1) the archives in the local store that no pin in MODULE.bazel references, each marked
`kept` when an earlier commit pinned it (`git log` of MODULE.bazel) and `never pinned`
otherwise; (2) golden files in a pinned archive that no test reads: a checkpoint that left the
variants (variants.py) or a case that left cases.yaml. --delete removes the store versions
that were never pinned by any commit (a published-then-abandoned version) and keeps every
version an earlier commit pinned, so any old commit still builds.

Exit status: 0 nothing unread in the pinned archives (unpinned store versions are listed, not
an error: they are the history); 1 a pinned archive holds files or cases no test reads; 2 bad
input (one line on stderr: a MODULE.bazel that does not parse, a pinned archive whose bytes are
not its pinned sha256). CI runs the check as //tools/golden_update:unreferenced_test.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from goldens import schema
from goldens.artifacts import stanza
from goldens.artifacts.extract import read_pinned
from goldens.artifacts.store import ArchiveRef, LocalStore, ref_from_url
from goldens.cli_files import OneLineParser, repo_root, user_path
from goldens.record import case_specs
from goldens.schema import golden_file_name

EXAMPLES = """\
examples:
  ./bazelw run //tools:golden_unreferenced
  ./bazelw run //tools:golden_unreferenced -- --delete
"""
# The checkpoints the golden tests read (variants.py): model -> encodings; None: any (a
# user's own Llama 3.1 file, named by its file type).
READ_VARIANTS: dict[str, tuple[str, ...] | None] = {
    "tinyllama": ("float32", "bfloat16", "q4_k", "nvfp4"),
    "smollm2": ("q4_1",),
    "llama3_1": None,
}


def stored_archives(store: LocalStore) -> list[ArchiveRef]:
    """Every NAME/VERSION/SHA256/NAME.tar.gz of the local store."""
    refs = []
    for path in sorted(store.root.glob("*/*/*/*.tar.gz")):
        sha, version, name = path.parent.name, path.parent.parent.name, path.parent.parent.parent
        if version.isdigit() and path.name == f"{name.name}.tar.gz":
            refs.append(ArchiveRef(name.name, int(version), sha))
    return refs


def pinned_in_history(repository: Path) -> set[str] | None:
    """Every sha256 MODULE.bazel has pinned in any commit of any branch; None outside a git
    checkout, and in a shallow clone (its history is cut: an older pin would read as none)."""
    shallow = subprocess.run(
        ["git", "-C", str(repository), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        return None
    done = subprocess.run(
        ["git", "-C", str(repository), "log", "--all", "-p", "--format=", "--", "MODULE.bazel"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None
    return set(re.findall(r'sha256 = "([0-9a-f]{64})"', done.stdout))


# Archives of another kind than the engine's goldens: the one file each holds, and the keys
# its reader needs (the eval slice's golden: tools/eval_slice/tests/conftest.py reads it).
OTHER_ARCHIVES = {"eval_slice_golden": ("eval_slice_golden.json", ("schema", "setup", "rows"))}


def _unread_other(members: dict[str, bytes], archive_name: str) -> list[str]:
    name, keys = OTHER_ARCHIVES[archive_name]
    problems = [
        f"{archive_name}: {member}: not the file its test reads ({name})"
        for member in sorted(members)
        if member != name
    ]
    if name in members:
        try:
            body = json.loads(members[name])
            missing = [key for key in keys if key not in body]
        except (ValueError, TypeError) as error:
            missing = [str(error)]
        if missing:
            problems.append(f"{archive_name}: {name} lacks {', '.join(missing)}")
    return problems


def unread_goldens(members: dict[str, bytes], archive_name: str) -> list[str]:
    """What in one pinned archive no golden test reads: files of checkpoints that left the
    variants, and cases that left cases.yaml (for the other archives, OTHER_ARCHIVES: files
    other than the one their test reads)."""
    if archive_name in OTHER_ARCHIVES:
        return _unread_other(members, archive_name)
    problems = []
    for member, data in sorted(members.items()):
        try:
            body = json.loads(data)
            body["provenance"], body["cases"]
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{archive_name}: {member} is not a golden file ({error})")
            continue
        provenance = body["provenance"]
        model, encoding = provenance.get("model"), provenance.get("encoding")
        encodings = READ_VARIANTS.get(model, ())
        producer = schema.PRODUCERS[schema.reference_of(provenance.get("producer"))]
        hardware = provenance.get("hardware", "all")
        if encodings is not None and encoding not in encodings:
            problems.append(
                f"{archive_name}: {member}: checkpoint {model} {encoding} is not a variant the "
                "tests read (variants.py)"
            )
            continue
        if member != golden_file_name(model, encoding, hardware, producer):
            problems.append(f"{archive_name}: {member}: not the name tests look for")
            continue
        listed = {spec.id for spec in case_specs(model)}
        stale = [case["id"] for case in body["cases"] if case["id"] not in listed]
        if stale:
            problems.append(
                f"{archive_name}: {member}: cases {stale} are not in cases.yaml for {model}"
            )
    return problems


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="golden_unreferenced",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--delete",
        action="store_true",
        help="remove store versions no commit ever pinned (keeps every version a commit pinned)",
    )
    parser.add_argument("--artifacts-dir", help="the local store (default: REPO/artifacts)")
    parser.add_argument("--module-file", help="MODULE.bazel (default: REPO/MODULE.bazel)")
    parser.add_argument(
        "--repository", help="git checkout whose history counts as pinned (default: REPO)"
    )
    return parser


def _read_pins(
    module_file: Path, store: LocalStore
) -> tuple[dict[str, stanza.GoldenPin], dict[str, dict[str, bytes]]]:
    """MODULE.bazel's pins, and the files of each pinned archive the local store holds, each
    archive checked against its pin's sha256 first (ChecksumMismatch names it and the fix)."""
    if not module_file.is_file():
        raise ValueError(f"--module-file {module_file} does not exist; point it at MODULE.bazel")
    pins = stanza.parse(module_file.read_text(encoding="utf-8"))
    pinned = {}
    for pin in pins.values():
        ref = ref_from_url(pin.url)
        if ref is not None and store.path(ref).is_file():
            pinned[pin.name] = read_pinned(store.path(ref), pin.sha256)
    return pins, pinned


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    store = LocalStore(user_path(args.artifacts_dir) if args.artifacts_dir else None)
    if not store.root.is_dir():
        # A missing store holds no archives: every one would read as pinned, and exit 0.
        print(
            f"golden_unreferenced: error: --artifacts-dir={store.root} is not a folder; point "
            "it at the local store (default: REPO/artifacts)",
            file=sys.stderr,
        )
        return 2
    module_file = user_path(args.module_file) if args.module_file else repo_root() / "MODULE.bazel"
    try:
        pins, pinned = _read_pins(module_file, store)
    # A MODULE.bazel that is missing or does not parse (StanzaError), a damaged pinned archive
    # (ChecksumMismatch), one that cannot be read: bad input, reported before anything is done.
    except (ValueError, OSError) as error:
        print(f"golden_unreferenced: error: {error}", file=sys.stderr)
        return 2
    pinned_now = {pin.sha256 for pin in pins.values()}
    repository = user_path(args.repository) if args.repository else repo_root()
    history = pinned_in_history(repository)

    unpinned = [ref for ref in stored_archives(store) if ref.sha256 not in pinned_now]
    for ref in unpinned:
        if history is None:
            state = "no whole git history to tell whether a commit pinned it"
        elif ref.sha256 in history:
            state = "kept: an earlier commit pins it"
        else:
            state = "never pinned"
        print(f"unpinned: {ref.relative_path} ({state})")
    problems = []
    for name, members in pinned.items():
        problems += unread_goldens(members, name)
    for problem in problems:
        print(f"unread: {problem}")
    if args.delete:
        if history is None:
            print(
                f"golden_unreferenced: error: --delete needs the whole git history of "
                f"{repository} (not a git checkout, or a shallow clone: git fetch --unshallow)",
                file=sys.stderr,
            )
            return 2
        for ref in unpinned:
            if ref.sha256 not in history:
                folder = store.path(ref).parent
                shutil.rmtree(folder)
                if not any(folder.parent.iterdir()):
                    folder.parent.rmdir()  # the version folder, empty now
                print(f"deleted {ref.relative_path}")
    if not unpinned and not problems:
        print("every stored archive is pinned and every pinned golden is read")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
