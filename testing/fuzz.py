"""Shared pieces of the property-based (hypothesis) tests.

`fuzz_settings` is the one configuration every fuzz test runs under:

- derandomized (`derandomize=True`, no example database): the examples come from a seed derived
  from the test's source, so CI and every laptop see the same examples on every run, and a
  failure does not come and go between runs (under the hypothesis that
  third_party/requirements_lock.txt pins: another version draws other examples, and refuses
  another's `@reproduce_failure`);
- drawn without hypothesis's local constants: 5% of its draws take a literal found in the
  source of whichever non-test modules happen to be imported (hypothesis 6.1xx), so the
  examples depended on the process, not the test. Under Bazel the runner
  (bazel/pytest_runner.py, imported as `__main__`) added its numbers: test_fuzz_compare's fifth
  example had a logit scale twice plain pytest's, and an edit of any imported module could
  move every property's examples. `_pin_constant_pool` empties that pool (hypothesis's own
  list of boundary values stays), so a test's examples are its source's alone;
- `print_blob=True`: on a failure hypothesis prints the falsifying example and a
  `@reproduce_failure(...)` line; paste it above the failing test to replay exactly that
  example;
- no deadline and no too-slow health check: examples load models and files, and their time
  varies with the machine.

`first_failure` serves the planted-bug tests. A property that never fails proves nothing, so
each property has a test that plants a realistic bug with monkeypatch and runs the property
on it, expecting it to fail. `first_failure` also counts the examples, so that the test can
assert that the bug was found while generating examples (within `max_examples`), not only
by luck while shrinking another failure. A planted run stops at its first failing example
and does not shrink it (`shrink=False`): the verdict needs the failure, not the smallest
example, and shrinking was most of these tests' time (on the 2-core Xeon fuzz_engine_test
101 s -> 16 s, fuzz_compare_test 41 s -> 12 s). The examples drawn are the same either way:
each planted bug is caught at the same example number as with shrinking.

The planted run is seeded by the property's source and signature alone. For an unparametrized
property those are its own run's examples. For a parametrized one (`pytest.mark.parametrize`,
or a parametrized fixture), pytest's hypothesis plugin adds each parametrization's node id to
its own run's seed, so a planted run draws other examples than any of them, but the same ones
on every run, whichever parametrizations ran before it or were deselected.

A failure counts as the property catching the bug only when the property's own check raised
it. A plant that fails once and then behaves (hypothesis's Flaky: the failing example passed
when replayed) is refused, and so is an error raised while a plant was running (the plant's
own assert, or the subject's, under the plant: the property's check never ran). `match` names
the property's failure message and replaces that second rule where a property's check runs
inside a plant (a planted subject that the property drives) or a test plants a failure on
purpose.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import traceback
from collections.abc import Callable
from types import CodeType, FunctionType
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky, UnsatisfiedAssumption
from hypothesis.internal.conjecture import providers as _providers

ExceptionTypes = type[BaseException] | tuple[type[BaseException], ...]
# What hypothesis adds to a test's source and signature to seed a derandomized run; its pytest
# plugin sets it to the node id of each parametrization of a parametrized property.
ADD_DIGEST = "_hypothesis_internal_add_digest"
# Marks first_failure's own counting wrapper, so that a later call on the same monkeypatch
# does not take it for a plant.
_COUNTER = "_first_failure_counter"


def _pin_constant_pool() -> None:
    """Replace hypothesis's pool of constants collected from the imported modules' source with
    an empty one (module docstring). Private API, so its absence (another hypothesis than the
    lock's) fails at import instead of silently drawing from the process again."""
    collect = getattr(_providers, "_get_local_constants", None)
    if collect is None or not hasattr(_providers, "Constants"):
        raise ImportError(
            f"hypothesis {hypothesis.__version__} has no providers._get_local_constants: "
            "testing/fuzz.py's _pin_constant_pool needs updating for it (or use the version "
            "third_party/requirements_lock.txt pins)"
        )
    global _unpinned
    _unpinned = collect
    empty = _providers.Constants()
    _providers._get_local_constants = lambda: empty


_unpinned = None  # hypothesis's own collector, for the test that shows what the pin changes


_pin_constant_pool()


def fuzz_settings(max_examples: int) -> settings:
    """The settings of every fuzz test: derandomized, no database, no deadline, print_blob."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=max_examples,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


@dataclasses.dataclass(frozen=True)
class PlantedFailure:
    """How a property failed on a planted bug."""

    first: int  # the 1-based example that failed first
    calls: int  # every example run (shrinking included when asked; not those rejected by assume)
    errors: list[BaseException]  # what hypothesis raised: one failure, or each distinct one


def _code_of(value: Any, *, depth: int = 0) -> list[CodeType]:
    """The code objects a planted value runs: a function's, a method's, a staticmethod's or
    classmethod's, a functools.partial's function's; for a class, its own methods'."""
    if isinstance(value, type):
        if depth:
            return []
        return [code for item in vars(value).values() for code in _code_of(item, depth=1)]
    value = getattr(value, "__func__", value)  # bound methods, staticmethod, classmethod
    if isinstance(value, functools.partial):
        value = value.func
    code = getattr(value, "__code__", None)
    return [code] if isinstance(code, CodeType) else []


def _plants(monkeypatch: pytest.MonkeyPatch) -> dict[CodeType, str]:
    """The code each value set so far through `monkeypatch` (setattr, setitem) runs, by a
    name for messages. Read from the MonkeyPatch's undo lists (private; pytest 9.2)."""
    planted: dict[CodeType, str] = {}
    for owner, name, _ in monkeypatch._setattr:
        value = getattr(owner, name, None)
        if isinstance(value, FunctionType) and value.__dict__.get(_COUNTER):
            continue  # an earlier first_failure's counter on the same monkeypatch, no plant
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        planted.update(dict.fromkeys(_code_of(value), label))
    for mapping, key, _ in monkeypatch._setitem:
        planted.update(dict.fromkeys(_code_of(mapping.get(key)), f"[{key!r}]"))
    return planted


def _raised_in_plant(error: BaseException, planted: dict[CodeType, str]) -> str | None:
    """The plant (and its function) running where `error` was raised, or None."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code in planted:
            return f"{planted[frame.f_code]} ({frame.f_code.co_qualname})"
    return None


def first_failure(
    monkeypatch: pytest.MonkeyPatch,
    prop: Callable[..., None],
    *,
    match: str | None = None,
    expected: ExceptionTypes = AssertionError,
    unexpected: ExceptionTypes = (),
    shrink: bool = False,
    **kwargs: Any,
) -> PlantedFailure:
    """Run the hypothesis test `prop(**kwargs)` with a bug planted and assert that it fails.

    Every error hypothesis raises (the failure, or an ExceptionGroup of the distinct failures
    it found) must be an `expected` and not an `unexpected` instance. The failure must be the
    property's: a Flaky failure (the failing example passed when replayed) is refused; with
    `match`, the regex must be found in at least one error's message; without it, no error may
    be raised while a value planted through `monkeypatch` runs. Counts the examples through
    `prop.hypothesis.inner_test`; examples rejected by `assume` or a filter do not count, as
    they do not count towards `max_examples`. Prints and returns where the first failure came.
    """
    planted = _plants(monkeypatch)  # before this function's own setattrs below
    inner = prop.hypothesis.inner_test
    calls, first = 0, 0

    # wraps: hypothesis seeds a derandomized run from inner_test's source and signature (it
    # follows __wrapped__), so the planted run of an unparametrized property draws the same
    # examples as the property's own run.
    @functools.wraps(inner)
    def counting(*args: Any, **inner_kwargs: Any) -> None:
        nonlocal calls, first
        try:
            inner(*args, **inner_kwargs)
        except UnsatisfiedAssumption:
            raise
        except Exception:
            calls += 1
            first = first or calls
            raise
        calls += 1

    # wraps also copied inner's __dict__, and with it the digest hypothesis's pytest plugin
    # adds to a parametrized property's seed: the node id of whichever parametrization ran
    # last in this process (none under a -k that selects only the planted test), set on the
    # inner test all parametrizations share. Dropped, the planted run is seeded by the source
    # and signature alone: the same examples on every run, whatever ran before it.
    counting.__dict__.pop(ADD_DIGEST, None)
    setattr(counting, _COUNTER, True)
    monkeypatch.setattr(prop.hypothesis, "inner_test", counting)
    if not shrink:
        own = prop._hypothesis_internal_use_settings
        phases = tuple(p for p in own.phases if p is not Phase.shrink)
        monkeypatch.setattr(prop, "_hypothesis_internal_use_settings", settings(own, phases=phases))
    with pytest.raises(Exception) as caught:
        prop(**kwargs)
    raised = caught.value
    assert not isinstance(raised, Flaky), (
        f"{prop.__name__}: the plant is flaky, not caught: example {first} failed, then passed "
        f"when hypothesis ran it again ({type(raised).__name__}: {raised}); a planted bug must "
        "fail the same example every time"
    )
    errors = list(raised.exceptions) if isinstance(raised, ExceptionGroup) else [raised]
    assert all(isinstance(e, expected) and not isinstance(e, unexpected) for e in errors), errors
    if match is not None:
        assert any(re.search(match, str(e)) for e in errors), [str(e) for e in errors]
    else:
        for error in errors:
            plant = _raised_in_plant(error, planted)
            assert plant is None, (
                f"{prop.__name__}: {error!r} was raised inside the plant {plant}, not by the "
                "property's check: fix the plant, or pass match= naming the property's "
                "failure message if its check runs inside the plant"
            )
    assert first, f"{prop.__name__} raised {errors!r} but no example failed"
    record = PlantedFailure(first=first, calls=calls, errors=errors)
    print(
        f"{prop.__name__}: planted bug caught at example {record.first} "
        f"({record.calls} examples{' with shrinking' if shrink else ', not shrunk'})"
    )
    return record
