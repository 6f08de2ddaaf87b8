"""Time the Llama 3 engine's hot ops one by one, per mode, kernel build, model shape and rows.

The ops are a layer's pieces in the order data flows through it, and the LM head:

    qkv           the q, k and v projections (one fused product in quantized and ggml)
    attn_out      the attention output projection (wo)
    decode_attn   one new position's attention over --context cached ones: rotation, cache
                  write and grouped-query attention (one kernel call in quantized and ggml)
    prefill_attn  causal attention of `rows` positions from position 0, the same steps
    swiglu        the gate/up projection (fused in quantized and ggml) and SiLU(gate) * up
    down          the down projection (w2)
    head          the LM head projection, dim -> vocab

Each runs through the engine's own modules (pipelines/llama3/model.py in eager, packed.py in
quantized, ggml_mode.py in ggml), built alone on random weights of the shape's real sizes,
so no checkpoint is read: every GGUF block holds random quants and modest float16 scales,
which is a valid block whose products do the same work as a real one (quantizing random
floats instead, Q4_K's search in numpy, would take minutes at Llama-3-8B's sizes). Eager
multiplies the blocks' float32 values. An attention op gets its q, k and v as given tensors
(the projections are the qkv op) and stops before wo.

Quantized and ggml run once per kernel build (pipelines/llama3/kernel_library.py: portable,
avx2, avx512, vnni; by default every one this CPU runs), all in this process: a module keeps
the library that $LLAMA_GOLDENS_KERNELS named when it was built, so the tool sets it around
building each build's modules. A star marks the build the engine picks by itself. Eager runs
on torch's kernels only (build "torch").

Each op is called once untimed, then in --repeats batches of enough calls to last 20 ms; its
time is the fastest batch's time per call (as tools/bench/bench.py keeps each side's fastest:
a burst of load from another process then skews no row alone), on --threads torch threads.
An op whose untimed call took over a second is timed by one more call only: Llama-3-8B's
512-row head takes seconds a call, minutes on the portable build (--builds and --rows narrow
a run).

Bytes are what the op reads: its weights as the mode stores them (float32 in eager, the
packed arrays in quantized, the GGUF blocks in ggml) and its input rows, plus the cached keys
and values for attention (quantized dequantizes its weights again for every product of 64
rows or more, so its GB/s there is a rate of work, not of memory traffic). FLOPs are
2 x rows x in x out for a product, 4 x heads x head_dim per query and key it sees for
attention; GB/s and GFLOP/s are those over the time. A decode step's share is an op's one-row
time times how often a step runs it (once per layer, the head once) over the sum of those:
the step's timed ops only (no norms, no embedding, no sampling), whose sum the tool prints
per mode and build.

Shapes: smollm2 (SmolLM2-135M: Q4_1 layers, its tied Q8_0 embedding as the head) and
llama3_8b (Llama-3-8B, every matrix Q4_K; a Q4_K_M file's head is Q6_K, which neither
packed mode computes); tiny is a few-second shape for tests. --json FILE also writes every
row, each decode step's sum, the setup, and each op's time in a packed mode and build over the
eager mode's (same shape, op and rows, their timed batches alternating: `ratios`; the eager
layer is kept for that while the packed modes run) as a record (kind
"hot_ops", keys sorted by tools/bench/record.py's writer), which perf_regression compares
with a baseline of such records (tools/bench/hot_ops_baseline.json), and for diffs.

Example:
    bazel run //tools:bench_hot_ops
    bazel run //tools:bench_hot_ops -- --shapes=smollm2 --rows=1,64 --threads=1 --repeats=9 \
        --json hot_ops.json
    bazel run //tools:bench_hot_ops -- --shapes=llama3_8b --builds=avx2 --rows=1 --context=4096
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pipelines.llama3 import ggml_mode, kernel_library, packed
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.model import Attention, FeedForward, precompute_rope
from pipelines.llama3.packing import RawMatrix
from pipelines.llama3.quants import dequantize
from tools.bench.record import json_output, load_average, machine_info, write_record

Q = GGMLQuantizationType
MODES = ("eager", "quantized", "ggml")
# The table's order per rows count: the order data flows through a layer, then the head
OP_ORDER = ("qkv", "decode_attn", "prefill_attn", "attn_out", "swiglu", "down", "head")
EAGER_BUILD = "torch"  # eager's "build": torch's own kernels
BUILDS = tuple(kernel_library.REQUIRED_FLAGS)  # vnni, avx512, avx2, portable
MIN_BATCH_SECONDS = 0.02  # each timed batch lasts at least this long
SLOW_SECONDS = 1.0  # an op slower than this is timed once
RECORD_KIND = "hot_ops"
SCHEMA_VERSION = 2  # 2: `ratios`


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's sizes and weight types: what the ops' matrices and caches are made of."""

    title: str
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    n_layers: int
    rope_theta: float
    qtype: GGMLQuantizationType  # the layers' matrices
    head_qtype: GGMLQuantizationType

    def config(self) -> LlamaConfig:
        """The engine's configuration of these sizes (what Attention is built from)."""
        return LlamaConfig(
            vocab_size=self.vocab,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=1e-5,
            context_length=8192,
            tie_word_embeddings=False,
        )

    def describe(self) -> str:
        return (
            f"{self.title}: dim {self.dim}, {self.n_heads}/{self.n_kv_heads} heads x "
            f"{self.head_dim}, ffn {self.ffn_dim}, vocab {self.vocab}, {self.n_layers} layers, "
            f"{self.qtype.name} layers, {self.head_qtype.name} head"
        )


