"""The sampler's own proof (pipelines/llama3/sampling.py).

- Philox4x32-10 gives Random123's known-answer vectors.
- The processed distribution equals an independent reference (plain Python over lists, both
  chain orders written out in REFERENCE_CHAINS, not read from sampling.CHAINS) on a table of
  cases that puts each step at its edge: ties at the top-k boundary, a top-p boundary (off
  exact mass ties: test_the_top_p_cases_lie_off_mass_ties; the engine's rule at an exact tie
  has its own test), min-p below a flat top, penalties, extreme temperatures, and a row where
  min-p before or after top-p keeps other tokens (each order's top-p/min-p swap fails).
- Draws: for each case, DRAWS tokens drawn by the engine's sampler (seed SEED, positions
  0 .. DRAWS-1) are tested against the reference probabilities by a G-test at ALPHA = 1e-6.
  The unmutated sampler passes every case; the chance that it fails one is at most
  len(CASES) x ALPHA = 1.4e-5 over seeds (the seed is fixed, so the run replays exactly).
  Each planted sampler bug (MUTATIONS) fails at least one case; the test prints, per bug, the
  case that catches it and the G-test's power there at ALPHA (noncentral chi-square with
  lambda = 2 DRAWS KL(mutated || reference), normal approximation), and asserts power >= 0.999.
  The bugs live in sampler_mutations.py, shared with the sampling goldens' lane.
- The draw rule and the kept-set rule (sampling.compare_draws, compare_kept): seeded steps
  with logits within a tolerance never FAIL (AMBIGUOUS and BOUNDARY counted), and each planted
  rule-breaker (another uniform, ranking-order draws, logits past the tolerance, bounds too
  narrow, a top-p keeping one token more) FAILs; a common shift of the logits FAILs only under
  a repetition penalty (the tolerance's premise, sampling's module docstring).
- Refused: settings out of range (a temperature under sampling.TEMPERATURE_MIN, presence and
  frequency penalties past ADDITIVE_PENALTY_RANGE, seeds outside [0, 2**64)) and rows with a
  NaN or +inf logit, which drew token 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from goldens import multinomial
from goldens.multinomial import chi2_sf
from pipelines.llama3 import generate, sampling
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.tests.sampler_mutations import MUTATIONS

ALPHA = 1e-6
DRAWS = 20_000
SEED = 20261202


def test_philox_gives_random123s_known_answers() -> None:
    vectors = [
        ((0, 0, 0, 0), (0, 0), "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, "408f276d 41c83b0e a20bc7c6 6d5451fd"),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            "d16cfe09 94fdcceb 5001e420 24126ea1",
        ),
    ]
    for counter, key, expected in vectors:
        got = " ".join(f"{int(w):08x}" for w in sampling.philox4x32(counter, key))
        assert got == expected


def test_the_uniforms_depend_on_the_seed_and_the_position_only() -> None:
    u = sampling.uniform(7, np.arange(1000))
    assert u.min() >= 0 and u.max() < 1 and len(set(u.tolist())) == 1000
    assert sampling.uniform(7, 123) == u[123]  # a scalar at a position is the array's entry
    assert not np.array_equal(sampling.uniform(8, np.arange(1000)), u)


def test_the_uniforms_use_all_64_bits_of_the_seed() -> None:
    """Planted: a key of the seed's low 32 bits (seed & 0xFFFFFFFF) drew these equal; and a
    known answer at the largest seed and a position past 2**32 (pinned from this code)."""
    for seed in (0, 1, 12345, 2**32 - 1, 2**63):
        for position in (0, 5, 2**33 + 1):
            assert sampling.uniform(seed, position) != sampling.uniform(seed + 2**32, position)
    assert float(sampling.uniform(2**64 - 1, 2**40)) == 0.9599552145480266


# --- an independent reference: plain Python over lists ------------------------------------


# The chains' orders, written here apart from sampling.CHAINS (the engine's table), so that an
# order edited there fails against this reference instead of moving with it.
REFERENCE_CHAINS = {
    "transformers": ("temperature", "top_k", "top_p", "min_p"),
    "llama_cpp": ("top_k", "top_p", "min_p", "temperature"),
}


def _reference(logits: list[float], s: SamplerSettings, history: list[int]) -> dict[int, float]:
    values = [float(v) for v in logits]
    counts = {t: history.count(t) for t in set(history)}
    for t, n in counts.items():
        v = values[t]
        if s.repetition_penalty != 1.0:
            v = v / s.repetition_penalty if v > 0 else v * s.repetition_penalty
        values[t] = v - s.presence_penalty - s.frequency_penalty * n
    kept = sorted(range(len(values)), key=lambda t: (-values[t], t))
    scale = {t: 1.0 for t in kept}

    def probs(tokens):
        top = max(values[t] / scale[t] for t in tokens)
        weights = {t: math.exp(values[t] / scale[t] - top) for t in tokens}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    def step(name, tokens):
        if name == "temperature":
            for t in tokens:
                scale[t] = s.temperature
            return tokens
        if name == "top_k":
            return tokens[: s.top_k] if s.top_k else tokens
        p = probs(tokens)
        if name == "top_p":
            out, mass = [], 0.0
            for t in tokens:
                if out and mass >= s.top_p:
                    break
                out.append(t)
                mass += p[t]
            return out if s.top_p < 1 else tokens
        best = max(p.values())
        return [t for t in tokens if p[t] >= s.min_p * best] if s.min_p > 0 else tokens

    for name in REFERENCE_CHAINS[s.order]:
        kept = step(name, kept)
    return probs(kept)


def _logits(probs: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else -30.0 for p in probs]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    logits: list[float]
    settings: SamplerSettings
    history: list[int] = dataclasses.field(default_factory=list)


# No ranked prefix of FLAT's mass lies within 0.02 of a case's top_p, tempered or not, after
# top-k or not (test_the_top_p_cases_lie_off_mass_ties): each planted bug is caught by what it
# does, not by how float64 rounds a sum equal to top_p (0.3 + 0.25 + 0.15 + 0.1 against 0.8).
FLAT = _logits([0.31, 0.255, 0.165, 0.105, 0.07, 0.04, 0.03, 0.015, 0.007, 0.003])
# min-p 0.2 before top-p 0.7 keeps 4 tokens (0.4 .. 0.09) whose renormalized mass reaches 0.7
# at two; after it, top-p keeps 3 (the mass above the 4th is 0.76) and min-p all three.
MIN_P_ROW = _logits([0.4, 0.25, 0.11, 0.09, 0.03, 0.03, 0.03, 0.03, 0.03])
CASES = [
    Case("top_k tie", _logits([0.4, 0.3, 0.3, 0.0]), SamplerSettings(top_k=2)),
    Case("top_p edge", FLAT, SamplerSettings(temperature=0.7, top_p=0.6)),
    Case("top_p hot", FLAT, SamplerSettings(temperature=2.0, top_p=0.8)),
    Case("min_p flat", FLAT, SamplerSettings(min_p=0.2)),
    Case(
        "penalties",
        FLAT,
        SamplerSettings(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
        [0, 0, 1, 5],
    ),
    Case(
        "penalties + positive",
        [2.0, 1.5, 1.0, -0.5, 0.3],
        SamplerSettings(repetition_penalty=2.0),
        [0, 3],
    ),
    Case(
        "llama_cpp chain",
        FLAT,
        SamplerSettings(temperature=2.0, top_k=6, top_p=0.7, min_p=0.1, order="llama_cpp"),
    ),
    Case(
        "transformers chain",
        FLAT,
        SamplerSettings(temperature=2.0, top_k=6, top_p=0.7, min_p=0.1),
    ),
    Case("cold", FLAT, SamplerSettings(temperature=0.01)),
    Case("hot", FLAT, SamplerSettings(temperature=2.0)),
    Case("top_p 0.05", FLAT, SamplerSettings(top_p=0.05)),
    Case("top_k 1", FLAT, SamplerSettings(top_k=1, temperature=2.0)),
    Case("transformers min_p after top_p", MIN_P_ROW, SamplerSettings(top_p=0.7, min_p=0.2)),
    Case(
        "llama_cpp min_p after top_p",
        MIN_P_ROW,
        SamplerSettings(temperature=2.0, top_p=0.7, min_p=0.2, order="llama_cpp"),
    ),
]


def _expected(case: Case) -> dict[int, float]:
    return _reference(case.logits, case.settings, case.history)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_processed_distribution_is_the_references(case: Case) -> None:
    ids, probs = sampling.processed(np.array(case.logits), case.settings, case.history)
    expected = _expected(case)
    assert set(ids.tolist()) == set(expected), (ids, expected)
    for t, p in zip(ids.tolist(), probs.tolist(), strict=True):
        assert abs(p - expected[t]) < 1e-12, (t, p, expected[t])


def _is_the_references(case: Case) -> bool:
    ids, probs = sampling.processed(np.array(case.logits), case.settings, case.history)
    expected = _expected(case)
    return set(ids.tolist()) == set(expected) and all(
        abs(p - expected[t]) < 1e-12 for t, p in zip(ids.tolist(), probs.tolist(), strict=True)
    )


# Planted: orders edited in the engine's table (sampling.CHAINS), each of which some case above
# sees (a reference that read the table moved with it: the first passed).
EDITED_ORDERS = {
    "transformers: min-p before top-p": (
        "transformers",
        ("temperature", "top_k", "min_p", "top_p"),
    ),
    "llama_cpp: min-p before top-p": ("llama_cpp", ("top_k", "min_p", "top_p", "temperature")),
    "transformers: temperature after top-p": (
        "transformers",
        ("top_k", "top_p", "temperature", "min_p"),
    ),
    "llama_cpp: temperature first": ("llama_cpp", ("temperature", "top_k", "top_p", "min_p")),
}


@pytest.mark.parametrize("plant", EDITED_ORDERS)
def test_an_order_edited_in_the_engines_table_is_not_the_references(plant, monkeypatch) -> None:
    order, chain = EDITED_ORDERS[plant]
    monkeypatch.setattr(sampling, "CHAINS", {**sampling.CHAINS, order: chain})
    assert [c.name for c in CASES if not _is_the_references(c)], plant


def test_the_top_p_cases_lie_off_mass_ties() -> None:
    """Each top-p case's threshold lies 0.02 or more from every ranked prefix's mass, in each
    arrangement a planted order could give it: tempered or not, after top-k and min-p or not."""
    for case in (c for c in CASES if c.settings.top_p < 1.0):
        s = case.settings
        assert not case.history  # no penalties to apply first
        for t, k, m in itertools.product({1.0, s.temperature}, {0, s.top_k}, {0.0, s.min_p}):
            ranked = sorted((v / t for v in case.logits), reverse=True)[: k or None]
            weights = [math.exp(v - ranked[0]) for v in ranked]
            weights = [w for w in weights if w >= m]  # the top one's weight is 1
            masses = itertools.accumulate(w / sum(weights) for w in weights[:-1])
            assert min((abs(mass - s.top_p) for mass in masses), default=1.0) >= 0.02, (
                case.name,
                (t, k, m),
            )


def test_top_p_at_an_exact_tie_keeps_the_prefix_that_reaches_it() -> None:
    """The engine's rule where a ranked prefix's mass equals top_p exactly (equal logits: exact
    quarters and eighths): that prefix is enough, the next token is not kept (the mass above
    it, cumsum - probs, equals top_p: not below it). The reference agrees. Another rule would
    change the sampling goldens (sampling.top_p's docstring)."""
    for n, p, kept in ((4, 0.5, 2), (4, 0.75, 3), (8, 0.375, 3), (8, 0.125, 1), (4, 0.25, 1)):
        ids, _ = sampling.processed(np.zeros(n), SamplerSettings(top_p=p))
        assert ids.tolist() == list(range(kept)), (n, p, ids)
        reference = _reference([0.0] * n, SamplerSettings(top_p=p), [])
        assert sorted(reference) == list(range(kept)), (n, p, reference)


def test_min_p_keeps_a_token_at_exactly_min_p_times_the_most_likely() -> None:
    """min_p keeps the tokens whose probability is at least min_p times the most likely one's:
    at exactly that ratio both are kept. The ratio is found on this machine (its exp's last
    bit may differ on another CPU): the float64 min_p near p1 / p0 whose product with p0 is
    p1 exactly. Planted, a strict comparison (`>`): the second dropped, and no other test saw
    it (a mutation sweep's survivor)."""
    logits = np.array([np.log(2.0), 0.0])
    probs = sampling._softmax(logits)
    ratio = probs[1] / probs[0]
    candidates = [ratio, *(np.nextafter(ratio, edge) for edge in (0.0, 1.0))]
    exact = [m for m in candidates if m * probs[0] == probs[1]]
    assert exact, (probs, candidates)  # the boundary, exactly
    ids, _ = sampling.processed(logits, SamplerSettings(min_p=float(exact[0])))
    assert sorted(ids.tolist()) == [0, 1]


def test_the_edges_named_by_peers_bugs() -> None:
    tie = np.log([0.4, 0.3, 0.3])
    ids, _ = sampling.processed(tie, SamplerSettings(top_k=2))
    assert ids.tolist() == [0, 1]  # the tie at the k-th logit broken by id, not over-accepted
    ids, _ = sampling.processed(tie, SamplerSettings(top_k=2, top_p=0.05))
    assert ids.tolist() == [0]  # top-k then top-p never masks every token
    # The two orders give different distributions for the same settings (temperature first
    # or last): what a user comparing llama.cpp with transformers must choose between.
    settings = {"temperature": 2.0, "top_p": 0.7}
    a = sampling.processed(np.array(FLAT), SamplerSettings(**settings))
    b = sampling.processed(np.array(FLAT), SamplerSettings(**settings, order="llama_cpp"))
    assert len(a[0]) != len(b[0])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 0.0, "temperature=0.0 must be > 0"),
        ("top_k", -1, "top_k=-1 must be >= 0"),
        ("top_p", 0.0, "top_p=0.0 must lie in (0, 1]"),
        ("min_p", 1.0, "min_p=1.0 must lie in [0, 1)"),
        ("order", "vllm", "order='vllm' is not one of transformers, llama_cpp"),
        ("seed", -1, "seed=-1 must lie in [0, 2**64)"),
        ("seed", 2**64, "seed=18446744073709551616 must lie in [0, 2**64)"),
        ("temperature", 1e-4, "temperature=0.0001 must be >= 0.001"),
        ("temperature", 1e-308, "temperature=1e-308 must be >= 0.001"),
        ("temperature", 1e-320, "temperature=1e-320 must be >= 0.001"),
        ("presence_penalty", -1e308, "presence_penalty=-1e+308 must lie in [-1000, 1000]"),
        ("presence_penalty", 1000.5, "presence_penalty=1000.5 must lie in [-1000, 1000]"),
        ("frequency_penalty", -1e308, "frequency_penalty=-1e+308 must lie in [-1000, 1000]"),
        ("frequency_penalty", 1e4, "frequency_penalty=10000.0 must lie in [-1000, 1000]"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field, value, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplerSettings(**{field: value})


def test_the_settings_ranges_edges_are_accepted_and_draw_finite_distributions() -> None:
    """The smallest temperature draws the argmax, even of float32's largest logits after the
    largest penalties (where 1e-308 drew token 0: NaN probabilities); the additive penalties'
    bounds on a token seen a thousand times stay finite (-1e308 seen twice made a logit inf)."""
    SamplerSettings(seed=0), SamplerSettings(seed=2**64 - 1)
    row = torch.tensor([0.1, 3.0, 2.0, -1.0])
    for extra in ({}, {"min_p": 0.1}, {"top_p": 0.5}, {"top_k": 3}):
        settings = SamplerSettings(temperature=sampling.TEMPERATURE_MIN, **extra)
        assert [sampling.sample(row, settings, seed, [], 0) for seed in range(5)] == [1] * 5
    huge = torch.tensor([-3.4e38, 3.4e38, 3.3e38, 0.0])
    settings = SamplerSettings(
        temperature=1e-3, repetition_penalty=1e-3, presence_penalty=-1e3, frequency_penalty=-1e3
    )
    ids, probs = sampling.processed(huge, settings, [0, 1, 2] * 1000)
    assert np.isfinite(probs).all() and int(ids[np.argmax(probs)]) == 1
    for penalty in (-1e3, 1e3):
        settings = SamplerSettings(presence_penalty=penalty, frequency_penalty=penalty)
        ids, probs = sampling.processed(row, settings, [2] * 1000)
        assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
        assert probs[ids.tolist().index(2)] == (1.0 if penalty < 0 else 0.0)


NOT_DRAWABLE = {
    "a NaN logit": ([0.1, 3.0, math.nan, -1.0], "a logit is NaN or \\+inf"),
    "a +inf logit": ([0.1, 3.0, math.inf, -1.0], "a logit is NaN or \\+inf"),
    "NaN last": ([0.1, 3.0, 2.0, math.nan], "a logit is NaN or \\+inf"),
    "every logit -inf": ([-math.inf] * 4, "every logit is -inf"),
}


@pytest.mark.parametrize("row", NOT_DRAWABLE)
@pytest.mark.parametrize(
    "settings",
    [
        SamplerSettings(),
        SamplerSettings(top_k=2),
        SamplerSettings(top_p=0.5),
        SamplerSettings(min_p=0.1),
        SamplerSettings(order="llama_cpp", top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "llama_cpp chain"],
)
def test_a_row_without_a_finite_top_logit_is_refused(row, settings) -> None:
    """NaN or +inf anywhere drew token 0 (or, with min-p, raised numpy's zero-size error; with
    top-k a NaN outside the candidates was ignored): a clear ValueError instead, from the
    draw and from the kept-set bounds alike. A -inf logit alone is a masked token."""
    values, message = NOT_DRAWABLE[row]
    logits = torch.tensor(values, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"the step's logits are not drawable: {message}"):
        sampling.sample(logits, settings, 1, [0], 1)
    with pytest.raises(ValueError, match="not drawable"):
        sampling.kept_bounds(logits, settings, [0], 0.01)
    masked = torch.tensor([0.1, 3.0, -math.inf, -1.0])
    assert sampling.sample(masked, settings, 1, [0], 1) in {0, 1, 3}


def test_logits_that_overflow_under_the_temperature_are_refused() -> None:
    """The last guard: float64 logits beyond float32's range, divided by the temperature,
    overflow to inf (no setting can prevent that): refused, not drawn as token 0."""
    logits = np.array([1e306, 2e306, 0.0])
    with (
        np.errstate(over="ignore", invalid="ignore"),
        pytest.raises(ValueError, match="the processed probabilities are not finite"),
    ):
        sampling.processed(logits, SamplerSettings(temperature=1e-3))


# --- draws against the reference: the G-test and the planted bugs ---------------------------


def test_the_chi_square_tail_is_right() -> None:
    # textbook quantiles: chi2(1) 3.841 -> 0.05; chi2(5) 11.07 -> 0.05; chi2(2) x -> exp(-x/2)
    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(11.070498, 5) - 0.05) < 1e-6
    assert abs(chi2_sf(40.0, 2) - math.exp(-20.0)) < 1e-18


def _draws(case: Case) -> np.ndarray:
    ids, probs = sampling.processed(np.array(case.logits), case.settings, case.history)
    return sampling.pick(ids, probs, sampling.uniform(SEED, np.arange(DRAWS)))


def g_test(case: Case) -> float:
    """The G-test's p-value of the sampler's DRAWS draws against the reference."""
    return multinomial.g_test(_draws(case).tolist(), _expected(case))


def power(case: Case) -> float:
    """The G-test's power at ALPHA against the (mutated) sampler's distribution of `case`."""
    ids, probs = sampling.processed(np.array(case.logits), case.settings, case.history)
    mutated = dict(zip(ids.tolist(), probs.tolist(), strict=True))
    return multinomial.power(mutated, _expected(case), DRAWS, ALPHA)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_sampler_passes_the_g_test(case: Case) -> None:
    assert g_test(case) > ALPHA


def test_every_planted_sampler_bug_fails_the_g_test(monkeypatch, capsys) -> None:
    lines, missed = [], []
    for name, (attribute, replacement) in MUTATIONS.items():
        with monkeypatch.context() as patch:
            patch.setattr(sampling, attribute, replacement)
            caught = [(c, g_test(c)) for c in CASES]
            caught = [(c, p) for c, p in caught if p <= ALPHA]
            if not caught:
                missed.append(name)
                lines.append(f"  {name:<32} PASS (missed)")
                continue
            case, p_value = caught[0]
            case_power = power(case)
            lines.append(
                f"  {name:<32} FAIL on {case.name!r} (p = {p_value:.2g}; power {case_power:.6f})"
            )
            assert case_power >= 0.999, f"{name}: power {case_power} on {case.name}"
    with capsys.disabled():
        print(
            f"\nsampler mutations, G-test at alpha {ALPHA:g}, {DRAWS} draws per case, "
            f"{len(CASES)} cases:\n" + "\n".join(lines)
        )
    assert not missed, f"planted bugs no case catches: {missed}"


TESTDATA = Path(
    os.environ.get("PIPELINES_TESTDATA", "max_tests/integration/architectures/llama3/testdata")
)


def test_generate_samples_under_a_seed_and_refuses_sampler_flags_without_temperature(
    capsys,
) -> None:
    common = ["--gguf", str(TESTDATA / "tiny_llama.gguf"), "--prompt", "Hi", "--max-new-tokens"]
    sampled = [*common, "6", "--temperature", "1.0", "--top-p", "0.9", "--seed", "3"]
    texts = []
    for argv in (sampled, sampled, [*sampled[:-1], "4"], [*common, "6"]):
        assert generate.main(argv) == 0
        texts.append(capsys.readouterr().out.split(" prompt tokens at")[0])
    assert texts[0] == texts[1]  # the same seed: the same text
    assert texts[0] != texts[2] and texts[0] != texts[3]  # another seed; greedy
    with pytest.raises(SystemExit) as refused:
        generate.main([*common, "6", "--top-k", "5"])
    assert refused.value.code == 2
    assert "--top-k sample: give --temperature too" in capsys.readouterr().err


# --- the draw rule (sampling.compare_draws): near-equal distributions, the same uniform ------
#
# A run whose log-probabilities lie within ATOL of the reference's (and that keeps the same
# tokens) draws differently only where the uniform lies within TV of a boundary: the rule
# calls those AMBIGUOUS and never FAILs a correct draw (a theorem of the id-order draw, in the
# module docstring; checked here on TRIALS seeded steps). Planted: a run that draws at the
# next position's uniform, one that walks the kept tokens in ranking order, one whose logits
# lie 30 times further than ATOL: each FAILs at half the steps or more (the counts are
# printed: the first two at about 83% of the steps, every step where the draws differ; the
# TV check sees far logits at a share that grows with the distance, 44% at 10 x ATOL, the
# margin being the worst case of ATOL; the lanes' logit checks judge the logits themselves).

ATOL = 0.01  # large, so that ambiguous draws happen often enough to be seen
TRIALS = 3000
RULE_SETTINGS = [
    SamplerSettings(temperature=0.7),
    SamplerSettings(temperature=1.5, repetition_penalty=1.3),
    SamplerSettings(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2),
]


def _ranked_order_pick(ids, probs, u):
    """Planted: the draw walks the kept tokens in ranking order, not id order."""
    order = np.lexsort((ids, -probs))
    ids, cdf = ids[order], np.cumsum(probs[order])
    return ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(ids) - 1)]


