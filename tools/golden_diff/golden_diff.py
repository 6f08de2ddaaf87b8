"""Show what is behind a new golden pin: two golden sets compared step by step.

A changed golden reaches review as a one-line change of a sha256 in MODULE.bazel, which says
nothing about what moved. `golden_diff NAME` opens two sets of NAME's golden files (by default
the pinned archive and the goldens just computed into the testdata folder) and reports, per
golden file and case, the first step whose numbers changed, the greedy tokens there with a few
steps of context, how far the log-probabilities moved, which provenance fields differ, and
which files or cases were added or removed. A reviewer reads it next to the hash.

Both goldens store per step only the top-k ids and logits and the logsumexp, so:
- a log-probability is a logit minus its step's logsumexp;
- |Δ log-prob| is taken over the "from" side's top-k ids. An id missing from the "to" side's
  top-k has a log-probability at most the to side's k-th one, which stands in for it as an
  upper bound (so |Δ| is a lower bound there when the from side's value is above it); the
  summary says how many ids were bounded at the step it quotes;
- KL(from || to) covers the from side's top-k ids plus one bucket for the rest of the
  vocabulary, the bucket estimate of compare.py (the to side's bucket is its known mass
  outside those ids plus what its top-k leaves, less the bounds it lent).
Each golden feeds its own greedy tokens, so once the tokens differ, later steps compare
different prefixes. Golden files are read leniently (any schema_version, any provenance
fields): comparing across a schema change is exactly what a reviewer needs.

Each file and case is classified against its tolerance entry (tolerances.yaml, by the
golden's producer, encoding and device), worst first: `cases changed` (cases, prompts, input
ids or recorded positions added or removed), `tokens changed` (a greedy token differs),
`over tolerance` (|Δ log-prob| or KL above the entry's threshold), `moved` (within the
tolerance, above the noise), `noise` (within the entry's noise floor: the larger of its
noise_floor and isa_noise_floor, what another CPU moves a correct run by), `identical`. The
last line names the worst class.

Exit status: 0 identical or noise only (nothing worth publishing), 1 anything worse, 2 bad
input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from goldens import locate
from goldens.artifacts import archive, stanza
from goldens.artifacts.extract import download_pinned, extract_pinned
from goldens.artifacts.stanza import GoldenPin
from goldens.artifacts.store import (
    SHA256_PATTERN,
    ArchiveRef,
    LocalStore,
    Store,
    StoreError,
    ref_from_url,
)
from goldens.artifacts.store_options import (
    CheckFailed,
    UsageError,
    add_store_arguments,
    store_from_args,
)
from goldens.cli_files import OneLineParser, output_directory, repo_root, user_path
from goldens.compare import bucket_kl
from goldens.report import CaseView, write_report
from goldens.schema import Case, Step, case_from_json
from goldens.tolerances import Tolerance, tolerance

T = TypeVar("T")
OWN_NAME = locate.ARCHIVES["own"][0]
TORCH_NAME = locate.ARCHIVES["torch"][0]
# variants.TESTDATA_REL; that module imports torch, which a diff does not need.
TESTDATA = Path("max_tests/integration/architectures/llama3/testdata")
REGENERATE = {
    OWN_NAME: "./bazelw run //max_tests/integration/architectures/llama3:evaluate_llama -- "
    "--encoding=all --model=all",
    TORCH_NAME: "./bazelw run //max_tests/integration/architectures/llama3/testdata:"
    "run_torch_llama -- --model=all --verbose",
}
CONTEXT_BEFORE, CONTEXT_AFTER = 2, 3  # steps of token context around a divergence

EXAMPLES = """\
examples:
  # the pinned archive against the goldens just computed into the testdata folder
  ./bazelw run //tools:golden_diff -- test_llama_golden
  # two published versions of the local store
  ./bazelw run //tools:golden_diff -- test_llama_golden --from=1 --to=2
  # a sha256 (stored or pinned) against a folder, with an HTML report
  ./bazelw run //tools:golden_diff -- torch_llama_golden \\
      --from=04065a48b3e58edad7d180e4940c3dbebc835ad6a782831db74e4157d8b1c8d5 \\
      --to=/tmp/goldens --html=diff.html
  # an archive file against the pin, without Bazel
  python3 -m tools.golden_diff.golden_diff test_llama_golden --to=test_llama_golden.tar.gz
