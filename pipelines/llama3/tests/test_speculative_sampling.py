"""Speculative sampling with a draft that samples (speculative.SamplingDraft): the rejection
sampler against the target's distribution, deterministically and by the G-test, and each
planted verification bug caught.

- Deterministic: for processed target and draft distributions p and q of random logits (other
  settings, other kept sets), the emitted token's exact distribution, composed from the
  implementation's own terms (speculative.emitted_distribution: accept x with min(1, p/q),
  else the residual max(0, p - q) normalized), equals p within 1e-12, and the bonus token is
  drawn from p.
- Statistical: `speculative.decode` over fixed rows (every context gives the target p and the
  draft q, so each emitted token is an independent draw that must follow p): RUNS seeded runs
  of STEPS tokens, K = 3, the tokens emitted at proposal slots (accepted or replaced) and the
  bonus tokens each held to p by the G-test at ALPHA = 1e-6 (the false-alarm rate of each of
  the two tests; the draws are seeded, so a run replays exactly). Each planted bug's power
  (the probability that its draws fail the test) is computed from its exact distribution and
  printed: at least 0.999 for every plant the draws can show; the two they cannot (q in
  float32, p modified in place: the draws never read p again) are caught by the deterministic
  check alone, as said in their rows.
- Planted (SPECULATIVE_SAMPLING_MUTATIONS), each FAILS: the residual not renormalized, the
  acceptance ratio with q in float32, the target's probabilities modified in place, the bonus
  token drawn from the draft, the ratio from the draft's distribution before its sampler's
  processing (the one drawn from is after it). The matrix prints each one's exact error, its
  draws' p-values and the power.
- The p verify hands the rejection sampler and the bonus draw, slot by slot, on generate's and
  the serving engine's paths, with penalties and a constraint: exactly the step's processed
  distribution recomputed from the recorded row, the recorded mask and the tokens before it
  (planted: temperature applied twice, penalties over the prompt alone; the G-test's draws
  above compose no p of their own and let the first through at power 0.09).
- Constrained (a toy vocabulary of 8 letters and a language whose mask alternates with the
  position): each stratum's draws (proposal slot 0 or 1, bonus; even or odd position) held
  to the masked target by the G-test, ALPHA in all (Bonferroni over the 6 strata). Planted,
  a draft masking every proposal by the verified state fails, its power printed (>= 0.999).
- With a real model (the tiny checkpoint drafting with its first 0 layers): generate and the
  serving engine emit rows equal to those of the same tokens forced without speculation (the
  rejected proposals' keys never read), and proposals are both accepted and rejected; planted,
  a rejected proposal's keys left in use fails. `generate --draft-samples` drafts this way.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from goldens import multinomial
from pipelines.llama3 import Llama3Engine, generate, sampling, speculative
from pipelines.llama3.decoder import Decoder
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.serving import Request, ServingEngine
from pipelines.llama3.speculative import SamplingDraft, Speculation

TESTDATA = Path(
    os.environ.get("PIPELINES_TESTDATA", "max_tests/integration/architectures/llama3/testdata")
)
ALPHA = 1e-6
RUNS, STEPS, K = 250, 16, 3
# The fixed rows: the target keeps tokens 0-3 of 8, the draft 0, 1, 3 and 6 (one the target
# drops): proposals are often rejected, and all K accepted often enough for the bonus test.
# (Top-k 4 at temperature 0.9: the unprocessed draft's ratio is then far enough off that the
# draws show it; with top-k 6 its slots' distribution moves too little for any power.)
TARGET_ROW = [2.0, 1.2, 0.9, 0.5, 0.3, 0.1, -3.0, -4.0]
DRAFT_ROW = [1.0, 1.5, 0.2, 0.8, -5.0, -5.0, 1.1, -6.0]
TARGET_SAMPLER = SamplerSettings(temperature=0.9, top_k=4)  # the request's, the draft's too


def _distributions(seed: int):
    rng = np.random.default_rng(seed)
    p = sampling.processed(rng.normal(0, 2, 40), SamplerSettings(temperature=0.8, top_p=0.9))
    q = sampling.processed(rng.normal(0, 2, 40), SamplerSettings(temperature=1.5, top_k=12))
    return p, q


def _max_error(emitted: dict[int, float], p) -> float:
    want = dict(zip(p[0].tolist(), p[1].tolist(), strict=True))
    tokens = set(emitted) | set(want)
    return max(abs(emitted.get(t, 0.0) - want.get(t, 0.0)) for t in tokens)


@pytest.mark.parametrize("seed", range(6))
def test_the_rejection_sampler_emits_the_target_distribution(seed) -> None:
    p, q = _distributions(seed)
    assert _max_error(speculative.emitted_distribution(p, q), p) < 1e-12
    assert speculative.bonus_distribution(p, q) is p
    residual = speculative.residual_distribution(p, q)
    assert abs(residual[1].sum() - 1) < 1e-12 and (residual[1] >= 0).all()


# --- planted bugs ----------------------------------------------------------------------------


def _unnormalized_residual(p, q):
    ids, probs = p
    q_at = np.array([speculative.probability(q, int(t)) for t in ids])
    return ids, np.maximum(probs - q_at, 0.0)  # planted: max(0, p - q) not normalized


def _float32_ratio(p, q, x):
    qx = float(np.float32(speculative.probability(q, x)))  # planted: q(x) in another precision
    return min(1.0, speculative.probability(p, x) / qx)


def _in_place_residual(p, q):
    ids, probs = p
    q_at = np.array([speculative.probability(q, int(t)) for t in ids])
    probs -= q_at  # planted: the target's probabilities modified in place
    np.maximum(probs, 0.0, out=probs)
    return ids, probs / probs.sum()


def _bonus_from_the_draft(p, q):
    return q  # planted: the bonus token drawn from the draft's distribution


def _unprocessed(self, q, logits):
    # planted: the ratio uses the draft's distribution before its sampler's processing
    return sampling.processed(logits, SamplerSettings())


# name: (object, attribute, replacement); the seeded draws must catch each (a G-test at ALPHA)
# but those in EXACT_ONLY, which only the exact check can
SPECULATIVE_SAMPLING_MUTATIONS = {
    "residual not renormalized": (speculative, "residual_distribution", _unnormalized_residual),
    "acceptance ratio with q in float32": (speculative, "accept_probability", _float32_ratio),
    "target probabilities modified in place": (
        speculative,
        "residual_distribution",
        _in_place_residual,
    ),
    "bonus token drawn from the draft": (speculative, "bonus_distribution", _bonus_from_the_draft),
    "acceptance ratio from the unprocessed draft": (SamplingDraft, "reported", _unprocessed),
}


# --- the statistical test over fixed rows --------------------------------------------------


class _FixedRows:
    """A model whose next-token logits are `row` after any context."""

    max_seq_len = 1 << 20

    def __init__(self, row: list[float]) -> None:
        self.row = torch.tensor(row, dtype=torch.float32)

    def setup_caches(self, n: int) -> None:
        pass

    def __call__(self, tokens: torch.Tensor, start: int, outputs=None) -> torch.Tensor:
        rows = tokens.shape[1] if outputs is None else len(outputs)
        return self.row.repeat(rows, 1)[None]


def _draws() -> tuple[list[int], list[int], speculative.Stats]:
    """(tokens at proposal slots, bonus tokens, stats) of RUNS seeded runs over fixed rows."""
    slots, bonus, total = [], [], speculative.Stats()
    target = _FixedRows(TARGET_ROW)
    for seed in range(RUNS):
        decoder = Decoder(STEPS, prompt=[0], sampling=TARGET_SAMPLER, seed=seed)
        draft = SamplingDraft(types.SimpleNamespace(model=_FixedRows(DRAFT_ROW), device="cpu"))
        step_logits = torch.empty(STEPS, len(TARGET_ROW))
        stats = speculative.decode(
            target, decoder, target.row, 1, Speculation(draft, K), step_logits, "cpu"
        )
        emitted = iter(decoder.tokens[1:])  # the first is the prefill's plain draw
        for proposed, accepted in zip(stats.proposed, stats.accepted, strict=True):
            slots += [t for _, t in zip(range(accepted), emitted, strict=False)]
            last = next(emitted, None)
            if last is not None:
                (bonus if accepted == proposed else slots).append(last)
        total.merge(stats)
    return slots, bonus, total


def _draw_distribution(dist) -> dict[int, float]:
    """The exact distribution of speculative.draw(dist, u), u uniform on [0, 1)."""
    ids, probs = dist
    order = np.argsort(ids, kind="stable")
    out, before = {}, 0.0
    for t, cdf in zip(ids[order].tolist(), np.cumsum(probs[order]).tolist(), strict=True):
        out[t] = max(0.0, min(cdf, 1.0) - min(before, 1.0))
        before = cdf
    out[int(ids[order][-1])] += max(0.0, 1.0 - before)  # past the last interval: the last id
    return out


def _target():
    return sampling.processed(torch.tensor(TARGET_ROW), TARGET_SAMPLER)


def _exact() -> tuple[dict, dict]:
    """The exact distributions of a proposal slot's token and of a bonus token under the
    speculative functions as they are now (patched or not), p fresh for every draw as the
    decoder computes it."""
    q = sampling.processed(torch.tensor(DRAFT_ROW), TARGET_SAMPLER)
    reported = SamplingDraft.reported(None, q, torch.tensor(DRAFT_ROW))
    slot: dict[int, float] = {}
    for x, qx in zip(q[0].tolist(), q[1].tolist(), strict=True):
        a = speculative.accept_probability(_target(), reported, x)
        slot[x] = slot.get(x, 0.0) + qx * a
        rest = _draw_distribution(speculative.residual_distribution(_target(), reported))
        for t, r in rest.items():
            slot[t] = slot.get(t, 0.0) + qx * (1 - a) * r
    return slot, _draw_distribution(speculative.bonus_distribution(_target(), reported))


def _exact_error() -> float:
    """The deterministic check: the worst |emitted - p| of random pairs and the fixed rows'
    pair, the bonus distribution's included."""
    q = sampling.processed(torch.tensor(DRAFT_ROW), TARGET_SAMPLER)
    pairs = [_distributions(seed) for seed in range(3)] + [(_target(), q)]
    error = 0.0
    for p, q in pairs:
        error = max(error, _max_error(speculative.emitted_distribution(p, q), p))
        ids, probs = speculative.bonus_distribution(p, q)
        error = max(error, _max_error(dict(zip(ids.tolist(), probs.tolist(), strict=True)), p))
    return error


