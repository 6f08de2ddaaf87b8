"""Entry point of every `pytest_test`: runs pytest on the files Bazel passes as arguments.

It maps Bazel's test environment onto pytest: the XML report goes where Bazel collects it,
`TESTBRIDGE_TEST_ONLY` (`--test_filter`) becomes `-k`, and pytest's "no tests collected"
exit code 5 fails the target, so a target that collects nothing is never a green test.

A selection (`-k`/`-m`, e.g. `--test_arg=-k --test_arg='test_llama[...]'` on a suite) that
matches nothing in this target is checked against the other test files of the target's Bazel
package. They are not in this target's runfiles (an edit of one test file must not rerun its
siblings' targets): the runner finds them in the source tree, through the symlink of its own
test file (tests run unsandboxed), and collects them (`--collect-only`, in a subprocess with the
source tree first on the path), never runs them: their own targets do.

- The siblings select at least one test: the target passes (0), naming the files and counts,
  and its JUnit XML holds one skipped case saying so: the selection ran in those files'
  targets, none of this target's tests did (.ci/run's closing line counts it as skipped).
- They select nothing: the expression is wrong (a typo must not pass a whole suite). The
  target fails with 5 (pytest's NO_TESTS_COLLECTED, the code this target already got),
  naming the expression and the test ids nearest to it.
- A sibling file fails to collect (import error): the target fails with 2 (pytest's
  INTERRUPTED, its code for collection errors), naming the file and the error, since whether
  the selection is valid is then unknown.
- No source tree (a remote worker): the target passes with the skipped case, saying that the
  selection could not be checked there.

Without a selection an empty target fails with 5, as pytest says.

Sharding (`shard_count` on the target): Bazel's TEST_TOTAL_SHARDS and TEST_SHARD_INDEX split
the selected tests round-robin in collection order, or in contiguous runs with
PYTEST_SHARDS=contiguous in the target's env (tests that share per-process state in order,
e.g. one engine per checkpoint, keep it); each shard runs its share in a process of its own,
and the runner touches TEST_SHARD_STATUS_FILE to say it shards. Contiguous runs are cut at
equal shares of the tests' weights: 1 each, times every factor of PYTEST_SHARD_WEIGHTS
("smollm2=10 chunked=3": a test whose id contains "smollm2" weighs 10, 30 if "chunked" too)
whose word its id contains, so that a target's few heavy cases do not land in one shard. A
shard left with no test while the selection holds some passes with the skipped case saying so.
Each shard's JUnit XML records what it split, as the `shard_collection` property of its
testsuite: the count of the selected tests and the sha256 of their node ids in collection
order. A shard keeps its share by position in its own collection, so shards that collected
different orders (a parametrization over a set follows the hash seed, random in each shard's
process) run some tests twice and others in no shard, every shard passing; the CI summary
(bazel/test_summary.py) fails a target whose shards' properties differ.

The check is scoped to the package: give a selection to the target that holds the test (the
README's one-case commands do), or to a suite of its package's targets, not to `//...`, where
packages without a match fail.
"""

import difflib
import gc
import hashlib
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from xml.sax.saxutils import quoteattr


def _shared_site_packages(entry: str) -> str | None:
    """The folder that the runfiles folder `entry` (a pip package's site-packages, whose files
    are symlinks) mirrors: the package's external repository, shared by every target; None
    where the files are no symlinks into a tree of the same shape (a remote worker's copy)."""
    try:
        names = sorted(os.listdir(entry))
    except OSError:
        return None
    for name in names:
        path = os.path.join(entry, name)
        probes = [path] if os.path.isfile(path) else []
        if not probes and os.path.isdir(path):
            probes = [os.path.join(path, n) for n in sorted(os.listdir(path))[:8]]
        for probe in probes:
            if not (os.path.islink(probe) and os.path.isfile(probe)):
                continue
            relative = os.path.relpath(probe, entry)
            real = os.path.realpath(probe)
            if not real.endswith(os.sep + relative):
                return None
            folder = real[: -len(relative) - 1]
            return folder if os.path.samefile(os.path.join(folder, relative), probe) else None
    return None


def share_package_bytecode() -> None:
    """Import the pip packages from their external repositories instead of this target's
    runfiles tree, here and in the tests' child processes ($PYTHONPATH): Python then keeps
    their bytecode (rules_python ships none) in one place for every target. From the runfiles
    tree, each of the suite's ~60 targets (and each tool a test starts) compiled torch's and
    transformers' modules again on a fresh machine: 2.4 s a process of importing torch,
    transformers and the engine (4.0 s cold, 1.6 s warm, 2-core Intel Xeon). The files are
    the same (the runfiles' symlinks point at them); the repositories' BUILD files leave
    `*.pyc` out of every target, so what Python writes there changes no action's inputs."""
    mapping = {}
    for entry in sys.path:
        if "rules_python~~pip~" in entry and entry.endswith("site-packages"):
            shared = _shared_site_packages(entry)
            if shared is not None:
                mapping[entry] = shared
    sys.path[:] = [mapping.get(entry, entry) for entry in sys.path]
    if os.environ.get("PYTHONPATH"):
        entries = os.environ["PYTHONPATH"].split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(mapping.get(e, e) for e in entries)


