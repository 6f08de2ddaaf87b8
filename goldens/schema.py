"""The golden file: what one producer (engine or torch reference) saw for one model x encoding.

A golden stores what diagnoses a failure, not full-vocabulary dumps: per step the chosen token,
the top-k ids and logits, the logsumexp and summary statistics of the full logits. That keeps a
4-prompt x 10-step file at vocab 128256 in tens of kilobytes. Full logits are opt-in.

Files are written deterministically: sorted keys, floats rounded to float32 precision
(`repr` of a float32 value is stable), no wall-clock fields, trailing newline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from goldens.cli_files import write_atomically

# 2: logits_dtype in the provenance; bfloat16 goldens' logits computed in float32.
# 3: cases carry `positions` and `position_steps`, the top-k log-probabilities at a spread of
#    prompt positions from the same prefill (long prompts). Version 2 files still read, with
#    no prompt positions (golden_diff compares old archives with new ones).
# 4: cases carry `sampling`: for each sampler of cases.yaml's table, the processed distribution
#    at every teacher-forced step and a seeded sampled continuation (`Sampled`). Older files
#    read with none.
# 5: cases carry `constrained`: for each constraint of cases.yaml's table that names the case,
#    the greedy continuation restricted to its language (`Constrained`: each step's logits
#    restricted and renormalized, the step's mask) and a seeded one. Older files read with none.
SCHEMA_VERSION = 5
READABLE_SCHEMA_VERSIONS = (2, 3, 4, 5)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a golden came from; compared loosely (a different producer is information)."""

    producer: str  # "engine" or "torch"
    producer_version: str
    model: str  # tinyllama | smollm2 | llama3_1
    encoding: str  # float32 | bfloat16 | q4_k | q4_1 | ...
    hardware: str  # "all" where the result does not depend on it, else the GPU's name
    device: str  # cpu | cuda
    dtype: str  # compute dtype: float32 | bfloat16
    checkpoint: str  # file name, not a path: goldens are machine-independent
    checkpoint_sha256: str
    torch_version: str
    logits_dtype: str  # the final norm and LM head's dtype: float32 for every producer
    # The machine's share of the numbers (empty in goldens made before they were recorded):
    # the CPU model, the kernel level torch ran (torch.backends.cpu.get_cpu_capability(),
    # e.g. AVX512, AVX2, DEFAULT) and its thread count. Another CPU gives files that differ
    # here and, within the tolerance's isa_noise_floor, in the numbers (golden_diff: noise).
    cpu: str = ""
    kernel_level: str = ""
    threads: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    token_id: int
    token_text: str
    topk_ids: list[int]
    topk_logits: list[float]
    logsumexp: float
    stats: dict[str, float]  # mean, std, min, max of the full logits
    logits: list[float] | None = None  # the full vocabulary, only with --full-logits

    @property
    def top_gap(self) -> float:
        """Top-1 minus top-2 logit: small means the greedy choice is a near-tie (infinite for
        a constrained step whose language allows one token)."""
        if len(self.topk_logits) < 2:
            return math.inf
        return self.topk_logits[0] - self.topk_logits[1]

    def topk_log_probs(self) -> np.ndarray:
        """Log-probabilities of the top-k ids (logit minus the step's logsumexp), float64."""
        return np.asarray(self.topk_logits, dtype=np.float64) - self.logsumexp


