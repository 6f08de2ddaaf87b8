"""golden_update: change a golden on purpose, in one reviewed command.

Regenerates the engine's goldens, eager's and the ggml mode's (`ggml_*`, on the encodings where
that mode has its own), and transformers' when asked with --torch or when their inputs changed
(a checkpoint, the cases, the transformers version), into a pending folder outside testdata/;
compares them with the pinned archives the way golden_diff does (identical, noise, moved, over
tolerance, tokens changed, cases changed), prints the review, and only then publishes: with
--accept every changed golden file, or, in a terminal, one file at a time (accept, reject,
skip, show the diff). Each archive with an accepted file gets its next version (or, when a
stored version holds the same files, that version again; --dry-run names the same version)
through the upload command (tools/artifacts), pinned in MODULE.bazel and the distdir file, and
the golden tests run again. An identical or noise-only result publishes nothing and says so.

--from=OUTPUTS reviews a failing golden test's kept runs (its outputs.zip, or the folder it
extracts to) instead of recomputing; a run whose greedy tokens changed was teacher-forced past
the change, so it is shown, never accepted: recompute without --from.

Under CI=true nothing is published. Exit status: 0 nothing to publish, or published and the
tests passed; 1 changes pending (not accepted), or the tests failed after publishing; 2 bad
input (flags, files, a store that cannot be read; one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from goldens import schema
from goldens.artifacts import archive
from goldens.artifacts.store import PublishRefused, StoreError
from goldens.artifacts.store_options import (
    CheckFailed,
    UsageError,
    add_store_arguments,
    store_from_args,
)
from goldens.cli_files import OneLineParser, output_directory, repo_root, user_path
from goldens.diff import (
    OWN_NAME,
    TORCH_NAME,
    FileDiff,
    GoldenSet,
    diff_sets,
    file_class,
    worst_class,
)
from tools.artifacts import upload_artifact
from tools.golden_diff.inputs import (
    InputError,
    Inputs,
    fetch_members,
    golden_set,
    load_input,
    load_pinned,
)
from tools.golden_diff.render import file_lines, summary_lines

PENDING = ".goldens-pending"  # under the repository root; git-ignored
PUBLISHABLE = ("moved", "over tolerance", "tokens changed", "cases changed")
# A kept run of a failing test was fed the golden's tokens after its first changed one.
NOT_FROM_A_FORCED_RUN = ("tokens changed", "cases changed")
# The producers whose runs are the engine archive's goldens: eager's and the ggml mode's.
GOLDEN_PRODUCERS = (schema.PRODUCERS["own"], schema.PRODUCERS["ggml"])
# What pins, as check_pinnable's refusal names it: golden_update pins every version it publishes.
PINNING = "golden_update (it pins what it publishes)"
GOLDEN_TESTS = [
    "//max_tests/integration/architectures/llama3:test_llama",
    "//max_tests/integration/architectures/llama3:test_llama_constrained",
    "//max_tests/integration/architectures/llama3:test_llama_long",
    "//max_tests/integration/architectures/llama3:test_golden_sanity",
]

EXAMPLES = """\
examples:
  # after an intended engine change: review what moved, nothing is published
  ./bazelw run //tools:golden_update
  # publish every changed golden as the next version, pin it, rerun the golden tests
  ./bazelw run //tools:golden_update -- --accept
  # what would be published, and nothing else
  ./bazelw run //tools:golden_update -- --dry-run --model=tinyllama
  # accept a failing test's kept runs without recomputing them
  ./bazelw run //tools:golden_update -- --accept \\
      --from=bazel-testlogs/max_tests/integration/architectures/llama3/test_llama/shard_1_of_2/test.outputs/outputs.zip