share_package_bytecode()

import pytest  # noqa: E402 (after share_package_bytecode: the first import of a pip package)

# Markers every test suite uses for mechanics rather than selection; not worth suggesting.
_BUILTIN_MARKERS = {"parametrize", "usefixtures", "filterwarnings", "skip", "skipif", "xfail"}


class _Collected:
    """A pytest plugin recording what a session collected, selected and failed to collect."""

    def __init__(self) -> None:
        self.keyword = ""
        self.markexpr = ""
        self.selected: list[pytest.Item] = []
        self.deselected: list[pytest.Item] = []
        self.errors: list[tuple[str, str]] = []  # (node id, last line of the error)

    def pytest_configure(self, config: pytest.Config) -> None:
        # The values pytest parsed (addopts, TESTBRIDGE_TEST_ONLY and --test_arg together),
        # rather than re-parsing argv here.
        self.keyword = (config.getoption("keyword") or "").strip()
        self.markexpr = (config.getoption("markexpr") or "").strip()

    def selection_pairs(self) -> list[tuple[str, str]]:
        pairs = [("-k", self.keyword), ("-m", self.markexpr)]
        return [(flag, expr) for flag, expr in pairs if expr]

    def selection_args(self) -> list[str]:
        return [arg for pair in self.selection_pairs() for arg in pair]

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected.extend(items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append((report.nodeid, _last_error_line(report.longreprtext)))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.selected = list(session.items)


class _Shard:
    """A pytest plugin keeping this shard's share of the selected tests (module docstring)."""

    def __init__(self, total: int, index: int, contiguous: bool, weights: dict[str, float]) -> None:
        self.total, self.index, self.contiguous = total, index, contiguous
        self.weights = weights
        self.selected_before = 0  # tests the selection holds, over every shard
        self.collection: str | None = None  # "N tests, sha256 HEX" of their ordered node ids

    def _weight(self, nodeid: str) -> float:
        return math.prod(w for word, w in self.weights.items() if word in nodeid)

    def _shards(self, nodeids: list[str]) -> list[int]:
        """Each test's shard: round-robin, or contiguous runs of equal weight (a test goes
        to the shard in whose share its weight starts)."""
        if not self.contiguous:
            return [i % self.total for i in range(len(nodeids))]
        weights = [self._weight(n) for n in nodeids]
        total, before, shards = sum(weights), 0.0, []
        for w in weights:
            shards.append(min(self.total - 1, int(before * self.total / total)))
            before += w
        return shards

    @pytest.hookimpl(trylast=True)  # after -k/-m deselect
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        self.selected_before = len(items)
        nodeids = "\n".join(item.nodeid for item in items).encode("utf-8")
        self.collection = f"{len(items)} tests, sha256 {hashlib.sha256(nodeids).hexdigest()}"
        mine, others = [], []
        shards = self._shards([item.nodeid for item in items])
        for item, shard in zip(items, shards, strict=True):
            (mine if shard == self.index else others).append(item)
        if others:
            config.hook.pytest_deselected(items=others)
        items[:] = mine


def _shard() -> _Shard | None:
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1") or 1)
    if total <= 1:
        return None
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
        Path(status).touch()
    order = os.environ.get("PYTEST_SHARDS", "round_robin")
    if order not in ("round_robin", "contiguous"):
        raise SystemExit(f"pytest_runner: PYTEST_SHARDS={order!r}: round_robin or contiguous")
    weights = {}
    for entry in os.environ.get("PYTEST_SHARD_WEIGHTS", "").split():
        word, _, weight = entry.partition("=")
        try:
            weights[word] = float(weight)
        except ValueError:
            raise SystemExit(
                f"pytest_runner: PYTEST_SHARD_WEIGHTS entry {entry!r}: write WORD=NUMBER"
            ) from None
        if not (math.isfinite(weights[word]) and weights[word] > 0):
            # a weight of 0 or less moves the cut points backwards: a test falls in no shard
            raise SystemExit(
                f"pytest_runner: PYTEST_SHARD_WEIGHTS entry {entry!r}: a weight is a positive "
                "number (a test's relative seconds)"
            )
    index = int(os.environ.get("TEST_SHARD_INDEX", "0"))
    return _Shard(total, index, order == "contiguous", weights)


class _FrozenImports:
    """A pytest plugin moving what collection imported out of the garbage collector's sight.

    torch, transformers and the rest leave about a million objects behind, and pytest ends a
    session with five full gc.collect() passes (to surface exceptions raised in __del__): 0.4 s
    of a small target's 2 s, in each of the suite's processes. Frozen after collection, those
    objects are never scanned or freed again (they live as long as the process anyway); what
    the tests create is collected as before.
    """

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        gc.freeze()


PROFILE_ENV = "PYTEST_PROFILE"


def _profiled(run):
    """`run()`, under cProfile where $PYTEST_PROFILE is set (`--test_env=PYTEST_PROFILE=1`):
    the functions with the most time of their own and the most time under them are printed
    after the tests, and the whole profile is written as `profile.pstats` among the test's
    outputs (Bazel's `test.outputs/outputs.zip`; `python3 -m pstats` reads it)."""
    if not os.environ.get(PROFILE_ENV):
        return run()
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    code = profile.runcall(run)
    out = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if out:
        profile.dump_stats(os.path.join(out, "profile.pstats"))
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats(order).print_stats(30)
        body = text.getvalue()
        print(f"pytest_runner: profile by {order}\n" + body[body.find("   ncalls") :])
    return code


def main() -> int:
    base = ["-p", "no:cacheprovider", "-c", _find_config(), "--rootdir", os.getcwd()]
    args = list(base)
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if test_filter:
        args += ["-k", test_filter]
    user_args = sys.argv[1:]
    own = _Collected()
    shard = _shard()
    plugins = [own, _FrozenImports()] + ([shard] if shard else [])
    code = _profiled(lambda: pytest.main(args + user_args, plugins=plugins))
    if xml and shard is not None and shard.collection is not None:
        _record_collection(xml, shard.collection)
    if code != pytest.ExitCode.NO_TESTS_COLLECTED:
        return code
    if shard is not None and shard.selected_before:
        message = (
            f"shard {shard.index + 1} of {shard.total} holds none of the "
            f"{shard.selected_before} selected tests: the other shards ran them"
        )
        print(f"pytest_runner: {message}")
        if xml:
            _write_skipped_case(xml, message)
            _record_collection(xml, shard.collection)
        return pytest.ExitCode.OK
    if not own.selection_pairs():
        print(
            "pytest_runner: this target collected no test and has no -k/-m selection; "
            "a test target must run at least one test: check its srcs"
        )
        return code
    code, message = _resolve_in_siblings(own, [a for a in user_args if a.endswith(".py")])
    print(f"pytest_runner: {message}")
    if code == pytest.ExitCode.OK and xml:
        _write_skipped_case(xml, message)
    return code


def _resolve_in_siblings(own: _Collected, own_files: list[str]) -> tuple[int, str]:
    """The exit code and message of a target whose own selection collected nothing (module
    docstring)."""
    shown = " ".join(f"{flag} '{expr}'" for flag, expr in own.selection_pairs())
    found = _source_package(own_files)
    if found is None:
        return pytest.ExitCode.OK, (
            f"{shown} selects no test in this target, and there is no source tree here to check "
            "it against the package's other test files (remote execution?): none of this "
            "target's tests ran"
        )
    root, package = found
    own_real = {os.path.realpath(f) for f in own_files}
    siblings = [str(f) for f in _package_test_files(package) if str(f) not in own_real]
    if not siblings:
        return pytest.ExitCode.NO_TESTS_COLLECTED, (
            f"{shown} selects no test in this target, and its package has no other test "
            f"files; check the expression{_hint(own, own.deselected)}"
        )
    selected, deselected, errors = _collect(root, siblings, own.selection_args())
    relative = [os.path.relpath(f, root) for f in siblings]
    if errors:
        return pytest.ExitCode.INTERRUPTED, (
            f"{shown} selects no test in this target, and the package's other test files "
            f"could not be collected to check whether it selects any there: "
            f"{'; '.join(errors)}. Fix that collection error (it fails those files' own "
            "targets too)"
        )
    if selected:
        counts: dict[str, int] = {}
        for node in selected:
            path = node.split("::")[0]
            counts[path] = counts.get(path, 0) + 1
        where = ", ".join(f"{n} test{'s' if n > 1 else ''} in {p}" for p, n in counts.items())
        return pytest.ExitCode.OK, (
            f"{shown} selects {where}: the selection ran in sibling file(s) of this package "
            "(run by their own targets); none of this target's tests ran"
        )
    return pytest.ExitCode.NO_TESTS_COLLECTED, (
        f"{shown} selects no test in this target nor in the other test files of its package "
        f"({', '.join(relative)}); check the expression"
        f"{_hint(own, own.deselected, deselected)}"
    )


def _source_package(own_files: list[str]) -> tuple[Path, Path] | None:
    """(repository root, package folder) in the source tree that this target's test files
    link to, or None where they are plain copies (a remote worker)."""
    if not own_files:
        return None
    real = Path(os.path.realpath(own_files[0]))
    root = next((p for p in real.parents if (p / "MODULE.bazel").is_file()), None)
    if root is None:
        return None
    package = next(p for p in real.parents if (p / "BUILD.bazel").is_file() or p == root)
    return root, package


def _package_test_files(package: Path) -> list[Path]:
    """The package's test_*.py files, subpackages (folders with a BUILD file) left out."""
    files = []
    for folder, subfolders, names in os.walk(package):
        subfolders[:] = sorted(
            d for d in subfolders if not (Path(folder, d) / "BUILD.bazel").is_file()
        )
        files += [Path(folder, n) for n in sorted(names) if _is_test_file(n)]
    return files


def _is_test_file(name: str) -> bool:
    return name.startswith("test_") and name.endswith(".py")


def _collect(root: Path, files: list[str], selection: list[str]) -> tuple[list, list, list]:
    """(selected node ids, the files' test names when none is selected, collection errors) of
    `files` under the selection, collected by pytest in a subprocess importing from the source
    tree."""
    lines, code, stderr = _collect_only(root, [*selection, *files])
    errors = _collection_errors(lines)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        errors = errors or [f"pytest exited {code}: {stderr.strip()[-500:]}"]
    selected = [line for line in lines if "::" in line and " " not in line]
    if selected or errors:
        return selected, [], errors
    every, _, _ = _collect_only(root, files)
    return [], [line.split("::")[-1] for line in every if "::" in line], []


def _collection_errors(lines: list[str]) -> list[str]:
    """ "FILE: ERROR" for each "ERROR collecting FILE" section of pytest's output."""
    errors: dict[str, list[str]] = {}
    current = None
    for line in lines:
        header = re.fullmatch(r"_+ ERROR collecting (\S+) _+", line.strip())
        if header:
            current = header.group(1)
            errors[current] = []
        elif current is not None and not line.startswith("="):
            errors[current].append(line)
        else:
            current = None
    return [f"{name}: {_last_error_line(chr(10).join(text))}" for name, text in errors.items()]


def _collect_only(root: Path, args: list[str]) -> tuple[list[str], int, str]:
    """pytest --collect-only -q over `args` in the source tree: (stdout lines, exit, stderr)."""
    config = [
        "-rE",
        "-p",
        "no:cacheprovider",
        "-c",
        str(root / "pyproject.toml"),
        "--rootdir",
        str(root),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *config, *args],
        cwd=root,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(root), *sys.path])},
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.splitlines(), done.returncode, done.stderr