SHAPES = {
    "smollm2": Shape("SmolLM2-135M", 576, 9, 3, 64, 1536, 49152, 30, 100000.0, Q.Q4_1, Q.Q8_0),
    "llama3_8b": Shape("Llama-3-8B", 4096, 32, 8, 128, 14336, 128256, 32, 500000.0, Q.Q4_K, Q.Q4_K),
    "tiny": Shape("tiny (for tests)", 64, 4, 2, 16, 128, 256, 2, 10000.0, Q.Q4_1, Q.Q8_0),
}
DEFAULT_SHAPES = "smollm2,llama3_8b"

# Byte offsets of each block type's float16 scale fields (d, and the min or dmin)
SCALE_FIELDS = {Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q8_0: (0,)}


@dataclasses.dataclass
class Result:
    """One op's numbers in one mode and build, as a table row and a record entry."""

    shape: str
    mode: str
    build: str
    op: str
    rows: int
    context: int  # the positions attention reads (0 for a product)
    seconds: float
    bytes: int
    flops: int
    per_step: int  # how often a decode step runs it (0: not part of one)
    share: float | None = None
    # the eager mode's seconds for the same op and rows, timed in alternation with this one
    # (time_pair; None for the eager rows, and without the eager mode)
    peer_seconds: float | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def gflop_per_s(self) -> float:
        return self.flops / self.seconds / 1e9

    def entry(self) -> dict:
        data = dataclasses.asdict(self)
        data["gb_per_s"], data["gflop_per_s"] = self.gb_per_s, self.gflop_per_s
        return data


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog="bench_hot_ops",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help=f"of {', '.join(SHAPES)} (default: %(default)s)"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"of {', '.join(MODES)} (default: all)"
    )
    parser.add_argument(
        "--builds",
        default="",
        help=f"kernel builds, of {', '.join(BUILDS)} (default: all this CPU runs)",
    )
    parser.add_argument("--rows", default="1,64,512", help="activation rows (default: %(default)s)")
    parser.add_argument(
        "--context",
        type=int,
        default=1024,
        help="cached positions decode_attn reads (default: 1024)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed batches (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as a record")
    return parser


