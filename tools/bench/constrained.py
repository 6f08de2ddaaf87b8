"""Benchmark constrained decoding: the mask's time per token, and decode with a JSON schema
against without, beside llama-server with the same schema.

Mask time: every step of greedy constrained runs of each CASES entry on the tiny checkpoint
(Llama 3's 128k vocabulary) and on SmolLM2 (49k), replayed through a fresh matcher, each
step's mask computed as the decoder computes it (`Matcher.allowed` and the [vocab] bool
tensor); p50 and p99 per vocabulary, in microseconds.

Decode: SmolLM2 (--mode), greedy, --new-tokens after a prompt, with SCHEMA (an array of at
least 48 integers: no run ends before --new-tokens) and without; llama-server (the same
threads, the golden lanes' numerics flags) the same two ways, the schema as its `json_schema`
field. Each keeps its fastest of --repeats runs; the ratios (this engine / llama-server, and
each side's constrained / unconstrained) are from this one run. llama-server's outputs under
every case's constraint (its `json_schema` field, or GBNF) are judged: JSON by jsonschema, the
others by this engine's matcher; "cut" where --new-tokens ended a valid prefix.

Example:
    bazel run //tools:bench_constrained
    bazel run //tools:bench_constrained -- --mode=ggml --new-tokens=96 --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jsonschema
import torch

from goldens.cli_files import at_least, user_path, write_atomically
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import Llama3Engine, constrained
from pipelines.llama3.constrained import Constraint
from pipelines.llama3.gguf_file import CheckpointError
from tools.bench.record import json_output
from tools.bench.sampled import LlamaServerSide, llama_server_missing

TINY = "max_tests/integration/architectures/llama3/testdata/tiny_llama.gguf"
PROMPT = "A list of numbers as a JSON array: "
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 48}
CASES = {
    "any_json": Constraint.json_schema({}),
    "object": Constraint.json_schema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
            },
            "required": ["name", "age"],
        }
    ),
    "numbers": Constraint.json_schema(SCHEMA),
    "regex": Constraint.regex(r"[a-z]+(-[a-z]+)*@[a-z]+\.(com|org)"),
    "choice": Constraint.choice(["positive", "negative", "neutral"]),
    "grammar": Constraint.grammar('root ::= e\ne ::= [0-9]+ | "(" e " + " e ")"'),
}
# The same constraints as llama-server's request fields (its regexes are written as GBNF)
PEER_FIELDS = {
    "any_json": {"json_schema": {}},
    "object": {"json_schema": json.loads(CASES["object"].text)},
    "numbers": {"json_schema": SCHEMA},
    "regex": {
        "grammar": 'root ::= w ("-" w)* "@" w "." ("com" | "org")\nw ::= [a-z]+',
    },
    "choice": {"grammar": 'root ::= "positive" | "negative" | "neutral"'},
    "grammar": {"grammar": CASES["grammar"].text},
}


@dataclasses.dataclass
class MaskTimes:
    vocabulary: str
    size: int
    steps: int
    p50_us: float
    p99_us: float


def mask_times(engine: Llama3Engine, name: str, steps: int) -> MaskTimes:
    """Each case's greedy run, its steps' masks recomputed and timed."""
    times = []
    size = engine.config.vocab_size
    for constraint in CASES.values():
        out = engine.generate(engine.tokenizer.encode(PROMPT), steps, constraint=constraint)
        matcher = constrained.matcher(constraint, engine.tokenizer)
        for token in out.tokens:
            start = time.perf_counter()
            matcher.mask(size)
            times.append(time.perf_counter() - start)
            matcher.consume(token)
    cuts = statistics.quantiles(times, n=100)
    return MaskTimes(name, size, len(times), cuts[49] * 1e6, cuts[98] * 1e6)


@dataclasses.dataclass
class DecodeRow:
    side: str
    schema: bool
    tps: float = 0.0
    valid: str = ""  # llama-server's constrained outputs against the schema


def engine_row(engine: Llama3Engine, schema: bool, input_ids, args) -> DecodeRow:
    row = DecodeRow("engine", schema)
    constraint = Constraint.json_schema(SCHEMA) if schema else None
    for _ in range(args.repeats):
        # unconstrained: end of sequence ignored; constrained it must be honoured, and the
        # schema's 48 integers outlast --new-tokens
        out = engine.generate(
            list(input_ids), args.new_tokens, stop_on_eos=schema, constraint=constraint
        )
        row.tps = max(row.tps, (len(out.tokens) - 1) / out.decode_seconds)
    return row


def llama_rows(gguf: str, engine, input_ids, args) -> tuple[list[DecodeRow], str]:
    server = LlamaServerSide(gguf, args.threads)
    rows = [DecodeRow("llama-server", False), DecodeRow("llama-server", True)]
    outputs = []
    try:
        conformance = peer_conformance(server, engine, args.new_tokens)
        for _ in range(args.repeats):
            for row in rows:
                fields = {"json_schema": SCHEMA, "ignore_eos": False} if row.schema else {}
                answer = server.completion(input_ids, args.new_tokens, **fields)
                row.tps = max(row.tps, float(answer["timings"]["predicted_per_second"]))
                if row.schema:
                    outputs.append(answer["content"])
    finally:
        server.close()
    rows[1].valid = _validity(outputs, args.new_tokens)
    return rows, conformance


def _validity(outputs: list[str], new_tokens: int) -> str:
    """How many outputs are instances of SCHEMA, or prefixes of one cut by max tokens."""
    whole = cut = 0
    for text in outputs:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            whole += 1
        except json.JSONDecodeError:
            cut += text.startswith("[")  # ran into --new-tokens inside the array
        except jsonschema.ValidationError:
            pass
    return f"{whole} valid, {cut} cut at {new_tokens} tokens, of {len(outputs)}"


def peer_conformance(server: LlamaServerSide, engine: Llama3Engine, new_tokens: int) -> str:
    """llama-server's greedy output for each case, constrained by its own fields: a JSON one
    validated by jsonschema (whitespace is its grammar's choice), any other fed through this
    engine's matcher (in the language, or a prefix of a member where it ran out of tokens)."""
    input_ids = engine.tokenizer.encode(PROMPT)
    verdicts = []
    for name, constraint in CASES.items():
        fields = {**PEER_FIELDS[name], "ignore_eos": False}
        answer = server.completion(input_ids, new_tokens, **fields)
        text, cut = answer["content"], answer.get("stop_type") == "limit"
        verdicts.append(f"{name} {_judged(engine, constraint, text, cut)}")
    return "llama-server's constrained outputs: " + ", ".join(verdicts)


def _judged(engine: Llama3Engine, constraint: Constraint, text: str, cut: bool) -> str:
    if constraint.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(constraint.text))
            return "valid"
        except json.JSONDecodeError:
            return "cut" if cut else f"NOT JSON {text[:40]!r}"
        except jsonschema.ValidationError as error:
            return f"INVALID ({error.message[:40]})"
    matcher = constrained.matcher(constraint, engine.tokenizer)
    try:
        for token in engine.tokenizer.encode(text, add_bos=False):
            matcher.consume(token)
    except constrained.ConstraintError:
        return f"OUTSIDE {text[:40]!r}"
    return "valid" if matcher.accepting else ("cut" if cut else f"UNFINISHED {text[:40]!r}")