@dataclasses.dataclass(frozen=True)
class Kept:
    """One step's processed distribution: the ids a sampler keeps, ranked (logit descending,
    id ascending), and the probability it gives each (float32-rounded; they sum to ~1)."""

    ids: list[int]
    probs: list[float]


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One sampler of cases.yaml's `samplers` table on one case.

    `forced[i]` is the processed distribution at teacher-forced step i (the history: the
    prompt and the case's first i greedy tokens); `tokens` is the seeded continuation the
    sampler draws from the prompt (stopping at an end-of-sequence id like the steps), and
    `drawn[i]` the distribution that drew `tokens[i]`.
    """

    sampler: str  # the table's id
    settings: dict[str, Any]  # sampling.SamplerSettings' fields, the seed included
    forced: list[Kept]
    tokens: list[int]
    drawn: list[Kept]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.drawn):
            raise ValueError(
                f"sampler {self.sampler!r}: {len(self.tokens)} tokens but {len(self.drawn)} "
                "distributions that drew them"
            )


@dataclasses.dataclass(frozen=True)
class Allowed:
    """One constrained step's mask: how many ids the language allows there, the sha256 of
    those ids (ascending, little-endian int32: `allowed_digest`), and the ids themselves when
    there are at most MAX_LISTED (a step inside a JSON string allows most of a 128k vocabulary)."""

    count: int
    sha256: str
    ids: list[int] | None = None

    MAX_LISTED = 64


def allowed_from(ids) -> Allowed:
    """An `Allowed` from a step's allowed ids (any order)."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    listed = [int(i) for i in ids] if len(ids) <= Allowed.MAX_LISTED else None
    return Allowed(len(ids), allowed_digest(ids), listed)


def allowed_digest(ids: np.ndarray) -> str:
    """The sha256 of ascending ids as little-endian int32."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Constrained:
    """One constraint of cases.yaml's `constraints` table on one case.

    `steps[i]` is the greedy continuation's step i with the logits restricted to the language
    (every id outside it at -inf): its top-k among the allowed ids, its logsumexp over them
    (so the log-probabilities are renormalized to the language), and the constrained greedy
    choice; `allowed[i]` is that step's mask. The history of step i is the prompt and the first
    i tokens. `stopped_on_eos`: the continuation ended on an end-of-sequence id (its text a
    member of the language). `sampled` is the constraint's sampler on the same language: the
    processed distribution of each teacher-forced step and its seeded continuation.
    `kind` and `text` are pipelines.llama3.constrained.Constraint's fields.
    """

    constraint: str  # the table's id
    kind: str  # json_schema | regex | choice | grammar
    text: str
    steps: list[Step]
    allowed: list[Allowed]
    stopped_on_eos: bool
    sampled: Sampled

    def __post_init__(self) -> None:
        if not (len(self.steps) == len(self.allowed) == len(self.sampled.forced)):
            raise ValueError(
                f"constraint {self.constraint!r}: {len(self.steps)} steps, {len(self.allowed)} "
                f"masks and {len(self.sampled.forced)} teacher-forced distributions"
            )

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    def as_case(self, case: Case) -> Case:
        """This continuation as a case of its own (id `CASE/CONSTRAINT`): what compare.py and
        the sampling checks read, its rows being the restricted logits."""
        return Case(
            id=f"{case.id}/{self.constraint}",
            prompt=case.prompt,
            input_ids=list(case.input_ids),
            steps=list(self.steps),
            stopped_on_eos=self.stopped_on_eos,
            sampling=[self.sampled],
        )


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt: its generated steps, and the prompt positions recorded from its prefill.

    `steps[i]` are the next-token logits after the prompt and the first i generated tokens
    (sequence position len(input_ids) - 1 + i). `position_steps[j]` are the next-token logits
    at prompt position `positions[j]` (0-based: they predict input_ids[positions[j] + 1]); their
    token is the producer's greedy choice there. Prompt positions come before the last one,
    which is steps[0].
    """

    id: str
    prompt: str
    input_ids: list[int]
    steps: list[Step]
    stopped_on_eos: bool = False
    positions: list[int] = dataclasses.field(default_factory=list)
    position_steps: list[Step] = dataclasses.field(default_factory=list)
    sampling: list[Sampled] = dataclasses.field(default_factory=list)
    constrained: list[Constrained] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for sampled in self.sampling:
            if len(sampled.forced) != len(self.steps):
                raise ValueError(
                    f"case {self.id!r}, sampler {sampled.sampler!r}: {len(sampled.forced)} "
                    f"teacher-forced distributions for {len(self.steps)} steps"
                )
        if len(self.positions) != len(self.position_steps):
            raise ValueError(
                f"case {self.id!r}: {len(self.positions)} prompt positions but "
                f"{len(self.position_steps)} recorded steps for them"
            )
        last = len(self.input_ids) - 1
        if any(not 0 <= p < last for p in self.positions) or self.positions != sorted(
            set(self.positions)
        ):
            raise ValueError(
                f"case {self.id!r}: prompt positions must be increasing and below the last "
                f"prompt position {last} (steps[0] covers it), got {self.positions[:8]}..."
            )

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    @property
    def last_position(self) -> int:
        """The sequence position of the last generated step."""
        return len(self.input_ids) - 2 + len(self.steps)


@dataclasses.dataclass(frozen=True)
class Golden:
    provenance: Provenance
    cases: list[Case]
    schema_version: int = SCHEMA_VERSION

    @property
    def last_position(self) -> int:
        """The highest sequence position any of its cases reaches."""
        return max((c.last_position for c in self.cases), default=0)

    def case(self, case_id: str) -> Case:
        for case in self.cases:
            if case.id == case_id:
                return case
        raise KeyError(f"golden has no case {case_id!r}; it has {[c.id for c in self.cases]}")


# The producer of each reference's goldens: this engine (eager), transformers, this engine's
# ggml mode (llama.cpp's numerics on quantized files, its own goldens).
PRODUCERS = {"own": "engine", "torch": "torch", "ggml": "engine-ggml"}


def reference_of(producer: str | None) -> str:
    """The reference ("own", "torch", "ggml") a golden of `producer` serves; a run of another
    mode (`engine-MODE`) counts as the engine's."""
    for reference, name in PRODUCERS.items():
        if producer == name:
            return reference
    return "own"


def golden_file_name(model: str, encoding: str, hardware: str, producer: str = "engine") -> str:
    """`{model}_{encoding}_{hardware}_golden.json`; torch's: `torch_{model}_{encoding}_golden.json`
    on the CPU ("all") and `torch_{model}_{encoding}_{hardware}_golden.json` on a GPU; the ggml
    mode's: `ggml_{model}_{encoding}_golden.json`."""
    suffix = "" if hardware == "all" else f"_{hardware}"
    if producer == "torch":
        return f"torch_{model}_{encoding}{suffix}_golden.json"
    if producer == PRODUCERS["ggml"]:
        return f"ggml_{model}_{encoding}{suffix}_golden.json"
    return f"{model}_{encoding}_{hardware}_golden.json"


def hardware_key(name: str) -> str:
    """A device name as a file-name part: "NVIDIA H200" -> "nvidia_h200"."""
    key = "".join(c if c.isalnum() else "_" for c in name.lower())
    return "_".join(part for part in key.split("_") if part)


def _f32(value: float) -> float:
    """Round to float32 and back: stable text, and no precision the producer did not have."""
    value = float(np.float32(value))
    if not math.isfinite(value):
        raise ValueError(f"non-finite value {value} in a golden")
    return value


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) in float64, shifted by the peak so nothing overflows."""
    logits = np.asarray(logits, dtype=np.float64)
    peak = logits.max()
    return float(peak + math.log(np.exp(logits - peak).sum()))


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of `row`'s k largest values, largest first, ties by lower id first.

    Equals np.argsort(-row, kind="stable")[:k] (a test pins it), in O(vocab) instead of a
    full sort of a 128k-entry row at every step of every case: that sort was most of the
    time of recording or comparing a tiny checkpoint's golden. The k-th value is bounded in
    one pass first: of k disjoint slices' peaks the lowest has k values at or above it, so
    only those are sorted (a 128k row: 0.08 ms, where a partition for the exact k-th took
    1.3 ms); a bound that leaves too many candidates falls back to the partition.
    """
    if k >= row.size:
        return np.argsort(-row, kind="stable")[:k]
    negated = -row  # sorted ascending like argsort's, so NaN counts as the smallest value
    width = row.size // k
    bound = negated[: k * width].reshape(k, width).min(axis=1).max()  # NaN where a slice has one
    kth = bound  # at or beyond the k-th value: its candidates hold the top k
    if np.isnan(bound) or np.count_nonzero(negated <= bound) > _SORTED_CANDIDATES:
        kth = np.partition(negated, k - 1)[k - 1]
    if np.isnan(kth):  # fewer than k numbers: leave NaN ordering to argsort
        return np.argsort(negated, kind="stable")[:k]
    candidates = np.flatnonzero(negated <= kth)  # every tie with the k-th, in id order
    return candidates[np.argsort(negated[candidates], kind="stable")[:k]]


