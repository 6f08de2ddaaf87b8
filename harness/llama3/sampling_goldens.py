"""Sampling goldens: what each sampler of cases.yaml's table makes of a golden case, recorded
by evaluate_llama and checked on every mode and serving path.

Recorded per short case and sampler (schema `Sampled`): the processed distribution at each
teacher-forced step (the kept ids and probabilities, sampling.processed of the step's logits
with the prompt and the golden's tokens as history) and the continuation the sampler draws
under its seed, with the distribution that drew each token.

Checked, for a run whose logits are within the tolerance's `logprob_atol` of the golden's:

- **forced**: at each teacher-forced step, the run's processed distribution against the
  golden's by the kept-set rule (sampling.compare_kept): the same kept tokens, or the golden's
  between the tokens the run keeps however the tolerance ranks them and those it may keep
  (BOUNDARY, counted), and TV over the tokens both keep within sampling.draw_margin;
- **drawn**: the run's own seeded continuation (solo `generate`, or served) against the
  golden's by the draw rule (sampling.compare_draws): equal draws, or AMBIGUOUS where the
  uniform lies within the TV of a cumulative boundary (counted; the comparison of that
  continuation ends there: the histories differ). Before that, each golden token must be the
  draw of its own recorded distribution at the check's uniform: a generator, seed or position
  other than the golden's fails there, whatever the logits.

A FAIL names the case, the sampler, the step and the rule that failed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from goldens import schema
from goldens.record import SamplerSpec, sampler_specs
from goldens.tolerances import Tolerance
from harness.llama3.engine_runs import Run
from pipelines.llama3 import sampling

# A golden's probabilities are float32-rounded: its own draw is checked against its recorded
# distribution to this much of a cumulative boundary.
RECORDED_ROUNDING = 1e-6


def settings_of(spec: SamplerSpec | schema.Sampled) -> sampling.SamplerSettings:
    return sampling.SamplerSettings(**spec.settings)


def _kept(logits, settings, history) -> schema.Kept:
    return schema.kept_from(*sampling.processed(logits, settings, history))


def record(engine, run: Run) -> list[schema.Sampled]:
    """The sampling goldens of one short case's run (golden_files.engine_golden records none
    for cases.yaml's long cases)."""
    recorded = []
    for spec in sampler_specs():
        settings = settings_of(spec)
        forced = [
            _kept(run.logits[i], settings, [*run.input_ids, *run.tokens[:i]])
            for i in range(len(run.tokens))
        ]
        out = engine.generate(run.input_ids, run.spec.steps, sampling=settings)
        drawn = [
            _kept(out.logits[i], settings, [*run.input_ids, *out.tokens[:i]])
            for i in range(len(out.tokens))
        ]
        recorded.append(
            schema.Sampled(spec.id, dict(spec.settings), forced, list(out.tokens), drawn)
        )
    return recorded