def _verdict(name: str) -> tuple[bool, bool, str, float]:
    """(caught by the exact check, caught by the draws, its row of the matrix, the draws'
    power against it) for the speculative functions as they are now."""
    p = _target()
    want = dict(zip(p[0].tolist(), p[1].tolist(), strict=True))
    error = _exact_error()
    slots, bonus, stats = _draws()
    p_slots, p_bonus = multinomial.g_test(slots, want), multinomial.g_test(bonus, want)
    exact_slot, exact_bonus = _exact()
    power_slots = multinomial.power(exact_slot, want, len(slots), ALPHA)
    power_bonus = multinomial.power(exact_bonus, want, len(bonus), ALPHA)
    exact, drawn = error > 1e-12, min(p_slots, p_bonus) <= ALPHA
    caught = exact or drawn
    row = (
        f"  {name:<42} {'FAIL' if caught else 'PASS'}: exact max |Δ| {error:.2g}; G-test "
        f"p-value slots {p_slots:.3g} ({len(slots)} draws, power {power_slots:.4f}), bonus "
        f"{p_bonus:.3g} ({len(bonus)} draws, power {power_bonus:.4f}); "
        f"{sum(stats.accepted)}/{sum(stats.proposed)} proposals accepted"
    )
    return exact, drawn, row, max(power_slots, power_bonus)