def _rule_counts(
    scale: float = 1.0,
    run_pick=None,
    run_position: int = 0,
    shift: float = 0.0,
    rule_settings: list[SamplerSettings] = RULE_SETTINGS,
    trials: int = TRIALS,
) -> dict[str, int]:
    """The draw rule's verdicts over `trials` seeded steps: a prompt of 5 random tokens, the
    reference's logits N(0, 2) over 64 ids, the run's raw logits within scale x ATOL / 2 of
    them (so log-probabilities within scale x ATOL), then all moved by `shift`."""
    rng = np.random.default_rng(SEED)
    counts = {"equal": 0, "AMBIGUOUS": 0, "FAIL": 0}
    for trial in range(trials):
        settings = rule_settings[trial % len(rule_settings)]
        prompt = rng.integers(0, 64, size=5).tolist()
        logits = rng.normal(0.0, 2.0, size=64)
        nudged = logits + rng.uniform(-scale * ATOL / 2, scale * ATOL / 2, size=64) + shift
        seed = trial
        position = len(prompt)
        p = sampling.processed(logits, settings, prompt)
        q = sampling.processed(nudged, settings, prompt)
        a = int(sampling.pick(*p, sampling.uniform(seed, position)))
        pick = run_pick or sampling.pick
        b = int(pick(*q, sampling.uniform(seed, position + run_position)))
        verdicts = sampling.compare_continuations(
            ([a], torch.tensor(logits)[None]),
            ([b], torch.tensor(nudged)[None]),
            settings,
            seed,
            prompt,
            sampling.draw_margin(ATOL, settings),
        )
        counts[verdicts[0].verdict] += 1
    return counts


