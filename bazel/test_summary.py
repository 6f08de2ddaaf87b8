"""Count the pytest results under a bazel-testlogs folder: one closing line for CI logs.

Every pytest_test writes JUnit XML (test.xml); golden tests add an `ambiguous_steps`
property per test (steps where the greedy token swapped at a near-tie and every number
passed) and a `headroom` property per tolerance entry it checked (`ENTRY|SHARE|TEST|WHERE|METRIC`:
the worst metric as a share of the entry's threshold). Prints `tests: N passed, N failed, N
skipped, N ambiguous steps, N golden checks` (`golden_checks` properties: every step and
prompt position the judge lanes compared), then the three entries closest to their
thresholds; exit 1 when no test ran at all, so a CI that ran nothing is never green.

  python3 -m bazel.test_summary "$(./bazelw info bazel-testlogs)"
  python3 -m bazel.test_summary --passed TEST_FUNCTION TESTLOGS_FOLDER   # exit 1 unless it passed
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def reports(testlogs: Path) -> list[Path]:
    """Every target's JUnit XML once: a sharded target's `shard_N_of_M/test.xml` files are
    left out where Bazel wrote their merge beside them (its `test.xml`)."""
    found = []
    for xml in sorted(testlogs.rglob("test.xml")):
        shard = xml.parent.name.startswith("shard_") and "_of_" in xml.parent.name
        if shard and (xml.parent.parent / "test.xml").is_file():
            continue
        found.append(xml)
    return found


def closest(testlogs: Path, count: int = 3) -> list[str]:
    """The `count` tolerance entries whose worst check came closest to the threshold, each
    with its share, test and place: `own/float32/cpu 35% (tiny-float32-llama3_1, long_8k,
    prompt position 4097, logprob)`."""
    worst: dict[str, tuple[float, str]] = {}
    for xml in reports(testlogs):
        for prop in ET.parse(xml).getroot().iter("property"):
            if prop.get("name") != "headroom":
                continue
            entry, share, test, where, metric = prop.get("value", "").split("|")
            if float(share) > worst.get(entry, (-1.0, ""))[0]:
                worst[entry] = (float(share), f"{test}, {where}, {metric}")
    ranked = sorted(worst.items(), key=lambda item: -item[1][0])[:count]
    return [f"{entry} {share:.0%} ({place})" for entry, (share, place) in ranked]


def summarize(testlogs: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "ambiguous": 0, "checks": 0}
    for xml in reports(testlogs):
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
                elif prop.get("name") == "golden_checks":
                    counts["checks"] += int(prop.get("value", "0"))
    return counts


def passed(testlogs: Path, name: str) -> bool:
    """Whether a test case `name` (its function, without parameters) passed: not skipped,
    not failed, under `testlogs` (a target's folder or the whole tree)."""
    for xml in reports(testlogs):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.get("name", "").split("[")[0] != name:
                continue
            if all(case.find(tag) is None for tag in ("skipped", "failure", "error")):
                return True
    return False


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--passed":  # CI's probe: did this one test pass here?
        if passed(Path(argv[2]), argv[1]):
            return 0
        print(f"test_summary: {argv[1]} did not pass under {argv[2]} (skipped, failed or absent)")
        return 1
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: python3 -m bazel.test_summary BAZEL_TESTLOGS_DIR (got {argv})")
        return 2
    c = summarize(Path(argv[0]))
    print(
        f"tests: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
        f"{c['ambiguous']} ambiguous steps, {c['checks']} golden checks (steps and prompt "
        "positions compared by the judge lanes)"
    )
    nearest = closest(Path(argv[0]))
    if nearest:
        print("closest to tolerance: " + "; ".join(nearest))
    return 1 if c["passed"] + c["failed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