# The plants the draws cannot show (they fail the exact check alone): q(x) in float32 moves
# the emitted distribution by ~1e-9; p modified in place is read again only by the exact
# composition (a sampler that drew again from p would show it).
EXACT_ONLY = {"acceptance ratio with q in float32", "target probabilities modified in place"}


def test_draws_follow_the_target_and_every_planted_bug_fails(monkeypatch, capsys) -> None:
    """Each plant caught by what is meant to catch it: the seeded draws' G-test, or for
    EXACT_ONLY the exact check (a plant failing the exact check alone while the draws no
    longer reach the patched function, e.g. a bonus drawn without bonus_distribution, would
    otherwise count as caught)."""
    exact, drawn, row, _ = _verdict("unmutated")
    rows, missed, weak = [row], [], []
    assert not (exact or drawn), row
    for name, (owner, attribute, replacement) in SPECULATIVE_SAMPLING_MUTATIONS.items():
        with monkeypatch.context() as patch:
            patch.setattr(owner, attribute, replacement)
            exact, drawn, row, power = _verdict(name)
        rows.append(row)
        if not (exact if name in EXACT_ONLY else drawn):
            missed.append(name)
        if name not in EXACT_ONLY and power < 0.999:
            weak.append(f"{name}: power {power:.4f}")
    with capsys.disabled():
        print(f"\nspeculative sampling, alpha {ALPHA:g}, K={K}, {RUNS} runs x {STEPS}:")
        print("\n".join(rows))
    assert not missed, missed
    assert not weak, weak