def test_the_draw_rule_never_fails_a_draw_within_the_margin(capsys) -> None:
    counts = _rule_counts()
    with capsys.disabled():
        print(f"\ndraw rule, {TRIALS} steps, logits within atol {ATOL}: {counts}")
    assert counts["FAIL"] == 0
    assert counts["AMBIGUOUS"] > 0  # the rule's other branch is exercised
    assert counts["AMBIGUOUS"] < 0.02 * TRIALS  # about TV per step: rare


@pytest.mark.parametrize(
    ("bug", "kwargs"),
    [
        ("the next position's uniform", {"run_position": 1}),
        ("ranking order", {"run_pick": _ranked_order_pick}),
        ("logits 30 x atol apart", {"scale": 30.0}),
    ],
)
def test_a_draw_no_tolerance_explains_fails_the_draw_rule(bug, kwargs, capsys) -> None:
    counts = _rule_counts(**kwargs)
    with capsys.disabled():
        print(f"\ndraw rule, planted {bug}: {counts}")
    assert counts["FAIL"] >= 0.5 * TRIALS, counts


SHIFT_TRIALS = 600


def test_a_common_logit_shift_breaks_only_the_repetition_penalty(capsys) -> None:
    """The tolerance's premise (sampling's module docstring): a common shift of the logits (0.5)
    moves no log-probability, yet under a repetition penalty (1.3, on the raw logits) it FAILs
    steps, so log-probabilities within atol are not enough there; raw logits within atol (the
    premise's form for a repetition penalty) never FAIL, and without a repetition penalty the
    shift changes nothing (presence and frequency subtract the same amounts)."""
    rng = np.random.default_rng(SEED)
    logits = rng.normal(0.0, 2.0, size=64)
    shifted = torch.log_softmax(torch.tensor(logits + 0.5), -1)
    assert float((shifted - torch.log_softmax(torch.tensor(logits), -1)).abs().max()) < 1e-12
    penalty = [SamplerSettings(temperature=t, repetition_penalty=1.3) for t in (0.7, 1.5)]
    additive = [SamplerSettings(presence_penalty=0.5, frequency_penalty=0.2), RULE_SETTINGS[0]]
    n = SHIFT_TRIALS
    counts = {
        "shift 0.5, repetition penalty": _rule_counts(
            0, shift=0.5, rule_settings=penalty, trials=n
        ),
        "raw logits within atol, repetition penalty": _rule_counts(
            2.0, rule_settings=penalty, trials=n
        ),
        "shift 0.5, presence and frequency": _rule_counts(
            0, shift=0.5, rule_settings=additive, trials=n
        ),
    }
    with capsys.disabled():
        print(f"\ndraw rule, a common logit shift, {SHIFT_TRIALS} steps each: {counts}")
    assert counts["shift 0.5, repetition penalty"]["FAIL"] > 0
    assert counts["raw logits within atol, repetition penalty"]["FAIL"] == 0
    assert counts["shift 0.5, presence and frequency"]["FAIL"] == 0


