"""Benchmark the Llama 3 engine's execution modes against transformers and llama.cpp, in one run.

Every side decodes greedily on the CPU in float32 with the same thread count and the same
prompt token ids: the engine in each --modes (eager, compiled, quantized), transformers on the
same GGUF, and llama.cpp when its Python binding imports (optional, tools/bench/llama_cpp_peer.py).
The table gives load seconds, prefill and decode tokens/s, the bytes of weights one decoded
token reads and the bandwidth that implies, then each mode's ratios against the peers.
Generations alternate between all sides `--repeats` times and each side keeps its fastest
prefill and decode, so a burst of load from another process skews no side alone.
`--json FILE` also writes the numbers as a record (tools/bench/record.py) that perf_regression
compares with a baseline.

Example:
    bazel run //tools/bench -- --new-tokens 32 --threads 2
    bazel run //tools/bench -- --modes=quantized --check   # exit 1 below the acceptance bars
    bazel run //tools/bench -- --threads 1 --json bench.json   # for perf_regression's baseline
"""

import argparse
import dataclasses
import math
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable

# transformers must never reach a hub: everything comes from the local GGUF.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch

from goldens.cli_files import PathError, output_directory, user_path
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import CheckpointError, Llama3Engine, LlamaConfig
from pipelines.llama3.engine import MODES, freeze_imported_objects
from pipelines.llama3.gguf_file import GGUFFile
from tools.bench import llama_cpp_peer
from tools.bench.record import (
    PEER,
    Timings,
    build_record,
    load_average,
    machine_info,
    write_record,
)

DEFAULT_PROMPT = "The capital of France is a city with a long history. Its most famous monument is"
MIN_LOAD_SPEEDUP = 5.0  # eager: load at least 5x faster than transformers
MIN_DECODE_RATIO = 1.0  # and decode at least as fast
QUANTIZED_OVER_TRANSFORMERS = 2.0  # quantized: decode at least 2x transformers'
QUANTIZED_OVER_LLAMA_CPP = 0.75  # and 0.75x llama.cpp's, when llama.cpp is measured
LLAMA_CPP = "llama.cpp"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", type=pathlib.Path, help="GGUF checkpoint (default: SmolLM2-135M-Instruct Q4_1)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating generations; the fastest counts"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"engine execution modes, comma-separated (default: {','.join(MODES)})",
    )
    parser.add_argument(
        "--no-llama-cpp", action="store_true", help="skip llama.cpp even when it imports"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when below the acceptance bar")
    parser.add_argument(
        "--json", metavar="FILE", help="also write the numbers as a record for perf_regression"
    )
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _transformers_config(gguf_dir: pathlib.Path, gguf_name: str, config: LlamaConfig):
    """transformers' config for the file, with Llama 3.1 rope scaling its GGUF loader drops."""
    if config.rope_scaling_type != "llama3":
        return None
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    hf_config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        "factor": config.rope_scaling_factor,
        "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_context_length,
    }
    return hf_config


@torch.inference_mode()
def _transformers_greedy(
    model, input_ids: list[int], new_tokens: int
) -> tuple[list[int], float, float]:
    """Prefill, then one forward per token with transformers' KV cache, as the engine does."""
    ids = torch.tensor([input_ids])
    start = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(new_tokens - 1):
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, prefill_seconds, time.perf_counter() - start


@dataclasses.dataclass
class Side:
    """One implementation under test: how it generates, and its fastest times so far."""

    name: str  # an engine mode, "transformers" or "llama.cpp"
    load_seconds: float
    weight_bytes: int  # bytes of weights one decoded token reads
    greedy: Callable[[list[int], int], tuple[list[int], float, float]]
    tokens: list[int] = dataclasses.field(default_factory=list)
    prefill_seconds: float = math.inf
    decode_seconds: float = math.inf

    def run(self, input_ids: list[int], new_tokens: int) -> None:
        tokens, prefill_seconds, decode_seconds = self.greedy(input_ids, new_tokens)
        self.tokens = tokens
        self.prefill_seconds = min(self.prefill_seconds, prefill_seconds)
        self.decode_seconds = min(self.decode_seconds, decode_seconds)

    def timings(self, prompt_tokens: int, new_tokens: int) -> Timings:
        return Timings(
            self.load_seconds,
            prompt_tokens / self.prefill_seconds,
            (new_tokens - 1) / self.decode_seconds,
        )


def _alternate(sides: list[Side], input_ids: list[int], new_tokens: int, repeats: int) -> None:
    """Generate with every side in turn, `repeats` times; each keeps its fastest.

    On a shared CPU another process can slow any single generation. Alternating exposes all
    sides to the same spells of load, and the fastest of several generations is the least
    disturbed one (the reason timeit reports a minimum).
    """
    for _ in range(repeats):
        for side in sides:
            side.run(input_ids, new_tokens)