# --- with a real model -------------------------------------------------------------------------

LOGPROB_ATOL = 2e-4  # rows computed several at a time (test_speculative's figure)
PROMPTS = ["The quick brown fox", "def main():\n    return", "1, 2, 3, 4,"]
NEW_TOKENS = 24


def _delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max())


def _sampled_runs(engine, draft) -> tuple[float, speculative.Stats]:
    """The worst row delta of generate's and the serving engine's sampled speculative runs
    against the same tokens forced without speculation, and the summed stats."""
    sampler = SamplerSettings(temperature=1.0, top_k=20, seed=7)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    worst, total = 0.0, speculative.Stats()
    runs = [
        engine.generate(p, NEW_TOKENS, False, sampling=sampler, speculation=Speculation(draft, 4))
        for p in prompts
    ]
    requests = [
        Request(
            str(i),
            p,
            NEW_TOKENS,
            sampling=sampler,
            ignore_eos=True,
            speculation=Speculation(draft, 4),
        )
        for i, p in enumerate(prompts)
    ]
    served = ServingEngine(engine, block_size=4).serve(requests)
    runs += [served[str(i)].output for i in range(len(prompts))]
    for prompt, run in zip(prompts * 2, runs, strict=True):
        forced = engine.generate(prompt, len(run.tokens), forced_tokens=run.tokens)
        worst = max(worst, _delta(run.logits, forced.logits))
        total.merge(run.speculation)
    return worst, total


