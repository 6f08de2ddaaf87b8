"""Constrained goldens: what each constraint of cases.yaml's table makes of a golden case,
recorded by evaluate_llama and checked on every mode and serving path.

Recorded per short case and constraint (schema `Constrained`): the greedy continuation under
the constraint, each step's logits restricted to the language and renormalized (a `Step`
whose top-k and logsumexp are over the allowed ids) with the step's mask (`Allowed`: the
count and sha256 of the allowed ids), and the constraint's sampler on the same language (the
processed distribution at each teacher-forced step, and its seeded continuation). A
continuation that is not a member of its language, or that runs to max tokens, fails to
record: every language of the table is finite and short.

Checked, for a run of the engine with the same constraint:

- **forced** (`check_forced`, test_llama, every mode): the engine fed the golden's
  constrained tokens. Each step's allowed ids must be the golden's exactly (the mask does not
  depend on the numerics: any difference FAILs, naming the step and both counts); the
  restricted rows are compared with the golden's by compare.py's rules under the mode's
  tolerance (log-probabilities renormalized to the language, top-k, KL, the greedy choice
  with its near-tie rule), and the sampler's processed distributions by the kept-set rule.
- **continuations** (`check_outputs`, test_llama_sampling, solo and every serving scenario):
  the greedy continuation equals the golden's up to a step where the golden's restricted row
  is a near-tie between the two choices (AMBIGUOUS, counted; the comparison ends there), and
  the seeded one passes the draw rule (sampling_goldens.check_drawn on the restricted rows).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from goldens import compare, schema
from goldens.record import ConstraintSpec, constraint_specs, sampler_specs
from goldens.tolerances import Tolerance
from harness.llama3 import sampling_goldens
from harness.llama3.engine_runs import Run
from harness.llama3.sampling_goldens import SamplingReport, settings_of
from pipelines.llama3 import constrained, sampling


def constraint_of(entry: schema.Constrained | ConstraintSpec) -> constrained.Constraint:
    return constrained.Constraint(entry.kind, entry.text)


def restricted(logits: np.ndarray, allowed: list[np.ndarray]) -> np.ndarray:
    """Rows [steps, vocab] of `logits` with every id outside the step's allowed ids at -inf."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = np.full_like(logits, -np.inf)
    vocab = logits.shape[1]
    for i, ids in enumerate(allowed):
        ids = np.asarray(ids)
        ids = ids[ids < vocab]
        rows[i, ids] = logits[i, ids]
    return rows