def _names(parser: _Parser, option: str, text: str, known) -> list[str]:
    """The comma-separated names of `option`, each one of `known`, at least one."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"--{option}={text}: choose from {', '.join(known)}, comma-separated")
    return names


def _builds(parser: _Parser, text: str) -> list[str]:
    """The kernel builds to time: those named (each runnable here, its library loadable), or
    every one this CPU runs."""
    runnable = [name for name in BUILDS if kernel_library.runnable(name)]
    names = _names(parser, "builds", text, BUILDS) if text else runnable
    for name in names:
        if name not in runnable:
            parser.error(
                f"--builds={text}: this CPU cannot run {name}; it runs {', '.join(runnable)}"
            )
        try:
            kernel_library.load(name)
        except kernel_library.KernelUnavailable as error:
            parser.error(f"--builds={text or ','.join(names)}: {error}")
    return names


def _rows(parser: _Parser, text: str) -> list[int]:
    try:
        rows = [int(part) for part in text.split(",") if part]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        parser.error(f"--rows={text}: give positive row counts, comma-separated (e.g. 1,64,512)")
    return rows


@contextlib.contextmanager
def kernel_build(build: str) -> Iterator[None]:
    """$LLAMA_GOLDENS_KERNELS=build while the modules are made (each keeps its library)."""
    before = os.environ.get(kernel_library.KERNELS_ENV)
    os.environ[kernel_library.KERNELS_ENV] = build
    try:
        yield
    finally:
        if before is None:
            del os.environ[kernel_library.KERNELS_ENV]
        else:
            os.environ[kernel_library.KERNELS_ENV] = before


def random_matrix(rows: int, cols: int, qtype, rng: np.random.Generator) -> RawMatrix:
    """A [rows, cols] matrix of valid `qtype` blocks: random quants, scales in [1e-3, 2e-2]."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    count = rows * cols // block_values
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 2e-2, count).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(count, 2)
    return RawMatrix(blocks.reshape(rows, -1), qtype, rows, cols)


def random_weights(shape: Shape, seed: int = 0) -> dict[str, RawMatrix]:
    """One layer's matrices and the head, by their names in model.py."""
    rng = np.random.default_rng(seed)
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    sizes = {
        "wq": (q_dim, shape.dim),
        "wk": (kv_dim, shape.dim),
        "wv": (kv_dim, shape.dim),
        "wo": (shape.dim, q_dim),
        "w1": (shape.ffn_dim, shape.dim),
        "w3": (shape.ffn_dim, shape.dim),
        "w2": (shape.dim, shape.ffn_dim),
    }
    weights = {name: random_matrix(*size, shape.qtype, rng) for name, size in sizes.items()}
    weights["head"] = random_matrix(shape.vocab, shape.dim, shape.head_qtype, rng)
    return weights


