"""calibrate_tolerances: measure the noise floor and the mutation floor behind every tolerance.

For each checkpoint variant, teacher-forced against the pinned goldens (own and torch):
  noise     two correct runs: the engine on 1 thread against its own golden (made on
            engine_runs.GOLDEN_THREADS, 1, as the tests run), and the engine against
            transformers' golden;
  mutations each known bug of mutations.py against both goldens.
It prints, per measurement, the worst step's max |Δ log-prob| over the golden top-k and KL.
  kernels   with --kernel-levels, the unmutated engine against both goldens once per kernel
            level this CPU reaches (KERNEL_LEVELS, each in a fresh process: the switches are
            read at start-up): ATEN_CPU_CAPABILITY picks ATen's own kernels (elementwise ops,
            reductions, SDPA), ONEDNN_MAX_CPU_ISA oneDNN's (bfloat16 matmuls), and
            MKL_ENABLE_INSTRUCTIONS / MKL_CBWR MKL's (float32 matmuls). The worst is the
            cross-ISA noise floor: what another CPU may move a correct run by.
            With --kernel-builds also the quantized mode (Q4 checkpoints) under each C kernel
            build this CPU runs (LLAMA_GOLDENS_KERNELS: portable, avx2, avx512, vnni; they
            sum in different orders) x each ATen level: part of the same floor.
Every threshold in goldens/tolerances.yaml must sit above the noise and below the
smallest mutation; the numbers recorded there (noise_floor, isa_noise_floor, mutation_floor)
come from here.

Example:
  ./bazelw run //max_tests/integration/architectures/llama3:calibrate_tolerances
  ./bazelw run //max_tests/integration/architectures/llama3:calibrate_tolerances -- \\
      --encoding=bfloat16 --goldens-dir=/tmp/goldens
  ./bazelw run //max_tests/integration/architectures/llama3:calibrate_tolerances -- \\
      --kernel-levels --encoding=float32
  ./bazelw run //max_tests/integration/architectures/llama3:calibrate_tolerances -- \\
      --kernel-levels --kernel-builds --encoding=q4_k
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from goldens import locate, schema
from goldens.cli_files import user_path
from goldens.tolerances import Tolerance
from harness.llama3 import engine_runs, golden_files, judge
from harness.llama3.variants import (
    Variant,
    checkout_testdata,
    variants,
)
from max_tests.integration.architectures.llama3 import mutations
from pipelines.llama3 import kernel_library

# A tolerance that fails nothing: the measurements read the metrics, not a verdict.
MEASURE = Tolerance(
    "measure", logprob_atol=1e9, kl_max=1e9, topk_overlap_min=0.0, near_tie_margin=0.0, why=""
)


MODULE = "max_tests.integration.architectures.llama3.calibrate_tolerances"
NOISE_MODE_ENV = "CALIBRATE_NOISE_MODE"  # the mode a --noise-json process loads
# Kernel settings one machine can switch between, each (name, environment, CPU flag it needs).
KERNEL_LEVELS = (
    ("aten avx512", {"ATEN_CPU_CAPABILITY": "avx512"}, "avx512f"),
    ("aten avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
    ("aten default", {"ATEN_CPU_CAPABILITY": "default"}, ""),
    ("onednn+mkl avx2", {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "avx2"),
    (
        "all portable",
        {
            "ATEN_CPU_CAPABILITY": "default",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        },
        "",
    ),
    ("mkl cbwr compatible", {"MKL_CBWR": "COMPATIBLE"}, ""),
)


def reachable_kernel_levels() -> list[tuple[str, dict[str, str]]]:
    """KERNEL_LEVELS whose CPU flag this machine has (from /proc/cpuinfo)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return [(name, env) for name, env, flag in KERNEL_LEVELS if not flag or flag in flags]


# The encodings the quantized mode runs with its C kernels, whose builds sum in different
# orders (the ggml mode's builds give the same bits: test_same_bits).
QUANTIZED_ENCODINGS = ("q4_k", "q4_1")


def reachable_kernel_builds() -> list[tuple[str, dict[str, str]]]:
    """(name, environment) for each quantized-mode kernel build x ATen level this CPU runs."""
    builds = [isa for isa in kernel_library.REQUIRED_FLAGS if kernel_library.runnable(isa)]
    aten = [env for name, env in reachable_kernel_levels() if name.startswith("aten ")]
    return [
        (
            f"quantized {isa} x aten {env['ATEN_CPU_CAPABILITY']}",
            {kernel_library.KERNELS_ENV: isa, **env, NOISE_MODE_ENV: "quantized"},
        )
        for isa in builds
        for env in aten
    ]


def kernel_noise(
    variant: Variant, goldens_dir: Path | None, levels: list[tuple[str, dict[str, str]]]
) -> list[tuple[str, str, float, float]]:
    """Rows (kind, what, max |Δ log-prob|, max KL): the unmutated engine on one thread
    against both goldens under each of `levels`, each in a fresh process."""
    rows = []
    for name, env in levels:
        command = [sys.executable, "-m", MODULE, "--noise-json", f"--encoding={variant.encoding}"]
        if goldens_dir is not None:
            command.append(f"--goldens-dir={goldens_dir}")
        done = subprocess.run(
            command, env={**os.environ, **env}, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name}: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
        for reference, (logprob, kl) in json.loads(done.stdout.splitlines()[-1]).items():
            rows.append(("kernels", f"{reference}: {name}", logprob, kl))
    return rows


