"""Show what is behind a new golden pin: two golden sets compared step by step.

A changed golden reaches review as a one-line change of a sha256 in MODULE.bazel, which says
nothing about what moved. `golden_diff NAME` opens two sets of NAME's golden files (by default
the pinned archive and the goldens just computed into the testdata folder) and reports, per
golden file and case, the first step whose numbers changed, the greedy tokens there with a few
steps of context, how far the log-probabilities moved, which provenance fields differ, and
which files or cases were added or removed. A reviewer reads it next to the hash.

Both goldens store per step only the top-k ids and logits and the logsumexp, so:
- a log-probability is a logit minus its step's logsumexp;
- |Δ log-prob| is taken over the "from" side's top-k ids. An id missing from the "to" side's
  top-k has a log-probability at most the to side's k-th one, which stands in for it as an
  upper bound (so |Δ| is a lower bound there when the from side's value is above it); the
  summary says how many ids were bounded at the step it quotes;
- KL(from || to) covers the from side's top-k ids plus one bucket for the rest of the
  vocabulary, the bucket estimate of compare.py (the to side's bucket is its known mass
  outside those ids plus what its top-k leaves, less the bounds it lent).
Each golden feeds its own greedy tokens, so once the tokens differ, later steps compare
different prefixes. Golden files are read leniently (any schema_version, any provenance
fields): comparing across a schema change is exactly what a reviewer needs.

Each file and case is classified against its tolerance entry (tolerances.yaml, by the
golden's producer, encoding and device), worst first: `cases changed` (cases, prompts, input
ids or recorded positions added or removed), `tokens changed` (a greedy token differs),
`over tolerance` (|Δ log-prob| or KL above the entry's threshold), `moved` (within the
tolerance, above the noise), `noise` (within the entry's noise floor: the larger of its
noise_floor and isa_noise_floor, what another CPU moves a correct run by), `identical`. The
last line names the worst class.

Exit status: 0 identical or noise only (nothing worth publishing), 1 anything worse, 2 bad
input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from goldens.artifacts.store_options import (
    CheckFailed,
    UsageError,
    add_store_arguments,
    store_from_args,
)
from goldens.cli_files import OneLineParser, PathError, output_file, repo_root, user_path
from goldens.diff import OWN_NAME, TORCH_NAME, diff_sets, worst_class
from goldens.report import write_report
from tools.golden_diff.inputs import (
    INPUT_HELP,
    REGENERATE,
    TESTDATA,
    InputError,
    Inputs,
    load_input,
)
from tools.golden_diff.render import case_views, json_document, markdown_lines, summary_lines

EXAMPLES = """\
examples:
  # the pinned archive against the goldens just computed into the testdata folder
  ./bazelw run //tools:golden_diff -- test_llama_golden
  # two published versions of the local store
  ./bazelw run //tools:golden_diff -- test_llama_golden --from=1 --to=2
  # a sha256 (stored or pinned) against a folder, with an HTML report
  ./bazelw run //tools:golden_diff -- torch_llama_golden \\
      --from=04065a48b3e58edad7d180e4940c3dbebc835ad6a782831db74e4157d8b1c8d5 \\
      --to=/tmp/goldens --html=diff.html
  # a failing test's teacher-forced runs against the pin, without recomputing them (a
  # sharded test's outputs are per shard: shard_1_of_2, shard_2_of_2)
  ./bazelw run //tools:golden_diff -- test_llama_golden \\
      --to=bazel-testlogs/max_tests/integration/architectures/llama3/test_llama/shard_1_of_2/test.outputs/outputs.zip
  # the review as a markdown table per file, for a pull request
  ./bazelw run //tools:golden_diff -- test_llama_golden --from=5 --to=6 --format=markdown
  # an archive file against the pin, without Bazel
  python3 -m tools.golden_diff.golden_diff test_llama_golden --to=test_llama_golden.tar.gz
"""


def parser() -> argparse.ArgumentParser:
    result = OneLineParser(
        prog="golden_diff",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument("name", metavar="NAME", help=f"{OWN_NAME} or {TORCH_NAME}")
    result.add_argument(
        "--from", dest="before", default="pinned", help=f"{INPUT_HELP} (default: pinned)"
    )
    result.add_argument(
        "--to", dest="after", help=f"{INPUT_HELP} (default: the testdata folder, {TESTDATA})"
    )
    result.add_argument(
        "--format",
        choices=["text", "markdown", "json"],
        default="text",
        help="the review on stdout: text (default), markdown (a table per golden file, for a "
        "pull request) or json",
    )
    result.add_argument("--html", metavar="FILE", help="also write an HTML report to FILE")
    result.add_argument(
        "--module-file", help="MODULE.bazel whose pin 'pinned' means (default: REPO/MODULE.bazel)"
    )
    add_store_arguments(
        result, "store of versions and sha256s (default: REPO/artifacts)", publishes=False
    )
    return result


def inputs_from(args: argparse.Namespace) -> Inputs:
    if args.name not in REGENERATE:
        raise InputError(
            f"unknown NAME {args.name!r}; golden archives: {', '.join(sorted(REGENERATE))}"
        )
    try:
        store = store_from_args(args)
    except (UsageError, CheckFailed) as error:
        raise InputError(str(error)) from None
    module_file = user_path(args.module_file) if args.module_file else repo_root() / "MODULE.bazel"
    return Inputs(args.name, store, module_file)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # usage errors and --help
        return int(stop.code or 0)
    try:
        inputs = inputs_from(args)
        html = user_path(args.html) if args.html else None
        if html is not None:
            output_file(html, "--html")
        before = load_input(inputs, args.before, "--from")
        after = load_input(inputs, args.after, "--to").over(before)
    except ValueError as error:  # InputError, PathError, a MODULE.bazel stanza.parse refuses
        print(f"golden_diff: error: {error}", file=sys.stderr)
        return 2
    diffs = diff_sets(before, after)
    summary = summary_lines(args.name, before, after, diffs)
    if args.format == "markdown":
        print("\n".join(markdown_lines(args.name, before, after, diffs)))
    elif args.format == "json":
        print(json_document(args.name, before, after, diffs))
    else:
        print("\n".join(summary))
    if html is not None:
        try:  # a write that fails is bad input (exit 2), not the verdict "different" (1)
            write_report(html, f"golden diff {args.name}", summary, case_views(diffs))
        except PathError as error:
            print(f"golden_diff: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {html}", file=sys.stderr)
    return 0 if worst_class(diffs)[0] in ("identical", "noise") else 1


if __name__ == "__main__":
    sys.exit(main())
