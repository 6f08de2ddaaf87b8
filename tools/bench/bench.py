"""Benchmark the Llama 3 engine's execution modes against transformers and llama.cpp, in one run.

Every side decodes greedily on the CPU in float32 with the same thread count and the same
prompt token ids: the engine in each --modes (pipelines.llama3.engine.MODES), transformers on
the same GGUF, and llama.cpp (tools/bench/llama_cpp_peer.py): its Python binding when that
imports, else Debian's `llama-bench` when it is on the PATH (tools/llama_cpp/install.sh), else
none, with a line saying why. `llama-bench` times a prompt of the same length and as many
decode steps, but of its own token ids: it returns no tokens and reports no load time, so it
takes no part in token comparisons and its load reads "n/a" (null in the record). A line
names the llama.cpp measured.

The table gives load seconds, prefill and decode tokens/s, the bytes of weights one decoded
token reads and the bandwidth that implies, then each mode's ratios against the peers, and
this machine's read bandwidth (a torch sum over a 512 MiB float32 tensor on the same threads,
best of 3) with the fraction of it each side's decode implies.
Generations alternate between all sides `--repeats` times (llama-bench: one run of it per
round) and each side keeps its fastest prefill and decode, so a burst of load from another
process skews no side alone. `--check` exits 1 below the acceptance bars (RATIO_BARS and the
load and token bars in _acceptance; a bar whose peer was not measured prints SKIP and fails
--check, unless --no-llama-cpp left llama.cpp out on purpose).
`--json FILE` also writes the numbers as a record (tools/bench/record.py) that perf_regression
compares with a baseline.

Example:
    bazel run //tools/bench -- --new-tokens 32 --threads 2
    bazel run //tools/bench -- --modes=quantized --check   # exit 1 below the acceptance bars
    bazel run //tools/bench -- --threads 1 --json bench.json   # for perf_regression's baseline
    bazel run //tools/bench -- --sampler=temperature=0.8,top_k=40,top_p=0.95,min_p=0.05
    bazel run //tools/bench -- --modes=quantized,ggml --no-sampling --profile=$PWD/bench.json

`--profile FILE` then runs one more generation of each engine mode under torch.profiler and
writes them as one Chrome trace-event file (pipelines/llama3/profiling.py; a range `bench
MODE` around each, the engine's own ranges and kernel calls inside): after the timed rounds,
so the profiler's cost touches no figure.

After the greedy table, a sampled decode section (tools/bench/sampled.py): each mode's decode
tokens/s greedy and sampled (--sampler, seed 0), beside llama-server doing both with the same
settings, and the ratios (--no-sampling skips it).
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

from goldens.cli_files import at_least, user_path
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import CheckpointError, Llama3Engine, LlamaConfig, profiling
from pipelines.llama3.engine import MODES, freeze_imported_objects
from pipelines.llama3.gguf_file import GGUFFile
from pipelines.llama3.sampling import settings_from_text, settings_text
from tools.bench import cpu_level, llama_cpp_peer, sampled
from tools.bench.record import (
    METRICS,
    PEER,
    Timings,
    build_record,
    json_output,
    load_average,
    machine_info,
    write_record,
)

DEFAULT_PROMPT = "The capital of France is a city with a long history. Its most famous monument is"
MIN_LOAD_SPEEDUP = 5.0  # eager: load at least 5x faster than transformers
MIN_DECODE_RATIO = 1.0  # and decode at least as fast
QUANTIZED_OVER_TRANSFORMERS = 2.0  # quantized: decode at least 2x transformers'
QUANTIZED_OVER_LLAMA_CPP = 0.75  # and 0.75x llama.cpp's, when llama.cpp is measured
GGML_OVER_LLAMA_CPP_DECODE = 1.0  # ggml: decode at least as fast as llama.cpp's
GGML_OVER_LLAMA_CPP_PREFILL = 1.0  # and prefill too
LLAMA_CPP = "llama.cpp"
# llama-bench with `--repack 0`: the weights as the file holds them, multiplied by the
# per-block dot products the ggml mode reproduces (by default llama.cpp repacks them at load
# for its CPU's kernels; on an Intel Xeon with AMX, 2x its decode on SmolLM2). A side of its
# own, no bar: it says how far the default's repacked kernels are from the ggml mode's.
LLAMA_CPP_NO_REPACK = "llama.cpp-no-repack"
LLAMA_CPP_SIDES = (LLAMA_CPP, LLAMA_CPP_NO_REPACK)  # the sides that are llama.cpp
GGML = "ggml"  # an engine mode once pipelines.llama3.engine.MODES has it
# (mode, peer, metric, least ratio mode/peer): a bar applies when both sides were measured.
RATIO_BARS = (
    ("eager", PEER, "decode", MIN_DECODE_RATIO),
    ("quantized", PEER, "decode", QUANTIZED_OVER_TRANSFORMERS),
    ("quantized", LLAMA_CPP, "decode", QUANTIZED_OVER_LLAMA_CPP),
    (GGML, LLAMA_CPP, "decode", GGML_OVER_LLAMA_CPP_DECODE),
    (GGML, LLAMA_CPP, "prefill", GGML_OVER_LLAMA_CPP_PREFILL),
)
BANDWIDTH_MIB = 512  # far past any cache: a read from memory
BANDWIDTH_REPEATS = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", type=pathlib.Path, help="GGUF checkpoint (default: SmolLM2-135M-Instruct Q4_1)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=at_least(1), default=2)
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating generations; the fastest counts"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"engine execution modes, comma-separated (default: {','.join(MODES)})",
    )
    parser.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="skip llama.cpp even when its binding imports or llama-bench is on the PATH",
    )
    parser.add_argument(
        "--sampler",
        default=settings_text(sampled.DEFAULT_SAMPLER),
        help="the sampled decode's settings, KEY=VALUE,... of temperature, top_k, top_p, "
        "min_p (default: %(default)s)",
    )
    parser.add_argument(
        "--no-sampling", action="store_true", help="skip the sampled decode section"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when below the acceptance bar")
    cpu_level.add_argument(parser)
    parser.add_argument(
        "--json", metavar="FILE", help="also write the numbers as a record for perf_regression"
    )
    parser.add_argument(
        "--profile",
        type=lambda value: profiling.trace_file(user_path(value)),
        metavar="FILE",
        help="after the timing, one generation of each engine mode under torch.profiler, "
        "written as a Chrome trace-event file (Perfetto's UI, chrome://tracing)",
    )
    return parser


def profile_engines(
    path: pathlib.Path, engines: list["Side"], input_ids: list[int], new_tokens: int
) -> int:
    """One greedy generation of each engine side under the profiler, a range `bench MODE`
    around each, written to `path`; returns the trace's event count."""
    with profiling.trace(path) as taken:
        for side in engines:
            with profiling.region(f"bench {side.name}"):
                side.greedy(input_ids, new_tokens)
    return taken.events


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
    load_seconds: float  # nan: not measured (llama-bench)
    weight_bytes: int  # bytes of weights one decoded token reads
    # (tokens, prefill seconds, decode seconds); tokens None: a side that returns none
    greedy: Callable[[list[int], int], tuple[list[int] | None, float, float]]
    tokens: list[int] | None = dataclasses.field(default_factory=list)
    prefill_seconds: float = math.inf
    decode_seconds: float = math.inf
    no_tokens: str = ""  # why tokens are None, for the comparison lines

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