class Given(nn.Module):
    """A projection whose output is set beforehand: attention ops time what follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.output: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output


def _dense(matrix: RawMatrix) -> nn.Linear:
    """Eager's product: nn.Linear on the blocks' float32 values."""
    with torch.device("meta"):
        linear = nn.Linear(matrix.cols, matrix.rows, bias=False)
    values = dequantize(matrix.raw, matrix.qtype, (matrix.rows, matrix.cols))
    linear.weight = nn.Parameter(values, requires_grad=False)
    return linear


def _weight_bytes(module) -> int:
    if isinstance(module, nn.Linear):
        return module.weight.numel() * module.weight.element_size()
    return module.weight.nbytes  # PackedWeight, GgmlMatrix: as stored


@dataclasses.dataclass
class Layer:
    """One mode's modules for the ops: `products` maps an op to (its call, weight bytes);
    `attention` runs with projections `given` (Given modules) and no output projection."""

    products: dict[str, tuple[Callable[[torch.Tensor], object], int]]
    attention: Attention
    given: dict[str, Given]


def eager_layer(shape: Shape, weights: dict[str, RawMatrix]) -> Layer:
    """Eager's modules: nn.Linear on the float32 values, model.py's FeedForward and Attention
    (q, k and v three products, as Attention.project runs them)."""
    dense = {name: _dense(matrix) for name, matrix in weights.items()}
    with torch.device("meta"):
        feed_forward = FeedForward(shape.dim, shape.ffn_dim)
        attention = Attention(shape.config())
    feed_forward.w1, feed_forward.w3, feed_forward.w2 = dense["w1"], dense["w3"], nn.Identity()
    given = {name: Given() for name in ("wq", "wk", "wv")}
    attention.wq, attention.wk, attention.wv = given["wq"], given["wk"], given["wv"]
    attention.wo = nn.Identity()
    qkv = (dense["wq"], dense["wk"], dense["wv"])
    products = {
        "qkv": (lambda x: [linear(x) for linear in qkv], sum(map(_weight_bytes, qkv))),
        "attn_out": (dense["wo"], _weight_bytes(dense["wo"])),
        "swiglu": (feed_forward, _weight_bytes(dense["w1"]) + _weight_bytes(dense["w3"])),
        "down": (dense["w2"], _weight_bytes(dense["w2"])),
        "head": (dense["head"], _weight_bytes(dense["head"])),
    }
    return Layer(products, attention, given)


def packed_layer(mode: str, shape: Shape, weights: dict[str, RawMatrix]) -> Layer:
    """Quantized's or ggml's modules, made with the kernel build in force (kernel_build)."""
    if mode == "quantized":
        linear, ffn_class, attention_class = (
            packed.packed_linear,
            packed.PackedFeedForward,
            packed.PackedAttention,
        )
    else:
        linear, ffn_class, attention_class = (
            ggml_mode.ggml_linear,
            ggml_mode.GgmlFeedForward,
            ggml_mode.GgmlAttention,
        )
    w = weights
    qkv = linear([w["wq"], w["wk"], w["wv"]])
    w13 = linear([w["w1"], w["w3"]], (shape.ffn_dim, shape.ffn_dim))
    feed_forward = ffn_class(shape.dim, shape.ffn_dim, w13, nn.Identity())
    given = {"wqkv": Given()}
    attention = attention_class(shape.config(), given["wqkv"], nn.Identity())
    wo, w2, head = linear([w["wo"]]), linear([w["w2"]]), linear([w["head"]])
    products = {
        "qkv": (qkv, _weight_bytes(qkv)),
        "attn_out": (wo, _weight_bytes(wo)),
        "swiglu": (feed_forward, _weight_bytes(w13)),
        "down": (w2, _weight_bytes(w2)),
        "head": (head, _weight_bytes(head)),
    }
    return Layer(products, attention, given)


def _calibrate(run: Callable[[], object]) -> tuple[int, bool]:
    """One untimed call (first allocations, caches): how many calls make a batch of at least
    MIN_BATCH_SECONDS, and whether the call is slow (over SLOW_SECONDS: one timed call)."""
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    return max(1, math.ceil(MIN_BATCH_SECONDS / max(first, 1e-7))), first > SLOW_SECONDS


def _batch(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def time_call(run: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `run`: the fastest of `repeats` batches of calls lasting at least
    MIN_BATCH_SECONDS each, after one untimed call; one timed call when that one was slow."""
    calls, slow = _calibrate(run)
    return min(_batch(run, calls) for _ in range(1 if slow else repeats))