def test_the_rule_needs_the_id_order_draw(monkeypatch, capsys) -> None:
    """Planted: the sampler itself (reference and run alike) walks its kept tokens in ranking
    order. Two near-tied tokens that swap ranks then swap whole intervals, so draws differ
    with the uniform far from any boundary: the rule's boundary condition FAILs them."""
    monkeypatch.setattr(sampling, "pick", _ranked_order_pick)
    counts = _rule_counts()
    with capsys.disabled():
        print(f"\ndraw rule, the sampler in ranking order, logits within atol: {counts}")
    assert counts["FAIL"] > 0


# --- the kept-set rule (sampling.kept_bounds, compare_kept): truncations under a tolerance -----
#
# A reference whose log-probabilities lie within ATOL of the run's may keep other tokens at a
# truncation's edge (a near-tie at the k-th logit, mass near top_p, a probability near min_p's
# floor). kept_bounds gives the tokens the chain keeps however the tolerance ranks them and
# those it may keep; compare_kept calls a kept set between them BOUNDARY, never FAIL. Checked
# on KEPT_TRIALS seeded steps of truncating settings (both orders, penalties); planted: bounds
# a quarter as wide (correct references then FAIL), and a run whose top-p keeps one token more
# than the chain (FAILs whenever that token is not at the edge).

