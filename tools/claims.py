"""claims: the bit-level properties README.md and docs/ state, and the tests that back them.

A paragraph (or table row) of README.md, docs/ or another README.md that says something
holds bit for bit (`bit for bit`, `bit-identical`, `bitwise`, `bit-exact`, `byte for byte`,
`byte-identical`, `to the bit`, `same`/`identical`/`equal` `bits`/`bytes`) must name the test
that breaks when it stops holding: a backticked test function, test file or Bazel test
target, one that runs (not skipped, skipif(True) or xfail, nor in a file `pytestmark` skips).
Every test name a document cites must exist (a renamed test leaves its claim unbacked). Pure
Python, no packages: tools/lint/lint.sh runs it on every CI run, before the tests.

    python3 -m tools.claims           list the property claims and their tests; exit 1 and name
                                      each unbacked claim or unknown test name
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

PROPERTY = re.compile(
    r"bits? for bits?|bit-for-bit|bit-identical|bitwise|bit-exact|byte for byte|byte-identical"
    r"|to the bit|(?:same|identical|equal) (?:bits|bytes)",
    re.I,
)
CODE = re.compile(r"`([^`\n]+)`")
# What a macro makes of a target's name (bazel/pytest.bzl gpu_pytest_test: NAME and NAME_on_cpu).
GENERATED_SUFFIXES = ("_on_cpu",)
# A test-like name, not a flag (`--test_env`, `--test_arg`): test_X, X_test, X_test_on_cpu.
TEST_NAME = re.compile(
    r"(?<![-\w])(test_\w+|\w+_test(?:"
    + "|".join(re.escape(suffix) for suffix in GENERATED_SUFFIXES)
    + r")?)\b"
)
# Names a document may put in backticks that look like tests and are not: the golden archives.
NOT_TESTS = {"test_llama_golden", "py_test"}


@dataclasses.dataclass(frozen=True)
class Claim:
    document: str
    line: int
    text: str
    tests: tuple[str, ...]


def blocks(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, text) of each paragraph and table row, code fences left out."""
    lines = text.splitlines()
    start, current, fenced = 0, [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
            if current:
                yield start, "\n".join(current)
            current = []
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("|") or line.startswith("#"):
            if current:
                yield start, "\n".join(current)
            current = []
            if line.startswith("|"):
                yield number, line
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        yield start, "\n".join(current)


def cited_tests(text: str) -> list[str]:
    names = []
    for code in CODE.findall(text):
        names += [n for n in TEST_NAME.findall(code) if n not in NOT_TESTS]
    return names


def claims(document: Path, root: Path) -> list[Claim]:
    found = []
    for line, text in blocks(document.read_text()):
        if PROPERTY.search(text):
            name = str(document.relative_to(root))
            found.append(Claim(name, line, " ".join(text.split()), tuple(cited_tests(text))))
    return found


# A test function under an unconditional skip, a skipif(True) or an xfail proves nothing; nor
# does any test of a file whose `pytestmark` skips or xfails it.
NOT_RUN = r"@pytest\.mark\.(?:skip\b(?!if)|skipif\(\s*True\b|xfail\b)"
SKIPPED = re.compile(rf"^\s*{NOT_RUN}[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (test_\w+)", re.M)
SKIPPED_FILE = re.compile(rf"^pytestmark\s*=\s*(?:\[[^\]]*)?{NOT_RUN[1:]}", re.M)
RULE = re.compile(r"^(\w+)\(\s*\n\s*name = \"(\w+)\"", re.M)  # a BUILD rule and its name


def known_tests(root: Path) -> tuple[set[str], set[str]]:
    """(what can back a claim: test functions not skipped, test files and test targets; every
    name a document may cite without being wrong: those, skipped tests, the test macros of
    the .bzl files and every other target)."""
    backing: set[str] = set()
    known: set[str] = set()
    for path in root.rglob("*.py"):
        if path.parts[len(root.parts)].startswith(("bazel-", ".")):
            continue
        text = path.read_text(errors="replace")
        functions = set(re.findall(r"^\s*def (test_\w+)", text, re.M))
        skipped = functions if SKIPPED_FILE.search(text) else set(SKIPPED.findall(text))
        if path.stem.startswith("test_"):
            (known if skipped == functions and functions else backing).add(path.stem)
        backing.update(functions - skipped)
        known.update(skipped)
    for path in root.rglob("*.bzl"):  # the test macros (pytest_test, llama3_test, ...)
        if not path.parts[len(root.parts)].startswith(("bazel-", ".")):
            known.update(re.findall(r"^def (\w+)\(", path.read_text(), re.M))
    for path in root.rglob("BUILD.bazel"):
        if path.parts[len(root.parts)].startswith(("bazel-", ".")):
            continue
        text = path.read_text()
        tests = {name for rule, name in RULE.findall(text) if rule.endswith("_test")}
        for target in re.findall(r'name = "(\w+)"', text):
            names = {target, *(target + suffix for suffix in GENERATED_SUFFIXES)}
            (backing if target in tests else known).update(names)
    return backing, known | backing


def documents(root: Path) -> list[Path]:
    """README.md, docs/ and every other README.md below the root (testdata's, the store's)."""
    others = sorted(
        path
        for path in root.rglob("README.md")
        if path != root / "README.md"
        and not path.relative_to(root).parts[0].startswith(("bazel-", "."))
    )
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *others]


def problems(root: Path) -> tuple[list[Claim], list[str]]:
    """Every property claim, and what is wrong: unbacked claims, unknown test names."""
    every, wrong = [], []
    backing, known = known_tests(root)
    for document in documents(root):
        for claim in claims(document, root):
            every.append(claim)
            if not claim.tests:
                wrong.append(
                    f"{claim.document}:{claim.line}: states a bit-level property and names no "
                    f"test: {claim.text[:160]}"
                )
            elif not any(name in backing for name in claim.tests):
                wrong.append(
                    f"{claim.document}:{claim.line}: states a bit-level property and names "
                    f"no test that runs ({', '.join(claim.tests)}: a macro, another target or a "
                    f"skipped test): {claim.text[:120]}"
                )
        for line, text in blocks(document.read_text()):
            for name in cited_tests(text):
                if name not in known:
                    wrong.append(
                        f"{document.relative_to(root)}:{line}: names `{name}`, which is no "
                        "test function, test file or target here"
                    )
    return every, wrong


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="claims", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--quiet", action="store_true", help="print only what is wrong")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "README.md").is_file():
        print(f"claims: {root} has no README.md: pass --root=REPOSITORY", file=sys.stderr)
        return 2
    every, wrong = problems(root)
    if not args.quiet:
        for claim in every:
            print(f"{claim.document}:{claim.line}: {', '.join(claim.tests)}")
    for problem in wrong:
        print(f"claims: {problem}", file=sys.stderr)
    backed = len(every) - sum("names no test" in w for w in wrong)
    print(f"claims: {len(every)} bit-level claims, {backed} backed by a named test")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
