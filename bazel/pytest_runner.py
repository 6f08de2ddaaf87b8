"""Entry point of every `pytest_test`: runs pytest on the files Bazel passes as arguments.

It maps Bazel's test environment onto pytest: the XML report goes where Bazel collects it,
`TESTBRIDGE_TEST_ONLY` (`--test_filter`) becomes `-k`, and pytest's "no tests collected"
exit code 5 fails the target, so a filter that matches nothing is never a green test.
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
    return pytest.main(args + sys.argv[1:])


def _find_config() -> str:
    # The runfiles tree mirrors the repository, so the root pyproject.toml is in the cwd.
    return os.path.join(os.getcwd(), "pyproject.toml")


if __name__ == "__main__":
    sys.exit(main())