KEPT_TRIALS = 1200
KEPT_SETTINGS = [
    SamplerSettings(temperature=2.0, top_k=20),
    SamplerSettings(temperature=1.5, top_k=32, top_p=0.6),
    SamplerSettings(top_p=0.5),
    SamplerSettings(temperature=0.7, min_p=0.1),
    SamplerSettings(
        order="llama_cpp",
        temperature=0.8,
        top_k=20,
        top_p=0.95,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
    ),
]


def _kept_counts(bounds_atol: float = ATOL, run_top_p=None) -> dict[str, int]:
    rng = np.random.default_rng(SEED + 1)
    counts = {"equal": 0, "BOUNDARY": 0, "FAIL": 0}
    for trial in range(KEPT_TRIALS):
        settings = KEPT_SETTINGS[trial % len(KEPT_SETTINGS)]
        prompt = rng.integers(0, 200, size=5).tolist()
        logits = rng.normal(0.0, rng.choice([0.5, 1.0, 3.0]), size=200)
        reference = logits + rng.uniform(-ATOL / 2, ATOL / 2, size=200)
        p = sampling.processed(reference, settings, prompt)
        if run_top_p is not None:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(sampling, "top_p", run_top_p)
                q = sampling.processed(logits, settings, prompt)
        else:
            q = sampling.processed(logits, settings, prompt)
        bounds = sampling.kept_bounds(logits, settings, prompt, bounds_atol)
        margin = sampling.draw_margin(ATOL, settings)
        counts[sampling.compare_kept(p, q, bounds, margin).verdict] += 1
    return counts