def _llama_cpp_no_repack_side(
    gguf_path: pathlib.Path, threads: int, llama_cpp: Side | None
) -> Side | None:
    """llama-bench with `--repack 0` (LLAMA_CPP_NO_REPACK), or None where it is not there:
    the llama.cpp side's own llama-bench without repacking (no second probe of it), else one
    of its own (the llama.cpp side is the binding)."""
    if llama_cpp is not None and isinstance(llama_cpp.peer, llama_cpp_peer.LlamaBenchPeer):
        peer = llama_cpp.peer.without_repack()
        return _peer_side(LLAMA_CPP_NO_REPACK, peer, gguf_path, llama_cpp.weight_bytes)
    binary = llama_cpp_peer.find_llama_bench()
    if binary is None:
        return None
    try:
        peer = llama_cpp_peer.LlamaBenchPeer(binary, gguf_path, threads, repack=False)
    except llama_cpp_peer.LlamaBenchError as error:
        _progress(f"{LLAMA_CPP_NO_REPACK}: skipped: {error}")
        return None
    return _peer_side(LLAMA_CPP_NO_REPACK, peer, gguf_path)


def _peer_side(name: str, peer, gguf_path: pathlib.Path, file_bytes: int | None = None) -> Side:
    if file_bytes is None:
        reader = GGUFFile(gguf_path)
        file_bytes = sum(reader.tensor_data(name).nbytes for name in reader.tensors)
    side = Side(name, peer.load_seconds, file_bytes, peer.greedy)
    side.peer = peer
    if not peer.compares_tokens:
        side.no_tokens = peer.NO_TOKENS
    return side


