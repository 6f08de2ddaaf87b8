"""Another engine's sampler judged by its draws against a golden's processed distribution.

An engine that draws by seed (llama-server: `LlamaCppEngine.sampled_tokens`) is asked for the
first token after a golden case's prompt `draws` times, one seed each. The draws are held to
the golden's first step processed by pipelines/llama3/sampling.py in a named order (llama.cpp's
chain puts temperature last, transformers' first) by the G-test at `alpha`
(goldens/multinomial.py). With top-k at most the golden's stored top-k, the stored logits hold
every token either chain can keep, so the expected distribution is exact.

The false-alarm rate is measured, not assumed: the engine's own top-k log-probabilities at the
same position, processed the same way, lie KL(theirs || golden's) away, so the test's null is
noncentral with lambda = 2 draws KL; the rate is that tail at the test's critical value. Where
it exceeds 10 x alpha the engine's numerics, not its sampler, would decide the verdict: the
check is then INCONCLUSIVE. The power against the other order is printed with each verdict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from goldens import multinomial
from goldens.schema import Case, Step
from pipelines.llama3 import sampling
from pipelines.llama3.sampling import SamplerSettings

# llama.cpp's request field names, which are SamplerSettings' too
DEFAULT_SAMPLER = {"temperature": 1.5, "top_k": 20, "top_p": 0.8, "min_p": 0.05}
DRAWS = 2000
ALPHA = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplerVerdict:
    case_id: str
    order: str  # the order judged
    chain: list[str]  # the engine's sampler chain, as it reports it
    kept: int  # tokens the expected distribution keeps
    p_value: float  # the G-test's, in `order`
    p_other: float  # in the other order
    power: float  # against the other order, at alpha
    false_alarm: float
    kl_noise: float  # the engine's own logits, processed, from the golden's
    alpha: float = ALPHA

    @property
    def verdict(self) -> str:
        if self.false_alarm > 10 * self.alpha:
            return "INCONCLUSIVE"
        return "PASS" if self.p_value > self.alpha else "FAIL"

    def summary(self) -> str:
        return (
            f"{self.case_id}: {self.verdict} in the {self.order} order (G-test p = "
            f"{self.p_value:.3g}, {self.kept} tokens kept); the other order p = "
            f"{self.p_other:.3g} (power {self.power:.6f} at alpha {self.alpha:g}); false-alarm "
            f"rate {self.false_alarm:.3g} (the engine's logits KL {self.kl_noise:.3g} from "
            f"the golden's); chain {self.chain}"
        )


def expected(ids: Sequence[int], logits: Sequence[float], sampler: Mapping, order: str):
    """token -> probability: stored top-k logits processed by `sampler` in `order`."""
    values = np.full(max(ids) + 1, -np.inf)
    values[list(ids)] = logits
    settings = SamplerSettings(order=order, **{k: v for k, v in sampler.items() if k != "samplers"})
    kept, probs = sampling.processed(values, settings)
    return dict(zip(kept.tolist(), probs.tolist(), strict=True))


def usable(step: Step, sampler: Mapping) -> str | None:
    """Why the golden's step cannot give an exact expected distribution, or None."""
    k = int(sampler.get("top_k", 0))
    if not 0 < k <= len(step.topk_ids):
        return (
            f"top_k={k}: the golden stores its top {len(step.topk_ids)} logits; give a top_k "
            f"from 1 to {len(step.topk_ids)} so that they hold every token the chain keeps"
        )
    return None


def check_sampler(
    engine,
    case: Case,
    sampler: Mapping = DEFAULT_SAMPLER,
    draws: int = DRAWS,
    order: str = "llama_cpp",
    alpha: float = ALPHA,
) -> SamplerVerdict:
    """`engine`'s draws after `case`'s prompt, seeds 0 .. draws-1, judged in `order`."""
    step = case.steps[0]  # the first token after the prompt
    problem = usable(step, sampler)
    if problem is not None:
        raise ValueError(problem)
    other = next(o for o in sampling.ORDERS if o != order)
    want = expected(step.topk_ids, step.topk_logits, sampler, order)
    alternative = expected(step.topk_ids, step.topk_logits, sampler, other)
    drawn, chain = engine.sampled_tokens(case.input_ids, dict(sampler), range(draws))
    (row,) = engine.next_token_rows(case.input_ids, [len(case.input_ids) - 1], len(step.topk_ids))
    theirs = expected(row.ids, row.logprobs, sampler, order)
    if set(theirs) == set(want):
        kl_noise = sum(p * math.log(p / want[t]) for t, p in theirs.items())
        df = len(want) - 1
        lam = 2 * draws * kl_noise
        false_alarm = multinomial.noncentral_sf(multinomial.critical(df, alpha), df, lam)
    else:  # the engine's own numbers keep other tokens: its draws cannot match the golden's
        kl_noise, false_alarm = math.inf, 1.0
    return SamplerVerdict(
        case_id=case.id,
        order=order,
        chain=chain,
        kept=len(want),
        p_value=multinomial.g_test(drawn, want),
        p_other=multinomial.g_test(drawn, alternative),
        power=multinomial.power(want, alternative, draws, alpha),
        false_alarm=false_alarm,
        kl_noise=kl_noise,
        alpha=alpha,
    )
