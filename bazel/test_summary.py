"""Count the pytest results of one Bazel test run: one closing line for CI logs.

The reports counted are this run's: Bazel's build event file (`bazel test ...
--build_event_json_file=FILE`) names every test attempt of the run with its outputs, and the
summary reads the `test.xml` of each shard's last attempt there (a result answered from a
cache too: its event names the files the cache restored). A walk of bazel-testlogs counted
whatever earlier runs had left there: Bazel 7.7 writes no merged `test.xml` for a sharded
target, so an earlier unsharded run's top-level file stayed beside the current shards and hid
them (a failure planted in shard_2_of_4 printed "0 failed"), and the reports of targets this
run did not test were counted as well.

Every pytest_test writes JUnit XML (test.xml); golden tests add an `ambiguous_steps`
property per test (steps where the greedy token swapped at a near-tie and every number
passed) and a `headroom` property per tolerance entry it checked (`ENTRY|SHARE|TEST|WHERE|METRIC`:
the worst metric as a share of the entry's threshold). Prints `tests: N passed, N failed, N
skipped, N ambiguous steps, N golden checks` (`golden_checks` properties: every step and
prompt position the judge lanes compared), one line per problem that counting test cases
misses (below; each counts as one failed test), then the three entries closest to their
thresholds. Exit 1 when a test failed or no test ran at all, so a CI that ran nothing is never
green; 2 on bad input.

The problems:
- A target that Bazel reports neither PASSED nor skipped (NO_STATUS, or aborted as SKIPPED:
  incompatible) while its XML holds no failure: pytest wrote its results, then the process
  exited non-zero (a native library crashing at interpreter exit: 139), or it never ran.
- Shards of one target that collected different ordered test lists: each shard runs its share
  by position in its own collection (bazel/pytest_runner.py), so a test parametrized over a set
  (ordered by a hash seed that differs per shard process) had some tests run twice and others
  by no shard, every shard passing. The runner records each shard's count and sha256 of the
  list as the `shard_collection` property of its testsuite; those of a target must agree.
- A report the run names that is missing, or is not XML.
- With `--allowed-skips FILE` (.ci/run: bazel/allowed_skips.txt), a skipped test whose reason
  matches none of the file's regular expressions: a skip counts as green in every report, so
  a test that stopped running where CI runs (a planted `pytest.skip`, a `pytest.fail` turned
  into one, a required input missing without its gate) would pass unseen.

  python3 -m bazel.test_summary BEP_FILE   # tools/remote/e2e.sh
  python3 -m bazel.test_summary --allowed-skips bazel/allowed_skips.txt BEP_FILE   # .ci/run
  python3 -m bazel.test_summary --passed TEST_FUNCTION BEP_FILE   # exit 1 unless it passed

A remotely executed or remotely cached test's event names its report by the remote cache's
address (bytestream://HOST/blobs/SHA256/SIZE); the report Bazel downloaded is the one under the
run's testlogs folder (the execroot the build events name) with that digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path

COLLECTION = "shard_collection"  # bazel/pytest_runner.py writes it
NOT_FAILED = {"PASSED", "NO_STATUS", "ABORTED (SKIPPED)"}  # no status: a skipped target


class BadInput(Exception):
    """An input the summary cannot read; the message names it and the fix."""


class Run:
    """One run's reports: each target's test.xml files, Bazel's status of each target where
    known, and the reports the run named that are not here."""

    def __init__(self) -> None:
        self.reports: dict[str, list[Path]] = {}
        self.status: dict[str, str] = {}
        self.missing: dict[str, list[str]] = {}


def _path(uri: str, testlogs: Path | None) -> Path | None:
    """The local file of a report's URI: a file URI's path, or the test.xml under `testlogs`
    (the target's own folder of this run's testlogs) whose sha256 a bytestream URI names."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    blob = re.search(r"/blobs/([0-9a-f]{64})/(\d+)$", parsed.path)
    if parsed.scheme != "bytestream" or blob is None or testlogs is None:
        return None
    digest, size = blob.group(1), int(blob.group(2))
    for xml in sorted(testlogs.rglob("test.xml")) if testlogs.is_dir() else ():
        if xml.stat().st_size == size and hashlib.sha256(xml.read_bytes()).hexdigest() == digest:
            return xml
    return None


def _testlogs(execroot: str | None, mnemonic: str | None, label: str) -> Path | None:
    """The label's own folder of the run's testlogs: EXECROOT/bazel-out/MNEMONIC/testlogs/
    PACKAGE/NAME (None where the events do not say, or for another repository's label)."""
    if execroot is None or mnemonic is None or not label.startswith("//"):
        return None
    package, _, name = label[2:].partition(":")
    return Path(execroot, "bazel-out", mnemonic, "testlogs", package, name)