"""

INPUT_HELP = (
    "a version of NAME in the store, a sha256 (stored or pinned), 'pinned', a folder of golden "
    "JSON files, or a .tar.gz archive (write ./2 for a folder named 2)"
)


class InputError(ValueError):
    """An input cannot be read as a set of NAME's goldens: exit 2."""


# --- reading goldens --------------------------------------------------------------------


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


def parse_golden(data: bytes, source: str) -> GoldenFile:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(
            f"{source} is not readable JSON ({error}); regenerate it or compare another input"
        ) from None
    try:
        return GoldenFile(
            schema_version=body.get("schema_version"),
            provenance=dict(body["provenance"]),
            cases=[case_from_json(c) for c in body["cases"]],
        )
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise InputError(
            f"{source} is not a golden file (malformed: {error!r}); regenerate it or compare "
            "another input"
        ) from None


def belongs_to(name: str, file_name: str) -> bool:
    """NAME's files, as testdata/README.md publishes them: torch_*_golden.json for torch's
    archive, every other *_golden.json for the engine's."""
    return file_name.endswith("_golden.json") and file_name.startswith("torch_") == (
        name == TORCH_NAME
    )


def golden_set(name: str, members: dict[str, bytes], description: str, where: str) -> GoldenSet:
    selected = {member: data for member, data in members.items() if belongs_to(name, member)}
    if not selected:
        pattern = "torch_*_golden.json" if name == TORCH_NAME else "*_golden.json except torch_*"
        raise InputError(
            f"{where} holds no {name} golden files ({pattern}); compute them with "
            f"{REGENERATE[name]}, or name another input"
        )
    files = {m: parse_golden(selected[m], f"{where}: {m}") for m in sorted(selected)}
    return GoldenSet(description, files)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What an input spelling is resolved against: NAME, its store and MODULE.bazel."""

    name: str
    store: Store
    module_file: Path

    def pin(self) -> GoldenPin | None:
        if not self.module_file.is_file():
            return None
        return stanza.parse(self.module_file.read_text(encoding="utf-8")).get(self.name)

    def stored_versions(self) -> str:
        return ", ".join(str(v) for v in self.store.versions(self.name)) or "none"


def load_input(inputs: Inputs, spec: str | None, flag: str) -> GoldenSet:
    """One side of the diff; `spec` None means the testdata folder."""
    if spec is None:
        return load_folder(inputs, repo_root() / TESTDATA, flag)
    if spec == "pinned":
        return load_pinned(inputs, flag)
    if SHA256_PATTERN.fullmatch(spec):
        return load_sha256(inputs, spec, flag)
    if spec.isascii() and spec.isdigit():
        return load_version(inputs, int(spec), flag)
    path = user_path(spec)
    if path.is_dir():
        return load_folder(inputs, path, flag)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        return load_archive_file(inputs, path, flag)
    raise InputError(
        f"{flag}={spec} (resolved to {path}) is none of: {INPUT_HELP}; "
        f"versions of {inputs.name} in the {inputs.store.description}: {inputs.stored_versions()}"
    )


def load_folder(inputs: Inputs, path: Path, flag: str) -> GoldenSet:
    members = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    return golden_set(inputs.name, members, f"folder {path}", f"{flag}: folder {path}")


def load_archive_file(inputs: Inputs, path: Path, flag: str) -> GoldenSet:
    where = f"{flag}: archive {path}"
    try:
        members = archive.unpack_members(path.read_bytes())
    except archive.ArchiveError as error:
        raise InputError(f"{where}: {error}; give a golden archive (NAME.tar.gz)") from None
    return golden_set(inputs.name, members, f"archive {path}", where)


def load_pinned(inputs: Inputs, flag: str) -> GoldenSet:
    pin = inputs.pin()
    if pin is None or not SHA256_PATTERN.fullmatch(pin.sha256):
        raise InputError(
            f"{flag}: {inputs.name} is not pinned in {inputs.module_file}; give a version "
            f"({inputs.stored_versions()}), a sha256, a folder or an archive instead"
        )
    pinned = ref_from_url(pin.url)
    if pinned is not None and pin.sha256 in inputs.store.digests(inputs.name, pinned.version):
        return load_stored(inputs, ArchiveRef(inputs.name, pinned.version, pin.sha256), flag)
    return load_sha256(inputs, pin.sha256, flag)


def load_version(inputs: Inputs, version: int, flag: str) -> GoldenSet:
    digests = inputs.store.digests(inputs.name, version)
    if digests:
        return load_stored(inputs, ArchiveRef(inputs.name, version, digests[0]), flag)
    pin = inputs.pin()
    pinned = ref_from_url(pin.url) if pin is not None else None
    if pin is not None and pinned is not None and pinned.version == version:
        return load_sha256(inputs, pin.sha256, flag)
    raise InputError(
        f"{flag}={version}: version {version} of {inputs.name} is not in the "
        f"{inputs.store.description} (versions there: {inputs.stored_versions()}); give one "
        "of those, or pick the store with --artifacts-dir or --bucket"
    )


def load_sha256(inputs: Inputs, sha256: str, flag: str) -> GoldenSet:
    """The archive with this sha256: from the store when it holds it, else fetched by the pin."""
    for version in inputs.store.versions(inputs.name):
        if sha256 in inputs.store.digests(inputs.name, version):
            return load_stored(inputs, ArchiveRef(inputs.name, version, sha256), flag)
    pin = inputs.pin()
    if pin is None or pin.sha256 != sha256:
        raise InputError(
            f"{flag}={sha256}: this sha256 of {inputs.name} is neither pinned in "
            f"{inputs.module_file} nor in the {inputs.store.description}; give a stored "
            f"version ({inputs.stored_versions()}) or its sha256"
        )
    pinned = ref_from_url(pin.url)
    label = inputs.name if pinned is None else f"{inputs.name} version {pinned.version}"
    where = f"{flag}: pinned {inputs.name} (sha256 {sha256})"
    members = fetch_members(inputs.store, pin, where)
    return golden_set(inputs.name, members, f"{label} (sha256 {sha256}), fetched", where)


def load_stored(inputs: Inputs, ref: ArchiveRef, flag: str) -> GoldenSet:
    """An archive the store holds, its sha256 checked on the way."""
    description = f"{ref.name} version {ref.version} (sha256 {ref.sha256})"
    where = f"{flag}: {description}"
    store = inputs.store
    if isinstance(store, LocalStore):
        # Into the cache the tests extract pinned archives to (locate.py): reused, not redone.
        cache = locate.cache_root()
        folder = checked(where, lambda: extract_pinned(store.path(ref), ref.sha256, cache))
        members = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    else:
        members = fetch_members(store, GoldenPin(ref.name, ref.sha256, store.url(ref)), where)
    return golden_set(inputs.name, members, description, where)


def fetch_members(store: Store, pin: GoldenPin, where: str) -> dict[str, bytes]:
    """The pinned archive's files, fetched and checked as `upload_artifact fetch` does."""
    return checked(where, lambda: archive.unpack_members(download_pinned(store, pin)))