def _llama_cpp_side(
    gguf_path: pathlib.Path, threads: int, context: int, binding: bool = True
) -> Side | None:
    """llama.cpp through its binding (unless not `binding`), else through llama-bench, else
    None (a line says why)."""
    llama_cpp, what = llama_cpp_peer.import_llama_cpp() if binding else (None, "--cpu-level")
    if llama_cpp is not None:
        _progress(f"llama.cpp: {what}")
        peer = llama_cpp_peer.LlamaCppPeer(llama_cpp, gguf_path, threads, context)
    else:
        binary = llama_cpp_peer.find_llama_bench()
        if binary is None:
            _progress(
                f"llama.cpp: skipped: {what}; and no {llama_cpp_peer.LLAMA_BENCH} on the PATH "
                f"({llama_cpp_peer.INSTALL_HINT})"
            )
            return None
        try:
            peer = llama_cpp_peer.LlamaBenchPeer(binary, gguf_path, threads)
        except llama_cpp_peer.LlamaBenchError as error:
            _progress(f"llama.cpp: skipped: {error}")
            return None
        _progress(f"llama.cpp: {binary} (the binding does not import)")
    return _peer_side(LLAMA_CPP, peer, gguf_path)


def measure_read_bandwidth(
    mib: int = BANDWIDTH_MIB, repeats: int = BANDWIDTH_REPEATS
) -> tuple[float, float]:
    """(GB/s, seconds taken): the fastest of `repeats` torch sums over a float32 tensor of
    `mib` MiB, on torch's threads (the bench's --threads). ones() writes every page first, so
    no sum pays for page faults."""
    start = time.perf_counter()
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    fastest = math.inf
    for _ in range(repeats):
        begin = time.perf_counter()
        data.sum()
        fastest = min(fastest, time.perf_counter() - begin)
    gb_per_s = data.nbytes / fastest / 1e9
    del data
    return gb_per_s, time.perf_counter() - start


def _implied_gb_per_s(side: Side, new_tokens: int) -> float:
    return side.weight_bytes * (new_tokens - 1) / side.decode_seconds / 1e9


def _number(value: float, digits: int = 2) -> str:
    """`value` with `digits` decimals, or n/a when it was not measured (nan)."""
    return f"{value:.{digits}f}" if math.isfinite(value) else "n/a"


def _print_table(sides: list[Side], prompt_tokens: int, new_tokens: int) -> None:
    rows = [
        ("load seconds", lambda s: s.load_seconds),
        ("prefill tok/s", lambda s: prompt_tokens / s.prefill_seconds),
        ("decode tok/s", lambda s: (new_tokens - 1) / s.decode_seconds),
        ("weights MB/token", lambda s: s.weight_bytes / 1e6),
        ("implied GB/s", lambda s: _implied_gb_per_s(s, new_tokens)),
    ]
    widths = [max(14, len(side.name) + 2) for side in sides]
    print(f"{'':18}" + "".join(f"{s.name:>{w}}" for s, w in zip(sides, widths, strict=True)))
    for label, value in rows:
        cells = (f"{_number(value(s)):>{w}}" for s, w in zip(sides, widths, strict=True))
        print(f"{label:18}" + "".join(cells))


def _print_ratios(modes: list[Side], peers: list[Side], prompt_tokens, new_tokens) -> None:
    """Each engine mode over each peer: load (seconds: lower is better), prefill, decode."""
    for peer in peers:
        theirs = peer.timings(prompt_tokens, new_tokens)
        for side in modes:
            ours = side.timings(prompt_tokens, new_tokens)
            ratio = {name: ours.metric(name) / theirs.metric(name) for name in METRICS}
            print(
                f"{side.name}/{peer.name}: "
                + "  ".join(f"{name} {_number(ratio[name], 3)}" for name in METRICS)
            )