# Above this many candidates at or above the one-pass bound, top_k_ids finds the exact k-th.
_SORTED_CANDIDATES = 4096


def step_from_logits(
    logits: np.ndarray, token_id: int, token_text: str, top_k: int, full: bool = False
) -> Step:
    """Summarize one step's next-token logits (1-D, vocab) as a golden `Step`."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 1:
        raise ValueError(f"expected 1-D logits, got shape {logits.shape}")
    # -inf is a constraint's refused id; NaN and +inf are a broken run, and would be recorded
    # as a NaN logsumexp (not JSON) with statistics that silently skip them.
    broken = np.flatnonzero(np.isnan(logits) | (logits == np.inf))
    if broken.size:
        raise ValueError(
            f"non-finite logit {logits[broken[0]]} at id {int(broken[0])} ({broken.size} ids): "
            "a golden holds no NaN or +inf"
        )
    # A constrained row: -inf outside its language; the top-k and the statistics are the
    # allowed ids' (their log-probabilities renormalized to the language by the logsumexp).
    finite = logits[np.isfinite(logits)]
    top_k = min(top_k, len(finite))
    # Stable ordering: by logit descending, then by id, so ties never reorder between runs.
    order = top_k_ids(logits, top_k)
    lse = logsumexp(logits)
    logits_stats = finite if len(finite) < len(logits) else logits
    return Step(
        token_id=int(token_id),
        token_text=token_text,
        topk_ids=[int(i) for i in order],
        topk_logits=[_f32(logits[i]) for i in order],
        logsumexp=round(float(lse), 9),  # float64: KL estimates divide by exp of it
        stats={
            "mean": _f32(logits_stats.mean()),
            "std": _f32(logits_stats.std()),
            "min": _f32(logits_stats.min()),
            "max": _f32(logits_stats.max()),
        },
        logits=[_f32(v) for v in logits] if full else None,
    )


def to_json(golden: Golden) -> str:
    def plain(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {
                f.name: plain(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
                if not (f.name == "logits" and getattr(obj, f.name) is None)
            }
        if isinstance(obj, list):
            return [plain(v) for v in obj]
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        return obj

    body = plain(golden)
    return json.dumps(body, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def from_json(text: str, source: str = "<golden>") -> Golden:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    version = body.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
        raise ValueError(
            f"{source}: golden schema version {version}, this library reads {readable}; "
            "regenerate the golden with the current tools"
        )
    try:
        return Golden(
            provenance=Provenance(**body["provenance"]),
            cases=[case_from_json(c) for c in body["cases"]],
            schema_version=version,
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: malformed golden ({e})") from None


def case_from_json(body: dict) -> Case:
    """One case of a golden file's JSON (versions 1 and 2 have no prompt positions)."""
    return Case(
        id=body["id"],
        prompt=body["prompt"],
        input_ids=body["input_ids"],
        stopped_on_eos=body.get("stopped_on_eos", False),
        steps=[Step(**s) for s in body["steps"]],
        positions=body.get("positions", []),
        position_steps=[Step(**s) for s in body.get("position_steps", [])],
        sampling=[_sampled_from_json(s) for s in body.get("sampling", [])],
        constrained=[_constrained_from_json(c) for c in body.get("constrained", [])],
    )


def _constrained_from_json(body: dict) -> Constrained:
    return Constrained(
        constraint=body["constraint"],
        kind=body["kind"],
        text=body["text"],
        steps=[Step(**s) for s in body["steps"]],
        allowed=[Allowed(**a) for a in body["allowed"]],
        stopped_on_eos=body["stopped_on_eos"],
        sampled=_sampled_from_json(body["sampled"]),
    )


def _sampled_from_json(body: dict) -> Sampled:
    return Sampled(
        sampler=body["sampler"],
        settings=body["settings"],
        forced=[Kept(**k) for k in body["forced"]],
        tokens=body["tokens"],
        drawn=[Kept(**k) for k in body["drawn"]],
    )


def kept_from(ids, probs) -> Kept:
    """A `Kept` from a sampler's (ids, probabilities) arrays, probabilities float32-rounded."""
    return Kept([int(i) for i in ids], [float(np.float32(p)) for p in probs])


def read(path: str | os.PathLike) -> Golden:
    path = Path(path)
    return from_json(path.read_text(encoding="utf-8"), source=str(path))


def write(golden: Golden, path: str | os.PathLike) -> None:
    """Write atomically: a reader never sees half a golden."""
    write_atomically(Path(path), to_json(golden))