"""

Regenerate = Callable[[Path, argparse.Namespace, bool], None]


class UpdateError(Exception):
    """Bad input or a failed step: exit 2, one line."""


def _parser() -> argparse.ArgumentParser:
    # evaluate_llama's choices, checked here: its own parser ran only after the pending folder
    # was emptied, so --model=tinylama deleted the previous run's goldens, then exited 2.
    # Imported here, not at the top: variants imports torch (1.6 s), which the library's
    # other users do not need.
    from harness.llama3.variants import ENCODINGS, MODELS

    parser = OneLineParser(
        prog="golden_update",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--accept", action="store_true", help="publish every changed golden file, no questions"
    )
    action.add_argument(
        "--dry-run", action="store_true", help="show what would be published; publish nothing"
    )
    parser.add_argument(
        "--torch",
        action="store_true",
        help="regenerate transformers' goldens too (default: only when their inputs changed)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        metavar="OUTPUTS",
        help="a failing golden test's outputs.zip (or its extracted folder): review its kept "
        "runs instead of recomputing",
    )
    parser.add_argument(
        "--model", default="all", choices=["all", *MODELS], help="as evaluate_llama's"
    )
    parser.add_argument(
        "--encoding", default="all", choices=["all", *ENCODINGS], help="as evaluate_llama's"
    )
    parser.add_argument(
        "--pending-dir", help=f"where regenerated goldens wait for review (default: REPO/{PENDING})"
    )
    parser.add_argument(
        "--no-test", action="store_true", help="do not rerun the golden tests after publishing"
    )
    files = parser.add_argument_group("repository files")
    files.add_argument("--module-file", help="MODULE.bazel to pin in (default: REPO/MODULE.bazel)")
    files.add_argument("--distdir-bazelrc", help="distdir fragment (default: the repository's)")
    add_store_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, regenerate: Regenerate | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:
        return int(stop.code or 0)
    try:
        return _update(args, regenerate or _regenerate)
    # Bad flags, and a store that cannot be reached or refuses: each stops golden_update
    # before it publishes anything (upload_artifact reports its own failures when publishing).
    except (
        UpdateError,
        InputError,
        ValueError,
        UsageError,
        CheckFailed,
        StoreError,
        PublishRefused,
    ) as error:
        print(f"golden_update: error: {error}", file=sys.stderr)
        return 2


def _update(args: argparse.Namespace, regenerate: Regenerate) -> int:
    ci = os.environ.get("CI", "").lower() == "true"
    if ci and args.accept:
        raise UpdateError(
            "CI=true: golden_update never publishes under CI; review here, accept on your "
            "machine (./bazelw run //tools:golden_update -- --accept)"
        )
    module_file = user_path(args.module_file) if args.module_file else repo_root() / "MODULE.bazel"
    store = store_from_args(args)
    if args.accept:  # refused now, not after minutes of regenerating
        upload_artifact.check_pinnable(store, module_file, PINNING)
    inputs = {name: Inputs(name, store, module_file) for name in (OWN_NAME, TORCH_NAME)}
    pinned = {name: load_pinned(inputs[name], "pinned") for name in inputs}

    if args.source:
        pending = None
        after = {OWN_NAME: load_input(inputs[OWN_NAME], args.source, "--from")}
        if not after[OWN_NAME].partial:
            raise UpdateError(
                f"--from={args.source} is not a golden test's outputs (no golden_report_*.html)"
            )
    else:
        pending = _pending_folder(args)
        torch_reasons = [] if args.torch else _torch_inputs_changed(pinned[TORCH_NAME])
        with_torch = args.torch or bool(torch_reasons)
        for reason in torch_reasons:
            _progress(f"transformers' goldens are regenerated too: {reason}")
        regenerate(pending, args, with_torch)
        after = {OWN_NAME: _pending_set(inputs[OWN_NAME], pending)}
        if with_torch:
            after[TORCH_NAME] = _pending_set(inputs[TORCH_NAME], pending)

    plan: dict[str, list[FileDiff]] = {}
    for name, new in after.items():
        diffs = diff_sets(pinned[name], new.over(pinned[name]))
        print("\n".join(summary_lines(name, pinned[name], new.over(pinned[name]), diffs)))
        changed = [d for d in diffs if file_class(d)[0] in PUBLISHABLE]
        if args.source:
            changed = _acceptable_from_forced_runs(changed, new)
        klass = worst_class(diffs)[0]
        if not changed:
            print(f"{name}: nothing to publish ({klass})")
            continue
        plan[name] = changed
    if not plan:
        return 0
    if args.dry_run:
        for name, diffs in plan.items():
            files = [d.name for d in diffs]
            version, stored = version_to_pin(
                inputs[name], _archive_members(inputs[name], files, pending, args)
            )
            listed = ", ".join(files)
            if stored:
                print(
                    f"would pin {name} version {version} again, which holds these files "
                    f"already: {listed} (dry run: nothing done)"
                )
            else:
                print(
                    f"would publish {name} version {version} with {listed} (dry run: nothing done)"
                )
        return 0
    if ci:
        print("CI=true: nothing is published under CI", file=sys.stderr)
        return 1
    accepted = _decide(plan, args)
    if not any(accepted.values()):
        print(
            "nothing accepted; publish with --accept (or run it in a terminal to choose file "
            "by file)"
        )
        return 1
    upload_artifact.check_pinnable(store, module_file, PINNING)
    for name, files in accepted.items():
        if files:
            _publish(inputs[name], files, pending, args)
    if args.no_test:
        return 0
    return _rerun_golden_tests()


def _pending_folder(args: argparse.Namespace) -> Path:
    """The pending folder, emptied of an earlier run's goldens. A folder holding anything
    else is refused, untouched: --pending-dir may name any folder (`.` is the checkout)."""
    pending = user_path(args.pending_dir) if args.pending_dir else repo_root() / PENDING
    output_directory(pending, "--pending-dir")
    others = sorted(p.name for p in pending.iterdir() if not _is_pending_golden(p))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise InputError(
            f"--pending-dir={pending} holds {shown}: golden_update empties its pending folder "
            f"of an earlier run's *{GOLDEN_SUFFIX} files and nothing else; name an empty or "
            f"new folder (default: REPO/{PENDING})"
        )
    for stale in pending.iterdir():
        stale.unlink()
    return pending


GOLDEN_SUFFIX = "_golden.json"


def _is_pending_golden(path: Path) -> bool:
    return path.is_file() and not path.is_symlink() and path.name.endswith(GOLDEN_SUFFIX)


def _pending_set(inputs: Inputs, pending: Path) -> GoldenSet:
    """The regenerated files of one archive; those not regenerated stay the pinned ones."""
    members = {p.name: p.read_bytes() for p in pending.iterdir() if p.is_file()}
    description = f"regenerated into {pending}"
    return golden_set(inputs.name, members, description, f"pending {pending}", partial=True)


def _regenerate(
    pending: Path, args: argparse.Namespace, with_torch: bool, evaluate: Callable | None = None
) -> None:
    """evaluate_llama (and run_torch_llama) writing into `pending`, in this process: the eager
    goldens, then the ggml mode's (`ggml_*`, the same archive) on the selected encodings where
    that mode has goldens of its own."""
    if evaluate is None:
        from max_tests.integration.architectures.llama3 import evaluate_llama

        evaluate = evaluate_llama.main
    selection = ["--model", args.model, "--encoding", args.encoding, "--output-dir", str(pending)]
    if evaluate(selection) != 0:
        raise UpdateError("evaluate_llama failed (above); nothing was published")
    for encoding in ggml_encodings(args.model, args.encoding):
        ggml = ["--model", args.model, "--encoding", encoding, "--mode", "ggml"]
        if evaluate([*ggml, "--output-dir", str(pending)]) != 0:
            raise UpdateError("evaluate_llama --mode=ggml failed (above); nothing was published")
    if with_torch:
        from max_tests.integration.architectures.llama3.testdata import run_torch_llama

        if run_torch_llama.main(selection) != 0:
            raise UpdateError("run_torch_llama failed (above); nothing was published")


def ggml_encodings(model: str, encoding: str) -> list[str]:
    """The encodings of the selection whose ggml goldens exist (variants.GGML_ENCODINGS), each
    with a checkpoint on this machine."""
    from harness.llama3.variants import GGML_ENCODINGS, variants

    chosen = [e for e in GGML_ENCODINGS if encoding in ("all", e)]
    return [e for e in chosen if any(v.path is not None for v in variants(model, e))]


def _torch_inputs_changed(pinned: GoldenSet) -> list[str]:
    """Why transformers' goldens must be made again: what they were made from changed."""
    import transformers

    from goldens.record import case_specs, file_sha256
    from harness.llama3.variants import variants

    by_key = {(v.model, v.encoding): v for v in variants() if v.path is not None}
    version = f"transformers/{transformers.__version__}"
    reasons = []
    for name, golden in pinned.files.items():
        prov = golden.provenance
        variant = by_key.get((prov.get("model"), prov.get("encoding")))
        if variant is None:
            continue
        if prov.get("producer_version") != version:
            reasons.append(f"{name} was made by {prov.get('producer_version')}, this is {version}")
        elif prov.get("checkpoint_sha256") != file_sha256(variant.path):
            reasons.append(f"{name}: checkpoint {variant.path.name} changed")
        else:
            listed = [(s.id, s.prompt) for s in case_specs(variant.model)]
            if [(c.id, c.prompt) for c in golden.cases] != listed:
                reasons.append(f"{name}: its cases are not cases.yaml's")
    return reasons


