"""Turn one generation (input ids, greedy tokens, per-step logits) into a golden case.

Shared by every producer (evaluate_llama for the engine, run_torch_llama for transformers),
so both write the same schema from the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import yaml

from goldens import long_prompts
from goldens.schema import Case, Constrained, Sampled, Step, step_from_logits

CASES_FILE = Path(__file__).with_name("cases.yaml")


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    id: str
    prompt: str
    steps: int
    top_k: int
    positions_every: int = 0  # record prompt positions (`prompt_positions`); 0: none
    long: bool = False  # a long-context case (run by the long golden lane)

    def positions(self, n_prompt: int) -> list[int]:
        return prompt_positions(n_prompt, self.positions_every) if self.positions_every else []


def prompt_positions(n_prompt: int, every: int) -> list[int]:
    """The prompt positions a golden records for an `n_prompt`-token prompt: every `every`-th
    position, each power of two with its neighbours (2^k - 1, 2^k, 2^k + 1: where cache blocks,
    buffers and rope bands turn), all before the last prompt position (the first step).

    A 6-token prompt gives 0..4; the 8,323-token long_8k prompt (every 256) gives 65 positions,
    up to 8193.
    """
    last = n_prompt - 1
    chosen = set(range(0, last, every))
    power = 1
    while power - 1 < last:
        chosen.update(p for p in (power - 1, power, power + 1) if p < last)
        power *= 2
    return sorted(chosen)


@functools.cache
def _cases_table(path: Path = CASES_FILE) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def case_specs(model: str) -> list[CaseSpec]:
    """The golden prompts of `model`, as cases.yaml lists them."""
    table = _cases_table()
    defaults = table["defaults"]
    try:
        listed = table["models"][model]["prompts"]
    except KeyError:
        raise KeyError(f"cases.yaml has no prompts for model {model!r}") from None
    prompts = [p for entry in listed for p in (entry if isinstance(entry, list) else [entry])]
    return [
        CaseSpec(
            id=p["id"],
            prompt=p["text"] if "text" in p else long_prompts.prompt(**p["generate"]),
            steps=int(p.get("steps", defaults["steps"])),
            top_k=int(p.get("top_k", defaults["top_k"])),
            positions_every=int(p.get("positions_every", defaults["positions_every"])),
            long="generate" in p,
        )
        for p in prompts
    ]


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """One row of cases.yaml's `samplers`: an id and sampling.SamplerSettings' fields."""

    id: str
    settings: dict

    MAX_KEPT = 32  # a golden stores each step's kept set (cases.yaml says why)


def sampler_specs(path: Path = CASES_FILE) -> list[SamplerSpec]:
    """cases.yaml's sampler table; each must keep at most MAX_KEPT tokens (its top_k)."""
    specs = [
        SamplerSpec(row["id"], dict(row["settings"])) for row in _cases_table(path)["samplers"]
    ]
    for spec in specs:
        if (
            not 0 < spec.settings.get("top_k", 0) <= SamplerSpec.MAX_KEPT
            or "seed" not in spec.settings
        ):
            raise ValueError(
                f"{path}: sampler {spec.id!r} must set top_k in 1..{SamplerSpec.MAX_KEPT} (a "
                "golden stores each step's kept tokens) and a seed (its continuation is "
                "recorded)"
            )
    return specs


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """One row of cases.yaml's `constraints`: a language (`kind` and `text` as
    pipelines.llama3.constrained.Constraint takes them), the short cases it constrains, the
    sampler of its seeded continuation and the most tokens a continuation may take."""

    id: str
    kind: str  # json_schema | regex | choice
    text: str  # the schema or the options as JSON text, the regex as written
    cases: tuple[str, ...]
    sampler: str
    max_tokens: int
    gbnf: str | None = None  # a regex's language in llama.cpp's GBNF, where the row gives it

    KINDS = ("json_schema", "regex", "choice")

    @property
    def value(self):
        """The schema, the regex or the list of options."""
        return self.text if self.kind == "regex" else json.loads(self.text)

    def llama_cpp_grammar(self, prefix: str = "") -> str | None:
        """The language in llama.cpp's GBNF after the text `prefix` (a choice's options that
        start with it, the rest of each; an empty rest made optional), or None where there is
        no such spelling here: a regex without the row's `gbnf` (whose language only from its
        start: `prefix` must be empty), a JSON schema (llama.cpp's converter admits
        whitespace, another language). Raises ValueError for a prefix no option has."""
        if self.kind == "regex":
            if prefix:
                raise ValueError(f"constraint {self.id!r}: a regex's GBNF has no prefix form")
            return self.gbnf
        if self.kind != "choice":
            return None
        rests = [o[len(prefix) :] for o in self.value if o.startswith(prefix)]
        if not rests:
            raise ValueError(f"constraint {self.id!r}: no option starts with {prefix!r}")
        options = " | ".join(json.dumps(r) for r in sorted(set(rests)) if r)
        if not options:
            return None  # only the end of the text is left
        return f"root ::= ({options})" + ("?" if "" in rests else "")

    def member(self, text: str) -> str | None:
        """Why `text` is not a member of the language, or None: decided without the engine's
        library (jsonschema, Python's `re`, the list)."""
        if self.kind == "choice":
            return None if text in self.value else f"{text!r} is none of {self.value}"
        if self.kind == "regex":
            return (
                None if re.fullmatch(self.text, text) else f"{text!r} does not match {self.text!r}"
            )
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), self.value)
        except (json.JSONDecodeError, jsonschema.ValidationError) as error:
            return f"{text!r} is not valid for the schema: {str(error).splitlines()[0]}"
        return None