def checked(where: str, action: Callable[[], T]) -> T:
    """`action()`, with a store or checksum failure reported as bad input naming `where`."""
    try:
        return action()
    except (CheckFailed, StoreError, archive.ArchiveError, OSError) as error:
        raise InputError(f"{where}: {error}") from None


# --- comparing --------------------------------------------------------------------------


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
    reference = "torch" if provenance.get("producer") == "torch" else "own"
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


# --- the text summary -------------------------------------------------------------------


def number(value: float) -> str:
    """Two significant digits; 4.1e-3 rather than 0.0041 below 0.01."""
    if value == 0:
        return "0"
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.2g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def token_at(case: Case, step: int) -> str:
    return repr(case.steps[step].token_text) if step < len(case.steps) else "(no step)"


def case_line(diff: CaseDiff) -> str:
    before, after = diff.before, diff.after
    if before is None or after is None or diff.status == "identical":
        return f"case {diff.case_id}: {diff.status}"
    if diff.status == "prompt differs":
        return f"case {diff.case_id}: prompt differs: {before.prompt!r} -> {after.prompt!r}"
    if diff.status == "input ids differ":
        return f"case {diff.case_id}: {input_ids_difference(before.input_ids, after.input_ids)}"
    return f"case {diff.case_id}: " + "; ".join(changed_parts(diff, before, after))


def changed_parts(diff: CaseDiff, before: Case, after: Case) -> list[str]:
    """The first changed step and its tokens, the worst numbers, and what the tokens did;
    then what changed at the recorded prompt positions."""
    deltas = diff.deltas
    positions = position_parts(diff, before, after)
    step = first_difference(before.steps, after.steps)
    if step is None:
        if positions:
            return ["steps identical", *positions]
        return [f"stopped_on_eos {before.stopped_on_eos} -> {after.stopped_on_eos}"]
    divergence = first_difference(before.token_ids, after.token_ids)
    parts = [f"first changed step {step}: {token_change(before, after, step)}"]
    if deltas:
        parts.append(worst_numbers(deltas, divergence))
    parts.append(
        "greedy tokens unchanged" if divergence is None else f"tokens differ from step {divergence}"
    )
    if len(before.steps) != len(after.steps):
        parts.append(f"{len(before.steps)} -> {len(after.steps)} steps")
    return parts + positions


