"""testing.fuzz.first_failure: a planted bug counts as caught only when the property's own
check fails, on the same example every time."""

import ast
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testing.fuzz import first_failure, fuzz_settings


def double(x: int) -> int:
    return 2 * x


# The subject under test, reached through an attribute and a dict entry so that a plant can
# go in either way (monkeypatch.setattr, monkeypatch.setitem).
SUBJECT = {"double": double}


class Subject:
    double = staticmethod(double)


# Not named test_*: pytest does not collect it; only first_failure runs it.
@fuzz_settings(50)
@given(st.integers(0, 100))
def prop_double_is_a_sum(x: int) -> None:
    assert Subject.double(x) == SUBJECT["double"](x) == x + x, "double differs from x + x"


def _plant(monkeypatch: pytest.MonkeyPatch, how: str, plant: Callable[[int], int]) -> None:
    if how == "setattr":
        monkeypatch.setattr(Subject, "double", staticmethod(plant))
    else:
        monkeypatch.setitem(SUBJECT, "double", plant)


PLANTED_HOW = ["setattr", "setitem"]


@pytest.mark.parametrize("how", PLANTED_HOW)
def test_a_planted_bug_is_caught_at_the_first_example_it_breaks(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    seen: list[int] = []

    def off_by_one_above_50(x: int) -> int:
        seen.append(x)
        return 2 * x + (x > 50)

    _plant(monkeypatch, how, off_by_one_above_50)
    planted = first_failure(monkeypatch, prop_double_is_a_sum, match="double differs")
    breaking = next(i for i, x in enumerate(seen) if x > 50)
    assert planted.first == breaking + 1 > 1  # not the first example: the count means something
    assert planted.calls == len(seen) == planted.first + 1  # not shrunk: only the replay
    assert seen[-1] == seen[-2] > 50  # hypothesis replayed the failing example
    # The same verdict without match: the property's check raised it, outside the plant.
    seen.clear()
    assert first_failure(monkeypatch, prop_double_is_a_sum).first == planted.first


@pytest.mark.parametrize("how", PLANTED_HOW)
def test_a_plant_that_fails_once_then_behaves_is_flaky_not_caught(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    calls = []

    def wrong_once(x: int) -> int:
        calls.append(x)
        return 2 * x + (len(calls) == 1)

    _plant(monkeypatch, how, wrong_once)
    with pytest.raises(AssertionError, match=r"the plant is flaky, not caught: example 1 failed"):
        first_failure(monkeypatch, prop_double_is_a_sum, match="double differs")
    assert len(calls) >= 2  # example 1 failed, its replay passed


@pytest.mark.parametrize("how", PLANTED_HOW)
def test_a_plant_whose_own_assert_fires_is_not_caught(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    def broken_plant(x: int) -> int:
        assert isinstance(x, str), "plant expected a str"
        return 2 * x

    _plant(monkeypatch, how, broken_plant)
    # Without match: the error was raised while the plant ran.
    with pytest.raises(AssertionError, match=r"raised inside the plant .*broken_plant") as error:
        first_failure(monkeypatch, prop_double_is_a_sum)
    assert "plant expected a str" in str(error.value)
    # With match naming the property's message: the plant's message is not it.
    with pytest.raises(AssertionError, match="plant expected a str"):
        first_failure(monkeypatch, prop_double_is_a_sum, match="double differs")


# Draws 300 derandomized examples in a process of its own and prints them; "extra" first
# imports a module whose source holds numbers a draw could take, "unpinned" puts hypothesis's
# collector of such numbers back after testing.fuzz removed it.
_DRAWS = """
import sys

sys.path.insert(0, sys.argv[1])
if "extra" in sys.argv:
    import numbers_here  # noqa: F401

from hypothesis import given, strategies as st

from testing import fuzz

if "unpinned" in sys.argv:
    fuzz._providers._get_local_constants = fuzz._unpinned
seen = []


@fuzz.fuzz_settings(300)
@given(st.floats(0.0, 100.0), st.integers(0, 10**6))
def draws(x, n):
    seen.append((x, n))


draws()
print(repr(seen))
"""


def _draws(folder, *flags: str) -> list:
    script = folder / "draws.py"
    script.write_text(_DRAWS)
    (folder / "numbers_here.py").write_text("SCALE = 42.4242\nLIMIT = 777777\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, str(script), str(folder), *flags],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_a_propertys_examples_do_not_depend_on_the_modules_imported(tmp_path) -> None:
    """A fuzz test draws the same examples whatever else its process imported (the Bazel
    runner, a conftest, a module an edit touched): hypothesis's pool of numbers from the
    imported modules' source is emptied by testing.fuzz. Unpinned, importing one module with
    42.4242 and 777777 in its source moves the draws, and those numbers are among them."""
    plain, extra = _draws(tmp_path), _draws(tmp_path, "extra")
    assert plain == extra
    unpinned = _draws(tmp_path, "extra", "unpinned")
    assert unpinned != plain
    assert {42.4242, 777777} & {v for pair in unpinned for v in pair}