def test_a_sampling_draft_keeps_the_rows_of_the_tokens_it_emits(monkeypatch, capsys) -> None:
    """The tiny checkpoint drafting for itself with its first 0 layers, sampling: generate's
    and the serving engine's rows are those of the emitted tokens forced without speculation,
    with proposals accepted and rejected. Planted: a rejected proposal's keys and values left
    in use (the next block after the whole block) moves the rows."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    draft = speculative.self_draft(TESTDATA / "tiny_llama.gguf", 0, sample=True)
    worst, stats = _sampled_runs(engine, draft)
    with monkeypatch.context() as patch:
        patch.setattr(
            speculative, "next_position", lambda position, accepted, block: position + block
        )
        try:
            planted, _ = _sampled_runs(engine, draft)
        except ValueError:  # it ran past the cache: caught as surely
            planted = float("inf")
    with capsys.disabled():
        print(
            f"\nsampling draft (0 layers), k=4: {stats.summary()}; rows vs forced max "
            f"|Δ log-prob| {worst:.3g}; planted KV left in use: {planted:.3g}"
        )
    assert 0 < sum(stats.accepted) < sum(stats.proposed), stats.summary()
    assert worst < LOGPROB_ATOL
    assert planted >= LOGPROB_ATOL


def test_generate_drafts_by_sampling_on_request_and_refuses_it_without_a_sampler(capsys) -> None:
    common = ["--gguf", str(TESTDATA / "tiny_llama.gguf"), "--prompt", "The quick"]
    sampled = [*common, "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "3"]
    argv = [*sampled, "--speculate", "4", "--draft-layers", "0", "--draft-samples"]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    assert "speculation (0-layer self, sampling draft, k=4):" in out
    assert generate.main(argv) == 0
    assert capsys.readouterr().out.split(" prompt tokens")[0] == out.split(" prompt tokens")[0]
    with pytest.raises(SystemExit) as refused:
        generate.main([*common, "--speculate", "4", "--draft-layers", "0", "--draft-samples"])
    assert refused.value.code == 2
    assert "--draft-samples: give --draft-layers=N or --draft=GGUF and a sampler" in (
        capsys.readouterr().err
    )
    # a draft checkpoint samples the same way; its misuses exit 2 naming the option
    draft = str(TESTDATA / "tiny_llama_draft.gguf")
    assert generate.main([*sampled, "--speculate", "4", "--draft", draft, "--draft-samples"]) == 0
    assert "speculation (tiny_llama_draft.gguf, sampling draft, k=4):" in capsys.readouterr().out
    for extra, message in (
        (["--draft", draft], "--draft drafts for speculative decoding: give --speculate=K"),
        (["--speculate", "4", "--draft", draft, "--draft-layers", "0"], "two drafts: give one"),
        (["--speculate", "4", "--draft", "nowhere.gguf"], "nowhere.gguf is not a file"),
    ):
        with pytest.raises(SystemExit) as refused:
            generate.main([*common, *extra])
        assert refused.value.code == 2 and message in capsys.readouterr().err, extra


class _Loaded(Exception):
    """Raised instead of loading: the command line was accepted."""


def test_generate_reads_a_relative_draft_from_the_users_folder(tmp_path, monkeypatch) -> None:
    """Under `bazel run` the process starts in the runfiles; BUILD_WORKING_DIRECTORY is where the
    user typed --draft=tiny_llama_draft.gguf (the README's example said "is not a file")."""
    (tmp_path / "draft.gguf").write_bytes(b"")
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))

    def loaded(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(Llama3Engine, "from_gguf", loaded)
    argv = ["--gguf=target.gguf", "--prompt=x", "--speculate=4", "--draft=draft.gguf"]
    with pytest.raises(_Loaded):
        generate.main(argv)
    assert generate._parser().parse_args(argv).draft == tmp_path / "draft.gguf"


# --- the distribution handed to the rejection sampler, step by step ------------------------

# Penalties, truncation and temperature all in play (each reads the history or the row).
PENALIZED = SamplerSettings(
    temperature=0.8,
    top_k=40,
    repetition_penalty=1.3,
    presence_penalty=0.2,
    frequency_penalty=0.1,
    seed=11,
)


def _handed(monkeypatch) -> list[tuple]:
    """Records, at each verification slot, (the target's row j, the position the slot
    chooses, the p verify hands the rejection sampler or the bonus draw)."""
    records: list = []
    state: dict = {}
    real_row, real_uniform = speculative.verification_row, sampling.uniform
    real_step, real_bonus = speculative.rejection_step, speculative.bonus_distribution

    def verification_row(rows, j):
        state["row"] = rows[j].clone()
        return real_row(rows, j)

    def uniform(seed, position, domain=sampling.TOKEN_DOMAIN):
        if domain == sampling.TOKEN_DOMAIN:
            state["position"] = int(position)
        return real_uniform(seed, position, domain)

    def rejection_step(p, q, x, u_accept, u_residual):
        records.append((state["row"], state["position"], p))
        return real_step(p, q, x, u_accept, u_residual)

    def bonus_distribution(p, q):
        records.append((state["row"], state["position"], p))
        return real_bonus(p, q)

    monkeypatch.setattr(speculative, "verification_row", verification_row)
    monkeypatch.setattr(sampling, "uniform", uniform)
    monkeypatch.setattr(speculative, "rejection_step", rejection_step)
    monkeypatch.setattr(speculative, "bonus_distribution", bonus_distribution)
    return records


def _handed_failures(engine, draft, monkeypatch, constraint=None) -> tuple[list[str], int]:
    """Each p handed over in generate's and the serving engine's sampled speculative runs
    (one request at a time) against the step's processed distribution computed here: the
    recorded row, masked by the step's recorded allowed ids, penalized by the tokens before
    the position (the prompt and the output), exactly. (failures, slots checked)."""
    failures, checked, constrained = [], 0, constraint is not None
    for text in PROMPTS:
        prompt = engine.tokenizer.encode(text)
        for path in ("generate", "served"):
            with monkeypatch.context() as patch:
                records = _handed(patch)
                speculation = Speculation(draft, 4)
                if path == "generate":
                    out = engine.generate(
                        prompt, NEW_TOKENS, constrained, sampling=PENALIZED,
                        speculation=speculation, constraint=constraint, record_allowed=constrained,
                    )  # fmt: skip
                else:
                    request = Request(
                        "r", prompt, NEW_TOKENS, sampling=PENALIZED, ignore_eos=not constrained,
                        speculation=speculation, constraint=constraint, record_allowed=constrained,
                    )  # fmt: skip
                    out = ServingEngine(engine, block_size=4).serve([request])["r"].output
            sequence = [*prompt, *out.tokens]
            for row, position, (ids, probs) in records:
                logits = row
                if constraint is not None:
                    mask = torch.zeros(row.shape[-1], dtype=torch.bool)
                    mask[torch.as_tensor(out.allowed[position - len(prompt)])] = True
                    logits = row.masked_fill(~mask, float("-inf"))
                want_ids, want = sampling.processed(logits, PENALIZED, sequence[:position])
                checked += 1
                if not (np.array_equal(ids, want_ids) and np.allclose(probs, want, atol=1e-12)):
                    failures.append(f"{path} {text!r} position {position}: p is not the step's")
    return failures, checked


def _temperature_twice(self, logits):
    return sampling.processed(
        self.masked(logits) / self.sampling.temperature, self.sampling, self.history()
    )


def _prompt_only_history(self, logits):
    return sampling.processed(self.masked(logits), self.sampling, self.prompt)


@pytest.mark.parametrize(
    "plant",
    [None, _temperature_twice, _prompt_only_history],
    ids=["engine", "temperature_twice", "prompt_only_history"],
)
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "constrained"])
def test_the_rejection_sampler_is_handed_the_steps_distribution(monkeypatch, plant, constrained):
    """The target p verify hands the rejection sampler and the bonus draw is the step's
    processed distribution (penalties over the history so far, top-k, temperature, the
    constraint's mask), exactly, on generate's path and the serving engine's. The draws'
    G-test above cannot see a p computed wrongly inside verify at the draws it makes (the
    exact checks compose p themselves); planted, temperature applied twice (the G-test's
    power at its draws: 0.09) and penalties over the prompt alone fail here."""
    from pipelines.llama3.constrained import Constraint

    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")
    draft = speculative.self_draft(TESTDATA / "tiny_llama.gguf", 0, sample=True)
    constraint = Constraint.regex("[a-z ]{4,40}") if constrained else None
    if plant is not None:
        monkeypatch.setattr(Decoder, "distribution", plant)
    failures, checked = _handed_failures(engine, draft, monkeypatch, constraint)
    assert checked >= 20, checked  # measured 38 slots constrained, more free
    if plant is None:
        assert failures == [], failures[:5]
    else:
        assert failures, "the planted distribution passed"


