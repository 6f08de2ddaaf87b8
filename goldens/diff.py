"""Two sets of golden files compared step by step, and classified.

`diff_sets(before, after)` gives one `FileDiff` per golden file, each with one `CaseDiff` per
case: the first changed step, the per-step |Δ log-prob| and KL (`step_delta`), and which
fields, tokens or cases differ. `file_class`/`worst_class` name the worst class of a change
against the file's tolerance entry, worst first: cases changed, tokens changed, over
tolerance, moved, noise, identical (docs/goldens.md, "Changing a golden"); a case's sampling
goldens count too (`sampling_class`: samplers added or reset, a kept set or a seeded
continuation changed), and its constrained goldens (`constrained_class`: constraints added or
changed, a mask or a constrained continuation changed). Golden files are
read leniently (`parse_golden`: any schema_version, any provenance fields), so two schema
versions compare. tools/golden_diff renders the result; the numbers' rules are in its
docstring.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from goldens import locate, schema
from goldens.compare import bucket_kl
from goldens.schema import Case, Step, case_from_json
from goldens.tolerances import Tolerance, tolerance

OWN_NAME = locate.ARCHIVES["own"][0]
TORCH_NAME = locate.ARCHIVES["torch"][0]


class UnreadableGolden(ValueError):
    """A file that is not a golden (not JSON, or malformed)."""


@dataclasses.dataclass(frozen=True)
class GoldenFile:
    """A golden read leniently: any schema_version, provenance as the fields it has."""

    schema_version: Any
    provenance: dict[str, Any]
    cases: list[Case]


@dataclasses.dataclass(frozen=True)
class GoldenSet:
    description: str
    files: dict[str, GoldenFile]
    # A failing test's outputs hold only the goldens that failed: the rest are the pinned ones
    # (`over`).
    partial: bool = False

    def over(self, base: GoldenSet) -> GoldenSet:
        """This set's files over `base`'s, for a partial set; a whole set stays as it is."""
        if not self.partial:
            return self
        files = {**base.files, **self.files}
        return GoldenSet(f"{self.description}, other files from {base.description}", files)


def parse_golden(data: bytes, source: str) -> GoldenFile:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnreadableGolden(
            f"{source} is not readable JSON ({error}); regenerate it or compare another input"
        ) from None
    try:
        return GoldenFile(
            schema_version=body.get("schema_version"),
            provenance=dict(body["provenance"]),
            cases=[case_from_json(c) for c in body["cases"]],
        )
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise UnreadableGolden(
            f"{source} is not a golden file (malformed: {error!r}); regenerate it or compare "
            "another input"
        ) from None


def belongs_to(name: str, file_name: str) -> bool:
    """NAME's files, as testdata/README.md publishes them: torch_*_golden.json for torch's
    archive, every other *_golden.json for the engine's."""
    return file_name.endswith("_golden.json") and file_name.startswith("torch_") == (
        name == TORCH_NAME
    )


@dataclasses.dataclass(frozen=True)
class StepDelta:
    max_logprob_diff: float
    kl: float
    bounded_ids: int  # from-side top-k ids outside the to side's top-k


IDENTICAL_STEP = StepDelta(0.0, 0.0, 0)


def step_delta(before: Step, after: Step) -> StepDelta:
    """Max |Δ log-prob| over `before`'s top-k ids and KL(before || after) with a tail bucket.

    An id `after` lacks gets `after`'s k-th log-prob, an upper bound of its own.
    """
    if before == after:
        return IDENTICAL_STEP
    from_lp = before.topk_log_probs()
    after_lp = after.topk_log_probs()
    by_id = dict(zip(after.topk_ids, after_lp, strict=True))
    bound = float(after_lp.min())
    to_lp = np.array([by_id.get(i, bound) for i in before.topk_ids])
    missing = len(set(before.topk_ids) - by_id.keys())
    outside = sum(math.exp(lp) for i, lp in by_id.items() if i not in set(before.topk_ids))
    # What the to side's top-k leaves, without cancellation: 1 - exp(logsumexp(top-k)).
    rest = -math.expm1(float(np.logaddexp.reduce(after_lp)))
    tail = outside + max(rest - missing * math.exp(bound), 0.0)
    return StepDelta(
        max_logprob_diff=float(np.abs(to_lp - from_lp).max()),
        kl=bucket_kl(from_lp, to_lp, tail),
        bounded_ids=missing,
    )