def _in_vocab(ids: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.asarray(ids)
    return ids[ids < vocab]


@functools.cache
def _samplers() -> dict:
    return {spec.id: spec for spec in sampler_specs()}


def _generate(engine, input_ids, entry, max_tokens, **kwargs):
    """`engine.generate` under `entry`'s constraint, keeping each step's allowed ids."""
    return engine.generate(
        list(input_ids),
        max_tokens,
        constraint=constraint_of(entry),
        record_allowed=True,
        **kwargs,
    )


def _member(spec: ConstraintSpec, engine, tokens: list[int], what: str) -> None:
    """Raise unless `tokens` end on an end-of-sequence id and spell a member."""
    if not tokens or tokens[-1] not in engine.eos_ids:
        raise ValueError(
            f"constraint {spec.id!r}: the {what} continuation ran to {spec.max_tokens} tokens "
            f"without an end of sequence ({engine.tokenizer.decode(tokens)!r}): give the "
            "language a shorter longest member, or raise its max_tokens in cases.yaml"
        )
    text = engine.tokenizer.decode(tokens[:-1])
    reason = spec.member(text)
    if reason:
        raise ValueError(f"constraint {spec.id!r}: the {what} continuation is no member: {reason}")


def _kept(rows: np.ndarray, settings, history: list[int], tokens: list[int]) -> list[schema.Kept]:
    return [
        schema.kept_from(*sampling.processed(rows[i], settings, [*history, *tokens[:i]]))
        for i in range(len(tokens))
    ]


def record(engine, run: Run) -> list[schema.Constrained]:
    """The constrained goldens of one short case's run: a record per constraint of cases.yaml
    that names the case (golden_files.engine_golden records none for long cases)."""
    decode = engine.tokenizer.decode
    recorded = []
    for spec in constraint_specs():
        if run.spec.id not in spec.cases:
            continue
        out = _generate(engine, run.input_ids, spec, spec.max_tokens)
        tokens = list(out.tokens)
        _member(spec, engine, tokens, "greedy")
        logits = out.logits.float().numpy()
        rows = restricted(logits, out.allowed)
        steps = [
            schema.step_from_logits(rows[i], t, decode([t]), run.spec.top_k)
            for i, t in enumerate(tokens)
        ]
        allowed = [schema.allowed_from(_in_vocab(ids, logits.shape[1])) for ids in out.allowed]
        sampler = _samplers()[spec.sampler]
        settings = settings_of(sampler)
        drawn_out = _generate(engine, run.input_ids, spec, spec.max_tokens, sampling=settings)
        drawn_tokens = list(drawn_out.tokens)
        _member(spec, engine, drawn_tokens, f"seeded ({spec.sampler})")
        drawn_rows = restricted(drawn_out.logits.float().numpy(), drawn_out.allowed)
        sampled = schema.Sampled(
            spec.sampler,
            dict(sampler.settings),
            _kept(rows, settings, run.input_ids, tokens),
            drawn_tokens,
            _kept(drawn_rows, settings, run.input_ids, drawn_tokens),
        )
        recorded.append(
            schema.Constrained(
                spec.id, spec.kind, spec.text, steps, allowed, stopped_on_eos=True, sampled=sampled
            )
        )
    return recorded


@dataclasses.dataclass
class ConstrainedReport(SamplingReport):
    """The constrained checks of one golden: SamplingReport's counts for the sampler, and the
    restricted steps, masks and greedy continuations."""

    steps: int = 0  # teacher-forced restricted rows compared (compare.py)
    masks: int = 0  # teacher-forced masks compared
    ambiguous_steps: int = 0
    max_logprob_diff: float = 0.0
    greedy: int = 0  # greedy continuation tokens compared
    ambiguous_greedy: int = 0

    @property
    def checks(self) -> int:
        return super().checks + self.steps + self.masks + self.greedy

    def add(self, other: SamplingReport) -> None:
        super().add(other)
        if isinstance(other, ConstrainedReport):
            for name in ("steps", "masks", "ambiguous_steps", "greedy", "ambiguous_greedy"):
                setattr(self, name, getattr(self, name) + getattr(other, name))
            self.max_logprob_diff = max(self.max_logprob_diff, other.max_logprob_diff)

    def summary(self) -> str:
        return (
            f"constrained: {'FAIL' if self.failures else 'PASS'}, {self.masks} masks, "
            f"{self.steps} restricted steps ({self.ambiguous_steps} ambiguous, max |Δ log-prob| "
            f"{self.max_logprob_diff:.3g}), {self.forced_steps} forced distributions "
            f"({self.boundary_steps} at a kept-set boundary), {self.greedy} greedy tokens "
            f"({self.ambiguous_greedy} ambiguous), {self.draws} seeded draws "
            f"({self.ambiguous_draws} ambiguous), max TV {self.max_tv:.3g}"
        )


def _mask_failure(golden: schema.Allowed, ids: np.ndarray) -> str | None:
    if golden.count == len(ids) and golden.sha256 == schema.allowed_digest(ids):
        return None
    detail = f"the run allows {len(ids)} ids, the golden {golden.count}"
    if golden.ids is not None:
        extra = sorted(set(ids.tolist()) - set(golden.ids))[:5]
        missing = sorted(set(golden.ids) - set(ids.tolist()))[:5]
        detail += f" (the run's extra {extra}, missing {missing})"
    return detail


def _compare_restricted(
    report: ConstrainedReport, as_case: schema.Case, tokens, rows, tolerance: Tolerance, label: str
) -> None:
    """A run's restricted rows (full, or top-k) against a constrained golden's steps by
    compare.py's rules, counted into `report`, its first failing step a failure."""
    verdict = compare.compare_case(as_case, None, tokens, rows, tolerance)
    report.steps += len(verdict.steps)
    report.ambiguous_steps += len(verdict.ambiguous_steps)
    report.max_logprob_diff = max(report.max_logprob_diff, verdict.max_logprob_diff)
    failing = verdict.first_failing
    if failing is not None:
        report.failures.append(
            f"{label}, restricted {failing.where}: {failing.metric}: {failing.detail}"
        )


def check_forced(case: schema.Case, engine, tolerance: Tolerance, where: str) -> ConstrainedReport:
    """The engine fed each of the case's constrained continuations, against its golden."""
    report = ConstrainedReport()
    for entry in case.constrained:
        label = f"{where}: case {case.id!r}, constraint {entry.constraint!r}"
        tokens = entry.token_ids
        out = _generate(engine, case.input_ids, entry, len(tokens), forced_tokens=tokens)
        logits = out.logits.float().numpy()
        for i, (golden, ids) in enumerate(zip(entry.allowed, out.allowed, strict=True)):
            report.masks += 1
            failure = _mask_failure(golden, np.unique(_in_vocab(ids, logits.shape[1])))
            if failure:
                report.failures.append(f"{label}, teacher-forced step {i}: mask differs: {failure}")
                break
        rows = restricted(logits, out.allowed)
        as_case = entry.as_case(case)
        _compare_restricted(report, as_case, list(out.tokens), rows, tolerance, label)
        run = Run(None, list(case.input_ids), list(out.tokens), rows, 0.0)
        report.add(sampling_goldens.check_forced(as_case, run, tolerance, label))
    return report


def check_greedy(
    case: schema.Case,
    entry: schema.Constrained,
    tokens: list[int],
    rows: np.ndarray,
    tolerance: Tolerance,
    where: str,
) -> ConstrainedReport:
    """A greedy constrained continuation (its tokens and restricted rows) against the golden's:
    equal, or different first where both rows make the two choices a near-tie (AMBIGUOUS:
    the continuations part there)."""
    report = ConstrainedReport()
    label = f"{where}: case {case.id!r}, constraint {entry.constraint!r}, greedy"
    golden_tokens = entry.token_ids
    margin = tolerance.near_tie_margin
    for i, golden in enumerate(entry.steps):
        if i >= len(tokens):
            report.failures.append(
                f"{label} step {i}: the run stopped after {len(tokens)} tokens, the golden "
                f"continues to {len(golden_tokens)}"
            )
            return report
        report.greedy += 1
        token = tokens[i]
        if token == golden.token_id:
            continue
        golden_lp = dict(zip(golden.topk_ids, golden.topk_log_probs(), strict=True))
        golden_gap = golden_lp[golden.token_id] - golden_lp.get(token, -np.inf)
        run_gap = float(rows[i][token] - rows[i][golden.token_id])
        if golden_gap < margin and run_gap < margin:
            report.ambiguous_greedy += 1
            return report
        report.failures.append(
            f"{label} step {i}: the run chose {token}, the golden {golden.token_id} (the golden "
            f"prefers its own by {golden_gap:.3g}, the run its own by {run_gap:.3g}; near-tie "
            f"margin {margin:g})"
        )
        return report
    if len(tokens) > len(golden_tokens):
        report.failures.append(
            f"{label}: the run went on past the golden's {len(golden_tokens)} tokens "
            f"(an end of sequence there) to {len(tokens)}"
        )
    return report


# The key of a constrained continuation among served and solo outputs: (case, "CONSTRAINT"
# for the greedy one, "CONSTRAINT/SAMPLER" for the seeded one).
def keys(case: schema.Case, entry: schema.Constrained) -> tuple[tuple, tuple]:
    return (case.id, entry.constraint), (case.id, f"{entry.constraint}/{entry.sampled.sampler}")


def requests(
    golden: schema.Golden, greedy_only: bool = False
) -> list[tuple[tuple, schema.Case, schema.Constrained, bool]]:
    """Every constrained continuation of `golden` (the greedy ones only, with `greedy_only`):
    (key, case, entry, seeded)."""
    found = []
    for case in golden.cases:
        for entry in case.constrained:
            greedy, seeded = keys(case, entry)
            found.append((greedy, case, entry, False))
            if not greedy_only:
                found.append((seeded, case, entry, True))
    return found


def solo_outputs(engine, golden: schema.Golden, greedy_only: bool = False) -> dict:
    """`engine.generate` of every constrained continuation (the greedy ones only, with
    `greedy_only`: a speculative engine's seeded draws are not the golden's), keyed as `keys`
    says."""
    return {
        key: _generate(
            engine,
            case.input_ids,
            entry,
            len(entry.sampled.tokens if seeded else entry.steps),
            sampling=settings_of(entry.sampled) if seeded else None,
        )
        for key, case, entry, seeded in requests(golden, greedy_only)
    }


def check_outputs(
    golden: schema.Golden,
    outputs: dict,
    tolerance: Tolerance,
    where: str,
    greedy_only: bool = False,
) -> ConstrainedReport:
    """Each constrained continuation (`outputs`: GenerationOutputs with their allowed ids,
    keyed as `keys` says; the greedy ones only, with `greedy_only`) against its golden: the
    greedy ones by check_greedy, the seeded ones by the draw rule."""
    report = ConstrainedReport()
    for key, case, entry, seeded in requests(golden, greedy_only):
        out = outputs[key]
        rows = restricted(out.logits.float().numpy(), out.allowed)
        tokens = list(out.tokens)
        if seeded:
            label = f"{where}: constraint {entry.constraint!r}"
            report.add(
                sampling_goldens.check_drawn(
                    entry.as_case(case),
                    entry.sampled,
                    case.input_ids,
                    tokens,
                    rows,
                    tolerance,
                    label,
                )
            )
        else:
            report.add(check_greedy(case, entry, tokens, rows, tolerance, where))
    return report


# --- another engine: llama-server's grammar-constrained completions -----------------------

# The post-sampling probabilities asked of llama-server per step: above every golden's top-k,
# and above the mask of every step that lists its ids (the whole language at that step).
LLAMA_SERVER_PROBS = 64


def check_llama_server(
    server,
    case: schema.Case,
    entry: schema.Constrained,
    spec: ConstraintSpec,
    tokenizer,
    tolerance: Tolerance,
    grammar=None,
) -> ConstrainedReport:
    """llama-server (goldens.engines.openai.LlamaCppEngine) under `entry`'s constraint,
    against the golden: its greedy continuation must end on an end of generation and be a
    member (a JSON schema sent as its `json_schema`, whose language admits whitespace: that
    alone); where its GBNF spells this language (spec.llama_cpp_grammar), its tokens must be
    the golden's up to a near-tie of the golden's restricted row, and its restricted
    distribution (post-sampling probabilities under the grammar, teacher-forced by the
    golden's tokens: every step of a choice, whose rest after a prefix is a grammar too, the
    first step of a regex) must allow the golden's ids where the golden lists them and pass
    the golden's restricted steps by compare.py's rules for a top-k.

    llama.cpp ends a generation on any control token it names an end (Llama 3's
    <|end_of_text|> and <|eom_id|> besides the checkpoint's <|eot_id|>), which would make its
    language's end other ids than the golden's: every control token but the checkpoint's
    end-of-sequence ids is banned by `logit_bias`. `grammar(prefix)` replaces
    spec.llama_cpp_grammar (a planted bug)."""
    grammar = grammar or spec.llama_cpp_grammar
    report = ConstrainedReport()
    label = f"llama-server: case {case.id!r}, constraint {entry.constraint!r}"
    spelled = grammar()
    fields = {"grammar": spelled} if spelled else {"json_schema": json.loads(spec.text)}
    _, special = tokenizer.token_bytes()
    fields["logit_bias"] = [[i, False] for i in sorted(special - tokenizer.eos_ids)]
    answer = server.completion(case.input_ids, spec.max_tokens, temperature=0.0, **fields)
    tokens, text = [int(t) for t in answer.get("tokens", [])], answer.get("content", "")
    if answer.get("stop_type") != "eos":
        report.failures.append(
            f"{label}: greedy continuation stopped by {answer.get('stop_type')!r}, not an end of "
            f"generation, after {len(tokens)} tokens ({text!r})"
        )
        return report
    reason = spec.member(text)
    if reason:
        report.failures.append(f"{label}: greedy continuation is no member: {reason}")
        return report
    if not spelled:
        return report
    report.add(_greedy_against(label, entry, entry.token_ids, tokens, tolerance.near_tie_margin))
    rows = []
    for i in range(len(entry.steps)):
        try:
            rest = grammar(tokenizer.decode(entry.token_ids[:i]))
        except ValueError:  # a regex: its rest has no spelling here past the first step
            break
        if rest is None:  # only the end is left
            break
        answer = server.completion(
            [*case.input_ids, *entry.token_ids[:i]],
            1,
            grammar=rest,
            n_probs=LLAMA_SERVER_PROBS,
            post_sampling_probs=True,
            samplers=["temperature"],
            temperature=1.0,
            seed=0,
            logit_bias=fields["logit_bias"],
        )
        row = _restricted_row(answer, label, i)
        # where the golden lists its mask and llama-server's top holds all of it: the same ids
        allowed = entry.allowed[i]
        report.masks += allowed.ids is not None and allowed.count <= LLAMA_SERVER_PROBS
        if report.masks and allowed.ids is not None and set(row.ids) != set(allowed.ids):
            report.failures.append(
                f"{label}, teacher-forced step {i}: llama-server's grammar allows "
                f"{sorted(row.ids)}, the golden's language {allowed.ids}"
            )
            return report
        rows.append(row)
    if rows:
        as_case = dataclasses.replace(
            entry.as_case(case), steps=entry.steps[: len(rows)], sampling=[]
        )
        _compare_restricted(report, as_case, [row.token for row in rows], rows, tolerance, label)
    return report


def _greedy_against(
    label: str, entry: schema.Constrained, golden: list[int], run: list[int], margin: float
) -> ConstrainedReport:
    """Another engine's greedy tokens against the golden's, by the golden's restricted rows
    alone (the engine's own rows are not known): a first difference is AMBIGUOUS only where
    the golden ranks the engine's token within the near-tie margin of its own."""
    report = ConstrainedReport()
    for i, (want, got) in enumerate(zip(golden, run, strict=False)):
        report.greedy += 1
        if want == got:
            continue
        step = entry.steps[i]
        golden_lp = dict(zip(step.topk_ids, step.topk_log_probs(), strict=True))
        gap = golden_lp[want] - golden_lp.get(got, -np.inf)
        if gap < margin:
            report.ambiguous_greedy += 1
        else:
            report.failures.append(
                f"{label}, greedy step {i}: llama-server chose {got}, the golden {want} (which "
                f"it prefers by {gap:.3g}; near-tie margin {margin:g})"
            )
        return report
    if len(golden) != len(run):
        report.failures.append(
            f"{label}: llama-server's greedy continuation ended after {len(run)} tokens, the "
            f"golden's after {len(golden)}"
        )
    return report


def _restricted_row(answer: dict, label: str, step: int) -> compare.TopLogprobs:
    """The post-sampling top probabilities llama-server answered, as a top-k row."""
    try:
        (probs,) = answer["completion_probabilities"]
        top = probs["top_probs"]
        ids = tuple(int(t["id"]) for t in top)
        logprobs = tuple(float(np.log(max(float(t["prob"]), 1e-45))) for t in top)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{label}, step {step}: llama-server answered no post-sampling probabilities "
            f"({error!r}): {str(answer)[:200]}"
        ) from None
    return compare.TopLogprobs(ids, logprobs)
