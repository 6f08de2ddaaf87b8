"""eval_slice: perplexity and KL divergence of each quantization on a fixed text, computed by
this engine and by llama.cpp's `llama-perplexity` in the same run, side by side.

The text is the start of Shakespeare's Coriolanus (public domain; testdata/coriolanus.txt,
4,699 SmolLM2 tokens). The checkpoints are a family made from one GGUF file (checkpoints.py):
its weights as a float32 base, the base quantized again to Q8_0 and Q4_0, and the file itself
(SmolLM2's is Q4_1). Each member is scored on the slice (slice_stats.py: llama-perplexity's
chunking and formulas); every quantized member against the base: mean KL divergence, its
99th and 99.9th percentiles and maximum, the rate at which the most likely token is the same.

    ./bazelw run //tools:eval_slice                          # SmolLM2, engine and llama.cpp
    ./bazelw run //tools:eval_slice -- --chunks=3 --modes=ggml --no-llama-cpp
    ./bazelw run //tools:eval_slice -- --write-golden=$PWD/eval_slice_golden.json

The engine scores the base in the eager mode and each quantized member in every mode of
--modes (default: eager, the weights dequantized to float32; ggml, llama.cpp's arithmetic,
activations quantized as its kernels do). llama-perplexity (Debian's llama.cpp-tools:
tools/llama_cpp/install.sh) runs the same chunks: the base with --kl-divergence-base, each
member with --kl-divergence. --write-golden writes the engine's figures as the golden that
//tools/eval_slice:eval_slice_test judges (published with tools/upload-public-bazel-artifact.sh
as the `eval_slice_golden` archive; never edited by hand).

Exit status: 0 done; 1 a --check golden failed; 2 bad input (a checkpoint that is not there
or whose weights the family cannot be built from, too few tokens for one chunk, an output that
cannot be written, llama-perplexity missing or failing).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, LlamaFileType

from goldens.cli_files import (
    OneLineParser,
    PathError,
    at_least,
    output_file,
    user_path,
    write_atomically,
)
from goldens.locate import cache_root
from goldens.record import file_sha256
from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import CheckpointError, Llama3Engine
from pipelines.llama3.gguf_loader import metadata_value, open_gguf
from tools.eval_slice import checkpoints, slice_stats

TEXT = Path(__file__).resolve().parent / "testdata" / "coriolanus.txt"
GOLDEN_SCHEMA = 1
N_CTX = 512  # llama-perplexity's default chunk
BASE = "f32"
BASE_MODE = "eager"
MODES = ("eager", "quantized", "ggml")


class SliceError(Exception):
    """Bad input: the message names it and the fix (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a figure depends on besides the engine: the text, the chunking, the files."""

    text_sha256: str
    n_ctx: int
    chunks: int
    files: dict[str, str]  # member name -> sha256 of its file

    def key(self) -> dict:
        return dataclasses.asdict(self)


def setup_of(family: dict[str, Path], text: str, n_ctx: int, chunks: int) -> Setup:
    """The setup of a run over `chunks` chunks of `text` with `family`'s files."""
    return Setup(
        hashlib.sha256(text.encode()).hexdigest(),
        n_ctx,
        chunks,
        {name: file_sha256(path) for name, path in family.items()},
    )


def _progress(message: str) -> None:
    print(f"eval_slice: {message}", file=sys.stderr, flush=True)


def _load(path: Path, mode: str) -> Llama3Engine:
    try:
        return Llama3Engine.from_gguf(path, mode=mode)
    except CheckpointError as error:
        raise SliceError(f"{path}: {error}") from None


def engine_rows(
    family: dict[str, Path],
    text: str,
    n_ctx: int,
    max_chunks: int,
    modes: Sequence[str],
    memo: dict | None = None,
) -> tuple[dict[str, dict[str, float]], int]:
    """The engine's row for each (member, mode): the base in the eager mode, every quantized
    member in each of `modes`; and the number of chunks scored. One chunk at a time, so only
    one chunk's log-probabilities per model are held. With `memo`, each model's scored logits
    are kept there by (checkpoint, mode, chunk tokens) and read back instead of computed (a
    model is loaded only for a chunk it has not scored): a caller that scores the same models
    again, under other scoring, computes no forward twice."""
    base = _load(family[BASE], BASE_MODE)
    tokens = base.tokenizer.encode(text)
    bos = base.tokenizer.bos_id if base.tokenizer.add_bos else None
    pieces = slice_stats.chunks(tokens, n_ctx, max_chunks, bos)
    if not pieces:
        raise SliceError(
            f"the text is {len(tokens)} tokens, fewer than one chunk of --n-ctx={n_ctx}; "
            "give a smaller --n-ctx"
        )
    models = {f"{BASE}/{BASE_MODE}": (family[BASE], BASE_MODE)}
    models.update(
        {
            f"{name}/{mode}": (path, mode)
            for name, path in family.items()
            if name != BASE
            for mode in modes
        }
    )
    loaded = {f"{BASE}/{BASE_MODE}": base}
    rows = slice_stats.scored(n_ctx)

    def logits(key: str, piece: list[int]) -> torch.Tensor:
        path, mode = models[key]
        kept = (str(path), mode, tuple(piece))
        if memo is not None and kept in memo:
            return memo[kept]
        if key not in loaded:
            loaded[key] = _load(path, mode)
        computed = loaded[key].forward_logits(piece)[rows]
        if memo is not None:
            memo[kept] = computed
        return computed

    scores = {key: slice_stats.Scores() for key in models}
    for number, piece in enumerate(pieces, 1):
        started = time.perf_counter()
        targets = slice_stats.targets(piece, n_ctx)
        reference = None
        for key in models:  # the base first: every member's KL divergence is against it
            logp = slice_stats.log_probs(logits(key, piece))
            scores[key].add_chunk(logp, targets, reference)
            reference = logp if reference is None else reference
        seconds = time.perf_counter() - started
        _progress(f"engine: chunk {number}/{len(pieces)} ({len(scores)} models, {seconds:.1f} s)")
    return {key: slice_stats.summary(value) for key, value in scores.items()}, len(pieces)


# --- llama-perplexity ---------------------------------------------------------------------

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_BASE_FIGURES = {"Final estimate": _FINAL}
_STATS = {
    "ppl": re.compile(r"Mean PPL\(Q\)\s*:\s*([-0-9.]+)\s*±\s*([-0-9.]+)"),
    "kld_mean": re.compile(r"Mean    KLD:\s*([-0-9.]+)\s*±\s*([-0-9.]+)"),
    "kld_max": re.compile(r"Maximum KLD:\s*([-0-9.]+)"),
    "kld_p999": re.compile(r"99\.9%   KLD:\s*([-0-9.]+)"),
    "kld_p99": re.compile(r"99\.0%   KLD:\s*([-0-9.]+)"),
    "same_top": re.compile(r"Same top p:\s*([-0-9.]+)\s*±\s*([-0-9.]+) %"),
}


def llama_perplexity() -> str:
    found = shutil.which("llama-perplexity")
    if found is None:
        raise SliceError(
            "llama-perplexity is not installed: run tools/llama_cpp/install.sh (Debian's "
            "llama.cpp-tools), or pass --no-llama-cpp"
        )
    return found


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(
            command, capture_output=True, encoding="utf-8", errors="replace", timeout=3600
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SliceError(f"{' '.join(command)}: {error}") from None
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if " E " in line or line.startswith("E ")]
    if done.returncode != 0 or errors:
        tail = "\n".join(errors or output.strip().splitlines()[-5:])
        raise SliceError(f"{' '.join(command)} failed (exit {done.returncode}):\n{tail}")
    return output


def _run_printing(command: list[str], figures: dict[str, re.Pattern]) -> str:
    """_run's output, once every figure's pattern is in it: llama-perplexity logs from a thread
    of its own, which has been seen to lose its last lines at exit (its figures among them;
    twice in about a dozen runs on an Intel Xeon, the logits file complete), so a run whose
    figures are missing is run once more; missing twice, a SliceError naming them and the
    output's end."""
    for _ in range(2):
        output = _run(command)
        missing = [name for name, pattern in figures.items() if pattern.search(output) is None]
        if not missing:
            return output
    tail = "\n".join(output.strip().splitlines()[-8:])
    raise SliceError(
        f"{' '.join(command)} printed no {', '.join(missing)} (twice); its last lines:\n{tail}"
    )


def llama_cpp_rows(
    family: dict[str, Path], text_path: Path, n_ctx: int, chunks: int, threads: int
) -> dict[str, dict[str, float]]:
    """llama-perplexity's rows: the base's PPL (writing its log-probabilities), then each
    quantized member's PPL and KLD statistics against them."""
    binary = llama_perplexity()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="eval_slice_") as scratch:
        base_logits = str(Path(scratch) / "base.kld")

        def command(model: Path) -> list[str]:
            sizes = ["-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(chunks)]
            return [
                binary,
                "-m",
                str(model),
                *sizes,
                "-t",
                str(threads),
                # llama.cpp's CPU kernels, not the weights repacked for the CPU at load (AMX
                # tiles on a CPU with AMX, interleaved Q4_0 rows on others): the products the
                # ggml mode computes as llama.cpp does, on every CPU
                "--no-repack",
                "--kl-divergence-base",
                base_logits,
            ]

        _progress(f"llama-perplexity: {family[BASE].name}")
        output = _run_printing([*command(family[BASE]), "-f", str(text_path)], _BASE_FIGURES)
        final = _FINAL.search(output)
        rows[BASE] = {"ppl": float(final.group(1)), "ppl_err": float(final.group(2))}
        for name, path in family.items():
            if name == BASE:
                continue
            _progress(f"llama-perplexity: {path.name}")
            output = _run_printing([*command(path), "--kl-divergence"], _STATS)
            row = {}
            for figure, pattern in _STATS.items():
                match = pattern.search(output)
                row[figure] = float(match.group(1))
                if figure == "ppl":
                    row["ppl_err"] = float(match.group(2))
                if figure == "kld_mean":
                    row["kld_err"] = float(match.group(2))
            row["same_top"] /= 100.0
            rows[name] = row
    return rows


# --- the table and the golden -------------------------------------------------------------


def table(engine: dict[str, dict[str, float]], llama_cpp: dict[str, dict[str, float]]) -> str:
    """One line per engine row, the llama-perplexity figures of the same member below it."""
    head = (
        f"{'checkpoint':<12} {'by':<16} {'PPL':>18} {'mean KLD':>20} {'KLD 99%':>9} "
        f"{'KLD 99.9%':>9} {'KLD max':>9} {'same top':>9}"
    )
    lines = [head, "-" * len(head)]

    def line(member: str, by: str, row: dict[str, float]) -> str:
        ppl = f"{row['ppl']:.4f} ± {row['ppl_err']:.4f}"
        if "kld_mean" not in row:
            return f"{member:<12} {by:<16} {ppl:>18}"
        kld = f"{row['kld_mean']:.6f} ± {row['kld_err']:.6f}"
        return (
            f"{member:<12} {by:<16} {ppl:>18} {kld:>20} {row['kld_p99']:>9.5f} "
            f"{row['kld_p999']:>9.5f} {row['kld_max']:>9.5f} {row['same_top']:>8.2%}"
        )

    shown = set()
    for key, row in engine.items():
        member, mode = key.split("/")
        lines.append(line(member, f"engine {mode}", row))
        if member in llama_cpp and member not in shown:
            lines.append(line(member, "llama-perplexity", llama_cpp[member]))
            shown.add(member)
    return "\n".join(lines)


def golden_document(setup: Setup, engine: dict[str, dict[str, float]]) -> dict:
    return {"schema": GOLDEN_SCHEMA, "setup": setup.key(), "rows": engine}


# The golden check's bounds. Measured on the Intel Xeon over the 2-chunk slice: the engine's
# figures under ATEN_CPU_CAPABILITY=avx512 (native), avx2 and default differ by at most 6e-5
# of their value (a Q4_1 KLD maximum of 0.02; the ggml mode's PPL not at all, its arithmetic
# being the same on every build); every figure is held to 2e-4 of its golden value, three
# times that (at least ABSOLUTE). The same-top rate may move by two tokens of the slice (a
# near-tie resolved the other way on another CPU). Each planted bug in tests/test_eval_slice.py
# moves a figure past these: the smallest, standard errors over N instead of N - 1, moves
# both errors by 9.8e-4 of their value (N = 510: 4.9 bounds; at the 1e-3 this bound was
# before, it passed); one attn_v matrix of Q4_0 scaled by 1.02 puts its mean KLD 14 bounds
# away.
RELATIVE = 2e-4
ABSOLUTE = 1e-7  # for figures that are 0 (Q4_1 eager against its own weights)
SAME_TOP_TOKENS = 2


def setup_failures(golden: dict, setup: Setup) -> list[str]:
    """What differs between the golden's setup (text, chunking, files) and this run's."""
    if golden.get("schema") != GOLDEN_SCHEMA:
        return [f"golden schema {golden.get('schema')!r}, eval_slice reads {GOLDEN_SCHEMA}"]
    theirs, ours = golden["setup"], setup.key()
    return [
        f"setup {key}: golden {theirs.get(key)!r}, this run {ours[key]!r}"
        for key in ours
        if theirs.get(key) != ours[key]
    ]


def row_failures(
    golden: dict, rows: dict[str, dict[str, float]], partial: bool = False
) -> list[str]:
    """Each figure of `rows` outside its bound around the golden's (RELATIVE, or
    SAME_TOP_TOKENS for the same-top rate); rows the golden has and `rows` lacks, unless
    `partial`, and rows it does not have."""
    failures = [
        f"{key}: a row the golden does not have" for key in rows if key not in golden["rows"]
    ]
    for key, want in golden["rows"].items():
        got = rows.get(key)
        if got is None:
            if not partial:
                failures.append(f"{key}: no row computed (the golden has one)")
            continue
        for figure in slice_stats.FIGURES:
            if figure not in want:
                continue
            if figure == "same_top":
                bound = SAME_TOP_TOKENS / want["tokens"]
            else:
                bound = max(RELATIVE * abs(want[figure]), ABSOLUTE)
            value = got.get(figure, float("nan"))
            if not abs(value - want[figure]) <= bound:
                failures.append(
                    f"{key} {figure}: {value:.6g}, golden {want[figure]:.6g} "
                    f"(|diff| {abs(value - want[figure]):.3g} > {bound:.3g})"
                )
    return failures


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="eval_slice",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        + "\n".join(line for line in __doc__.splitlines() if line.startswith("    ./bazelw")),
    )
    parser.add_argument("--gguf", help="the family's source file (default: the pinned SmolLM2)")
    parser.add_argument("--text", default=str(TEXT), help="the slice's text (default: %(default)s)")
    parser.add_argument("--n-ctx", type=int, default=N_CTX, help="tokens a chunk (default 512)")
    parser.add_argument(
        "--chunks", type=at_least(1), default=0, help="at most this many chunks (default: all)"
    )
    parser.add_argument(
        "--modes", default="eager,ggml", help="engine modes for the quantized members"
    )
    parser.add_argument(
        "--threads", type=at_least(1), default=2, help="threads, engine and llama.cpp"
    )
    parser.add_argument("--cache", help="folder for the family's files (default: a cache folder)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="the engine's rows only")
    parser.add_argument("--write-golden", metavar="FILE", help="write the engine's figures")
    parser.add_argument(
        "--check", metavar="GOLDEN", help="judge the engine's figures against a golden file"
    )
    parser.add_argument("--json", metavar="FILE", help="write both engines' rows as JSON")
    return parser


def default_cache() -> Path:
    """Beside the pinned archives' extraction folder (goldens.locate's XDG rules)."""
    return cache_root().parent / "eval_slice"


# The weight types the family is built from: gguf-py dequantizes each to the float32 base, and
# quantizes it again where a quantized member keeps the source's type (the token embedding).
# gguf-py cannot quantize the k-quants, IQ and NVFP4 types (NotImplementedError after the base
# is written: 20-30 s and a finished member left in the cache), so they are refused first.
TAKES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
BLOCK = 32  # values per Q8_0 and Q4_0 block: a weight row of the family is a whole number of them


def unbuildable(source: Path, reader, file_type: int | None) -> str | None:
    """Why the family cannot be built from `source`'s weights (None when it can): a weight
    matrix of a type outside TAKES, or rows that are not whole Q8_0/Q4_0 blocks (the tiny
    float32 checkpoint's 16-value rows). `reader`: the file's header and tensor index, read
    by the engine's parser (`open_gguf`: 0.04 s on SmolLM2's file, 0.1-0.2 s on the tiny ones;
    gguf-py's reader takes 2.4 s and 8 s, its vocabulary read a string at a time);
    `file_type`: its general.file_type (None: it records none)."""
    try:
        kind = "of no recorded file type" if file_type is None else LlamaFileType(file_type).name
    except ValueError:
        kind = f"file type {file_type}"
    matrices = [t for t in reader.tensors.values() if len(t.shape) > 1]
    taken = {GGMLQuantizationType[name] for name in TAKES}
    other = sorted({t.tensor_type.name for t in matrices if t.tensor_type not in taken})
    if other:
        return (
            f"--gguf={source} is {kind} (weights {', '.join(other)}); the slice builds its "
            f"family from {', '.join(TAKES)} weights: pass such a file (default: the pinned "
            "SmolLM2, Q4_1)"
        )
    # the embedding keeps its own type (and so its blocks) in every quantized member
    ragged = [t for t in matrices if t.shape[-1] % BLOCK and t.name != checkpoints.EMBEDDING]
    if ragged:
        return (
            f"--gguf={source} is {kind} with weight rows of {ragged[0].shape[-1]} values "
            f"({ragged[0].name}); the slice's Q8_0 and Q4_0 members need rows of a multiple "
            f"of {BLOCK}: pass a larger checkpoint (default: the pinned SmolLM2, Q4_1)"
        )
    return None


def family_of(source: Path, cache: Path) -> dict[str, Path]:
    """The members by name: the derived ones, then the source under its own type's name."""
    if not source.is_file():
        raise SliceError(f"--gguf={source}: no such file; pass a GGUF checkpoint")
    try:
        reader = open_gguf(source)  # a file that is not a GGUF: CheckpointError (a ValueError)
        file_type = metadata_value(reader, "general.file_type", None)
        file_type = None if file_type is None else int(file_type)
        problem = unbuildable(source, reader, file_type)  # before the minutes of writing
        if problem is not None:
            raise SliceError(problem)
        own = checkpoints.member_name(file_type)
    except ValueError as error:
        raise SliceError(f"--gguf={source}: not a GGUF checkpoint ({error})") from None
    members = checkpoints.family(source, cache / file_sha256(source)[:16], skip=own)
    members[own] = source
    return members


def _golden(value: str, parser: argparse.ArgumentParser) -> dict:
    """The golden `--check` names, read before the minutes of scoring."""
    try:
        golden = json.loads(user_path(value).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        parser.error(f"--check={value}: {error}")
    if not (
        isinstance(golden, dict)
        and isinstance(golden.get("rows"), dict)
        and isinstance(golden.get("setup"), dict)
    ):
        parser.error(f"--check={value}: not an eval-slice golden (eval_slice --write-golden)")
    return golden


def _check_writable(parser: argparse.ArgumentParser, option: str, path: Path) -> None:
    """`path` a file this process can write (output_file: a file created and dropped in its
    folder), found before the minutes of scoring, not after them."""
    try:
        output_file(path, option)
    except PathError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes={args.modes}: choose from {', '.join(MODES)}")
    if args.n_ctx < 4:
        parser.error(f"--n-ctx={args.n_ctx}: give at least 4")
    for option, value in (("--write-golden", args.write_golden), ("--json", args.json)):
        if value and user_path(value).is_dir():
            parser.error(f"{option}={value}: {user_path(value)} is a folder; name a file")
        if value and not user_path(value).parent.is_dir():
            parser.error(f"{option}={value}: {user_path(value).parent} is not a folder")
        if value:
            _check_writable(parser, option, user_path(value))
    golden = _golden(args.check, parser) if args.check else None
    torch.set_num_threads(args.threads)
    try:
        text_path = user_path(args.text)
        if not text_path.is_file():
            raise SliceError(f"--text={args.text}: no such file")
        try:
            source = user_path(args.gguf) if args.gguf else smollm2_gguf()
        except FileNotFoundError as error:
            raise SliceError(str(error)) from None
        cache = user_path(args.cache) if args.cache else default_cache()
        _progress(f"the checkpoint family of {source.name} in {cache}")
        family = family_of(source, cache)
        text = text_path.read_text(encoding="utf-8")
        engine, count = engine_rows(family, text, args.n_ctx, args.chunks, modes)
        setup = setup_of(family, text, args.n_ctx, count)
        theirs = {}
        if not args.no_llama_cpp:
            theirs = llama_cpp_rows(family, text_path, args.n_ctx, count, args.threads)
    except SliceError as error:
        print(f"eval_slice: error: {error}", file=sys.stderr)
        return 2
    print(
        f"{text_path.name}: {count} chunks of {args.n_ctx} tokens, "
        f"{int(next(iter(engine.values()))['tokens'])} tokens scored"
    )
    print(table(engine, theirs))
    if args.write_golden:
        out = user_path(args.write_golden)
        document = golden_document(setup, engine)
        if not _written(out, json.dumps(document, indent=1, sort_keys=True) + "\n"):
            return 2
        print(f"golden: {out}")
    if golden is not None:
        failures = setup_failures(golden, setup) + row_failures(golden, engine)
        for failure in failures:
            print(f"FAIL {failure}")
        print(f"golden {args.check}: {'FAILED' if failures else 'passed'}")
        if failures:
            return 1
    if args.json:
        out = user_path(args.json)
        document = {"setup": setup.key(), "engine": engine, "llama_perplexity": theirs}
        if not _written(out, json.dumps(document, indent=1, sort_keys=True) + "\n"):
            return 2
    return 0


def _written(path: Path, content: str) -> bool:
    """Write `path`; a write that fails all the same (a disk filled during the run) is one line
    and exit 2, not a traceback whose exit 1 would read as a failed golden."""
    try:
        write_atomically(path, content)
    except PathError as error:
        print(f"eval_slice: error: {error}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
