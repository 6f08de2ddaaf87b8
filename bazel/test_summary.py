"""Count the pytest results under a bazel-testlogs folder: one closing line for CI logs.

Every pytest_test writes JUnit XML (test.xml); golden tests add an `ambiguous_steps`
property per test (steps where the greedy token swapped at a near-tie and every number
passed). Prints `tests: N passed, N failed, N skipped, N ambiguous steps`; exit 1 when no
test ran at all, so a CI that ran nothing is never green.

  python3 -m bazel.test_summary "$(./bazelw info bazel-testlogs)"
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def summarize(testlogs: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "ambiguous": 0}
    for xml in sorted(testlogs.rglob("test.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                counts["skipped"] += 1
            elif case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
            else:
                counts["passed"] += 1
            for prop in case.iter("property"):
                if prop.get("name") == "ambiguous_steps":
                    counts["ambiguous"] += int(prop.get("value", "0"))
    return counts


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: python3 -m bazel.test_summary BAZEL_TESTLOGS_DIR (got {argv})")
        return 2
    c = summarize(Path(argv[0]))
    print(
        f"tests: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
        f"{c['ambiguous']} ambiguous steps"
    )
    return 1 if c["passed"] + c["failed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
