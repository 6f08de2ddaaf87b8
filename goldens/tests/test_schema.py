"""Golden files: deterministic bytes, lossless round trip, small at Llama 3's vocabulary."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct

import numpy as np
import pytest
import yaml

from goldens import schema
from goldens.record import (
    CaseSpec,
    constraint_specs,
    prompt_positions,
    record_case,
    sampler_specs,
)


def _golden(vocab: int = 1000, cases: int = 4, steps: int = 10, full: bool = False):
    rng = np.random.default_rng(0)  # only the test's data; never a golden's
    recorded = []
    for c in range(cases):
        logits = rng.standard_normal((steps, vocab)).astype(np.float32) * 3
        tokens = [int(np.argmax(r)) for r in logits]
        spec = CaseSpec(f"case{c}", f"prompt {c} «ünïcode»", steps, 20)
        recorded.append(
            record_case(
                spec,
                [128000, 5, c],
                tokens,
                logits,
                lambda ids: f"t{ids[0]}",
                {128001},
                full_logits=full,
            )
        )
    prov = schema.Provenance(
        "engine",
        "llama3-engine/1",
        "tinyllama",
        "float32",
        "all",
        "cpu",
        "float32",
        "tiny_llama.gguf",
        "ab" * 32,
        "2.13.0",
        "float32",
    )
    return schema.Golden(prov, recorded)


def test_round_trip_is_lossless_and_bytes_are_stable(tmp_path):
    golden = _golden()
    path = tmp_path / "g.json"
    schema.write(golden, path)
    again = schema.read(path)
    assert again == golden
    assert schema.to_json(again) == path.read_text(encoding="utf-8")


def test_sampling_goldens_round_trip_and_must_cover_every_step(tmp_path):
    golden = _golden(vocab=50, cases=1, steps=3)
    kept = schema.kept_from(np.array([7, 2]), np.array([0.7, 0.3]))
    settings = {"temperature": 2.0, "top_k": 2, "seed": 1}
    sampled = schema.Sampled("hot", settings, [kept] * 3, [7], [kept])
    case = dataclasses.replace(golden.cases[0], sampling=[sampled])
    golden = dataclasses.replace(golden, cases=[case])
    schema.write(golden, tmp_path / "g.json")
    assert schema.read(tmp_path / "g.json") == golden
    with pytest.raises(ValueError, match="2 teacher-forced distributions for 3 steps"):
        dataclasses.replace(case, sampling=[dataclasses.replace(sampled, forced=[kept] * 2)])
    with pytest.raises(ValueError, match="1 tokens but 0 distributions"):
        dataclasses.replace(sampled, drawn=[])


def test_constrained_goldens_round_trip_and_restrict_the_step(tmp_path):
    """A constrained step is the row restricted to its language: top-k, statistics and
    logsumexp over the allowed ids only, a single allowed id a step with no near-tie."""
    golden = _golden(vocab=50, cases=1, steps=2)
    row = np.linspace(-2.0, 3.0, 50).astype(np.float32)
    restricted = np.full_like(row, -np.inf)
    restricted[[4, 9, 30]] = row[[4, 9, 30]]
    step = schema.step_from_logits(restricted, 30, "x", top_k=20)
    assert step.topk_ids == [30, 9, 4]
    assert step.stats["min"] == pytest.approx(row[4])
    assert np.exp(step.topk_log_probs()).sum() == pytest.approx(1.0)
    only = np.full_like(row, -np.inf)
    only[7] = 1.0
    single = schema.step_from_logits(only, 7, "y", top_k=20)
    assert single.topk_ids == [7] and single.top_gap == np.inf
    allowed = [schema.allowed_from([30, 4, 9]), schema.allowed_from(range(100))]
    assert allowed[0].ids == [4, 9, 30] and allowed[1].ids is None
    assert allowed[1] == schema.Allowed(100, schema.allowed_digest(np.arange(100)))
    kept = schema.kept_from(np.array([30, 9]), np.array([0.8, 0.2]))
    sampled = schema.Sampled(
        "hot", {"temperature": 2.0, "top_k": 2, "seed": 1}, [kept] * 2, [30], [kept]
    )
    entry = schema.Constrained("c", "regex", "[a-z]", [step, single], allowed, True, sampled)
    case = dataclasses.replace(golden.cases[0], constrained=[entry])
    golden = dataclasses.replace(golden, cases=[case])
    schema.write(golden, tmp_path / "g.json")
    assert schema.read(tmp_path / "g.json") == golden
    assert entry.as_case(case).token_ids == [30, 7]
    with pytest.raises(ValueError, match="2 steps, 1 masks"):
        dataclasses.replace(entry, allowed=allowed[:1])


def test_four_prompts_of_ten_steps_at_vocab_128256_stay_under_1_mb():
    text = schema.to_json(_golden(vocab=128256))
    assert len(text.encode()) < 1_000_000
    assert len(schema.to_json(_golden(vocab=2000, cases=1, full=True))) > 2000 * 10 * 5


def test_topk_is_sorted_by_logit_with_ties_broken_by_id():
    logits = np.array([1.0, 3.0, 3.0, 2.0, -1.0], dtype=np.float32)
    step = schema.step_from_logits(logits, 1, "x", top_k=4)
    assert step.topk_ids == [1, 2, 3, 0]
    assert step.top_gap == 0.0
    assert step.logsumexp == pytest.approx(np.log(np.exp(logits.astype(np.float64)).sum()), 1e-6)


def test_newer_schema_version_is_refused_with_the_fix():
    text = schema.to_json(_golden(vocab=50, cases=1)).replace(
        f'"schema_version": {schema.SCHEMA_VERSION}', '"schema_version": 99'
    )
    assert '"schema_version": 99' in text
    with pytest.raises(ValueError, match="regenerate the golden"):
        schema.from_json(text, "x.json")


def test_hardware_key_is_a_file_name_part():
    assert schema.hardware_key("NVIDIA H200") == "nvidia_h200"
    assert schema.hardware_key("NVIDIA GeForce RTX 4090 (sm_89)") == "nvidia_geforce_rtx_4090_sm_89"


def test_a_file_that_is_no_readable_golden_is_refused_naming_it():
    """Every refusal of from_json: not JSON, a schema version outside READABLE_SCHEMA_VERSIONS
    (missing, too old, too new) with the fix, and a missing or unknown field as a ValueError
    naming the file. Catches a version check that refuses only newer versions (missing and 1
    read) and a TypeError (an unknown field) escaping unnamed."""
    text = schema.to_json(_golden(vocab=50, cases=1, steps=2))
    with pytest.raises(ValueError, match=r"x\.json: not valid JSON"):
        schema.from_json(text[:-3], "x.json")
    for version in (None, 1, 0, schema.SCHEMA_VERSION + 1):
        body = json.loads(text)
        body["schema_version"] = version
        if version is None:
            del body["schema_version"]
        with pytest.raises(
            ValueError, match=re.escape(f"x.json: golden schema version {version},")
        ):
            schema.from_json(json.dumps(body), "x.json")
    for edit in (
        lambda b: b["cases"][0].pop("input_ids"),  # KeyError
        lambda b: b["provenance"].pop("model"),  # TypeError: a missing argument
        lambda b: b["cases"][0]["steps"][0].update(bogus=1),  # TypeError: an unknown field
    ):
        body = json.loads(text)
        edit(body)
        with pytest.raises(ValueError, match=r"x.json: malformed golden \("):
            schema.from_json(json.dumps(body), "x.json")


def test_an_older_readable_version_reads_as_the_version_it_is():
    """A version 2-4 file reads with its own schema_version (golden_diff compares old archives
    with new ones), and writes back as that version. Catches from_json stamping every file
    it reads with the current SCHEMA_VERSION."""
    text = schema.to_json(_golden(vocab=50, cases=1, steps=2))
    current = f'"schema_version": {schema.SCHEMA_VERSION}'
    for version in (2, 3, 4):
        old = text.replace(current, f'"schema_version": {version}')
        golden = schema.from_json(old, "old.json")
        assert golden.schema_version == version
        assert schema.to_json(golden) == old


def _case(positions: list[int], n_position_steps: int) -> schema.Case:
    step = schema.step_from_logits(np.arange(10.0), 9, "x", 3)
    return schema.Case(
        "c", "p", [1, 2, 3, 4, 5, 6], [step], False, positions, [step] * n_position_steps
    )


def test_prompt_positions_must_be_increasing_below_the_last_and_one_step_each(tmp_path):
    """A case's prompt positions are strictly increasing, each in 0..len(input_ids) - 2 (the
    last prompt position is steps[0]), one recorded step apiece: in memory and in a file.
    Catches `p <= last` (the last position admitted), the dropped order check (unsorted or
    repeated positions) and a one-way length check (more positions than steps)."""
    assert _case([0, 1, 4], 3).positions == [0, 1, 4]
    for positions in ([5], [6], [-1], [3, 1], [1, 1], [0, 2, 2]):
        with pytest.raises(ValueError, match="increasing and below the last prompt position 5"):
            _case(positions, len(positions))
    for positions, n_steps in (([0, 1], 1), ([0], 2), ([], 1)):
        with pytest.raises(ValueError, match=f"{len(positions)} prompt positions but {n_steps}"):
            _case(positions, n_steps)
    golden = dataclasses.replace(_golden(vocab=50, cases=1, steps=1), cases=[_case([0, 4], 2)])
    body = json.loads(schema.to_json(golden))
    body["cases"][0]["positions"] = [0, 5]
    with pytest.raises(ValueError, match="below the last prompt position 5"):
        schema.from_json(json.dumps(body), "x.json")


def test_a_constrained_entry_needs_a_teacher_forced_distribution_per_step():
    """Constrained's steps, masks and its sampler's teacher-forced distributions are one per
    step. Catches a check that compares only the steps with the masks."""
    step = schema.step_from_logits(np.arange(10.0), 9, "x", 3)
    kept = schema.kept_from([9], [1.0])
    allowed = [schema.allowed_from([9])] * 2
    sampled = schema.Sampled("hot", {"top_k": 1, "seed": 1}, [kept], [], [])
    with pytest.raises(ValueError, match="2 steps, 2 masks and 1 teacher-forced"):
        schema.Constrained("c", "choice", "[]", [step, step], allowed, False, sampled)


def test_a_mask_lists_at_most_64_ids_and_digests_them_ascending_as_int32():
    """Allowed lists the ids when there are at most MAX_LISTED (64) of them, and its sha256 is
    over the unique ids ascending as little-endian int32 (the digest committed goldens hold).
    Catches `< MAX_LISTED` and a digest over int64."""
    assert schema.allowed_from(range(64)).ids == list(range(64))
    assert schema.allowed_from(range(65)).ids is None
    assert schema.allowed_from(range(65)).count == 65
    digest = hashlib.sha256(struct.pack("<3i", 4, 9, 128255)).hexdigest()
    assert schema.allowed_from([128255, 9, 4, 9]) == schema.Allowed(3, digest, [4, 9, 128255])
    assert schema.allowed_digest(np.array([4, 9, 128255])) == digest


def test_kept_probabilities_are_float32_rounded():
    """kept_from rounds each probability to float32 (no precision the sampler did not have;
    stable text). Catches the probabilities stored as the float64 it was given."""
    kept = schema.kept_from(np.array([7, 2]), np.array([0.7, 0.3]))
    assert kept.ids == [7, 2] and all(type(i) is int for i in kept.ids)
    assert kept.probs == [float(np.float32(0.7)), float(np.float32(0.3))]
    assert kept.probs[0] != 0.7


def test_a_case_that_ends_on_end_of_sequence_records_it_and_reads_it_back(tmp_path):
    """stopped_on_eos is True exactly when the last generated token is an end-of-sequence id,
    and it survives a write and read. Catches record_case testing the first token and
    case_from_json not reading the field (every case read back as not stopped)."""
    logits = np.eye(3, 10, k=4, dtype=np.float32)  # rows choose 4, 5, 6
    spec = CaseSpec("c", "p", 3, 5)
    cases = [
        record_case(spec, [1, 2], tokens, logits, lambda ids: "t", {6, 9})
        for tokens in ([4, 5, 6], [6, 5, 4], [4, 5, 7])
    ]
    assert [c.stopped_on_eos for c in cases] == [True, False, False]
    golden = dataclasses.replace(_golden(vocab=10, cases=1, steps=3), cases=cases[:1])
    schema.write(golden, tmp_path / "g.json")
    assert schema.read(tmp_path / "g.json").cases[0].stopped_on_eos is True


def test_prompt_positions_take_every_power_of_two_neighbour_before_the_last():
    """prompt_positions: every `every`-th position and each 2^k - 1, 2^k, 2^k + 1, all before
    the last prompt position, for every prompt length. Catches a loop that stops once the
    power reaches the last position (a 9-token prompt loses 7)."""
    assert prompt_positions(9, 256) == [0, 1, 2, 3, 4, 5, 7]
    for every in (3, 256):
        for n in range(2, 700):
            last = n - 1
            powers = {2**k + d for k in range(11) for d in (-1, 0, 1)}
            expected = set(range(0, last, every)) | {p for p in powers if 0 <= p < last}
            assert prompt_positions(n, every) == sorted(expected), (n, every)


def _cases_yaml(tmp_path, name: str, samplers: list, constraints: list):
    path = tmp_path / f"{name}.yaml"
    defaults = {"steps": 10, "top_k": 20, "positions_every": 256, "constrained_max_tokens": 48}
    table = {"defaults": defaults, "samplers": samplers, "constraints": constraints}
    path.write_text(yaml.safe_dump(table), encoding="utf-8")
    return path


def test_cases_yaml_samplers_and_constraints_that_a_golden_cannot_hold_are_refused(tmp_path):
    """cases.yaml's tables are checked when read: a sampler keeps 1..32 tokens (its top_k) and
    sets a seed; a constraint gives exactly one kind, a sampler of the table and its cases.
    Catches the seed check dropped, two kinds admitted, and the cases check dropped."""
    hot = {"id": "hot", "settings": {"temperature": 2.0, "top_k": 32, "seed": 1}}
    answer = {"id": "answer", "choice": ["yes", "no"], "sampler": "hot", "cases": ["question"]}
    path = _cases_yaml(tmp_path, "good", [hot], [answer])
    assert [(s.id, s.settings["top_k"]) for s in sampler_specs(path)] == [("hot", 32)]
    (spec,) = constraint_specs(path)
    assert (spec.kind, spec.value, spec.cases, spec.max_tokens) == (
        "choice",
        ["yes", "no"],
        ("question",),
        48,
    )
    bad_samplers = {
        "no_seed": {"temperature": 2.0, "top_k": 20},
        "no_top_k": {"seed": 1},
        "top_k_0": {"top_k": 0, "seed": 1},
        "top_k_33": {"top_k": 33, "seed": 1},
    }
    for name, settings in bad_samplers.items():
        path = _cases_yaml(tmp_path, name, [{"id": "s", "settings": settings}], [])
        with pytest.raises(ValueError, match=r"sampler 's' must set top_k in 1\.\.32"):
            sampler_specs(path)
    bad_constraints = {
        "two_kinds": answer | {"regex": "yes|no"},
        "no_kind": {k: v for k, v in answer.items() if k != "choice"},
        "unknown_sampler": answer | {"sampler": "cold"},
        "no_cases": {k: v for k, v in answer.items() if k != "cases"},
        "empty_cases": answer | {"cases": []},
    }
    for name, row in bad_constraints.items():
        path = _cases_yaml(tmp_path, name, [hot], [row])
        with pytest.raises(ValueError, match="constraint 'answer' must give one of"):
            constraint_specs(path)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nan_or_positive_infinite_logit_is_refused_when_recorded(value):
    """A golden step is never recorded from a broken row: a NaN or +inf logit is refused,
    naming its id and how many there are, where the recording would otherwise write a NaN
    logsumexp (not JSON) and statistics that skip it. A constraint's -inf stays allowed.
    Planted: the check dropped (the step was recorded with logsumexp NaN)."""
    row = np.linspace(0.0, 1.0, 50)
    row[[3, 7]] = value
    with pytest.raises(ValueError, match=rf"non-finite logit {value} at id 3 \(2 ids\)"):
        schema.step_from_logits(row, 49, "x", 20)
    row[[3, 7]] = -np.inf
    step = schema.step_from_logits(row, 49, "x", 20)
    assert np.isfinite(step.logsumexp) and 3 not in step.topk_ids
