"""The speculative golden lane can fail: each planted verification bug fails a golden.

Run by //max_tests/integration/architectures/llama3:test_llama_speculative beside test_llama.py
(every short case through K + 1-row verification forwards). What a teacher-forced lane can see
is the verification forward itself: rejection (a rejected proposal's KV left in use, a tie
accepted) never happens when every proposal is the forced token; the free-running parity of
pipelines/llama3/tests/test_speculative.py holds those.
"""

from __future__ import annotations

import pytest

from goldens.tolerances import tolerance
from harness.llama3 import engine_runs, judge
from harness.llama3.variants import variants
from pipelines.llama3 import speculative
from pipelines.llama3.speculative import Speculation

K = 8  # the lane's largest


def _rows_off_by_one(rows, j):
    return rows[min(j + 1, rows.shape[0] - 1)]


SPECULATION_MUTATIONS = {
    "verification rows off by one": ("verification_row", _rows_off_by_one),
    "verification block one position late": ("block_start", lambda position: position + 1),
}


@pytest.mark.parametrize("name", SPECULATION_MUTATIONS)
def test_a_speculation_bug_fails_the_goldens(name, goldens, monkeypatch) -> None:
    """On the tiny float32 file in the eager mode, K = 8: the own golden's short cases FAIL."""
    (variant,) = [v for v in variants("tinyllama") if v.encoding == "float32"]
    golden, source = goldens.load("own", variant)
    engine = engine_runs.Speculating(engine_runs.load_engine(variant), Speculation(k=K))
    attribute, replacement = SPECULATION_MUTATIONS[name]
    monkeypatch.setattr(speculative, attribute, replacement)
    tol = tolerance("own", variant.encoding, "cpu")
    verdict = judge.check(engine, golden, source, "own", tol, variant, lane="short")
    print(f"{name}: {verdict.summary()}")
    assert verdict.failures, f"{name} passes the goldens: {verdict.summary()}"