def time_pair(
    run: Callable[[], object], peer: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Seconds per call of `run` and of `peer`, timed as time_call does but their batches
    alternating: a change of the machine's speed while they are measured (turbo, a noisy
    neighbour) reaches both, so their ratio holds still where the times do not."""
    calls, slow = _calibrate(run)
    peer_calls, peer_slow = _calibrate(peer)
    fastest, peer_fastest = math.inf, math.inf
    for _ in range(1 if slow or peer_slow else repeats):
        fastest = min(fastest, _batch(run, calls))
        peer_fastest = min(peer_fastest, _batch(peer, peer_calls))
    return fastest, peer_fastest


class Bench:
    """The ops of one shape at given rows and context, for each mode's Layer."""

    def __init__(self, shape: Shape, rows: list[int], context: int, repeats: int) -> None:
        self.shape, self.rows, self.context, self.repeats = shape, rows, context, repeats
        self.positions = max(context + 1, *rows)  # what the caches and rope tables cover
        self.cos, self.sin = precompute_rope(shape.config(), self.positions, torch.device("cpu"))
        generator = torch.Generator().manual_seed(0)
        cache = (1, shape.n_kv_heads, self.positions, shape.head_dim)
        self.cache_k = torch.randn(cache, generator=generator)
        self.cache_v = torch.randn(cache, generator=generator)

    def _attention_call(self, layer: Layer, rows: int) -> tuple[str, Callable[[], object]]:
        """decode_attn (one row after `context` cached positions) or prefill_attn (`rows` from
        position 0), with random projections given."""
        s = self.shape
        start = self.context if rows == 1 else 0
        widths = {"wq": s.n_heads, "wk": s.n_kv_heads, "wv": s.n_kv_heads}
        widths["wqkv"] = s.n_heads + 2 * s.n_kv_heads
        outputs = {name: torch.randn(1, rows, widths[name] * s.head_dim) for name in layer.given}
        attention = layer.attention
        attention.cache_k, attention.cache_v = self.cache_k, self.cache_v
        cos, sin = self.cos[start : start + rows], self.sin[start : start + rows]
        x = torch.empty(1, rows, s.dim)  # read for its shape only

        def run() -> torch.Tensor:
            for name, given in layer.given.items():
                given.output = outputs[name]  # the decode kernels rotate q and k in place
            return attention(x, start, cos, sin, None)

        return ("decode_attn" if rows == 1 else "prefill_attn"), run

    def measure(
        self, name: str, mode: str, build: str, layer: Layer, peer: Layer | None = None
    ) -> list[Result]:
        """Every op at every rows count through `layer`'s modules; with `peer` (the eager
        mode's), each timed in alternation with the peer's same op (Result.peer_seconds)."""
        s = self.shape
        results = []

        def timed(run: Callable[[], object], peer_run: Callable[[], object] | None):
            if peer_run is None:
                return time_call(run, self.repeats), None
            return time_pair(run, peer_run, self.repeats)

        def add(op: str, rows: int, context: int, times, size: int, flops: int) -> None:
            per_step = 0 if rows > 1 else 1 if op == "head" else s.n_layers
            seconds, peer_seconds = times
            row = Result(name, mode, build, op, rows, context, seconds, size, flops, per_step)
            row.peer_seconds = peer_seconds
            results.append(row)

        for rows in self.rows:
            for op, (in_features, out_features) in product_sizes(s).items():
                module, weight_bytes = layer.products[op]
                x = torch.randn(1, rows, in_features)
                peer_run = None
                if peer is not None:
                    peer_run = lambda m=peer.products[op][0], x=x: m(x)  # noqa: E731
                times = timed(lambda m=module, x=x: m(x), peer_run)
                flops = 2 * rows * in_features * out_features
                add(op, rows, 0, times, weight_bytes + x.numel() * 4, flops)
            op, run = self._attention_call(layer, rows)
            peer_run = None if peer is None else self._attention_call(peer, rows)[1]
            keys = self.context + 1 if rows == 1 else rows  # the positions attention reads
            seen = keys if rows == 1 else rows * (rows + 1) // 2  # keys summed over queries
            qkv_bytes = rows * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim * 4
            kv_bytes = 2 * s.n_kv_heads * keys * s.head_dim * 4
            flops = 4 * s.n_heads * s.head_dim * seen
            add(op, rows, keys, timed(run, peer_run), qkv_bytes + kv_bytes, flops)
        return sorted(results, key=lambda r: (r.rows, OP_ORDER.index(r.op)))