def _engine_side(gguf_path: pathlib.Path, mode: str) -> Side:
    start = time.perf_counter()
    engine = Llama3Engine.from_gguf(gguf_path, mode=mode)
    load_seconds = time.perf_counter() - start

    def greedy(input_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        out = engine.generate(input_ids, new_tokens, stop_on_eos=False)
        return out.tokens, out.prefill_seconds, out.decode_seconds

    side = Side(mode, load_seconds, engine.weight_bytes_per_token, greedy)
    side.engine = engine
    return side


def _transformers_side(gguf_path: pathlib.Path, config: LlamaConfig) -> Side:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as gguf_dir:
        # transformers wants a folder and a file name; a symlink avoids copying the checkpoint.
        link = pathlib.Path(gguf_dir) / gguf_path.name
        link.symlink_to(gguf_path)
        hf_config = _transformers_config(pathlib.Path(gguf_dir), link.name, config)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=link.name,
            dtype=torch.float32,
            **({"config": hf_config} if hf_config else {}),
        )
        load_seconds = time.perf_counter() - start
    model.eval()
    linear_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    return Side(
        PEER, load_seconds, linear_bytes, lambda ids, n: _transformers_greedy(model, ids, n)
    )


def _llama_cpp_side(gguf_path: pathlib.Path, threads: int, context: int) -> Side | None:
    llama_cpp, what = llama_cpp_peer.import_llama_cpp()
    _progress(f"llama.cpp: {what}")
    if llama_cpp is None:
        return None
    peer = llama_cpp_peer.LlamaCppPeer(llama_cpp, gguf_path, threads, context)
    reader = GGUFFile(gguf_path)
    file_bytes = sum(reader.tensor_data(name).nbytes for name in reader.tensors)
    return Side(LLAMA_CPP, peer.load_seconds, file_bytes, peer.greedy)


def _print_table(sides: list[Side], prompt_tokens: int, new_tokens: int) -> None:
    rows = [
        ("load seconds", lambda s: s.load_seconds),
        ("prefill tok/s", lambda s: prompt_tokens / s.prefill_seconds),
        ("decode tok/s", lambda s: (new_tokens - 1) / s.decode_seconds),
        ("weights MB/token", lambda s: s.weight_bytes / 1e6),
        ("implied GB/s", lambda s: s.weight_bytes * (new_tokens - 1) / s.decode_seconds / 1e9),
    ]
    print(f"{'':18}" + "".join(f"{side.name:>14}" for side in sides))
    for label, value in rows:
        print(f"{label:18}" + "".join(f"{value(side):14.2f}" for side in sides))


def _print_ratios(modes: list[Side], peers: list[Side], prompt_tokens, new_tokens) -> None:
    """Each engine mode over each peer: load (seconds: lower is better), prefill, decode."""
    for peer in peers:
        theirs = peer.timings(prompt_tokens, new_tokens)
        for side in modes:
            ours = side.timings(prompt_tokens, new_tokens)
            print(
                f"{side.name}/{peer.name}: load {ours.load_seconds / theirs.load_seconds:.3f}  "
                f"prefill {ours.prefill_tokens_per_second / theirs.prefill_tokens_per_second:.3f}"
                f"  decode {ours.decode_tokens_per_second / theirs.decode_tokens_per_second:.3f}"
            )


def _acceptance(sides: dict[str, Side], prompt_tokens: int, new_tokens: int) -> list[str]:
    """The bars a --check run must clear, as 'PASS/FAIL what' lines."""
    timing = {name: side.timings(prompt_tokens, new_tokens) for name, side in sides.items()}
    decode = {name: t.decode_tokens_per_second for name, t in timing.items()}
    bars = []
    if "eager" in sides:
        bars.append(
            (
                timing[PEER].load_seconds / timing["eager"].load_seconds >= MIN_LOAD_SPEEDUP,
                f"eager load >= {MIN_LOAD_SPEEDUP}x faster than transformers",
            )
        )
        bars.append(
            (decode["eager"] >= MIN_DECODE_RATIO * decode[PEER], "eager decode >= transformers")
        )
    if "quantized" in sides:
        bars.append(
            (
                decode["quantized"] >= QUANTIZED_OVER_TRANSFORMERS * decode[PEER],
                f"quantized decode >= {QUANTIZED_OVER_TRANSFORMERS}x transformers",
            )
        )
        if LLAMA_CPP in sides:
            bars.append(
                (
                    decode["quantized"] >= QUANTIZED_OVER_LLAMA_CPP * decode[LLAMA_CPP],
                    f"quantized decode >= {QUANTIZED_OVER_LLAMA_CPP}x llama.cpp",
                )
            )
    reference = sides.get("eager")
    for name in MODES:
        if reference is not None and name in sides and name != "eager":
            bars.append((sides[name].tokens == reference.tokens, f"{name} greedy tokens = eager's"))
    return [f"{'PASS' if ok else 'FAIL'} {what}" for ok, what in bars]