def _acceptable_from_forced_runs(changed: list[FileDiff], runs: GoldenSet) -> list[FileDiff]:
    """The kept runs that can become goldens: the engine's eager runs and its ggml mode's (the
    producers of the engine's archive), whose greedy tokens did not change."""
    acceptable = []
    for diff in changed:
        klass, why = file_class(diff)
        producer = (diff.after.provenance if diff.after else {}).get("producer")
        if diff.name not in runs.files:
            continue
        if producer not in GOLDEN_PRODUCERS:
            print(f"{diff.name}: a run of producer {producer!r}, not a golden; not accepted")
        elif klass in NOT_FROM_A_FORCED_RUN:
            print(
                f"{diff.name}: {klass} ({why}); a kept run was teacher-forced past that point, "
                "so it is not a golden: run golden_update without --from to recompute it"
            )
        else:
            acceptable.append(diff)
    return acceptable


def _decide(plan: dict[str, list[FileDiff]], args: argparse.Namespace) -> dict[str, list[str]]:
    """The accepted file names per archive: all with --accept, else asked one by one."""
    if args.accept:
        return {name: [d.name for d in diffs] for name, diffs in plan.items()}
    if not sys.stdin.isatty():
        return {name: [] for name in plan}
    accepted: dict[str, list[str]] = {}
    for name, diffs in plan.items():
        accepted[name] = []
        for diff in diffs:
            while True:
                answer = input(
                    f"{name}: {diff.name} [{file_class(diff)[0]}]: "
                    "(a)ccept, (r)eject, (s)kip, (d)iff? "
                ).strip()
                if answer in ("a", "accept"):
                    accepted[name].append(diff.name)
                elif answer in ("d", "diff"):
                    print("\n".join(file_lines(diff)))
                    continue
                elif answer not in ("r", "reject", "s", "skip"):
                    continue
                break
    return accepted


