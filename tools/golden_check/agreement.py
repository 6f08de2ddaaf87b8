"""Three-way agreement: this engine, transformers and llama.cpp on every checkpoint, as a table.

Each pair is one engine teacher-forced on the other's golden (every case, every step and
recorded prompt position): this engine on transformers' golden (the torch goldens), llama.cpp
on this engine's golden and on transformers'. Per pair: the worst |Δ log-prob| over the
golden's top-20, the worst KL, greedy agreement (steps where the engine, fed the golden's
prefix, chose the golden's token) and, for llama.cpp, how many golden ids were outside its
top-20 (their |Δ| is then a lower bound). llama-server runs as the llama.cpp lane runs it
(goldens/engines/llama_server.py).

  ./bazelw run //tools:engine_agreement              markdown table on stdout (README.md)
  ./bazelw run //tools:engine_agreement -- --lane=short

Exit status: 0 printed; 2 llama-server is missing (tools/llama_cpp/install.sh) or a
checkpoint's goldens are not pinned.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from goldens.cli_files import OneLineParser
from goldens.engines.base import EngineError
from goldens.engines.llama_server import LlamaServer, binary
from goldens.engines.openai import LlamaCppEngine
from goldens.machine import cpu_model
from goldens.tolerances import tolerance
from harness.llama3 import golden_files, judge
from harness.llama3.engine_adapters import ThisEngine, judge_engine
from harness.llama3.variants import testdata_directory, variants

CASES = {"all": "every case", "short": "the short cases", "long": "the long cases"}
PAIRS = (
    ("this engine", "torch", "this engine vs transformers"),
    ("llama.cpp", "own", "llama.cpp vs this engine"),
    ("llama.cpp", "torch", "llama.cpp vs transformers"),
)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="engine_agreement",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: ./bazelw run //tools:engine_agreement -- --lane=short",
    )
    p.add_argument("--lane", choices=judge.LANES, default="all", help="which cases")
    return p


def _cell(verdict: judge.Verdict) -> str:
    agreement = sum(r.greedy_agreement for r in verdict.reports)
    bounded = sum(c.bounded for r in verdict.reports for c in r.checks)
    tail = f", {bounded} bounded" if bounded else ""
    return (
        f"{verdict.max_logprob_diff:.2g} / {verdict.max_kl:.1g} / {agreement}/{verdict.steps}{tail}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        binary()
    except EngineError as e:
        print(f"engine_agreement: {e}", file=sys.stderr)
        return 2
    rows = []
    for variant in variants():
        if variant.path is None or variant.encoding == "unknown":
            continue
        goldens = {}
        for reference in ("own", "torch"):
            found = golden_files.find_golden(reference, variant, testdata_directory())
            if found is None:
                print(
                    f"engine_agreement: no {reference} golden of {variant.test_id}", file=sys.stderr
                )
                return 2
            goldens[reference] = (judge.in_lane(found[0], variant.model, args.lane), found[1])
        engines = {"this engine": ThisEngine(variant)}
        cells = []
        with LlamaServer(variant.path) as server:
            engines["llama.cpp"] = LlamaCppEngine(server.url)
            for who, reference, _ in PAIRS:
                golden, source = goldens[reference]
                engine = engines[who]
                # The cpu entry only for the report's sake: the table records numbers.
                tol = tolerance(reference, variant.encoding, "cpu")
                verdict = judge_engine(engine, golden, source, reference, tol, variant, args.lane)
                cells.append(_cell(verdict))
                print(f"  {variant.test_id}: {who} on {reference}: {cells[-1]}", file=sys.stderr)
        rows.append((f"{variant.model} {variant.encoding}", cells))
    print(
        f"Max |Δ log-prob| / max KL / greedy agreement, teacher-forced on every step and "
        f"prompt position of {CASES[args.lane]} ({cpu_model()}; llama-server 1 thread, f32 KV):\n"
    )
    print("| checkpoint | " + " | ".join(title for _, _, title in PAIRS) + " |")
    print("| --- |" + " --- |" * len(PAIRS))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