def first_difference(before: Sequence[Any], after: Sequence[Any]) -> int | None:
    """The first index where the sequences differ (a missing item counts); None if equal."""
    if list(before) == list(after):
        return None
    pairs = zip(before, after, strict=False)
    return next((i for i, (b, a) in enumerate(pairs) if b != a), min(len(before), len(after)))


@dataclasses.dataclass(frozen=True)
class CaseDiff:
    case_id: str
    before: Case | None
    after: Case | None
    deltas: list[StepDelta]  # over the steps both sides have, when their inputs are equal
    # over the prompt positions both sides record, when their inputs are equal
    position_deltas: dict[int, StepDelta] = dataclasses.field(default_factory=dict)

    @property
    def status(self) -> str:
        before, after = self.before, self.after
        if before is None or after is None:
            return "added" if before is None else "removed"
        if before == after:
            return "identical"
        if before.prompt != after.prompt:
            return "prompt differs"
        if before.input_ids != after.input_ids:
            return "input ids differ"
        return "changed"


# Classes of a difference, mildest first; a file's is its worst case's.
CLASSES = ("identical", "noise", "moved", "over tolerance", "tokens changed", "cases changed")


def file_tolerance(golden: GoldenFile | None) -> Tolerance | None:
    """The tolerance entry a golden is held to (own for the engine's, torch for
    transformers'), or None where tolerances.yaml has none."""
    if golden is None:
        return None
    provenance = golden.provenance
    reference = schema.reference_of(provenance.get("producer"))
    try:
        return tolerance(reference, provenance.get("encoding", ""), provenance.get("device", ""))
    except KeyError:
        return None


def noise_limits(tol: Tolerance) -> tuple[float, float]:
    """(log-prob, KL) below which a difference is noise: the larger of the entry's floors."""
    floors = [f for f in (tol.noise_floor, tol.isa_noise_floor) if f is not None]
    return max((f.logprob for f in floors), default=0.0), max((f.kl for f in floors), default=0.0)


def case_class(diff: CaseDiff, tol: Tolerance | None) -> tuple[str, str]:
    """(class, why) of one case's difference under `tol` (None: noise cannot be told)."""
    before, after = diff.before, diff.after
    if diff.status == "identical":
        return "identical", ""
    if before is None or after is None or diff.status != "changed":
        return "cases changed", diff.status
    if before.positions != after.positions or len(before.steps) != len(after.steps):
        return "cases changed", "recorded steps or prompt positions differ"
    if before.token_ids != after.token_ids:
        return "tokens changed", f"from step {first_difference(before.token_ids, after.token_ids)}"
    logits = _logit_class(diff, tol)
    worst, whys = logits[0], [logits[1]]
    for changed in (sampling_class(before, after), constrained_class(before, after)):
        if changed is None:
            continue
        klass, why = changed
        if klass == "moved" and logits[0] != "identical":  # the probabilities follow the logits
            klass = logits[0]
        worst = max(worst, klass, key=CLASSES.index)
        whys.append(why)
    return worst, "; ".join(w for w in whys if w)


def constrained_class(before: Case, after: Case) -> tuple[str, str] | None:
    """(class, why) of the change in two cases' constrained goldens, None where they are
    equal: constraints added, removed or changed change cases; a mask, a greedy or seeded
    continuation or a kept set that differs changes tokens; probabilities alone moved,
    described by the largest change of a restricted log-probability or a kept probability."""
    if before.constrained == after.constrained:
        return None
    ours = {c.constraint: c for c in before.constrained}
    theirs = {c.constraint: c for c in after.constrained}
    added, removed = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
    reset = sorted(
        k
        for k in ours.keys() & theirs.keys()
        if (ours[k].kind, ours[k].text, ours[k].sampled.settings)
        != (theirs[k].kind, theirs[k].text, theirs[k].sampled.settings)
    )
    if added or removed or reset:
        parts = [
            f"{what} {names}"
            for what, names in (("added", added), ("removed", removed), ("changed", reset))
            if names
        ]
        return "cases changed", "constraints " + ", ".join(parts)
    worst = 0.0
    for name, old in ours.items():
        new = theirs[name]
        if old.token_ids != new.token_ids:
            step = first_difference(old.token_ids, new.token_ids)
            return "tokens changed", f"constraint {name}'s greedy continuation from step {step}"
        if old.allowed != new.allowed:
            step = first_difference(old.allowed, new.allowed)
            return "tokens changed", f"constraint {name}'s mask at step {step}"
        klass = sampling_class(old.as_case(before), new.as_case(after))
        if klass is not None and klass[0] != "moved":
            return klass[0], f"constraint {name}: {klass[1]}"
        for was, now in zip(old.steps, new.steps, strict=True):
            if was.topk_ids != now.topk_ids:
                continue  # a reordering within the tolerance: the logits' class says how far
            change = np.abs(was.topk_log_probs() - now.topk_log_probs()).max(initial=0.0)
            worst = max(worst, float(change))
    return "moved", f"constrained: max |Δ restricted log-prob| {number(worst)}"