def _print_tokens(sides: list[Side]) -> None:
    """How many greedy tokens each side shares with the first mode's (a side without tokens
    says why it is not compared)."""
    reference = sides[0]
    for side in sides[1:]:
        if side.tokens is None:
            print(f"greedy tokens not compared: {side.name} ({side.no_tokens})")
            continue
        same = sum(a == b for a, b in zip(side.tokens, reference.tokens, strict=True))
        note = " (llama.cpp's numerics: another program, not a bar)" if side.name == "ggml" else ""
        print(
            f"greedy tokens identical to {reference.name}: {side.name} "
            f"{same}/{len(side.tokens)}{note}"
        )


def _print_bandwidth(
    sides: list[Side], new_tokens: int, gb_per_s: float, seconds: float, threads: int
) -> None:
    print(
        f"measured read bandwidth: {gb_per_s:.2f} GB/s (torch sum over a {BANDWIDTH_MIB} MiB "
        f"float32 tensor, {threads} thread{'s' * (threads != 1)}, best of {BANDWIDTH_REPEATS}, "
        f"{seconds:.2f} s)"
    )
    for side in sides:
        share = _implied_gb_per_s(side, new_tokens) / gb_per_s
        print(f"{side.name}: decode at {share:.0%} of measured read bandwidth")


def _acceptance(sides: dict[str, Side], prompt_tokens: int, new_tokens: int) -> list[str]:
    """The bars a --check run must clear, as 'PASS/FAIL what' lines."""
    timing = {name: side.timings(prompt_tokens, new_tokens) for name, side in sides.items()}
    bars = []
    if "eager" in sides and PEER in sides:
        bars.append(
            (
                timing[PEER].load_seconds / timing["eager"].load_seconds >= MIN_LOAD_SPEEDUP,
                f"eager load >= {MIN_LOAD_SPEEDUP}x faster than transformers",
            )
        )
    for mode, peer, metric, least in RATIO_BARS:
        if mode in sides and peer in sides:
            ratio = timing[mode].metric(metric) / timing[peer].metric(metric)
            bars.append((ratio >= least, f"{mode}/{peer}: {metric} >= {least}"))
        elif mode in sides:  # said, not dropped: a bar left out is no bar cleared
            bars.append((None, f"{mode}/{peer}: {metric} >= {least} ({peer} not measured)"))
    reference = sides.get("eager")
    for name in MODES:
        # ggml computes llama.cpp's program (8-bit activations): its tokens may leave eager's
        # (on SmolLM2 after a few), as llama.cpp's do; its goldens are its own (test_llama)
        if reference is not None and name in sides and name not in ("eager", "ggml"):
            bars.append((sides[name].tokens == reference.tokens, f"{name} greedy tokens = eager's"))
    verdict = {True: "PASS", False: "FAIL", None: "SKIP"}
    return [f"{verdict[ok]} {what}" for ok, what in bars]


def _write_json(
    path: pathlib.Path,
    engine: dict[str, Timings],
    peer: Timings,
    other_peers: dict[str, Timings],
    setup,
    load_at_start: float,
    read_gb_per_s: float,
    peer_versions: dict[str, str],
) -> None:
    """The run as a record: timings, ratios, and the machine and versions they depend on."""
    import transformers

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    conditions = {
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
        "read_bandwidth_gb_per_s": round(read_gb_per_s, 2),
    }
    record = build_record(
        engine,
        peer,
        machine=machine_info(),
        versions=versions,
        setup=setup,
        conditions=conditions,
        other_peers=other_peers,
        peer_versions=peer_versions,
    )
    write_record(path, record)
    _progress(f"wrote {path}")


def _sampled_decode(args, engines: list[Side], gguf_path, input_ids, sampler) -> list[str]:
    """The sampled decode section (tools/bench/sampled.py); llama-server when it starts."""
    from goldens.engines.base import EngineError

    llama, skipped = None, ""
    if args.no_llama_cpp:
        skipped = "--no-llama-cpp"
    else:
        try:
            llama = sampled.LlamaServerSide(gguf_path, args.threads)
        except EngineError as error:
            skipped = f"{error} ({llama_cpp_peer.INSTALL_HINT})"
    _progress(f"sampled decode: {len(engines)} modes{' and llama-server' if llama else ''}")
    try:
        rows = sampled.measure(
            {side.name: side.engine for side in engines},
            llama,
            input_ids,
            args.new_tokens,
            args.repeats,
            sampler,
        )
    finally:
        if llama is not None:
            llama.close()
    return sampled.lines(rows, sampler, args.repeats, skipped)