def _lines(masks: list[MaskTimes], rows: list[DecodeRow], args) -> list[str]:
    out = ["mask time per token (Matcher.allowed + the bool mask), greedy runs of every case:"]
    for m in masks:
        out.append(
            f"  {m.vocabulary:<8} vocabulary {m.size:>6}: {m.steps:>4} steps, "
            f"p50 {m.p50_us:7.1f} us, p99 {m.p99_us:7.1f} us"
        )
    out.append(
        f"decode tok/s, SmolLM2 ({args.mode}), greedy, {args.new_tokens} tokens, "
        f"{args.threads} threads, fastest of {args.repeats}; schema: {json.dumps(SCHEMA)}"
    )
    tps = {(r.side, r.schema): r.tps for r in rows}
    for r in rows:
        base = tps.get((r.side, False))
        ratio = f"{r.tps / base:.2f}x unconstrained" if r.schema and base else ""
        out.append(
            f"  {r.side:<13} {'schema' if r.schema else 'none':<7} {r.tps:7.1f} {ratio}"
            + (f"  outputs: {r.valid}" if r.valid else "")
        )
    for schema in (False, True):
        ours, theirs = tps.get(("engine", schema)), tps.get(("llama-server", schema))
        if ours and theirs:
            label = "with the schema" if schema else "without"
            out.append(f"engine / llama-server decode tok/s {label}: {ours / theirs:.2f}")
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_constrained",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gguf", type=user_path, default=None, help="default: SmolLM2-135M-Instruct Q4_1"
    )
    parser.add_argument(
        "--mode", default="quantized", choices=("eager", "quantized", "ggml"), help="engine mode"
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded per run")
    parser.add_argument("--mask-steps", type=int, default=24, help="steps per case timed")
    parser.add_argument(
        "--threads", type=at_least(1), default=2, help="torch and llama.cpp threads"
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the fastest kept")
    parser.add_argument(
        "--no-llama-server", action="store_true", help="only this engine's rows (no peer)"
    )
    parser.add_argument("--json", default=None, help="write the figures to this file too")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or args.mask_steps < 1:
        parser.error("--new-tokens must be at least 2, --repeats and --mask-steps at least 1")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf={args.gguf} is not a file; give a GGUF checkpoint")
    json_path = json_output(args.json, parser)
    gguf = str(args.gguf or smollm2_gguf())
    torch.set_num_threads(args.threads)
    try:
        engine = Llama3Engine.from_gguf(gguf, mode=args.mode)
    except CheckpointError as error:  # truncated, not GGUF, not a llama: the loader says which
        print(f"error: --gguf: {error}", file=sys.stderr)
        return 2
    if engine.tokenizer is None:
        print(f"error: {gguf} stores no tokenizer: constraints need one", file=sys.stderr)
        return 2
    tiny = Llama3Engine.from_gguf(TINY)
    masks = [
        mask_times(tiny, "tiny", args.mask_steps),
        mask_times(engine, "smollm2", args.mask_steps),
    ]
    input_ids = engine.tokenizer.encode(PROMPT)
    rows = [engine_row(engine, schema, input_ids, args) for schema in (False, True)]
    peer_line = llama_server_missing(args.no_llama_server)  # or the peer's conformance
    if not peer_line:
        peer, peer_line = llama_rows(gguf, engine, input_ids, args)
        rows += peer
    lines = [*_lines(masks, rows, args), peer_line]
    print("\n".join(lines))
    if json_path:
        record = {
            "masks": [dataclasses.asdict(m) for m in masks],
            "decode": [dataclasses.asdict(r) for r in rows],
        }
        write_atomically(json_path, (json.dumps(record, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