def sampling_class(before: Case, after: Case) -> tuple[str, str] | None:
    """(class, why) of the change in two cases' sampling goldens, None where they are equal:
    samplers added, removed or reset change cases; a kept set or a seeded continuation that
    differs changes tokens; probabilities alone moved (as the logits, where those moved too:
    case_class), described by their largest change."""
    if before.sampling == after.sampling:
        return None
    ours = {s.sampler: s for s in before.sampling}
    theirs = {s.sampler: s for s in after.sampling}
    added, removed = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
    reset = sorted(k for k in ours.keys() & theirs.keys() if ours[k].settings != theirs[k].settings)
    if added or removed or reset:
        parts = [
            f"{what} {names}"
            for what, names in (("added", added), ("removed", removed), ("settings changed", reset))
            if names
        ]
        return "cases changed", "samplers " + ", ".join(parts)
    worst = 0.0
    for name, old in ours.items():
        new = theirs[name]
        if old.tokens != new.tokens:
            step = first_difference(old.tokens, new.tokens)
            return "tokens changed", f"sampler {name}'s seeded continuation from draw {step}"
        for where, a, b in (
            ("teacher-forced", old.forced, new.forced),
            ("drawn", old.drawn, new.drawn),
        ):
            for step, (was, now) in enumerate(zip(a, b, strict=True)):
                if was.ids != now.ids:
                    return "tokens changed", f"sampler {name}'s kept tokens at {where} step {step}"
                change = np.abs(np.subtract(was.probs, now.probs)).max(initial=0.0)
                worst = max(worst, float(change))
    return "moved", f"sampling: max |Δ probability| {number(worst)}"


def _logit_class(diff: CaseDiff, tol: Tolerance | None) -> tuple[str, str]:
    """case_class of the logits alone (the inputs and tokens are equal)."""
    before, after = diff.before, diff.after
    if (before.steps, before.position_steps) == (after.steps, after.position_steps):
        return "identical", ""
    deltas = [*diff.deltas, *diff.position_deltas.values()]
    logprob = max((d.max_logprob_diff for d in deltas), default=0.0)
    kl = max((d.kl for d in deltas), default=0.0)
    numbers = f"|Δ log-prob| {number(logprob)}, KL {number(kl)}"
    if tol is None:
        return "moved", f"{numbers}; no tolerance entry to tell noise"
    noise_logprob, noise_kl = noise_limits(tol)
    if logprob <= noise_logprob and kl <= noise_kl:
        return "noise", f"{numbers} within {tol.key}'s noise floor {number(noise_logprob)}"
    if logprob <= tol.logprob_atol and kl <= tol.kl_max:
        return "moved", f"{numbers} within {tol.key} ({tol.logprob_atol:g}, KL {tol.kl_max:g})"
    return "over tolerance", f"{numbers} over {tol.key} ({tol.logprob_atol:g}, KL {tol.kl_max:g})"


def file_class(diff: FileDiff) -> tuple[str, str]:
    """(class, why) of a file: its worst case's; an added or removed file changes cases."""
    if diff.status in ("added", "removed"):
        return "cases changed", f"file {diff.status}"
    tol = file_tolerance(diff.after)
    classes = [(case_class(c, tol), c.case_id) for c in diff.cases]
    (klass, why), case_id = max(classes, key=lambda c: CLASSES.index(c[0][0]))
    if klass == "identical" and diff.status == "changed":
        return "noise", "only the header changed"
    return klass, f"case {case_id}: {why}" if why else ""


def diff_case(before: Case | None, after: Case | None) -> CaseDiff:
    case_id = before.id if before is not None else after.id if after is not None else ""
    deltas, position_deltas = [], {}
    same_inputs = before is not None and after is not None
    if same_inputs and (before.prompt, before.input_ids) == (after.prompt, after.input_ids):
        deltas = [step_delta(b, a) for b, a in zip(before.steps, after.steps, strict=False)]
        theirs = dict(zip(after.positions, after.position_steps, strict=True))
        position_deltas = {
            p: step_delta(step, theirs[p])
            for p, step in zip(before.positions, before.position_steps, strict=True)
            if p in theirs
        }
    return CaseDiff(case_id, before, after, deltas, position_deltas)


