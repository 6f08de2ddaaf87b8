"""Tolerances, read from tolerances.yaml: one entry per reference x encoding x device."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import yaml

TOLERANCES_FILE = Path(__file__).with_name("tolerances.yaml")
REFERENCES = ("own", "torch")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    key: str  # "own/float32/cpu": where in tolerances.yaml this came from
    atol: float
    rtol: float
    kl_max: float
    topk_overlap_min: float
    near_tie_margin: float
    why: str


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
    return Tolerance(key=key, **entry)