def main(argv: list[str] | None = None) -> int:
    freeze_imported_objects()  # before the first load: see its docstring
    parser = _parser()
    args = parser.parse_args(argv)
    level_line = cpu_level.enter(args.cpu_level, parser)  # runs the bench again at the level
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
    try:
        sampler = settings_from_text(args.sampler)
    except ValueError as error:
        parser.error(str(error))
    json_path = json_output(args.json, parser)
    profile_path = args.profile
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
        # --cpu-level limits the backend of the tools it starts; the binding is its own build
        context = len(input_ids) + args.new_tokens + 8
        llama_cpp = _llama_cpp_side(gguf_path, args.threads, context, not args.cpu_level)
        peers += [llama_cpp] if llama_cpp else []
        no_repack = _llama_cpp_no_repack_side(gguf_path, args.threads, llama_cpp)
        peers += [no_repack] if no_repack else []
    for side in engines + peers:  # warm-up: caches, kernel selection, torch.compile's compilation
        start = time.perf_counter()
        try:
            side.greedy(input_ids, 4)
        except llama_cpp_peer.LlamaBenchError as error:  # e.g. a GGUF it cannot load
            _progress(f"llama.cpp: skipped: {error}")
            peers.remove(side)
        if side.name == "compiled":
            _progress(f"compiled: first generation (compiling) {time.perf_counter() - start:.1f} s")
    sides = engines + peers
    _progress(f"generating: {len(sides)} sides alternately, {args.repeats} times")
    try:
        _alternate(sides, input_ids, args.new_tokens, args.repeats)
    except llama_cpp_peer.LlamaBenchError as error:
        print(f"error: llama.cpp: {error}", file=sys.stderr)
        return 2
    read_gb_per_s, read_seconds = measure_read_bandwidth()
    if profile_path:
        _progress(f"profiling one generation of each mode into {profile_path}")
        events = profile_engines(profile_path, engines, input_ids, args.new_tokens)
    llama_cpp_about = {s.name: s.peer.describe() for s in peers if s.name in LLAMA_CPP_SIDES}

    print(f"checkpoint: {gguf_path.name}  threads: {args.threads}  float32 cpu")
    if level_line:
        print(level_line)
    print(
        f"prompt tokens: {len(input_ids)}  new tokens: {args.new_tokens}  "
        f"fastest of {args.repeats} alternating generations"
    )
    for name, about in llama_cpp_about.items():
        print(f"{name}: {about}")
    _print_table(sides, len(input_ids), args.new_tokens)
    _print_ratios(engines, peers, len(input_ids), args.new_tokens)
    _print_tokens(sides)
    _print_bandwidth(sides, args.new_tokens, read_gb_per_s, read_seconds, args.threads)
    if not args.no_sampling:
        print("\n".join(_sampled_decode(args, engines, gguf_path, input_ids, sampler)))
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
        if args.cpu_level:  # a record of a level compares with a baseline of that level only
            setup["cpu_level"] = args.cpu_level
        timings = {s.name: s.timings(len(input_ids), args.new_tokens) for s in sides}
        _write_json(
            json_path,
            {m.name: timings[m.name] for m in engines},
            timings[PEER],
            {name: t for name, t in timings.items() if name in LLAMA_CPP_SIDES},
            setup,
            load_at_start,
            read_gb_per_s,
            llama_cpp_about,
        )
    if profile_path:
        print(f"profile: {profile_path} ({events} trace events; Perfetto's UI, chrome://tracing)")
    return check_status(verdicts, args.no_llama_cpp) if args.check else 0


def check_status(verdicts: list[str], no_llama_cpp: bool) -> int:
    """--check's exit status: 1 below a bar, or with a bar not judged (SKIP) unless
    --no-llama-cpp left its peer out on purpose; the reason on stderr."""
    if any(v.startswith("FAIL") for v in verdicts):
        print("FAILED: below the acceptance bar", file=sys.stderr)
        return 1
    if any(v.startswith("SKIP") for v in verdicts) and not no_llama_cpp:
        print(
            "FAILED: a bar could not be judged (its peer was not measured: see the SKIP lines); "
            "install llama.cpp (tools/llama_cpp/install.sh), or pass --no-llama-cpp to check "
            "without it",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
