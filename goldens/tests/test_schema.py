"""Golden files: deterministic bytes, lossless round trip, small at Llama 3's vocabulary."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from goldens import schema
from goldens.record import CaseSpec, record_case


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