def _write_json(
    path: pathlib.Path,
    engine: dict[str, Timings],
    peer: Timings,
    other_peers: dict[str, Timings],
    setup,
    load_at_start: float,
) -> None:
    """The run as a record: timings, ratios, and the machine and versions they depend on."""
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    conditions = {"load_average_start": load_at_start, "load_average_end": load_average()}
    record = build_record(
        engine,
        peer,
        machine=machine_info(),
        versions=versions,
        setup=setup,
        conditions=conditions,
        other_peers=other_peers,
    )
    write_record(path, record)
    _progress(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    freeze_imported_objects()  # before the first load: see its docstring
    parser = _parser()
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(
            f"--new-tokens={args.new_tokens} must be at least 2 (one prefill, then decode steps)"
        )
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1")
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes={args.modes}: choose from {', '.join(MODES)}")
    json_path = user_path(args.json) if args.json else None
    if json_path:
        try:  # before the minutes of benchmarking, not after
            output_directory(json_path.parent, "--json")
        except PathError as error:
            parser.error(str(error))
    torch.set_num_threads(args.threads)
    try:
        gguf_path = args.gguf or smollm2_gguf()
    except FileNotFoundError as error:
        parser.error(str(error))
    if args.gguf and os.environ.get("BUILD_WORKING_DIRECTORY") and not gguf_path.is_absolute():
        gguf_path = pathlib.Path(os.environ["BUILD_WORKING_DIRECTORY"]) / gguf_path
    gguf_path = gguf_path.resolve()

    load_at_start = load_average()
    engines = []
    for mode in modes:
        _progress(f"engine ({mode}): loading {gguf_path}")
        try:
            engines.append(_engine_side(gguf_path, mode))
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    tokenizer = engines[0].engine.tokenizer
    input_ids = tokenizer.encode(args.prompt)
    _progress("transformers: loading (dequantizes the whole file)")
    peers = [_transformers_side(gguf_path, engines[0].engine.config)]
    if not args.no_llama_cpp:
        llama_cpp = _llama_cpp_side(gguf_path, args.threads, len(input_ids) + args.new_tokens + 8)
        peers += [llama_cpp] if llama_cpp else []
    sides = engines + peers
    for side in sides:  # warm-up: caches, kernel selection, torch.compile's compilation
        start = time.perf_counter()
        side.greedy(input_ids, 4)
        if side.name == "compiled":
            _progress(f"compiled: first generation (compiling) {time.perf_counter() - start:.1f} s")
    _progress(f"generating: {len(sides)} sides alternately, {args.repeats} times")
    _alternate(sides, input_ids, args.new_tokens, args.repeats)

    print(f"checkpoint: {gguf_path.name}  threads: {args.threads}  float32 cpu")
    print(
        f"prompt tokens: {len(input_ids)}  new tokens: {args.new_tokens}  "
        f"fastest of {args.repeats} alternating generations"
    )
    _print_table(sides, len(input_ids), args.new_tokens)
    _print_ratios(engines, peers, len(input_ids), args.new_tokens)
    for side in sides[1:]:
        same = sum(a == b for a, b in zip(side.tokens, sides[0].tokens, strict=True))
        print(f"greedy tokens identical to {sides[0].name}: {side.name} {same}/{len(side.tokens)}")
    verdicts = _acceptance({s.name: s for s in sides}, len(input_ids), args.new_tokens)
    print("\n".join(verdicts))
    if json_path:
        setup = {
            "checkpoint": gguf_path.name,
            "device": "cpu",
            "dtype": "float32",
            "new_tokens": args.new_tokens,
            "prompt_tokens": len(input_ids),
            "repeats": args.repeats,
            "threads": args.threads,
        }
        timings = {s.name: s.timings(len(input_ids), args.new_tokens) for s in sides}
        _write_json(
            json_path,
            {m.name: timings[m.name] for m in engines},
            timings[PEER],
            {name: t for name, t in timings.items() if name == LLAMA_CPP},
            setup,
            load_at_start,
        )
    if args.check and any(v.startswith("FAIL") for v in verdicts):
        print("FAILED: below the acceptance bar", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