def from_bep(bep: Path) -> Run:
    """The reports and statuses a build event file names (JSON, one event a line)."""
    last: dict[tuple[str, int, int], tuple[int, str | None]] = {}  # shard -> (attempt, uri)
    execroot: str | None = None  # the workspace event's
    mnemonics: dict[str, str] = {}  # configuration id -> its output folder (k8-fastbuild)
    configuration: dict[str, str] = {}  # label -> its tests' configuration id
    run = Run()
    for number, line in enumerate(bep.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadInput(
                f"{bep}, line {number}: not JSON ({error.msg}); pass the complete file that "
                "`bazel test --build_event_json_file=FILE` wrote"
            ) from None
        ids = event.get("id", {})
        if "workspaceInfo" in event:
            execroot = event["workspaceInfo"].get("localExecRoot")
        elif "configuration" in ids and "configuration" in event:
            mnemonics[ids["configuration"]["id"]] = event["configuration"].get("mnemonic", "")
        if "testResult" in ids and "testResult" in event:
            key = ids["testResult"]
            configuration[key["label"]] = key.get("configuration", {}).get("id", "")
            shard = (key["label"], int(key.get("run", 1)), int(key.get("shard", 1)))
            outputs = event["testResult"].get("testActionOutput", [])
            uri = next((o.get("uri") for o in outputs if o.get("name") == "test.xml"), None)
            attempt = int(key.get("attempt", 1))
            if attempt >= last.get(shard, (0, None))[0]:
                last[shard] = (attempt, uri)
        elif "testSummary" in ids:
            label = ids["testSummary"]["label"]
            if "testSummary" in event:
                run.status[label] = event["testSummary"].get("overallStatus", "NO_STATUS")
            elif "aborted" in event:
                run.status[label] = f"ABORTED ({event['aborted'].get('reason', 'UNKNOWN')})"
    for (label, _, shard), (_, uri) in sorted(last.items()):
        mnemonic = mnemonics.get(configuration.get(label, ""))
        path = _path(uri, _testlogs(execroot, mnemonic, label)) if uri else None
        if path is None or not path.is_file():
            where = f"its report {uri} is missing" if uri else "it wrote no test.xml"
            run.missing.setdefault(label, []).append(f"{label}: shard {shard} of this run: {where}")
            continue
        run.reports.setdefault(label, []).append(path)
    return run


def load(source: Path) -> Run:
    if source.is_file():
        return from_bep(source)
    raise BadInput(
        f"{source} is not a file; pass the build event file of the run "
        "(bazel test --build_event_json_file=FILE)"
    )


class _Unreadable(Exception):
    """A report that is not XML (a process killed while writing it); summarize names it."""


def _parse(xml: Path, target: str) -> ET.Element:
    try:
        return ET.parse(xml).getroot()
    except ET.ParseError as error:
        raise _Unreadable(f"{target}: its report {xml} is not JUnit XML ({error})") from None


def allowed_skips(path: Path) -> list[re.Pattern]:
    """The regular expressions of an allowed-skips file: one a line, `#` lines and blank lines
    aside (each pattern's reason is the comment above it)."""
    if not path.is_file():
        raise BadInput(f"--allowed-skips {path} is not a file; pass bazel/allowed_skips.txt")
    patterns = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            patterns.append(re.compile(line))
        except re.error as error:
            raise BadInput(
                f"{path}, line {number}: {line!r} is no regular expression ({error})"
            ) from None
    return patterns


def _skip_reason(skipped: ET.Element) -> str:
    """The reason pytest gave a skip: the `message` attribute (pytest's JUnit XML), else the
    element's text after pytest's `file:line: ` prefix."""
    message = skipped.get("message")
    if message is not None:
        return message
    return re.sub(r"^\S+:\d+: ", "", (skipped.text or "").strip())


def _short(collection: str) -> str:
    """`6 tests, sha256 1f0c8e2d9a4b...`: a collection with its digest cut to 12 digits."""
    return re.sub(r"([0-9a-f]{12})[0-9a-f]+", r"\1...", collection)


def summarize(
    run: Run, allowed: list[re.Pattern] | None = None
) -> tuple[dict[str, int], list[str]]:
    """The counts over every report of the run, and the problems (module docstring), each
    counted as one failed test; with `allowed` (allowed_skips), every skip's reason must match
    one of them."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "ambiguous": 0, "checks": 0}
    problems = []
    for target in sorted(set(run.reports) | set(run.status) | set(run.missing)):
        problems += run.missing.get(target, [])
        cases, failed = 0, len(run.missing.get(target, []))
        collections: dict[str, str] = {}  # shard folder -> its collection
        for xml in run.reports.get(target, []):
            try:
                root = _parse(xml, target)
            except _Unreadable as error:
                problems.append(str(error))
                failed += 1
                continue
            for case in root.iter("testcase"):
                cases += 1
                skipped = case.find("skipped")
                if skipped is not None:
                    counts["skipped"] += 1
                    reason = _skip_reason(skipped)
                    if allowed is not None and not any(p.search(reason) for p in allowed):
                        problems.append(
                            f"{target}: {case.get('name')} skipped ({reason!r}), a reason the "
                            "allowed skips do not list: make it run here, or fail where it "
                            "cannot, or add its reason to bazel/allowed_skips.txt with why"
                        )
                elif case.find("failure") is not None or case.find("error") is not None:
                    counts["failed"] += 1
                    failed += 1
                else:
                    counts["passed"] += 1
                for prop in case.iter("property"):
                    if prop.get("name") == "ambiguous_steps":
                        counts["ambiguous"] += int(prop.get("value", "0"))
                    elif prop.get("name") == "golden_checks":
                        counts["checks"] += int(prop.get("value", "0"))
            for prop in root.iter("property"):
                if prop.get("name") == COLLECTION:
                    collections[xml.parent.name] = prop.get("value", "")
        status = run.status.get(target)
        if status is not None and status not in NOT_FAILED and failed == 0:
            why = ": it crashed after its tests" if status == "FAILED" else ""
            problems.append(
                f"{target}: Bazel says {status}, its tests' XML says none failed{why} (see its "
                "test.log)"
                if cases
                else f"{target}: Bazel says {status}, and no test of it reported a result"
            )
        if len(set(collections.values())) > 1:
            shown = "; ".join(
                f"{shard}: {_short(value)}" for shard, value in sorted(collections.items())
            )
            problems.append(
                f"{target}: its shards collected different ordered test lists ({shown}), so "
                "some tests ran in no shard and others in two; make the collection order the "
                "same in every process (a parametrization over a set follows the hash seed)"
            )
    counts["failed"] += len(problems)
    return counts, problems


def closest(run: Run, count: int = 3) -> list[str]:
    """The `count` tolerance entries whose worst check came closest to the threshold, each
    with its share, test and place: `own/float32/cpu 35% (tiny-float32-llama3_1, long_8k,
    prompt position 4097, logprob)`."""
    worst: dict[str, tuple[float, str]] = {}
    for target, xmls in run.reports.items():
        for xml in xmls:
            try:
                root = _parse(xml, target)
            except _Unreadable:
                continue  # summarize names it
            for prop in root.iter("property"):
                if prop.get("name") != "headroom":
                    continue
                entry, share, test, where, metric = prop.get("value", "").split("|")
                if float(share) > worst.get(entry, (-1.0, ""))[0]:
                    worst[entry] = (float(share), f"{test}, {where}, {metric}")
    ranked = sorted(worst.items(), key=lambda item: -item[1][0])[:count]
    return [f"{entry} {share:.0%} ({place})" for entry, (share, place) in ranked]


def passed(run: Run, name: str) -> bool:
    """Whether a test case `name` (its function, without parameters) passed in the run: not
    skipped, not failed."""
    for target, xmls in run.reports.items():
        for xml in xmls:
            try:
                root = _parse(xml, target)
            except _Unreadable:
                continue
            for case in root.iter("testcase"):
                if case.get("name", "").split("[")[0] != name:
                    continue
                if all(case.find(tag) is None for tag in ("skipped", "failure", "error")):
                    return True
    return False


USAGE = (
    "usage: python3 -m bazel.test_summary [--allowed-skips FILE] BEP_FILE (the run's "
    "--build_event_json_file), or --passed TEST_FUNCTION BEP_FILE"
)


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "--passed":  # CI's probe: did this one test pass?
            if not Path(argv[2]).is_file():
                print(
                    f"test_summary: --passed reads the probe run's build event file "
                    f"(--build_event_json_file), got {argv[2]!r}; {USAGE}"
                )
                return 2
            if passed(from_bep(Path(argv[2])), argv[1]):
                return 0
            print(f"test_summary: {argv[1]} did not pass in {argv[2]} (skipped, failed or absent)")
            return 1
        allowed = None
        if len(argv) == 3 and argv[0] == "--allowed-skips":
            allowed = allowed_skips(Path(argv[1]))
            argv = argv[2:]
        if len(argv) != 1 or argv[0].startswith("-"):
            print(f"{USAGE} (got {argv})")
            return 2
        run = load(Path(argv[0]))
    except BadInput as error:
        print(f"test_summary: {error}")
        return 2
    c, problems = summarize(run, allowed)
    print(
        f"tests: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
        f"{c['ambiguous']} ambiguous steps, {c['checks']} golden checks (steps and prompt "
        "positions compared by the judge lanes)"
    )
    for problem in problems:
        print(problem)
    nearest = closest(run)
    if nearest:
        print("closest to tolerance: " + "; ".join(nearest))
    return 1 if c["failed"] or c["passed"] + c["failed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
