"""Is a golden worth comparing against? A golden of constant tokens, flat logits, exact ties or
near-ties everywhere would pass for almost any engine (upstream dropped tiny goldens for
exactly that)."""

from __future__ import annotations

from goldens.schema import Golden

MIN_DISTINCT_TOKENS = 3  # per case (of 10 greedy steps)
MAX_NEAR_TIE_SHARE = 0.1  # of all steps in a golden
MIN_LOGIT_STD = 0.1  # spread of the full logits at each step


def degeneracy_problems(golden: Golden, near_tie_margin: float) -> list[str]:
    """What makes `golden` useless as a regression check; empty when it discriminates."""
    problems = []
    # Recorded prompt positions are checked like steps: a tie there is as arbitrary.
    steps = [s for case in golden.cases for s in (*case.position_steps, *case.steps)]
    for case in golden.cases:
        distinct = len(set(case.token_ids))
        if distinct < min(MIN_DISTINCT_TOKENS, len(case.steps)):
            problems.append(f"case {case.id!r}: only {distinct} distinct tokens {case.token_ids}")
    ties = [(c.id, i) for c in golden.cases for i, s in enumerate(c.steps) if s.top_gap == 0.0]
    ties += [
        (c.id, f"prompt position {p}")
        for c in golden.cases
        for p, s in zip(c.positions, c.position_steps, strict=True)
        if s.top_gap == 0.0
    ]
    if ties:
        problems.append(
            f"{len(ties)} exact top-1 ties (gap 0.0) at {ties}: the greedy token there is "
            "arbitrary; compute the logits in float32 or choose other prompts"
        )
    near_ties = [s for s in steps if s.top_gap < near_tie_margin]
    if len(near_ties) > MAX_NEAR_TIE_SHARE * len(steps):
        problems.append(
            f"{len(near_ties)}/{len(steps)} steps and prompt positions are near-ties "
            f"(gap < {near_tie_margin:g}); "
            f"at most {MAX_NEAR_TIE_SHARE:.0%} allowed"
        )
    flat = [s for s in steps if s.stats["std"] < MIN_LOGIT_STD]
    if flat:
        problems.append(f"{len(flat)}/{len(steps)} steps have logit std < {MIN_LOGIT_STD}")
    return problems
