"""Every published golden discriminates (max_tests/goldens/sanity.py says what that means)."""

from __future__ import annotations

import pytest

from max_tests.goldens.sanity import degeneracy_problems
from max_tests.goldens.tolerances import tolerance
from max_tests.integration.architectures.llama3.variants import Variant, variants

VARIANTS = [v for v in variants() if v.path is not None]


@pytest.mark.parametrize("reference", ["own", "torch"])
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.test_id for v in VARIANTS])
def test_golden_is_not_degenerate(variant: Variant, reference: str, goldens) -> None:
    golden, name = goldens.load(reference, variant)
    margin = tolerance(reference, variant.encoding, "cpu").near_tie_margin
    problems = degeneracy_problems(golden, margin)
    assert not problems, f"degenerate golden {name}:\n  " + "\n  ".join(problems)