def position_parts(diff: CaseDiff, before: Case, after: Case) -> list[str]:
    """Prompt positions recorded on one side only, and the worst change at those both
    record (the position, not a step, names it)."""
    parts = []
    if before.positions != after.positions:
        added = sorted(set(after.positions) - set(before.positions))
        removed = sorted(set(before.positions) - set(after.positions))
        reach = f" (up to position {max(after.positions)})" if after.positions else ""
        parts.append(
            f"prompt positions {len(before.positions)} -> {len(after.positions)} recorded"
            f"{reach}: {len(added)} added, {len(removed)} removed"
        )
    moved = {p: d for p, d in diff.position_deltas.items() if d != IDENTICAL_STEP}
    if moved:
        worst = max(moved, key=lambda p: moved[p].max_logprob_diff)
        parts.append(
            f"{len(moved)} of {len(diff.position_deltas)} prompt positions moved: max "
            f"|Δ log-prob| {number(moved[worst].max_logprob_diff)} (position {worst}), "
            f"max KL {number(max(d.kl for d in moved.values()))}"
        )
    return parts


def token_change(before: Case, after: Case, step: int) -> str:
    first, second = token_at(before, step), token_at(after, step)
    return f"{first} (same token)" if first == second else f"{first} -> {second}"


def worst_numbers(deltas: list[StepDelta], divergence: int | None) -> str:
    """The case's max |Δ log-prob| with its step and caveats, and its max KL."""
    worst = int(np.argmax([d.max_logprob_diff for d in deltas]))
    notes = [f"step {worst}"]
    if divergence is not None and worst > divergence:
        notes.append("after the tokens diverged")
    if deltas[worst].bounded_ids:
        count = deltas[worst].bounded_ids
        notes.append(f"{count} id{'s' * (count > 1)} outside the to top-k, bounded")
    return (
        f"max |Δ log-prob| {number(deltas[worst].max_logprob_diff)} ({', '.join(notes)}), "
        f"max KL {number(max(d.kl for d in deltas))}"
    )


def input_ids_difference(before: list[int], after: list[int]) -> str:
    at = first_difference(before, after) or 0
    first = before[at] if at < len(before) else "(end)"
    second = after[at] if at < len(after) else "(end)"
    return (
        f"input ids differ at position {at}: {first} -> {second} "
        f"({len(before)} -> {len(after)} ids; tokenizer or BOS changed?)"
    )


def context_lines(before: Case, after: Case) -> list[str]:
    """The greedy tokens of both sides around their first difference, '|' marking it."""
    at = first_difference(before.token_ids, after.token_ids)
    if at is None:
        return []
    start = max(0, at - CONTEXT_BEFORE)
    lines = []
    for label, case in (("from:", before), ("to:", after)):
        texts = [repr(s.token_text) for s in case.steps[start : at + CONTEXT_AFTER]]
        marked = [*texts[: at - start], "|", *texts[at - start :]]
        steps = f"steps {start}-{start + len(texts) - 1}:"
        lines.append(f"  {label:<5} {steps} {' '.join(marked)}")
    return lines


def file_lines(diff: FileDiff) -> list[str]:
    if diff.status == "added":
        return [f"{diff.name}: added ({len(diff.cases)} cases)"]
    if diff.status == "removed":
        return [f"{diff.name}: removed ({len(diff.cases)} cases)"]
    header = f"{diff.name}: {diff.status}"
    if diff.status != "identical":
        header += f" [{file_class(diff)[0]}]"
    if diff.header_differences:
        header += ": " + "; ".join(diff.header_differences)
    lines = [header]
    for case in diff.cases:
        lines.append("  " + case_line(case))
        if case.status == "changed":
            lines += ["  " + line for line in context_lines(case.before, case.after)]
    return lines


def verdict(diffs: Iterable[FileDiff]) -> str:
    statuses = [d.status for d in diffs]
    common = statuses.count("identical") + statuses.count("changed")
    changed, added, removed = (statuses.count(s) for s in ("changed", "added", "removed"))
    if changed + added + removed == 0:
        return f"identical: {common} files"
    return f"different: {changed} of {common} files changed, {added} added, {removed} removed"


