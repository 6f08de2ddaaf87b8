"""Entry point of every `pytest_test`: runs pytest on the files Bazel passes as arguments.

It maps Bazel's test environment onto pytest: the XML report goes where Bazel collects it,
`TESTBRIDGE_TEST_ONLY` (`--test_filter`) becomes `-k`, and pytest's "no tests collected"
exit code 5 fails the target, so a target that collects nothing is never a green test.

One exception: with a selection (`-k`/`-m`, e.g. `--test_arg=-k --test_arg='test_llama[...]'`
on a suite), a target none of whose tests match passes, saying so: the selection ran
elsewhere in the suite.
"""

import os
import sys

import pytest


def main() -> int:
    args = ["-p", "no:cacheprovider", "-c", _find_config(), "--rootdir", os.getcwd()]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    test_filter = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if test_filter:
        args += ["-k", test_filter]
    user_args = sys.argv[1:]
    code = pytest.main(args + user_args)
    selecting = test_filter or any(
        a in ("-k", "-m") or a.startswith(("-k=", "-m=")) for a in user_args
    )
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and selecting:
        print("pytest_runner: the selection matched no test in this target; nothing to run here")
        return 0
    return code


def _find_config() -> str:
    # The runfiles tree mirrors the repository, so the root pyproject.toml is in the cwd.
    return os.path.join(os.getcwd(), "pyproject.toml")


if __name__ == "__main__":
    sys.exit(main())
