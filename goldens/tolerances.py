"""Tolerances, read from tolerances.yaml: one entry per reference x encoding x column (a
device of this engine: cpu, cuda, cuda_fallback; or another engine: llama_cpp, external)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import yaml

TOLERANCES_FILE = Path(__file__).with_name("tolerances.yaml")
REFERENCES = ("own", "torch")
# References of one execution mode's own goldens (the ggml mode's), judged only where named:
# entries() leaves them out unless asked, as the code-mutation matrix runs the eager engine.
MODE_REFERENCES = ("ggml",)
FLOORS = ("noise_floor", "isa_noise_floor", "mutation_floor")
CASES = ("all", "short")  # an entry's `cases`


@dataclasses.dataclass(frozen=True)
class Floor:
    """A measurement behind a threshold: the largest step of two correct runs (noise), or the
    smallest of the mutations' largest steps (what a real bug moves)."""

    logprob: float  # max |Δ log-prob| over the golden top-k, worst step
    kl: float  # KL(golden || run), worst step
    measured: str  # what was compared, so the number can be measured again


@dataclasses.dataclass(frozen=True)
class Tolerance:
    key: str  # "own/float32/cpu": where in tolerances.yaml this came from
    logprob_atol: float
    kl_max: float
    topk_overlap_min: float
    near_tie_margin: float
    why: str
    noise_floor: Floor | None = None
    # the noise across the kernel levels of one CPU (calibrate_tolerances --kernel-levels)
    isa_noise_floor: Floor | None = None
    mutation_floor: Floor | None = None
    # which cases the entry judges: "all", or "short" where its `why` measures the long
    # cases off by design (the restriction lives in the reviewed entry, not in a test)
    cases: str = "all"
    # the thresholds for the long cases where they differ (an entry's `long`: the fields it
    # names over the entry's own, key `.../long`); None: the entry judges them as the rest
    long: Tolerance | None = None

    def for_case(self, long: bool) -> Tolerance:
        """The thresholds a case is judged by: the long cases' where the entry has them."""
        return self.long if long and self.long is not None else self

    @property
    def reference(self) -> str:
        """`own` or `torch`: which goldens this entry compares against."""
        return self.key.split("/")[0]

    @property
    def encoding(self) -> str:
        return self.key.split("/")[1]


class NotJudged(KeyError):
    """An engine x encoding whose numerics differ from the goldens' by design: the entry
    records the measured distance and why, and nothing is judged against it."""

    def __str__(self) -> str:
        return str(self.args[0])


@functools.cache
def _table(path: Path = TOLERANCES_FILE) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def tolerance(reference: str, encoding: str, device: str, fallback: bool = False) -> Tolerance:
    """The entry for reference x encoding x device (`cuda_fallback` when `fallback`)."""
    column = f"{device}_fallback" if fallback else device
    key = f"{reference}/{encoding}/{column}"
    try:
        entry = _table()[reference][encoding][column]
    except KeyError:
        raise KeyError(
            f"no tolerance {key} in {TOLERANCES_FILE.name}; add an entry with a measured why"
        ) from None
    entry = dict(entry)
    if entry.pop("judged", True) is False:
        measured = entry.get("measured", {})
        raise NotJudged(
            f"{key} is not judged: {' '.join(entry.get('why', '').split())} (measured: max "
            f"|Δ log-prob| {measured.get('logprob')}, KL {measured.get('kl')})"
        )
    long = entry.pop("long", None)
    floors = {f: Floor(**entry.pop(f)) for f in FLOORS if f in entry}
    if entry.get("cases", "all") not in CASES:
        raise ValueError(
            f"{key}: cases {entry['cases']!r} is not one of {', '.join(CASES)} "
            f"({TOLERANCES_FILE.name})"
        )
    judged = Tolerance(key=key, **entry, **floors)
    if long is None:
        return judged
    long = dict(long)
    long_floors = {f: Floor(**long.pop(f)) for f in FLOORS if f in long}
    return dataclasses.replace(
        judged, long=dataclasses.replace(judged, key=f"{key}/long", **long, **long_floors)
    )


def judged_lane(lane: str, tolerance: Tolerance) -> str:
    """The cases judged when `lane` ("all", "short", "long") is asked of `tolerance`: its own
    `cases` where it judges fewer; a lane with none of its cases is an error naming both."""
    if tolerance.cases == "all" or lane == tolerance.cases:
        return lane
    if lane == "all":
        return tolerance.cases
    raise ValueError(
        f"{tolerance.key} judges the {tolerance.cases} cases only (its why in "
        f"{TOLERANCES_FILE.name}); the {lane} lane has none of them"
    )


def entries(reference: str | None = None, encoding: str | None = None) -> list[Tolerance]:
    """Every entry in tolerances.yaml (`cuda_fallback` columns included), optionally only
    those of one reference and/or encoding."""
    return [
        tolerance(ref, enc, column.removesuffix("_fallback"), column.endswith("_fallback"))
        for ref in (REFERENCES if reference is None else (reference,))
        for enc, columns in _table()[ref].items()
        if encoding in (None, enc)
        for column, entry in columns.items()
        if entry.get("judged", True)
    ]
