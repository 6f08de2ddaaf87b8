"""Constrained decoding (constrained.py) held to a reference that does not use its library.

- Masks: for every corpus case (JSON schemas with the edge cases users hit: `{}`, `$ref`,
  `maxItems: 0`, enums with shared prefixes, unicode; regexes; choices; a grammar in Lark
  and in GBNF), at every step of constrained runs of the tiny checkpoint (Llama 3's 128k
  vocabulary) and of SmolLM2 (49k), greedy and sampled, the ids the engine allowed equal the
  brute-force reference's (constrained_reference.py: every token checked by `regex` partial
  matching of the text so far plus the token). Zero differences; the two places where the
  engine's JSON strings are narrower than JSON (LIBRARY_LIMITS: a raw DEL, the escape \\/)
  are modelled in the reference and proven still to be the only ones.
- Outputs conform: a finished constrained output is a member of its language; a JSON one
  validates against its schema (jsonschema); SmolLM2 finishes every case whose language has
  a short member before max tokens.
- Distribution: a sampled constrained step draws from the target's processed distribution
  restricted to the allowed ids and renormalized: exactly (1e-12), and by the G-test on
  DRAWS seeded draws at ALPHA = 1e-6 (false-alarm rate), whose power against drawing before
  masking is computed and printed (>= 0.999).
- Every path: the serving engine gives each request of a ragged batch its own mask (tokens and
  masks equal to its solo `generate`) in the batch, chunked, prefix-cache and preempting
  scenarios (the last must preempt), and speculating with a model draft (K = 4) in a batch and
  under preemption, in the eager, quantized and ggml modes; speculative decoding (n-gram,
  model and sampling drafts) keeps greedy constrained tokens and masks exactly, the drafts
  masked too.
- Planted (MUTATIONS), each FAILS the check it exists for (CAUGHT_BY): an end of sequence
  allowed before the text is complete, or never; the mask applied after sampling; another
  request's mask in a ragged batch; the state not rolled back after draft proposals, and
  not rolled back after the serving engine's proposals only (generate's are); one token id
  off; a sampling draft proposing from its unmasked distribution (the q it reports then not
  the one it drew from, which the rejection sampler's exactness needs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from goldens import multinomial
from pipelines.llama3 import Llama3Engine, constrained
from pipelines.llama3.constrained import Constraint
from pipelines.llama3.decoder import Decoder
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.serving import Request, ServingEngine
from pipelines.llama3.speculative import NgramDraft, Speculation, self_draft
from pipelines.llama3.tests import constrained_reference as reference
from pipelines.llama3.tests.constrained_mutations import MUTATIONS

TESTDATA = Path(
    os.environ.get("PIPELINES_TESTDATA", "max_tests/integration/architectures/llama3/testdata")
)
ALPHA = 1e-6
DRAWS = 2000
STEPS = 8  # tokens per constrained run in the mask comparison
SAMPLER = SamplerSettings(temperature=1.3, seed=11)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    constraint: Constraint
    pattern: str  # the reference's language
    members: tuple[str, ...]  # texts walked token by token: every state on the way compared
    short: bool = True  # the language has a short member: SmolLM2 must finish it
    # the engine runs compared (False: greedy, True: sampled); any JSON's strings take the
    # reference seconds a step (every token is allowed inside them): greedy only
    runs: tuple[bool, ...] = (False, True)


def _schema(name: str, schema, members, short: bool = True, runs=(False, True)) -> Case:
    pattern = reference.schema_pattern(schema)
    return Case(name, Constraint.json_schema(schema), pattern, members, short, runs)


EXPR = r"(?P<e>[0-9]+|\((?&e)\+(?&e)\))"
CORPUS = [
    _schema(
        "any_json",
        {},
        (r'{"a":[1,-2.5e+3,true,null],"b":{}}', r'"\ud83d\ude00\n"'),
        short=False,
        runs=(False,),
    ),
    _schema(
        "ref",
        {
            "$defs": {"color": {"enum": ["red", "green", "greenish"]}},
            "type": "object",
            "properties": {"color": {"$ref": "#/$defs/color"}, "n": {"type": "integer"}},
            "required": ["color"],
            "additionalProperties": False,
        },
        ('{"color":"greenish","n":-7}', '{"color":"green"}'),
    ),
    _schema("max_items_0", {"type": "array", "items": {"type": "integer"}, "maxItems": 0}, ("[]",)),
    _schema(
        "shared_prefixes",
        {"enum": ["a", "ab", "abc", 1, 12, None, True]},
        ('"abc"', '"a"', "12", "1", "null", "true"),
    ),
    _schema(
        "unicode_enum",
        {"enum": ["café", "cafés", "日本語", "naïve"]},
        ('"cafés"', '"café"', '"日本語"', '"naïve"'),
    ),
    _schema(
        "object",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "ok": {"type": "boolean"},
                "tag": {"type": "string", "maxLength": 6},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        ('{"id":0,"ok":false,"tag":"日本"}', '{"id":-12,"ok":true}'),
        short=False,
    ),
    _schema(
        "array_of_enums",
        {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        ('["x","y","x"]', '["y"]'),
    ),
    _schema("short_string", {"type": "string", "maxLength": 3}, (r'"é\"x"', '""')),
    Case(
        "regex_alternation",
        Constraint.regex("a(b|cd)*e"),
        "a(b|cd)*e",
        ("abcdbe", "ae"),
        short=False,
    ),
    Case("regex_phone", Constraint.regex("[0-9]{3}-[0-9]{4}"), "[0-9]{3}-[0-9]{4}", ("555-1234",)),
    Case(
        "regex_email",
        Constraint.regex(r"[a-z]+@[a-z]+\.(com|org)"),
        r"[a-z]+@[a-z]+\.(com|org)",
        ("ab@cd.org", "x@y.com"),
    ),
    Case("regex_dot", Constraint.regex(".{0,4}!"), ".{0,4}!", ("é日!!!", "!")),
    Case(
        "choice",
        Constraint.choice(["yes", "no", "yesno"]),
        "(?:yes|no|yesno)",
        ("yes", "yesno", "no"),
    ),
    Case(
        "choice_unicode",
        Constraint.choice(["café", "cafés", "日本"]),
        "(?:café|cafés|日本)",
        ("café", "cafés", "日本"),
    ),
    Case(
        "lark",
        Constraint.grammar('start: e\ne: NUM | "(" e "+" e ")"\nNUM: /[0-9]+/'),
        EXPR,
        ("((1+23)+4)", "7"),
        short=False,
    ),
    Case(
        "gbnf",
        Constraint.grammar('root ::= e\ne ::= [0-9]+ | "(" e "+" e ")"'),
        EXPR,
        ("((1+23)+4)",),
        short=False,
    ),
]
CASES = {case.name: case for case in CORPUS}


@pytest.fixture(scope="module")
def tiny() -> Llama3Engine:
    return Llama3Engine.from_gguf(TESTDATA / "tiny_llama.gguf")


@pytest.fixture(scope="module")
def smollm2() -> Llama3Engine:
    return Llama3Engine.from_gguf(os.environ["SMOLLM2_GGUF"])


_TEXTS: dict[int, reference.TokenTexts] = {}


def _texts(engine: Llama3Engine) -> reference.TokenTexts:
    key = id(engine.tokenizer.backend)
    if key not in _TEXTS:
        _TEXTS[key] = reference.TokenTexts(*engine.tokenizer.token_bytes())
    return _TEXTS[key]


def _prompt(engine: Llama3Engine, case: Case) -> list[int]:
    return engine.tokenizer.encode(f"Answer with {case.name.replace('_', ' ')} only: ")


def _text(engine: Llama3Engine, tokens: list[int]) -> bytes:
    data = engine.tokenizer.token_bytes()[0]
    return b"".join(data[t] for t in tokens if t not in engine.eos_ids)


def _mask_differences(engine: Llama3Engine, case: Case, out) -> list[str]:
    """Each step where the engine's allowed ids and the reference's differ, described."""
    language = reference.Language(case.pattern)
    texts, data = _texts(engine), engine.tokenizer.token_bytes()[0]
    eos = sorted(engine.eos_ids)
    found = []
    for step, ours in enumerate(out.allowed):
        text = _text(engine, out.tokens[:step])
        want = texts.allowed(language, text, eos)
        if not np.array_equal(np.asarray(ours), want):
            extra = sorted(set(ours.tolist()) - set(want.tolist()))
            missing = sorted(set(want.tolist()) - set(ours.tolist()))
            found.append(
                f"{case.name} step {step} after {text!r}: engine-only "
                f"{[data[i] for i in extra[:4]]} ({len(extra)}), reference-only "
                f"{[data[i] for i in missing[:4]]} ({len(missing)})"
            )
    return found


def _conformance(engine: Llama3Engine, case: Case, out, finish: str | None) -> list[str]:
    """What is wrong with a constrained output: a token outside its masks, a finished text
    outside the language or its schema."""
    wrong = [
        f"{case.name}: step {i} took {t}, not allowed"
        for i, (t, ids) in enumerate(zip(out.tokens, out.allowed, strict=True))
        if t not in set(ids.tolist())
    ]
    if finish != "stop":
        return wrong
    text = _text(engine, out.tokens).decode("utf-8", errors="replace")
    if not reference.Language(case.pattern).member(text):
        wrong.append(f"{case.name}: finished {text!r} is outside the language")
    elif case.constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(case.constraint.text))
        except (jsonschema.ValidationError, json.JSONDecodeError) as error:
            wrong.append(f"{case.name}: {text!r} fails its schema: {error}")
    return wrong


def _finish(out, max_new_tokens: int, engine: Llama3Engine) -> str:
    stopped = out.tokens and out.tokens[-1] in engine.eos_ids
    return "stop" if stopped or len(out.tokens) < max_new_tokens else "length"


def _run(engine, case: Case, sampled: bool, steps: int = STEPS, **kwargs):
    return engine.generate(
        _prompt(engine, case),
        steps,
        constraint=case.constraint,
        record_allowed=True,
        sampling=SAMPLER if sampled else None,
        **kwargs,
    )


def _check_masks(engine, names, sampled_too: bool = True) -> list[str]:
    failures = []
    for name in names:
        case = CASES[name]
        for sampled in case.runs if sampled_too else (False,):
            out = _run(engine, case, sampled)
            failures += _mask_differences(engine, case, out)
            failures += _conformance(engine, case, out, _finish(out, STEPS, engine))
    return failures


def _walk_members(engine, names) -> list[str]:
    """Each member of each case fed token by token (one byte a token where it is short, so
    every byte boundary, inside a UTF-8 character too, is a state; else its encoding), the
    engine's mask compared with the reference's before each token and after the last (where
    only the text's completion or an end of sequence may follow)."""
    data = engine.tokenizer.token_bytes()[0]
    single = {d: i for i, d in enumerate(data) if len(d) == 1}
    failures = []
    for name in names:
        case = CASES[name]
        for member in case.members:
            raw = member.encode()
            if len(raw) <= 16:
                tokens = [single[raw[i : i + 1]] for i in range(len(raw))]
            else:
                tokens = engine.tokenizer.encode(member, add_bos=False)
            matcher = constrained.matcher(case.constraint, engine.tokenizer)
            allowed = []
            for token in tokens:
                allowed.append(constrained.allowed_ids(matcher))
                matcher.consume(token)
            allowed.append(constrained.allowed_ids(matcher))
            eos = sorted(engine.eos_ids)[:1]
            walk = type("Walk", (), {"tokens": [*tokens, *eos], "allowed": allowed})
            failures += _mask_differences(engine, case, walk)
    return failures


def test_the_references_unfinished_characters_try_only_the_tokens_that_continue_them(
    tiny,
) -> None:
    """After bytes that end inside a UTF-8 character the reference tries only the tokens that
    start with a continuation byte: the same ids as trying every token of the vocabulary one
    by one (any other byte breaks the character). On the tiny vocabulary, inside any JSON
    string after the first byte of "中", and in a choice of two words after two of its three
    bytes. Catches the filter keeping lead bytes instead, or dropping the tokens of one
    continuation byte."""
    texts = _texts(tiny)
    states = [
        (reference.schema_pattern({}), b'"' + "中".encode()[:1]),
        (reference.choice_pattern(["中文", "日本"]), "中".encode()[:2]),
    ]
    for pattern, text in states:
        language = reference.Language(pattern)
        prefix, pending = reference._split_utf8(text)
        every = []
        for index, data in texts.texts:
            joined = reference._split_utf8(pending + data)
            if joined is not None and texts._completes(language, prefix + joined[0], joined[1]):
                every.append(index)
        assert every and texts.allowed(language, text, []).tolist() == every, pattern


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_masks_equal_the_reference(tiny, name) -> None:
    assert _check_masks(tiny, [name]) == []
    assert _walk_members(tiny, [name]) == []


@pytest.mark.parametrize("name", list(CASES))
def test_smollm2_masks_equal_the_reference(smollm2, name) -> None:
    assert _check_masks(smollm2, [name], sampled_too=False) == []
    assert _walk_members(smollm2, [name]) == []


def test_the_library_limits_are_the_only_departures_from_json(tiny) -> None:
    """Inside a JSON string, the engine's mask against JSON's whole string syntax: the tokens
    only JSON allows are exactly those holding a raw DEL or the escape \\/ (LIBRARY_LIMITS)."""
    matcher = constrained.matcher(Constraint.json_schema({}), tiny.tokenizer)
    text = b'"a'
    for token in tiny.tokenizer.encode(text.decode(), add_bos=False):
        matcher.consume(token)
    data = tiny.tokenizer.token_bytes()[0]
    json_only = reference.Language(reference.schema_pattern({}, rfc=True))
    rfc = set(_texts(tiny).allowed(json_only, text, sorted(tiny.eos_ids)).tolist())
    ours = set(matcher.allowed().tolist())
    assert ours <= rfc
    departures = [data[i] for i in sorted(rfc - ours)]
    assert all(b"\x7f" in d or b"\\/" in d for d in departures), departures
    assert any(b"\x7f" in d for d in departures) and any(b"\\/" in d for d in departures)


def _smollm2_outputs(engine) -> list[str]:
    failures = []
    for case in CORPUS:
        out = _run(engine, case, sampled=False, steps=24)
        finish = _finish(out, 24, engine)
        failures += _conformance(engine, case, out, finish)
        if case.short and finish != "stop":
            failures.append(f"{case.name}: ran to max tokens ({_text(engine, out.tokens)!r})")
    return failures


def test_smollm2_outputs_conform_and_finish(smollm2) -> None:
    assert _smollm2_outputs(smollm2) == []


# --- the constrained distribution -------------------------------------------------------


# The sampled step the distribution is checked at: the tiny model's first step under
# DISTRIBUTION_CASE (thousands of ids allowed), the sampler keeping the top 8 of those at a
# temperature that spreads them (the tiny model's logits span tens of units).
DISTRIBUTION_CASE = Case("lowercase", Constraint.regex("[a-z]{1,3}"), "[a-z]{1,3}", ())
DISTRIBUTION_SAMPLER = SamplerSettings(temperature=2.0, top_k=8, seed=0)


def _position(engine) -> tuple[torch.Tensor, list[int]]:
    prompt = _prompt(engine, DISTRIBUTION_CASE)
    return engine.generate(prompt, 1).logits[0], prompt


def _restricted(logits: torch.Tensor, allowed: np.ndarray) -> dict:
    """The processed distribution restricted to `allowed` and renormalized, computed here:
    the top 8 allowed ids by logit, softmax of their logits over the temperature."""
    values = logits.double().numpy()[allowed]
    top = np.argsort(-values, kind="stable")[: DISTRIBUTION_SAMPLER.top_k]
    scaled = values[top] / DISTRIBUTION_SAMPLER.temperature
    probs = np.exp(scaled - scaled.max())
    return dict(zip(allowed[top].tolist(), (probs / probs.sum()).tolist(), strict=True))


def _draws(engine, logits, prompt, n: int) -> list[int]:
    """n draws of the step, seeds 0..n-1 (choose does not advance the matcher)."""
    matcher = constrained.matcher(DISTRIBUTION_CASE.constraint, engine.tokenizer)
    drawn = []
    for seed in range(n):
        settings = dataclasses.replace(DISTRIBUTION_SAMPLER, seed=seed)
        decoder = Decoder(4, engine.eos_ids, sampling=settings, prompt=prompt, constraint=matcher)
        drawn.append(decoder.choose(logits))
    return drawn


def _distribution_failures(engine) -> list[str]:
    logits, prompt = _position(engine)
    matcher = constrained.matcher(DISTRIBUTION_CASE.constraint, engine.tokenizer)
    want = _restricted(logits, matcher.allowed())
    settings = DISTRIBUTION_SAMPLER
    decoder = Decoder(4, engine.eos_ids, sampling=settings, prompt=prompt, constraint=matcher)
    ids, probs = decoder.distribution(logits)
    got = {i: p for i, p in zip(ids.tolist(), probs.tolist(), strict=True) if p > 0}
    failures = []
    error = max(abs(got.get(t, 0.0) - want.get(t, 0.0)) for t in set(got) | set(want))
    if error > 1e-12:
        failures.append(f"distribution off the restricted one by {error:.3g}")
    p_value = multinomial.g_test(_draws(engine, logits, prompt, DRAWS), want)
    if p_value < ALPHA:
        failures.append(f"draws fail the G-test: p = {p_value:.3g} < {ALPHA}")
    return failures


def test_sampling_draws_from_the_restricted_renormalized_distribution(tiny) -> None:
    assert _distribution_failures(tiny) == []
    # the power against the planted bug below (drawn from the unmasked top 8, a refused draw
    # mended to the masked argmax): its exact distribution against the restricted one
    logits, _ = _position(tiny)
    allowed = constrained.matcher(DISTRIBUTION_CASE.constraint, tiny.tokenizer).allowed()
    everything = np.arange(logits.shape[0])
    unmasked = _restricted(logits, everything)
    best = int(allowed[np.argmax(logits.numpy()[allowed])])
    planted = {t: p for t, p in unmasked.items() if t in set(allowed.tolist())}
    planted[best] = planted.get(best, 0.0) + 1.0 - sum(planted.values())
    want = _restricted(logits, allowed)
    power = multinomial.power(planted, want, DRAWS, ALPHA)
    print(
        f"G-test at alpha {ALPHA}, {DRAWS} draws over {len(want)} ids: power against "
        f"masking after sampling {power:.6f}"
    )
    assert power >= 0.999


# --- every path: serving, speculative decoding ------------------------------------------


# The serving scenarios a constrained batch goes through: every request its own mask in each.
SCENARIOS = {
    "batch": {"block_size": 4},
    "chunked": {"block_size": 4, "chunk_size": 3},
    "prefix": {"block_size": 4, "prefix_caching": True},
    "preempt": {"block_size": 4, "num_blocks": 16},  # five requests of ~11 blocks each
    # every request speculating with SPEC_K proposals of a 0-layer model draft a step (the
    # matcher takes each proposal and is rolled back), in a batch and under preemption
    "spec": {"block_size": 4},
    "spec-preempt": {"block_size": 4, "num_blocks": 16},
}
SPECULATING = ("spec", "spec-preempt")
SPEC_K = 4
PREAMBLE = "You answer in exactly the format you are asked for. "


def _serving_failures(engine, scenarios=tuple(SCENARIOS)) -> list[str]:
    """Five requests in one ragged batch behind a shared preamble, four constrained (two
    choices of one prompt, differently), one not: in each scenario each one's tokens and
    masks equal its solo generate's; the preempt scenario must preempt."""
    names = ["ref", "regex_phone", "choice", "choice_unicode", None]
    requests = []
    for i, name in enumerate(names):
        case = CASES.get(name)
        words = "choice" if name and name.startswith("choice") else (name or "anything")
        prompt = engine.tokenizer.encode(f"{PREAMBLE}Answer with {words}: ")
        constraint = case and case.constraint
        requests.append(
            Request(f"r{i}", prompt, STEPS, constraint=constraint, record_allowed=bool(case))
        )
    solo = {
        r.id: engine.generate(r.prompt, STEPS, constraint=r.constraint, record_allowed=True)
        for r in requests
    }
    failures = []
    for scenario in scenarios:
        serving = ServingEngine(engine, **SCENARIOS[scenario])
        served = requests
        if scenario in SPECULATING:
            draft = self_draft(TESTDATA / "tiny_llama.gguf", 0)
            served = [
                dataclasses.replace(r, speculation=Speculation(draft, SPEC_K)) for r in requests
            ]
        results = serving.serve(served)
        if scenario.endswith("preempt") and serving.preemptions == 0:
            failures.append(f"{scenario}: the pool preempted nothing (the scenario is not one)")
        for request, name in zip(requests, names, strict=True):
            served, want = results[request.id].output, solo[request.id]
            if served.tokens != want.tokens:
                failures.append(f"{scenario} {name}: tokens {served.tokens} != solo {want.tokens}")
            elif name and not _same_masks(served, want):
                failures.append(f"{scenario} {name}: masks differ from solo")
    return failures


def test_a_ragged_batch_gives_each_request_its_own_mask(tiny) -> None:
    assert _serving_failures(tiny) == []


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_every_mode_constrains_alike(mode) -> None:
    """The Q4_K checkpoint in the quantized and ggml modes: member walks, constrained runs
    against the reference, and the serving scenarios."""
    engine = Llama3Engine.from_gguf(TESTDATA / "tiny_llama_q4_k.gguf", mode=mode)
    names = ["object", "choice_unicode", "lark"]
    assert _check_masks(engine, names) == []
    assert _serving_failures(engine) == []


def _same_masks(one, other) -> bool:
    return len(one.allowed) == len(other.allowed) and all(
        np.array_equal(a, b) for a, b in zip(one.allowed, other.allowed, strict=True)
    )


def _speculation_failures(engine) -> list[str]:
    """Greedy constrained tokens and masks with the n-gram and the model draft, K = 3 and 8,
    equal those without speculation; with a sampling draft the output conforms."""
    failures = []
    drafts = {"ngram": NgramDraft(), "model": self_draft(TESTDATA / "tiny_llama.gguf", 0)}
    for name in ("any_json", "regex_alternation", "object", "lark"):
        case = CASES[name]
        plain = _run(engine, case, sampled=False, steps=12)
        for draft_name, draft in drafts.items():
            for k in (3, 8):
                out = _run(engine, case, False, 12, speculation=Speculation(draft, k))
                if out.tokens != plain.tokens or not _same_masks(out, plain):
                    failures.append(f"{name} {draft_name} K={k}: {out.tokens} != {plain.tokens}")
        sampler = self_draft(TESTDATA / "tiny_llama.gguf", 0, sample=True)
        out = _run(engine, case, True, 12, speculation=Speculation(sampler, 3))
        failures += _conformance(engine, case, out, _finish(out, 12, engine))
    return failures


def test_speculation_keeps_the_constrained_tokens(tiny) -> None:
    assert _speculation_failures(tiny) == []


def _draft_failures(engine) -> list[str]:
    """The rejection sampler emits the target's (restricted) distribution only if each
    proposal is drawn from the q it reports: under a constraint, q is the draft's processed
    distribution masked at that draft position, so every proposal and every q's support are
    in the language; afterwards the matcher is where it was."""
    draft = self_draft(TESTDATA / "tiny_llama.gguf", 0, sample=True)
    case = CASES["object"]
    prompt = _prompt(engine, case)
    failures = []
    for seed in range(4):
        matcher = constrained.matcher(case.constraint, engine.tokenizer)
        matcher.consume(engine.tokenizer.encode('{"', add_bos=False)[0])
        before = list(matcher.consumed)
        settings = dataclasses.replace(SAMPLER, seed=seed)
        decoder = Decoder(12, engine.eos_ids, sampling=settings, prompt=prompt, constraint=matcher)
        proposal, dists = draft.drafted([*prompt, *before], 4, decoder)
        if matcher.consumed != before:
            failures.append(f"seed {seed}: the matcher kept the proposals {matcher.consumed}")
        walk = constrained.matcher(case.constraint, engine.tokenizer)
        for token in before:
            walk.consume(token)
        for j, (token, (ids, probs)) in enumerate(zip(proposal, dists, strict=True)):
            allowed = set(walk.allowed().tolist())
            outside = set(ids[probs > 0].tolist()) - allowed
            if outside or token not in allowed:
                failures.append(f"seed {seed} proposal {j}: q or the proposal outside the mask")
                break
            walk.consume(token)
    return failures


def test_a_sampling_draft_draws_from_the_masked_distribution_and_rolls_back(tiny) -> None:
    assert _draft_failures(tiny) == []


# --- planted bugs (constrained_mutations.py) --------------------------------------------


# The checks each planted bug runs against (all of them: the matrix shows every verdict).
CHECKS = {
    "masks": lambda engine: _walk_members(engine, ["shared_prefixes", "choice", "ref"]),
    "distribution": _distribution_failures,
    "serving": lambda engine: _serving_failures(engine, ("batch", "spec")),
    "speculation": _speculation_failures,
    "draft": _draft_failures,
}


# The check each planted bug exists to be caught by (the module docstring's reasons): that one
# must fail, on the bug, not on a plant broken by a refactor (a TypeError, an AttributeError).
CAUGHT_BY = {
    "eos_before_complete": "masks",
    "eos_never": "masks",
    "one_id_off": "masks",
    "mask_after_sampling": "distribution",
    "another_requests_mask": "serving",
    "state_not_rolled_back": "speculation",
    "served_proposals_kept": "serving",
    "draft_unmasked": "draft",
}
BROKEN_PLANT = ("TypeError", "AttributeError", "NameError", "ImportError")


def test_every_planted_bug_fails(tiny, monkeypatch) -> None:
    assert sorted(CAUGHT_BY) == sorted(MUTATIONS)
    matrix = {}
    for name, plant in MUTATIONS.items():
        with monkeypatch.context() as patch:
            plant(patch)
            verdicts = {}
            for check, run in CHECKS.items():
                try:
                    failures = run(tiny)
                except Exception as error:  # a planted bug may also break the engine outright
                    failures = [f"{type(error).__name__}: {error}"]
                verdicts[check] = failures[0].splitlines()[0][:100] if failures else None
            matrix[name] = verdicts
    print("planted bug x check (FAILED: the check caught it):")
    for name, verdicts in matrix.items():
        print(f"  {name}:")
        for check, failure in verdicts.items():
            print(f"    {check:13s} {'FAILED ' + failure if failure else 'passed'}")
    escaped = [
        f"{name} ({CAUGHT_BY[name]}: {verdicts[CAUGHT_BY[name]] or 'passed'})"
        for name, verdicts in matrix.items()
        if not verdicts[CAUGHT_BY[name]] or verdicts[CAUGHT_BY[name]].startswith(BROKEN_PLANT)
    ]
    assert escaped == [], f"planted bugs their own check did not catch: {escaped}"


def test_the_generate_command_constrains_and_names_a_bad_constraint(tiny, capsys) -> None:
    from pipelines.llama3 import generate

    gguf = str(TESTDATA / "tiny_llama.gguf")
    base = ["--gguf", gguf, "--prompt", "Answer: ", "--max-new-tokens", "6"]
    assert generate.main([*base, "--choice", "yes", "--choice", "no"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line in ("Answer: yes", "Answer: no"), first_line  # <|eot_id|> is no text
    for option, value, message in (
        ("--regex", "[0-9", "unclosed character class"),
        ("--json-schema", "{bad", "not JSON"),
        ("--grammar", "@/nonexistent/grammar.gbnf", "is not a file"),
    ):
        with pytest.raises(SystemExit) as exit_:
            generate.main([*base, option, value])
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert option in error and message in error, error


def test_a_forced_token_outside_the_language_is_refused(tiny) -> None:
    """Teacher forcing feeds the constraint's matcher too (decoder.py): a forced token the
    language does not allow ("maybe" under a choice of "yes" and "no") is an error naming the
    token and the constraint's kind, in generate and in the serving engine. Planted: a matcher
    that drops such a token silently let both runs finish."""
    prompt = tiny.tokenizer.encode("Answer: ")
    forced = tiny.tokenizer.encode("maybe", add_bos=False)
    assert len(forced) == 1  # one token: the first step already feeds it
    choice = Constraint.choice(["yes", "no"])
    message = rf"token {forced[0]} \(b'maybe'\) is outside the choice constraint"
    with pytest.raises(constrained.ConstraintError, match=message):
        tiny.generate(prompt, len(forced), constraint=choice, forced_tokens=forced)
    request = Request("r", prompt, len(forced), forced_tokens=forced, constraint=choice)
    serving = ServingEngine(tiny, block_size=4)
    with pytest.raises(constrained.ConstraintError, match=message):
        serving.serve([request])
    assert serving.pending == 0  # nothing left behind for a next call


def test_masks_are_kept_only_when_asked(tiny) -> None:
    """A step's allowed ids are up to the vocabulary's size (about 1 MB inside a JSON string on
    128k tokens): a generation or a served request keeps them only with record_allowed."""
    case = CASES["any_json"]
    assert _run(tiny, case, False).allowed is not None  # _run asks
    plain = tiny.generate(_prompt(tiny, case), STEPS, constraint=case.constraint)
    assert plain.allowed is None
    request = Request("r", _prompt(tiny, case), STEPS, constraint=case.constraint)
    served = ServingEngine(tiny, block_size=4).serve([request])["r"].output
    assert served.allowed is None and served.tokens == plain.tokens


# --- the constraint's own promises, where no corpus run goes ----------------------------


def test_a_grammar_is_not_forced_to_its_canonical_tokenization(tiny, monkeypatch) -> None:
    """No forcing holds for every kind (the module docstring), grammars too: where a grammar
    determines the next bytes (`{"a":` here, in Lark and in GBNF) every token that goes on
    with them is allowed, `{` as well as the canonical `{"`, and each state's mask equals the
    reference's. The corpus's grammars never determine bytes ahead, so no other check sees
    it. Planted: the grammar kind compiled without the no_forcing header allowed only `{"`
    first (llguidance's default forcing)."""
    data = tiny.tokenizer.token_bytes()[0]
    grammars = {
        "lark": 'start: "{\\"a\\":" NUM "}"\nNUM: /[0-9]+/',
        "gbnf": 'root ::= "{\\"a\\":" [0-9]+ "}"',
    }
    for syntax, text in grammars.items():
        name = f"forced_{syntax}"
        case = Case(name, Constraint.grammar(text), r'\{"a":[0-9]+\}', ('{"a":12}',))
        monkeypatch.setitem(CASES, name, case)
        first = constrained.matcher(case.constraint, tiny.tokenizer).allowed()
        assert sorted(data[i] for i in first) == [b"{", b'{"'], syntax
        assert _walk_members(tiny, [name]) == []


def test_a_regex_may_hold_a_slash(tiny, monkeypatch) -> None:
    """A regex is Rust regex syntax, where `/` is an ordinary character, bare or escaped
    (`\\/`); the Lark terminal it becomes is written between slashes (_lark_regex escapes
    them). Both forms compile, and their masks equal the reference's at every byte of a
    member. The corpus's regexes hold no slash. Planted: the regex put between slashes as it
    is (the bare slash ended the terminal: no compile); the escaped slash escaped again (a
    lexer error). An escaped backslash before a slash (`\\\\/`: the text `\\/`) compiled to
    a lexer error until _lark_regex read the pattern an escape pair at a time."""
    slash = "[0-9]{2}/[0-9]{2}"
    cases = (
        ("slash", slash, slash, "12/34"),
        ("escaped", r"[0-9]{2}\/[0-9]{2}", slash, "12/34"),
        ("backslash", r"[0-9]\\/[0-9]", r"[0-9]\\/[0-9]", "1\\/2"),
    )
    for name, pattern, reference_pattern, member in cases:
        case = Case(name, Constraint.regex(pattern), reference_pattern, (member,))
        monkeypatch.setitem(CASES, name, case)
        assert _walk_members(tiny, [name]) == [], name


def test_a_boolean_schema_is_any_json_or_nothing(tiny) -> None:
    """A JSON schema is an object or a boolean (Constraint's docstring; the server passes a
    boolean `json_schema` on): `true` compiles and takes a JSON value token by token, its
    text then complete (an end of sequence allowed), and `false` admits nothing, a
    ConstraintError. `true` is `{}`: the same compact JSON, the same first mask, no newline
    after `{` (it had no x-guidance options, so llguidance's flexible whitespace let 50
    newlines through). Planted: the boolean test written with `or` (`schema is not True or
    schema is not False`) refused `true` too."""
    empty = constrained.matcher(Constraint.json_schema({}), tiny.tokenizer)
    first = constrained.matcher(Constraint.json_schema(True), tiny.tokenizer).allowed().tolist()
    assert first == empty.allowed().tolist()
    assert tiny.tokenizer.encode("{\n", add_bos=False)[0] not in first
    true = constrained.matcher(Constraint.json_schema(True), tiny.tokenizer)
    for token in tiny.tokenizer.encode('{"a":[1,"b"]}', add_bos=False):
        assert token in set(true.allowed().tolist())
        true.consume(token)
    assert true.accepting and set(tiny.eos_ids) <= set(true.allowed().tolist())
    with pytest.raises(constrained.ConstraintError, match="json_schema: "):
        constrained.matcher(Constraint.json_schema(False), tiny.tokenizer)


def test_a_bad_constraint_is_refused_where_it_is_made(tiny) -> None:
    """Each malformed constraint is a ConstraintError naming what is wrong, before a request
    runs: a kind outside KINDS when the Constraint is made; a choice that is empty or holds
    an empty string (an end of sequence at once) when it compiles; a grammar naming a token
    the vocabulary lacks when checked against the vocabulary (the server's 400: without one,
    before a checkpoint loads, token references are not checked); a matcher without a
    vocabulary. Planted, each caught here: the kind not checked; an empty string allowed in
    a choice; the check made without the vocabulary (the error came only at admission); a
    missing tokenizer passed on (an AttributeError)."""
    with pytest.raises(constrained.ConstraintError, match="kind 'xml' is not one of"):
        Constraint("xml", "<a/>")
    for options in (["yes", ""], []):
        with pytest.raises(constrained.ConstraintError, match="list of non-empty strings"):
            Constraint.choice(options).check()
    vocabulary = constrained.Vocabulary.of(tiny.tokenizer)
    for token in ("<[200000]>", "<|no_such_token|>"):
        with pytest.raises(constrained.ConstraintError, match="grammar: "):
            Constraint.grammar(f'start: "a" {token}').check(vocabulary)
    assert constrained.matcher(None, None) is None
    with pytest.raises(constrained.ConstraintError, match="needs the checkpoint's vocabulary"):
        constrained.matcher(Constraint.choice(["yes", "no"]), None)


def test_a_matcher_rolls_back_and_checks_proposals_in_place(tiny) -> None:
    """A matcher's state is its consumed tokens, with the mask computed once per state:
    rollback returns to the earlier state's mask (not one computed after the undone token);
    viable() counts the proposals the language allows and leaves the tokens and the mask as
    they were, whether it takes some or none; a refused token is not taken (the error counts
    the tokens before it); mask(size) holds the allowed ids below `size`. The decoder never
    computes a mask between a proposal's consume and its rollback, so no run sees these.
    Planted, each caught here: rollback keeping the cached mask; rollback(0) emptying the
    consumed tokens (`del consumed[-0:]` without the `if count` guard); viable() recording
    every proposal, refused ones too; a refused token appended before the check; mask()
    without its size filter (an IndexError)."""
    yes, no, maybe = (tiny.tokenizer.encode(w, add_bos=False)[0] for w in ("yes", "no", "maybe"))
    matcher = constrained.matcher(Constraint.choice(["yes", "yesno"]), tiny.tokenizer)
    start = matcher.allowed().copy()
    matcher.consume(yes)
    after_yes = matcher.allowed().copy()
    assert not np.array_equal(start, after_yes)
    matcher.rollback(1)
    assert matcher.consumed == [] and np.array_equal(matcher.allowed(), start)
    assert matcher.viable([yes, no, maybe]) == 2
    assert matcher.consumed == [] and np.array_equal(matcher.allowed(), start)
    size = int(start[-1])  # the largest allowed id left out
    mask = matcher.mask(size)
    assert mask.shape == (size,) and mask.nonzero().flatten().tolist() == start[:-1].tolist()
    matcher.consume(yes)
    assert matcher.viable([maybe]) == 0
    assert matcher.consumed == [yes] and np.array_equal(matcher.allowed(), after_yes)
    with pytest.raises(constrained.ConstraintError, match=f"token {maybe} .* after 1 tokens"):
        matcher.consume(maybe)
    assert matcher.consumed == [yes]


def test_a_sampling_draft_is_masked_where_the_text_may_end(tiny) -> None:
    """A matcher is stopped only once an end of sequence is taken, not where the text so far
    is a member that may go on (`7` under the expression grammar): there too a sampling
    draft's proposals and each q's support are in the language (_draft_failures checks inside
    an object, where the text is never a member). Planted: `stopped` read as `accepting` let
    the draft propose from its unmasked distribution as soon as the text was a member."""
    draft = self_draft(TESTDATA / "tiny_llama.gguf", 0, sample=True)
    case = CASES["lark"]
    prompt = _prompt(tiny, case)
    seven = tiny.tokenizer.encode("7", add_bos=False)
    for seed in range(3):
        matcher = constrained.matcher(case.constraint, tiny.tokenizer)
        matcher.consume(seven[0])
        assert matcher.accepting and not matcher.stopped
        settings = dataclasses.replace(SAMPLER, seed=seed)
        decoder = Decoder(12, tiny.eos_ids, sampling=settings, prompt=prompt, constraint=matcher)
        proposal, dists = draft.drafted([*prompt, *seven], 4, decoder)
        assert matcher.consumed == seven
        walk = constrained.matcher(case.constraint, tiny.tokenizer)
        walk.consume(seven[0])
        for j, (token, (ids, probs)) in enumerate(zip(proposal, dists, strict=True)):
            allowed = set(walk.allowed().tolist())
            assert set(ids[probs > 0].tolist()) <= allowed, f"seed {seed} proposal {j}: q"
            assert token in allowed, f"seed {seed} proposal {j}: {token}"
            if token in tiny.eos_ids:
                break  # proposals after an end of sequence are never verified
            walk.consume(token)


def test_a_masked_step_keeps_only_allowed_ids_whatever_the_truncation(tiny) -> None:
    """Refused ids are -inf (apply_mask), which sampling neither counts nor keeps: with no
    truncation, and with fewer ids allowed than top_k, the processed distribution's ids are
    exactly the allowed ones, each drawable, summing to 1 (the q a sampling draft reports and
    the p the rejection sampler divides by). Planted: refused logits set to the dtype's
    lowest finite value instead of -inf kept refused ids at probability 0 (all 128k of them
    without truncation)."""
    prompt = tiny.tokenizer.encode("Answer: ")
    logits = tiny.generate(prompt, 1).logits[0]
    for top_k in (0, 64):
        matcher = constrained.matcher(Constraint.choice(["yes", "no"]), tiny.tokenizer)
        settings = SamplerSettings(temperature=1.0, top_k=top_k, seed=0)
        decoder = Decoder(4, tiny.eos_ids, sampling=settings, prompt=prompt, constraint=matcher)
        ids, probs = decoder.distribution(logits)
        ids, probs = np.asarray(ids), np.asarray(probs, dtype=np.float64)
        assert sorted(ids.tolist()) == matcher.allowed().tolist(), top_k
        assert probs.min() > 0 and abs(probs.sum() - 1.0) < 1e-9, top_k


def test_the_generate_command_reads_a_constraint_file_and_names_a_late_refusal(
    tiny, tmp_path, capsys
) -> None:
    """docs/constrained_decoding.md: `--grammar=@FILE` (any constraint option) reads its text
    from the file, and a constraint that does not compile exits 2 naming its option, also
    where only the checkpoint's vocabulary refuses it (a token id past the vocabulary passes
    the check made before the checkpoint loads; the matcher refuses it). Planted, each
    caught here: the `@` kept in the path (`user_path(value)`: every existing file "is not
    a file", the missing one still is); generate's ConstraintError not caught (a traceback,
    not exit 2)."""
    from pipelines.llama3 import generate

    gguf = str(TESTDATA / "tiny_llama.gguf")
    base = ["--gguf", gguf, "--prompt", "Answer: ", "--max-new-tokens", "6"]
    grammar, schema = tmp_path / "yes_no.gbnf", tmp_path / "yes_no.json"
    grammar.write_text('root ::= "yes" | "no"\n')
    schema.write_text('{"enum": ["yes", "no"]}')
    for option, path, answers in (
        ("--grammar", grammar, ("yes", "no")),
        ("--json-schema", schema, ('"yes"', '"no"')),
    ):
        assert generate.main([*base, f"{option}=@{path}"]) == 0, capsys.readouterr().err
        first_line = capsys.readouterr().out.splitlines()[0]
        assert first_line in [f"Answer: {a}" for a in answers], (option, first_line)
    assert generate.main([*base, "--grammar", 'start: "a" <[200000]>']) == 2
    error = capsys.readouterr().err
    assert "error: --grammar: grammar: " in error and "200000" in error, error


def test_every_http_constraint_field_is_its_constraint(tiny) -> None:
    """docs/constrained_decoding.md: over HTTP a constraint is one of OpenAI's
    `response_format` (json_object: any JSON object; json_schema: its schema), llama-server's
    `json_schema` and `grammar`, or vLLM's `guided_json`, `guided_regex`, `guided_choice`,
    `guided_grammar`; `{"type": "text"}` is none. The server's parse of each is the
    Constraint generate takes (test_server runs five of them end to end; json_object,
    guided_json and guided_grammar only here). Planted, each caught here: guided_json left
    out of CONSTRAINT_FIELDS (the request ran unconstrained, 200); json_object as `{}` (any
    JSON value: a bare number too); guided_grammar read as a regex."""
    from pipelines.llama3 import server

    parse = server.build(tiny, "tiny", kv_tokens=256).parse
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    grammar = 'root ::= "(" [0-9]+ ")"'
    forms = [
        ({"response_format": {"type": "json_object"}}, Constraint.json_schema({"type": "object"})),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
            Constraint.json_schema(schema),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"json_schema": schema}, Constraint.json_schema(schema)),
        ({"guided_json": schema}, Constraint.json_schema(schema)),
        ({"grammar": grammar}, Constraint.grammar(grammar)),
        ({"guided_grammar": grammar}, Constraint.grammar(grammar)),
        ({"guided_regex": "[a-c]{2}x"}, Constraint.regex("[a-c]{2}x")),
        ({"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"])),
    ]
    for fields, constraint in forms:
        assert parse({"prompt": "x", "max_tokens": 4, **fields}).constraint == constraint, fields


def test_greedy_takes_the_best_allowed_token(tiny) -> None:
    """docs/constrained_decoding.md, "What a mask is": greedy picks the best allowed token,
    the argmax of the step's logits over its allowed ids, also where the unconstrained
    argmax is refused. The mask comparisons check which ids are allowed and that the token
    taken is one of them, not which one; the serving paths are compared with generate,
    which shares the decoder. Planted: greedy taking the unmasked argmax and, where the
    language refuses it, the lowest allowed id (a token of the language, not the best)."""
    refused = 0
    for name in ("regex_email", "array_of_enums", "lark"):
        out = _run(tiny, CASES[name], False)
        for step, (token, ids) in enumerate(zip(out.tokens, out.allowed, strict=True)):
            row = out.logits[step]
            best = int(ids[int(torch.argmax(row[torch.from_numpy(ids)]))])
            assert token == best, (name, step, token, best)
            refused += int(torch.argmax(row)) not in set(ids.tolist())
    assert refused > 0  # the unconstrained choice was refused somewhere: the case is tested