def constraint_specs(path: Path = CASES_FILE) -> list[ConstraintSpec]:
    """cases.yaml's constraint table: each row names exactly one of ConstraintSpec.KINDS, a
    sampler of the `samplers` table and short cases."""
    table = _cases_table(path)
    samplers = {spec.id for spec in sampler_specs(path)}
    specs = []
    for row in table.get("constraints", []):
        kinds = [kind for kind in ConstraintSpec.KINDS if kind in row]
        if len(kinds) != 1 or row.get("sampler") not in samplers or not row.get("cases"):
            raise ValueError(
                f"{path}: constraint {row.get('id')!r} must give one of "
                f"{', '.join(ConstraintSpec.KINDS)}, a sampler of the samplers table "
                f"({', '.join(sorted(samplers))}) and its cases"
            )
        value = row[kinds[0]]
        specs.append(
            ConstraintSpec(
                id=row["id"],
                kind=kinds[0],
                text=value if kinds[0] == "regex" else json.dumps(value),
                cases=tuple(row["cases"]),
                sampler=row["sampler"],
                max_tokens=int(row.get("max_tokens", table["defaults"]["constrained_max_tokens"])),
                gbnf=row.get("gbnf"),
            )
        )
    return specs


def record_case(
    spec: CaseSpec,
    input_ids: Sequence[int],
    tokens: Sequence[int],
    logits: np.ndarray,
    decode: Callable[[Sequence[int]], str],
    eos_ids: set[int],
    full_logits: bool = False,
    positions: Sequence[int] = (),
    prompt_logits: np.ndarray | None = None,
    sampling: Sequence[Sampled] = (),
    constrained: Sequence[Constrained] = (),
) -> Case:
    """`logits[i]` are the next-token logits that chose `tokens[i]`; `prompt_logits[j]` those
    at prompt position `positions[j]` of the same prefill (its token: their argmax)."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {logits.shape[0]} rows of logits")
    rows = np.zeros((0, logits.shape[1]), np.float32) if prompt_logits is None else prompt_logits
    rows = np.asarray(rows, dtype=np.float32)
    if rows.shape[0] != len(positions):
        raise ValueError(f"{len(positions)} prompt positions but {rows.shape[0]} rows of logits")

    def step(row: np.ndarray, token: int) -> Step:
        return step_from_logits(row, token, decode([token]), spec.top_k, full=full_logits)

    return Case(
        id=spec.id,
        prompt=spec.prompt,
        input_ids=[int(t) for t in input_ids],
        steps=[step(logits[i], int(tokens[i])) for i in range(len(tokens))],
        stopped_on_eos=bool(tokens) and int(tokens[-1]) in eos_ids,
        positions=[int(p) for p in positions],
        position_steps=[step(row, int(np.argmax(row))) for row in rows],
        sampling=list(sampling),
        constrained=list(constrained),
    )


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