def load_golden(reference: str, variant: Variant, goldens_dir: Path | None) -> schema.Golden:
    if goldens_dir is not None:
        return schema.read(goldens_dir / golden_files.golden_file_name(reference, variant))
    found = golden_files.find_golden(reference, variant, checkout_testdata())
    if found is None:
        name = golden_files.golden_file_name(reference, variant)
        searched = [s.description for s in locate.golden_sources(reference, checkout_testdata())]
        raise FileNotFoundError(f"{name}: not in {searched}")
    return found[0]


def worst(engine, golden: schema.Golden, variant: Variant) -> tuple[float, float]:
    """(max |Δ log-prob|, max KL) of the engine teacher-forced on `golden`."""
    verdict = judge.check(engine, golden, golden_files.GoldenSource(""), "", MEASURE, variant)
    return verdict.max_logprob_diff, verdict.max_kl


def measure(
    variant: Variant, goldens_dir: Path | None = None
) -> list[tuple[str, str, float, float]]:
    """Rows (kind, what, max |Δ log-prob|, max KL) for one variant against both goldens."""
    goldens = {ref: load_golden(ref, variant, goldens_dir) for ref in ("own", "torch")}
    rows = []
    engine = mutations.load(variant, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        own = worst(engine, goldens["own"], variant)
    finally:
        torch.set_num_threads(threads)
    rows.append(("noise", f"own: 1 thread vs the golden's {engine_runs.GOLDEN_THREADS}", *own))
    torch_noise = worst(engine, goldens["torch"], variant)
    rows.append(("noise", "torch: engine vs transformers", *torch_noise))
    last_position = min(golden.last_position for golden in goldens.values())
    for mutation in mutations.MUTATIONS:
        if mutation.name == "bos":
            continue  # caught by the input ids, whatever the numbers
        if not mutation.applies_to(engine.config, last_position):
            continue  # a bug this checkpoint's goldens cannot have (mutations.py says why)
        engine = mutations.load(variant, mutation)
        for reference, golden in goldens.items():
            rows.append(
                ("mutation", f"{reference}: {mutation.name}", *worst(engine, golden, variant))
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrate_tolerances",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Example:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--encoding", default="all", help="an encoding (e.g. nvfp4) or all")
    parser.add_argument("--goldens-dir", help="read goldens here instead of the pinned archives")
    parser.add_argument(
        "--kernel-levels",
        action="store_true",
        help="also measure the noise under every kernel level this CPU reaches (KERNEL_LEVELS)",
    )
    parser.add_argument(
        "--kernel-builds",
        action="store_true",
        help="also measure the quantized mode under every C kernel build x ATen level (Q4 files)",
    )
    # One process of --kernel-levels: the unmutated engine's worst numbers as one JSON line.
    parser.add_argument("--noise-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("PIPELINES_TESTDATA", str(checkout_testdata()))
    goldens_dir = user_path(args.goldens_dir).resolve() if args.goldens_dir else None
    if goldens_dir is not None and not goldens_dir.is_dir():
        parser.print_usage(sys.stderr)
        print(
            f"calibrate_tolerances: error: --goldens-dir={goldens_dir} is not a folder",
            file=sys.stderr,
        )
        return 2
    selected = [v for v in variants("all", args.encoding) if v.path is not None]
    selected = [v for v in selected if v.model != "llama3_1"]
    if not selected:
        parser.print_usage(sys.stderr)
        print(
            f"calibrate_tolerances: error: no checkpoint for --encoding={args.encoding}",
            file=sys.stderr,
        )
        return 2
    if args.noise_json:
        torch.set_num_threads(1)  # as the tests run
        (variant,) = selected
        mode = os.environ.get(NOISE_MODE_ENV, "eager")
        engine = (
            mutations.load(variant, None)
            if mode == "eager"
            else engine_runs.load_engine(variant, "cpu", mode=mode)
        )
        measured = {
            ref: worst(engine, load_golden(ref, variant, goldens_dir), variant)
            for ref in ("own", "torch")
        }
        print(json.dumps(measured))
        return 0
    for variant in selected:
        print(f"calibrate_tolerances: {variant.test_id} ...", file=sys.stderr, flush=True)
        print(f"\n{variant.encoding} ({variant.test_id})")
        print(f"  {'kind':<9} {'what':<40} {'max |Δ log-prob|':>17} {'max KL':>10}")
        rows = measure(variant, goldens_dir)
        if args.kernel_levels:
            rows += kernel_noise(variant, goldens_dir, reachable_kernel_levels())
        if args.kernel_builds and variant.encoding in QUANTIZED_ENCODINGS:
            rows += kernel_noise(variant, goldens_dir, reachable_kernel_builds())
        for kind, what, logprob, kl in rows:
            print(f"  {kind:<9} {what:<40} {logprob:>17.3g} {kl:>10.3g}")
        for reference in ("own", "torch"):
            levels = [r for r in rows if r[0] == "kernels" and r[1].startswith(reference)]
            if levels:
                high = max(levels, key=lambda r: r[2])
                print(
                    f"  cross-ISA noise floor ({reference}): {high[2]:.3g} log-prob "
                    f"({high[1]}), KL {max(r[3] for r in levels):.3g}"
                )
            floor = [r for r in rows if r[0] == "mutation" and r[1].startswith(reference)]
            low = min(floor, key=lambda r: r[2])
            print(
                f"  mutation floor ({reference}): {low[2]:.3g} log-prob ({low[1]}), "
                f"KL {min(r[3] for r in floor):.3g}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