# --- constrained: the draws over fixed rows, the language changing the mask step by step -----

# A toy vocabulary (the letters a-h as ids 0-7, an end of sequence at 8) and a language whose
# mask alternates: an even position allows a c d e g (and the end), an odd one a b e f h. The
# rows are the fixed rows above, the end at -30 (never in a top-k of 4).
LETTERS = "abcdefgh"
LANGUAGE = "([acdeg][abefh])*"
C_TARGET_ROW, C_DRAFT_ROW = [*TARGET_ROW, -30.0], [*DRAFT_ROW, -30.0]
C_K = 2  # slot 1 is the first a draft masked by the wrong state would propose for
STRATA = 6  # (parity, slot 0 or 1) of proposal slots, and the bonus tokens by parity


class _LetterTokenizer:
    """What constrained.Vocabulary reads of a tokenizer, for the toy vocabulary."""

    class backend:
        @staticmethod
        def encode(text: str, add_special_tokens: bool = False):
            return types.SimpleNamespace(ids=[LETTERS.index(c) for c in text])

    eos_ids, bos_id = {8}, None

    def token_bytes(self) -> tuple[list[bytes], set[int]]:
        return [c.encode() for c in LETTERS] + [b"<eos>"], {8}


def _allowed(parity: int) -> list[int]:
    return [LETTERS.index(c) for c in ("acdeg" if parity == 0 else "abefh")]