@dataclasses.dataclass(frozen=True)
class FileDiff:
    name: str
    before: GoldenFile | None
    after: GoldenFile | None
    cases: list[CaseDiff]

    @property
    def status(self) -> str:
        if self.before is None:
            return "added"
        if self.after is None:
            return "removed"
        return "identical" if self.before == self.after else "changed"

    @property
    def header_differences(self) -> list[str]:
        """schema_version and each provenance field that differs, as 'field: a -> b'."""
        if self.before is None or self.after is None:
            return []
        fields = [("schema_version", self.before.schema_version, self.after.schema_version)]
        keys = sorted(self.before.provenance.keys() | self.after.provenance.keys())
        fields += [(k, self.before.provenance.get(k), self.after.provenance.get(k)) for k in keys]
        return [f"{k} {_value(a)} -> {_value(b)}" for k, a, b in fields if a != b]


def _value(value: Any) -> str:
    return "(absent)" if value is None else repr(value)


def diff_file(name: str, before: GoldenFile | None, after: GoldenFile | None) -> FileDiff:
    before_cases = {c.id: c for c in before.cases} if before else {}
    after_cases = {c.id: c for c in after.cases} if after else {}
    order = list(before_cases) + [c for c in after_cases if c not in before_cases]
    cases = [diff_case(before_cases.get(c), after_cases.get(c)) for c in order]
    return FileDiff(name, before, after, cases)


def diff_sets(before: GoldenSet, after: GoldenSet) -> list[FileDiff]:
    names = sorted(before.files.keys() | after.files.keys())
    return [diff_file(n, before.files.get(n), after.files.get(n)) for n in names]


def worst_class(diffs: list[FileDiff]) -> tuple[str, str]:
    """The worst class over the files and where it is."""
    classes = [(file_class(d), d.name) for d in diffs]
    nothing = (("identical", ""), "")
    (klass, why), name = max(classes, key=lambda c: CLASSES.index(c[0][0]), default=nothing)
    return klass, f"{name}: {why}" if why else name


def number(value: float) -> str:
    """Two significant digits; 4.1e-3 rather than 0.0041 below 0.01."""
    if value == 0:
        return "0"
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.2g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@dataclasses.dataclass(frozen=True)
class CaseRow:
    """One case of a diff in a line: what a review table (markdown, JSON) shows."""

    file: str
    case: str
    klass: str
    why: str
    first_changed_step: int | None  # None: no step changed
    token_before: str | None  # the greedy token at that step, each side (None: no such step)
    token_after: str | None
    # its id: what tells two tokens apart (texts can coincide: each byte of a multi-byte
    # character decodes alone to '\ufffd')
    token_id_before: int | None
    token_id_after: int | None
    max_logprob_diff: float  # over the compared steps and prompt positions
    max_kl: float

    def as_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        return {"class": fields.pop("klass"), **fields}


def case_rows(diffs: list[FileDiff]) -> list[CaseRow]:
    """Every case of every file, identical ones included, in file then case order."""
    rows = []
    for file in diffs:
        tol = file_tolerance(file.after if file.after is not None else file.before)
        for diff in file.cases:
            klass, why = case_class(diff, tol)
            if file.status in ("added", "removed"):
                klass, why = "cases changed", f"file {file.status}"
            deltas = [*diff.deltas, *diff.position_deltas.values()]
            step = None
            before, after = diff.before, diff.after
            if before is not None and after is not None:
                step = first_difference(before.steps, after.steps)

            def token(case: Case | None, at: int | None = step) -> Step | None:
                if case is None or at is None or at >= len(case.steps):
                    return None
                return case.steps[at]

            first, second = token(before), token(after)

            rows.append(
                CaseRow(
                    file=file.name,
                    case=diff.case_id,
                    klass=klass,
                    why=why,
                    first_changed_step=step,
                    token_before=None if first is None else first.token_text,
                    token_after=None if second is None else second.token_text,
                    token_id_before=None if first is None else first.token_id,
                    token_id_after=None if second is None else second.token_id,
                    max_logprob_diff=max((d.max_logprob_diff for d in deltas), default=0.0),
                    max_kl=max((d.kl for d in deltas), default=0.0),
                )
            )
    return rows
