"""Fixtures of the llama3 golden tests.

`testdata_directory` (env PIPELINES_TESTDATA) is the folder with the tiny checkpoints; Bazel's
BUILD sets it, plain pytest falls back to the testdata folder of this checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from goldens import locate, schema
from harness.llama3 import golden_files
from harness.llama3.variants import Variant
from harness.llama3.variants import testdata_directory as _testdata

# Set by .bazelrc for every bazel test: a missing golden fails instead of skipping.
GOLDENS_REQUIRED_ENV = "GOLDENS_REQUIRED"


@pytest.fixture(scope="session")
def testdata_directory() -> Path:
    return _testdata().resolve()


class GoldenStore:
    """Finds goldens; a missing one skips with the command that makes it (fails under CI)."""

    def __init__(self, testdata: Path) -> None:
        self.testdata = testdata

    def find(
        self, reference: str, variant: Variant, hardware: str = "all"
    ) -> tuple[schema.Golden, golden_files.GoldenSource] | None:
        return golden_files.find_golden(reference, variant, self.testdata, hardware)

    def load(
        self, reference: str, variant: Variant, hardware: str = "all", device: str = "cpu"
    ) -> tuple[schema.Golden, golden_files.GoldenSource]:
        """The golden, or a skip naming the command that makes it (a failure under CI)."""
        found = self.find(reference, variant, hardware)
        if found is not None:
            return found
        name = golden_files.golden_file_name(reference, variant, hardware)
        searched = "; ".join(s.description for s in locate.golden_sources(reference, self.testdata))
        command = golden_files.regenerate_command(variant, reference, device)
        message = (
            f"missing golden {name} (searched: {searched}). Make it with:\n  {command}\n"
            "then publish it: tools/upload-public-bazel-artifact.sh (testdata/README.md)"
        )
        if os.environ.get(GOLDENS_REQUIRED_ENV) == "1":
            pytest.fail(message + f"\n(${GOLDENS_REQUIRED_ENV}=1: a missing golden fails)")
        pytest.skip(message)


@pytest.fixture(scope="session")
def goldens(testdata_directory: Path) -> GoldenStore:
    return GoldenStore(testdata_directory)