def product_sizes(s: Shape) -> dict[str, tuple[int, int]]:
    """Each product op's (in, out) features."""
    q_dim, qkv_dim = s.n_heads * s.head_dim, (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    return {
        "qkv": (s.dim, qkv_dim),
        "attn_out": (q_dim, s.dim),
        "swiglu": (s.dim, 2 * s.ffn_dim),
        "down": (s.ffn_dim, s.dim),
        "head": (s.dim, s.vocab),
    }


def decode_shares(results: list[Result]) -> float | None:
    """Set each one-row op's share of the decode step; return the step's seconds (None
    without one-row results)."""
    step = [r for r in results if r.per_step]
    total = sum(r.seconds * r.per_step for r in step)
    for r in step:
        r.share = r.seconds * r.per_step / total
    return total if step else None


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _header(shape: Shape, args: argparse.Namespace) -> None:
    print(f"\n{shape.describe()}")
    print(
        f"{args.threads} threads; decode_attn over {args.context} cached positions; fastest of "
        f"{args.repeats} batches; * the build the engine picks"
    )
    print(
        f"{'mode':<10} {'build':<9} {'op':<13} {'rows':>5} {'ms':>10} {'MB read':>9} "
        f"{'GB/s':>8} {'GFLOP/s':>8} {'decode share':>12}"
    )


def _print(results: list[Result], step_seconds: float | None, default_build: str | None) -> None:
    for r in results:
        build = r.build + ("*" if r.build == default_build else "")
        share = f"{r.share:.1%}" if r.share is not None else "-"
        print(
            f"{r.mode:<10} {build:<9} {r.op:<13} {r.rows:>5} {r.seconds * 1e3:>10.3f} "
            f"{r.bytes / 1e6:>9.2f} {r.gb_per_s:>8.2f} {r.gflop_per_s:>8.2f} {share:>12}"
        )
    if step_seconds is not None:
        r = results[0]
        print(f"{r.mode} {r.build}: a decode step's timed ops take {step_seconds * 1e3:.3f} ms")
    sys.stdout.flush()  # in step with the progress lines on stderr


def _engine_default(mode: str) -> str | None:
    """The build the engine runs `mode` on without $LLAMA_GOLDENS_KERNELS (eager: none)."""
    if mode == "eager":
        return None
    order = kernel_library.DEFAULT_ORDER if mode == "quantized" else kernel_library.GGML_ORDER
    return next(name for name in order if kernel_library.runnable(name))


def run_shape(name: str, args: argparse.Namespace) -> tuple[list[Result], list[dict]]:
    """Every mode and build of `args` on one shape: its results, and each decode step's
    seconds."""
    shape = SHAPES[name]
    _progress(f"{name}: random weights")
    weights = random_weights(shape)
    bench = Bench(shape, args.rows_list, args.context, args.repeats)
    _header(shape, args)
    results, steps = [], []
    # The eager layer stays for the packed modes to be timed against (their ratios);
    # Llama-3-8B's is 3 GB, its head 2 GB.
    peer = eager_layer(shape, weights) if "eager" in args.mode_list else None
    for mode in args.mode_list:
        for build in [EAGER_BUILD] if mode == "eager" else args.build_list:
            _progress(f"{name}: {mode} {build}")
            if mode == "eager":
                layer, against = peer, None
            else:
                with kernel_build(build):
                    layer = packed_layer(mode, shape, weights)
                against = peer
            measured = bench.measure(name, mode, build, layer, against)
            del layer  # before the next mode's weights
            step = decode_shares(measured)
            _print(measured, step, _engine_default(mode))
            results += measured
            if step is not None:
                steps.append({"shape": name, "mode": mode, "build": build, "seconds": step})
    return results, steps


def ratios(results: list[Result]) -> dict[str, dict[str, float]]:
    """Each op's seconds in a packed mode and build over the eager mode's for the same shape,
    op and rows timed in alternation with it (peer_seconds), by "shape/mode/build" and
    "op@rows" (none without the eager mode): what perf_regression compares."""
    table: dict[str, dict[str, float]] = {}
    for r in results:
        if r.peer_seconds is not None:
            group = table.setdefault(f"{r.shape}/{r.mode}/{r.build}", {})
            group[f"{r.op}@{r.rows}"] = r.seconds / r.peer_seconds
    return table


def record(args, results: list[Result], steps: list[dict], load_at_start: float) -> dict:
    """The run as a record: every row's numbers, each decode step, and what they depend on."""
    return {
        "kind": RECORD_KIND,
        "schema_version": SCHEMA_VERSION,
        "machine": machine_info(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "conditions": {"load_average_start": load_at_start, "load_average_end": load_average()},
        "setup": {
            "shapes": args.shape_list,
            "modes": args.mode_list,
            "builds": args.build_list,
            "rows": args.rows_list,
            "context": args.context,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        "results": [r.entry() for r in results],
        "decode_steps": steps,
        "ratios": ratios(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.shape_list = _names(parser, "shapes", args.shapes, SHAPES)
    args.mode_list = _names(parser, "modes", args.modes, MODES)
    uses_kernels = any(mode != "eager" for mode in args.mode_list)
    args.build_list = _builds(parser, args.builds) if uses_kernels else []
    args.rows_list = _rows(parser, args.rows)
    for option, value in (("context", args.context), ("repeats", args.repeats)):
        if value < 1:
            parser.error(f"--{option}={value}: must be at least 1")
    if args.threads < 1:
        parser.error(f"--threads={args.threads}: must be at least 1")
    json_path = json_output(args.json, parser)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    results, steps = [], []
    with torch.inference_mode():
        for name in args.shape_list:
            shape_results, shape_steps = run_shape(name, args)
            results += shape_results
            steps += shape_steps
    if json_path:
        write_record(json_path, record(args, results, steps, load_at_start))
        _progress(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