def _masked_distribution(row: list[float], parity: int):
    logits = torch.full((len(row),), float("-inf"))
    allowed = _allowed(parity)
    logits[allowed] = torch.tensor(row)[allowed]
    return sampling.processed(logits, TARGET_SAMPLER)


def _constrained_draws() -> tuple[dict, speculative.Stats]:
    """{stratum: tokens} of RUNS seeded constrained runs over the fixed rows, C_K = 2: a
    proposal slot's tokens under ("slot", parity of its position, j), the bonus tokens under
    ("bonus", parity)."""
    from pipelines.llama3.constrained import Constraint, matcher

    strata: dict = {}
    total, tokenizer = speculative.Stats(), _LetterTokenizer()
    target = _FixedRows(C_TARGET_ROW)
    for seed in range(RUNS):
        decoder = Decoder(
            STEPS, eos_ids={8}, prompt=[0], sampling=TARGET_SAMPLER, seed=seed,
            constraint=matcher(Constraint.regex(LANGUAGE), tokenizer),
        )  # fmt: skip
        draft = SamplingDraft(types.SimpleNamespace(model=_FixedRows(C_DRAFT_ROW), device="cpu"))
        step_logits = torch.empty(STEPS, len(C_TARGET_ROW))
        stats = speculative.decode(
            target, decoder, target.row, 1, Speculation(draft, C_K), step_logits, "cpu"
        )
        index = 1  # the first token is the prefill's plain draw
        for proposed, accepted in zip(stats.proposed, stats.accepted, strict=True):
            for j in range(accepted):
                strata.setdefault(("slot", index % 2, j), []).append(decoder.tokens[index])
                index += 1
            if index < len(decoder.tokens):
                parity = index % 2
                key = ("bonus", parity) if accepted == proposed else ("slot", parity, accepted)
                strata.setdefault(key, []).append(decoder.tokens[index])
                index += 1
        assert index == len(decoder.tokens) == STEPS, (seed, stats)
        total.merge(stats)
    return strata, total


def _masked_by_the_verified_state(self, history, k, decoder, choose):
    # planted: every proposal masked by the verified tokens' state (the matcher not advanced
    # by the proposals before it); a proposal the language refuses is cut off by `proposals`
    return self._run(history, k, lambda logits, context: choose(decoder.masked(logits), context))