@dataclasses.dataclass
class SamplingReport:
    """The sampling checks of one golden: counts, and one message per failure."""

    forced_steps: int = 0
    boundary_steps: int = 0  # kept sets that differ where the tolerance allows
    draws: int = 0
    ambiguous_draws: int = 0
    max_tv: float = 0.0
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def checks(self) -> int:
        return self.forced_steps + self.draws

    def add(self, other: SamplingReport) -> None:
        for name in ("forced_steps", "boundary_steps", "draws", "ambiguous_draws"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_tv = max(self.max_tv, other.max_tv)
        self.failures.extend(other.failures)

    def summary(self) -> str:
        return (
            f"sampling: {'FAIL' if self.failures else 'PASS'}, {self.forced_steps} forced "
            f"steps ({self.boundary_steps} at a kept-set boundary), {self.draws} seeded draws "
            f"({self.ambiguous_draws} ambiguous), max TV {self.max_tv:.3g}"
        )


def _pair(kept: schema.Kept) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(kept.ids, dtype=np.int64), np.asarray(kept.probs, dtype=np.float64)


def check_forced(case: schema.Case, run: Run, tolerance: Tolerance, where: str) -> SamplingReport:
    """The teacher-forced run's processed distributions against the case's sampling goldens."""
    report = SamplingReport()
    atol = tolerance.logprob_atol
    for sampled in case.sampling:
        settings = settings_of(sampled)
        margin = sampling.draw_margin(atol, settings)
        for i, golden in enumerate(sampled.forced):
            history = [*run.input_ids, *case.token_ids[:i]]
            row = run.logits[i]
            verdict = sampling.compare_kept(
                _pair(golden),
                sampling.processed(row, settings, history),
                sampling.kept_bounds(row, settings, history, atol),
                margin,
            )
            report.forced_steps += 1
            report.boundary_steps += verdict.verdict == "BOUNDARY"
            if np.isfinite(verdict.tv):
                report.max_tv = max(report.max_tv, verdict.tv)
            if verdict.verdict == "FAIL":
                report.failures.append(
                    f"{where}: case {case.id!r}, sampler {sampled.sampler!r}, teacher-forced "
                    f"step {i}: {verdict.detail}"
                )
    return report


def check_drawn(
    case: schema.Case,
    sampled: schema.Sampled,
    input_ids: list[int],
    tokens: list[int],
    logits: np.ndarray,
    tolerance: Tolerance,
    where: str,
) -> SamplingReport:
    """A run's seeded continuation (its tokens, and the logits [steps, vocab] that drew them)
    against the golden's, by the draw rule, up to the first step that is not equal."""
    report = SamplingReport()
    settings = settings_of(sampled)
    atol = tolerance.logprob_atol
    margin = sampling.draw_margin(atol, settings)
    seed = settings.seed
    history = list(input_ids)
    prefix = f"{where}: case {case.id!r}, sampler {sampled.sampler!r}, seeded draw"
    for step, golden in enumerate(sampled.drawn):
        if step >= len(tokens):
            report.failures.append(
                f"{prefix} {step}: the run stopped after {len(tokens)} tokens, the golden "
                f"continues to {len(sampled.tokens)} ({sampled.tokens[len(tokens) :][:5]}...)"
            )
            break
        u = float(sampling.uniform(seed, len(history)))
        p = _pair(golden)
        own = _own_draw(p, u)
        if sampled.tokens[step] not in own:
            report.failures.append(
                f"{prefix} {step}: the golden drew {sampled.tokens[step]} from its recorded "
                f"distribution, where the uniform at position {len(history)} (u={u:.6f}) draws "
                f"{sorted(own)}: another generator, seed or position than the golden's"
            )
            break
        row = logits[step]
        q = sampling.processed(row, settings, history)
        verdict = sampling.compare_draws(
            p, q, u, margin, sampling.kept_bounds(row, settings, history, atol)
        )
        report.draws += 1
        if np.isfinite(verdict.tv):
            report.max_tv = max(report.max_tv, verdict.tv)
        run_draw = verdict.run_token
        if verdict.verdict == "FAIL":
            report.failures.append(f"{prefix} {step}: {verdict.detail}")
            break
        if tokens[step] != run_draw:
            report.failures.append(
                f"{prefix} {step}: the run emitted {tokens[step]}, where its own logits draw "
                f"{run_draw} at u={u:.6f}: the decoder drew from something else"
            )
            break
        if verdict.verdict == "AMBIGUOUS":
            report.ambiguous_draws += 1
            break
        if tokens[step] != sampled.tokens[step]:
            report.failures.append(
                f"{prefix} {step}: the run drew {tokens[step]}, the golden "
                f"{sampled.tokens[step]}, and no tolerance explains it"
            )
            break
        history.append(sampled.tokens[step])
    else:
        if len(tokens) > len(sampled.tokens):
            report.failures.append(
                f"{prefix}: the run went on past the golden's {len(sampled.tokens)} tokens "
                f"(stopped on an end-of-sequence id there) to {len(tokens)}"
            )
    return report


def _own_draw(p: tuple[np.ndarray, np.ndarray], u: float) -> set[int]:
    """The token(s) a recorded distribution draws at u, allowing for its float32 rounding."""
    return {
        int(sampling.pick(*p, min(max(x, 0.0), 1.0 - 1e-16)))
        for x in (u - RECORDED_ROUNDING, u, u + RECORDED_ROUNDING)
    }


def solo_outputs(engine, golden: schema.Golden) -> dict[tuple[str, str], object]:
    """`engine.generate` sampling each case's samplers under their seeds, keyed (case,
    sampler) as scenarios.sampled_served keys its served outputs."""
    return {
        (case.id, sampled.sampler): engine.generate(
            case.input_ids, len(sampled.tokens), sampling=settings_of(sampled)
        )
        for case in golden.cases
        for sampled in case.sampling
    }


def check_outputs(
    golden: schema.Golden, outputs: dict, tolerance: Tolerance, where: str
) -> SamplingReport:
    """Each case's seeded continuations (`outputs`, GenerationOutputs keyed (case, sampler))
    against its sampling goldens by check_drawn."""
    report = SamplingReport()
    for case in golden.cases:
        for sampled in case.sampling:
            out = outputs[(case.id, sampled.sampler)]
            logits = out.logits.float().numpy()
            report.add(
                check_drawn(
                    case, sampled, case.input_ids, list(out.tokens), logits, tolerance, where
                )
            )
    return report
