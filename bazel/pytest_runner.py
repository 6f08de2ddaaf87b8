"""Entry point of every `pytest_test`: runs pytest on the files Bazel passes as arguments.

It maps Bazel's test environment onto pytest: the XML report goes where Bazel collects it,
`TESTBRIDGE_TEST_ONLY` (`--test_filter`) becomes `-k`, and pytest's "no tests collected"
exit code 5 fails the target, so a target that collects nothing is never a green test.

A selection (`-k`/`-m`, e.g. `--test_arg=-k --test_arg='test_llama[...]'` on a suite) that
matches nothing in this target is checked against the other test files of the target's Bazel
package, whose runfiles paths the `pytest_test` macro passes in `PYTEST_SIBLING_TESTS`
(space-separated). They are only collected (`--collect-only`, in this process, so heavy
imports are already done), never run: their own targets run them.

- The siblings select at least one test: the target passes (0), naming the files and counts;
  the selection runs in those files' targets.
- They select nothing: the expression is wrong (a typo must not pass a whole suite). The
  target fails with 5 (pytest's NO_TESTS_COLLECTED, the code this target already got),
  naming the expression and the test ids nearest to it.
- A sibling file fails to collect (import error) or is missing: the target fails with 2
  (pytest's INTERRUPTED, its code for collection errors), naming the file and the error,
  since whether the selection is valid is then unknown.

Without a selection an empty target fails with 5, as pytest says.

The check is scoped to the package: give a selection to the suite or target that holds the
test (`//max_tests/integration:tests`), not to `//...`, where packages without a match fail.
"""

import difflib
import gc
import os
import sys

import pytest

SIBLINGS_ENV = "PYTEST_SIBLING_TESTS"
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
    code = pytest.main(args + user_args, plugins=[own, _FrozenImports()])
    if code != pytest.ExitCode.NO_TESTS_COLLECTED:
        return code
    if not own.selection_pairs():
        print(
            "pytest_runner: this target collected no test and has no -k/-m selection; "
            "a test target must run at least one test: check its srcs"
        )
        return code
    siblings = [f for f in os.environ.get(SIBLINGS_ENV, "").split() if f not in user_args]
    return _resolve_in_siblings(base, siblings, own)


def _resolve_in_siblings(base: list[str], siblings: list[str], own: _Collected) -> int:
    """The exit code of a target whose own selection collected nothing (module docstring)."""
    shown = " ".join(f"{flag} '{expr}'" for flag, expr in own.selection_pairs())
    missing = [f for f in siblings if not os.path.isfile(f)]
    if missing:
        print(
            f"pytest_runner: {shown} selects no test in this target, and the package's other "
            f"test files to check it against are missing from the runfiles: "
            f"{', '.join(missing)}; {SIBLINGS_ENV} must list files in the target's data "
            "(the pytest_test macro in bazel/pytest.bzl adds them)"
        )
        return pytest.ExitCode.INTERRUPTED
    if not siblings:
        print(
            f"pytest_runner: {shown} selects no test in this target, and its package has no "
            f"other test files; check the expression{_hint(own, own.deselected)}"
        )
        return pytest.ExitCode.NO_TESTS_COLLECTED

    print(
        f"pytest_runner: {shown} selects no test in this target; collecting the other test "
        f"files of its package to check it: {' '.join(siblings)}"
    )
    sib = _Collected()
    sib_code = pytest.main(
        [*base, "--collect-only", "-q", *own.selection_args(), *siblings], plugins=[sib]
    )
    if sib.errors or sib_code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        errors = "; ".join(f"{node}: {line}" for node, line in sib.errors) or f"exit {sib_code}"
        print(
            f"pytest_runner: {shown} selects no test in this target, and the package's other "
            f"test files could not be collected to check whether it selects any there: "
            f"{errors}. Fix that collection error (it fails those files' own targets too)"
        )
        return sib_code if sib_code != pytest.ExitCode.OK else pytest.ExitCode.INTERRUPTED
    if sib.selected:
        counts: dict[str, int] = {}
        for item in sib.selected:
            path = os.path.relpath(item.path, os.getcwd())
            counts[path] = counts.get(path, 0) + 1
        where = ", ".join(f"{n} test{'s' if n > 1 else ''} in {p}" for p, n in counts.items())
        print(
            f"pytest_runner: {shown} selects {where}: the selection ran in sibling file(s) of "
            "this package (run by their own targets); nothing to run in this target, which passes"
        )
        return pytest.ExitCode.OK
    print(
        f"pytest_runner: {shown} selects no test in this target nor in the other test files "
        f"of its package ({', '.join(siblings)}); check the expression"
        f"{_hint(own, own.deselected + sib.deselected)}"
    )
    return pytest.ExitCode.NO_TESTS_COLLECTED


def _hint(own: _Collected, items: list[pytest.Item]) -> str:
    """What the expression could have been: the nearest test ids, or the markers in use."""
    if not items:
        return ""
    hints = []
    if own.keyword:
        names = sorted({item.name for item in items})
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