def test_the_kept_set_rule_never_fails_a_reference_within_the_tolerance(capsys) -> None:
    counts = _kept_counts()
    with capsys.disabled():
        print(f"\nkept-set rule, {KEPT_TRIALS} steps, logits within atol {ATOL}: {counts}")
    assert counts["FAIL"] == 0
    assert counts["BOUNDARY"] > 0  # kept sets do differ at the edges, and are allowed to


@pytest.mark.parametrize(
    ("bug", "kwargs"),
    [
        ("bounds a quarter as wide", {"bounds_atol": ATOL / 4}),
        (
            "the run's top-p keeps one token more",
            {"run_top_p": MUTATIONS["top-p one token too many"][1]},
        ),
    ],
)
def test_a_kept_set_no_tolerance_explains_fails(bug, kwargs, capsys) -> None:
    counts = _kept_counts(**kwargs)
    with capsys.disabled():
        print(f"\nkept-set rule, planted {bug}: {counts}")
    assert counts["FAIL"] > 0, counts


def test_the_bounds_are_the_kept_set_at_zero_tolerance() -> None:
    rng = np.random.default_rng(SEED + 2)
    for settings in KEPT_SETTINGS:
        logits = rng.normal(0.0, 1.0, size=200)
        ids, _ = sampling.processed(logits, settings, [1, 2])
        certain, possible = sampling.kept_bounds(logits, settings, [1, 2], 0.0)
        assert set(certain) == set(possible) == set(ids)
        certain, possible = sampling.kept_bounds(logits, settings, [1, 2], 1e-9)
        assert set(certain) <= set(ids) <= set(possible)