def _archive_members(
    inputs: Inputs, files: list[str], pending: Path | None, args: argparse.Namespace
) -> dict[str, bytes]:
    """NAME's archive to pin: the pinned members with the accepted files replaced or added."""
    members = fetch_members(inputs.store, inputs.pin(), f"pinned {inputs.name}")
    for file_name in files:
        members[file_name] = _new_bytes(file_name, pending, args)
    return members


def version_to_pin(inputs: Inputs, members: dict[str, bytes]) -> tuple[int, bool]:
    """The version of NAME that pinning `members` pins, and whether the store holds it already.

    The same files as a stored version (a change reverted after its goldens were published)
    pin that version again instead of publishing a copy of it; else the newest version + 1 is
    published. --dry-run asks this too, so it names the version that --accept pins.
    """
    data = archive.pack_members(members)
    versions = inputs.store.versions(inputs.name)
    for stored in sorted(versions, reverse=True):
        same = upload_artifact.stored_with_same_files(inputs.store, inputs.name, stored, data)
        if same is not None:
            return stored, True
    return max(versions, default=0) + 1, False


def _publish(
    inputs: Inputs, files: list[str], pending: Path | None, args: argparse.Namespace
) -> None:
    """Pins NAME's archive of the accepted files through the upload command (publish, pin,
    distdir): a stored version holding them, else the next version."""
    name = inputs.name
    members = _archive_members(inputs, files, pending, args)
    version, stored = version_to_pin(inputs, members)
    if stored:
        _progress(f"{name} version {version} already holds these files: pinning it again")
    with tempfile.TemporaryDirectory(prefix="golden_update_") as scratch:
        paths = []
        for member, content in sorted(members.items()):
            (Path(scratch) / member).write_bytes(content)
            paths.append(str(Path(scratch) / member))
        forwarded = _forwarded_flags(args)
        upload = ["upload", name, str(version), *paths, "--update-module", *forwarded]
        code = upload_artifact.main(upload)
    if code != 0:
        raise UpdateError(f"publishing {name} failed (exit {code}, above)")
    done = (
        f"pinned version {version} of" if stored else f"published and pinned version {version} of"
    )
    _progress(f"{done} {name}: {', '.join(files)}")


def _new_bytes(file_name: str, pending: Path | None, args: argparse.Namespace) -> bytes:
    if pending is not None:
        return (pending / file_name).read_bytes()
    source = user_path(args.source)
    if source.is_dir():
        return (source / file_name).read_bytes()
    with zipfile.ZipFile(source) as outputs:
        return outputs.read(file_name)


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    for flag in (
        "store",
        "artifacts_dir",
        "bucket",
        "endpoint_url",
        "region",
        "public_url_template",
        "module_file",
        "distdir_bazelrc",
    ):
        value = getattr(args, flag, None)
        if value:
            flags.append(f"--{flag.replace('_', '-')}={value}")
    if args.prefix and args.bucket:
        flags.append(f"--prefix={args.prefix}")
    return flags


def _rerun_golden_tests() -> int:
    """The golden tests against the new pins, as a user runs them."""
    command = [str(repo_root() / "bazelw"), "test", *GOLDEN_TESTS]
    _progress(f"rerunning the golden tests: {' '.join(command)}")
    return subprocess.run(command, cwd=repo_root(), check=False).returncode and 1


def _progress(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
