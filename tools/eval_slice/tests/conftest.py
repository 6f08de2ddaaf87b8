"""The eval slice's checkpoint family and golden, as Bazel provides them (plain pytest: the
family written to the cache folder, the golden from $EVAL_SLICE_GOLDEN)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipelines.checkpoints import smollm2_gguf
from tools.eval_slice import checkpoints, eval_slice

FAMILY_ENV = "EVAL_SLICE_FAMILY"  # the derived members' paths (the Bazel action's outputs)
GOLDEN_ENV = "EVAL_SLICE_GOLDEN"  # the golden archive's files
GOLDEN_FILE = "eval_slice_golden.json"
CHUNKS = 2  # the golden's slice: 2 chunks of 512 tokens, 510 tokens scored


@pytest.fixture(scope="session")
def family() -> dict[str, Path]:
    source = smollm2_gguf()
    own = checkpoints.source_name(source)
    if os.environ.get(FAMILY_ENV):
        folder = Path(os.environ[FAMILY_ENV].split()[0]).parent  # runfiles: relative to the cwd
        stem = source.name.split(".")[0]
        members = {name: folder / f"{stem}.{name}.gguf" for name in checkpoints.MEMBERS}
    else:
        members = checkpoints.family(source, eval_slice.default_cache() / "tests", skip=own)
    members[own] = source
    return members


@pytest.fixture(scope="session")
def golden() -> dict:
    if not os.environ.get(GOLDEN_ENV):
        pytest.fail(
            f"${GOLDEN_ENV} names no golden: run under Bazel (//tools/eval_slice:eval_slice_test), "
            "or extract the pinned one (python3 -m tools.artifacts.upload_artifact fetch "
            f"eval_slice_golden --output-dir=DIR) and set {GOLDEN_ENV}=DIR/{GOLDEN_FILE}"
        )
    (path,) = [p for p in os.environ[GOLDEN_ENV].split() if Path(p).name == GOLDEN_FILE]
    return json.loads(Path(path).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def text() -> str:
    return eval_slice.TEXT.read_text(encoding="utf-8")