def _slot_under_the_plant(parity: int) -> dict[int, float]:
    """The exact distribution of slot 1's token at `parity` under the plant: its proposal
    drawn from the draft masked for the other parity, kept only if the language allows it
    (else the slot is a bonus draw), then accepted or replaced by the implementation's terms."""
    p, q = _masked_distribution(C_TARGET_ROW, parity), _masked_distribution(C_DRAFT_ROW, 1 - parity)
    viable = [(int(x), float(w)) for x, w in zip(*q, strict=True) if int(x) in _allowed(parity)]
    mass = sum(w for _, w in viable)
    rest = _draw_distribution(speculative.residual_distribution(p, q))
    out: dict[int, float] = {}
    for x, w in viable:
        a = speculative.accept_probability(p, q, x)
        out[x] = out.get(x, 0.0) + w / mass * a
        for t, r in rest.items():
            out[t] = out.get(t, 0.0) + w / mass * (1 - a) * r
    return out


@pytest.mark.parametrize("plant", [None, "masked_by_the_verified_state"])
def test_constrained_draws_follow_the_masked_target(monkeypatch, plant, capsys) -> None:
    """Constrained speculative sampling emits the target's distribution under the language's
    mask at each position: RUNS seeded runs of STEPS tokens over the fixed rows with a
    sampling draft (K = 2), the tokens of each stratum (proposal slot 0 or 1, bonus; even or
    odd position) held to the masked target by the G-test at ALPHA / STRATA each (false-alarm
    rate at most ALPHA = 1e-6 in all, Bonferroni; seeded, so a run replays exactly). Planted,
    a draft that masks every proposal by the verified state (not advanced by the proposals
    before it) skews slot 1: its power, from the exact distribution at the drawn counts, is
    printed and must be at least 0.999."""
    if plant is not None:
        monkeypatch.setattr(speculative.ModelDraft, "_masked_run", _masked_by_the_verified_state)
    strata, stats = _constrained_draws()
    rows, failed, power = [], [], 0.0
    for key in sorted(strata):
        want = _masked_distribution(C_TARGET_ROW, key[1])
        want = dict(zip(want[0].tolist(), want[1].tolist(), strict=True))
        drawn = strata[key]
        p_value = multinomial.g_test(drawn, want)
        if p_value <= ALPHA / STRATA:
            failed.append(key)
        if plant is not None and key[0] == "slot" and key[2] == 1:
            exact = _slot_under_the_plant(key[1])
            power = max(power, multinomial.power(exact, want, len(drawn), ALPHA / STRATA))
        rows.append(f"  {key}: {len(drawn)} draws, G-test p-value {p_value:.3g}")
    with capsys.disabled():
        print(f"\nconstrained speculative sampling ({plant or 'unmutated'}), K={C_K}, "
              f"{RUNS} runs x {STEPS}: {stats.summary()}")  # fmt: skip
        print("\n".join(rows) + (f"\n  power against the plant: {power:.6f}" if plant else ""))
    assert len(strata) == STRATA, sorted(strata)
    assert all(len(drawn) >= 100 for drawn in strata.values()), rows
    if plant is None:
        assert not failed, rows
    else:
        assert power >= 0.999, power
        assert failed, rows


def test_generate_refuses_a_draft_it_cannot_use_with_exit_2_naming_the_option(
    tmp_path, capsys
) -> None:
    """--draft-layers takes 0 to n_layers - 1 of the checkpoint's layers (tiny_llama has 1), and
    a --draft file that is no GGUF checkpoint is an error naming --draft, both exit 2.
    Planted: the range check as `<= n_layers` (the full-depth "draft" ran, exit 0), and the
    draft's error printed without its `--draft=` (the option no longer named)."""
    common = ["--gguf", str(TESTDATA / "tiny_llama.gguf"), "--prompt", "x", "--speculate", "4"]
    with pytest.raises(SystemExit) as refused:
        generate.main([*common, "--draft-layers", "1", "--max-new-tokens", "2"])
    assert refused.value.code == 2
    assert "--draft-layers=1: the draft takes 0 to 0 of the checkpoint's 1 layers" in (
        capsys.readouterr().err
    )
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert generate.main([*common, f"--draft={empty}", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: --draft={empty}: {empty}: not a readable GGUF file" in captured.err
