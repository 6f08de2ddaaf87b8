"""The suite's cost: the slowest test targets of a Bazel run, and those far over their budget.

Reads the run's build event file (`bazel test ... --build_event_json_file=FILE`): every test
attempt Bazel executed (not those answered from a cache) with its seconds. Prints the ten
slowest, the sum over every executed target, and each target whose seconds are more than
`--factor` (2) times its row in the budget table (docs/test_budget.md: `| //label | seconds |
why |`), or that has no row. A report for people reading CI's log, not a timed test: the
exit code is 0 whatever the times (2: bad input).

  python3 -m bazel.test_budget bep.json --budget docs/test_budget.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROW = re.compile(r"^\|\s*`?(//[^|`]+?)`?\s*\|\s*(\d+(?:\.\d+)?)\s*\|")


def executed_seconds(bep: Path) -> dict[str, float]:
    """Seconds per test target executed in this run (attempts and shards summed); targets
    answered from a cache are left out."""
    seconds: dict[str, float] = {}
    for line in bep.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        result = event.get("testResult")
        label = event.get("id", {}).get("testResult", {}).get("label")
        if result is None or label is None or result.get("cachedLocally"):
            continue
        if result.get("executionInfo", {}).get("cachedRemotely"):
            continue
        millis = int(result.get("testAttemptDurationMillis", 0))
        seconds[label] = seconds.get(label, 0.0) + millis / 1000
    return seconds


def budget_rows(table: Path) -> dict[str, float]:
    """`//label -> seconds` from the budget table's rows."""
    rows = {}
    for line in table.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line.strip())
        if match:
            rows[match[1].strip()] = float(match[2])
    return rows


def report(seconds: dict[str, float], budget: dict[str, float], factor: float) -> list[str]:
    if not seconds:
        return ["slowest test targets: none executed (every result came from a cache)"]
    ranked = sorted(seconds.items(), key=lambda item: -item[1])
    lines = [f"slowest test targets (of {len(seconds)} executed, seconds):"]
    lines += [f"  {s:7.1f}  {label}" for label, s in ranked[:10]]
    lines.append(f"  {sum(seconds.values()):7.1f}  total, every executed target")
    for label, s in ranked:
        row = budget.get(label)
        if row is None:
            lines.append(f"budget: {label} took {s:.0f} s and has no row in the budget table")
        elif s > factor * row:
            lines.append(f"budget: {label} took {s:.0f} s, over {factor:g}x its row ({row:g} s)")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python3 -m bazel.test_budget bep.json --budget docs/test_budget.md",
    )
    parser.add_argument("bep", type=Path, help="Bazel's --build_event_json_file of a test run")
    parser.add_argument("--budget", type=Path, required=True, help="the budget table (markdown)")
    parser.add_argument("--factor", type=float, default=2.0, help="how far over a row is named")
    args = parser.parse_args(argv)
    for path in (args.bep, args.budget):
        if not path.is_file():
            print(f"test_budget: {path} is not a file", file=sys.stderr)
            return 2
    seconds = executed_seconds(args.bep)
    budget = budget_rows(args.budget)
    if not budget:
        print(f"test_budget: {args.budget} has no `| //label | seconds |` rows", file=sys.stderr)
        return 2
    print("\n".join(report(seconds, budget, args.factor)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