def worst_class(diffs: list[FileDiff]) -> tuple[str, str]:
    """The worst class over the files and where it is."""
    classes = [(file_class(d), d.name) for d in diffs]
    nothing = (("identical", ""), "")
    (klass, why), name = max(classes, key=lambda c: CLASSES.index(c[0][0]), default=nothing)
    return klass, f"{name}: {why}" if why else name


def summary_lines(
    name: str, before: GoldenSet, after: GoldenSet, diffs: list[FileDiff]
) -> list[str]:
    lines = [f"golden diff {name}", f"from: {before.description}", f"to:   {after.description}"]
    for diff in diffs:
        lines += file_lines(diff)
    klass, where = worst_class(diffs)
    if klass == "identical":
        return [*lines, verdict(diffs)]
    return [*lines, verdict(diffs), f"worst: {klass} ({where})"]


# --- the HTML report: goldens/report.py's page, one section per case ------------


def case_views(diffs: list[FileDiff]) -> list[CaseView]:
    """One CaseView per case both sides have, changed or identical."""
    return [
        case_view(file, case)
        for file in diffs
        for case in file.cases
        if case.before is not None and case.after is not None
    ]


def case_view(file: FileDiff, diff: CaseDiff) -> CaseView:
    before, after = diff.before, diff.after
    assert before is not None and after is not None
    notes = [] if diff.status in ("changed", "identical") else [case_line(diff)]
    if len(after.steps) > len(before.steps):  # the page shows the from side's steps
        notes.append(f"the to side has {len(after.steps)} steps, the from side {len(before.steps)}")
    return CaseView(
        title=f"{file.name} / {diff.case_id}",
        prompt=before.prompt,
        golden_tokens=[s.token_text for s in before.steps],
        run_tokens=[s.token_text for s in after.steps[: len(before.steps)]],
        logprob_delta=[d.max_logprob_diff for d in diff.deltas],
        kl=[d.kl for d in diff.deltas],
        status="IDENTICAL" if diff.status == "identical" else "CHANGED",
        first_failing_step=first_difference(before.steps, after.steps),
        notes=(*notes, *file.header_differences),
        positions=tuple(diff.position_deltas),
        position_logprob_delta=tuple(d.max_logprob_diff for d in diff.position_deltas.values()),
        position_kl=tuple(d.kl for d in diff.position_deltas.values()),
    )


# --- the command ------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    result = OneLineParser(
        prog="golden_diff",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument("name", metavar="NAME", help=f"{OWN_NAME} or {TORCH_NAME}")
    result.add_argument(
        "--from", dest="before", default="pinned", help=f"{INPUT_HELP} (default: pinned)"
    )
    result.add_argument(
        "--to", dest="after", help=f"{INPUT_HELP} (default: the testdata folder, {TESTDATA})"
    )
    result.add_argument("--html", metavar="FILE", help="also write an HTML report to FILE")
    result.add_argument(
        "--module-file", help="MODULE.bazel whose pin 'pinned' means (default: REPO/MODULE.bazel)"
    )
    add_store_arguments(
        result, "store of versions and sha256s (default: REPO/artifacts)", publishes=False
    )
    return result


def inputs_from(args: argparse.Namespace) -> Inputs:
    if args.name not in REGENERATE:
        raise InputError(
            f"unknown NAME {args.name!r}; golden archives: {', '.join(sorted(REGENERATE))}"
        )
    try:
        store = store_from_args(args)
    except (UsageError, CheckFailed) as error:
        raise InputError(str(error)) from None
    module_file = user_path(args.module_file) if args.module_file else repo_root() / "MODULE.bazel"
    return Inputs(args.name, store, module_file)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # usage errors and --help
        return int(stop.code or 0)
    try:
        inputs = inputs_from(args)
        html = user_path(args.html) if args.html else None
        if html is not None:
            output_directory(html.parent, "--html")
        before = load_input(inputs, args.before, "--from")
        after = load_input(inputs, args.after, "--to")
    except ValueError as error:  # InputError, PathError, a MODULE.bazel stanza.parse refuses
        print(f"golden_diff: error: {error}", file=sys.stderr)
        return 2
    diffs = diff_sets(before, after)
    summary = summary_lines(args.name, before, after, diffs)
    print("\n".join(summary))
    if html is not None:
        write_report(html, f"golden diff {args.name}", summary, case_views(diffs))
        print(f"wrote {html}", file=sys.stderr)
    return 0 if worst_class(diffs)[0] in ("identical", "noise") else 1


if __name__ == "__main__":
    sys.exit(main())