def test_absent_is_setdiff1d_of_unique_ids() -> None:
    """compare_kept's _absent (a vocabulary mask) gives np.setdiff1d's answer on 2,000 seeded
    pairs of id sets without repeats, in any order, empty and equal sets included."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 300))
        a = rng.choice(1000, size=int(rng.integers(0, n + 1)), replace=False)
        b = rng.choice(1000, size=int(rng.integers(0, n + 1)), replace=False)
        for x, y in ((a, b), (b, a), (a, a)):
            assert np.array_equal(sampling._absent(x, y), np.setdiff1d(x, y))


def test_kth_largest_is_the_partitions_answer() -> None:
    """sampling.kth_largest (a one-pass bound, then a partition of what is above it) equals
    np.partition's k-th largest on seeded rows: continuous, with ties at every value (the
    bound is often one), with NaN inside and after the bounding slices, and with infinities."""
    rng = np.random.default_rng(7)
    rows = [rng.normal(size=128256) * 3, np.round(rng.normal(size=4099) * 2), np.zeros(1000)]
    rows += [np.r_[rng.normal(size=500), [np.nan] * 3], np.r_[[np.nan] * 3, rng.normal(size=500)]]
    rows += [np.r_[rng.normal(size=50), [np.inf] * 10, [-np.inf] * 5]]
    for row in rows:
        for k in (1, 2, 7, 20, 40, len(row) - 1):
            expected = np.partition(row, len(row) - k)[len(row) - k]
            got = sampling.kth_largest(row, k)
            assert got == expected or (np.isnan(got) and np.isnan(expected)), (len(row), k)