def _write_skipped_case(xml: str, message: str) -> None:
    """Replace the empty JUnit XML with one skipped case saying why nothing ran here."""
    Path(xml).write_text(
        '<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name="pytest" '
        'errors="0" failures="0" skipped="1" tests="1"><testcase classname="pytest_runner" '
        f'name="none of this target\'s tests selected"><skipped message={quoteattr(message)} />'
        "</testcase></testsuite></testsuites>\n",
        encoding="utf-8",
    )


def _record_collection(xml: str, collection: str) -> None:
    """Add this shard's `shard_collection` property (module docstring) to each testsuite of
    its JUnit XML, in the testsuite's `<properties>`, where JUnit has suite properties."""
    path = Path(xml)
    if not path.is_file():  # pytest stopped before writing it; Bazel writes its own
        return
    tree = ET.parse(path)
    for suite in tree.getroot().iter("testsuite"):
        properties = suite.find("properties")
        if properties is None:
            properties = ET.Element("properties")
            suite.insert(0, properties)
        ET.SubElement(properties, "property", name="shard_collection", value=collection)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def _hint(own: _Collected, items: list[pytest.Item], more_names: list[str] = ()) -> str:
    """What the expression could have been: the nearest test ids, or the markers in use."""
    if not items and not more_names:
        return ""
    hints = []
    if own.keyword:
        names = sorted({item.name for item in items} | set(more_names))
        near = difflib.get_close_matches(own.keyword, names, n=3, cutoff=0.5) or names[:3]
        hints.append(f"test ids look like {', '.join(near)}")
    if own.markexpr:
        markers = sorted({m.name for item in items for m in item.iter_markers()})
        markers = [m for m in markers if m not in _BUILTIN_MARKERS]
        hints.append(f"markers in use: {', '.join(markers) or 'none'}")
    return ": " + "; ".join(hints)


def _last_error_line(text: str) -> str:
    """The exception line of a collection error ("E   ModuleNotFoundError: ..."), or its end."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return errors[-1] if errors else (lines[-1] if lines else "unknown error")


def _find_config() -> str:
    # The runfiles tree mirrors the repository, so the root pyproject.toml is in the cwd.
    return os.path.join(os.getcwd(), "pyproject.toml")


if __name__ == "__main__":
    sys.exit(main())
