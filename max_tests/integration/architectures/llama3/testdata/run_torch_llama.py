"""run_torch_llama: the independent reference goldens, from transformers on the same GGUF.

transformers' own Llama (AutoModelForCausalLM with gguf_file=) and its own GGUF tokenizer
run the golden prompts greedily; the result is written in the engine goldens' schema as
`torch_{model}_{encoding}_golden.json` (GPU bfloat16: `torch_{model}_{encoding}_{gpu}_golden.json`).

The model comes from torch_reference.load_reference, which restores the Llama 3.1 rope scaling
that transformers' GGUF loader drops and checks it against the file.

Examples:
  ./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama -- \\
      --model tinyllama --encoding float32
  ./bazelw run //max_tests/integration/architectures/llama3/testdata:run_torch_llama_gpu -- \\
      --model llama3_1 --encoding bfloat16 --verbose
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub: everything is local files
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import numpy as np
import torch

from goldens import schema
from goldens.cli_files import PathError, user_path
from goldens.record import case_specs, record_case
from harness.llama3 import engine_runs, golden_files
from harness.llama3.torch_reference import float32_head, load_reference
from harness.llama3.variants import (
    ENCODINGS,
    LLAMA3_1_ENV,
    MODELS,
    Variant,
    checkout_testdata,
    unavailable_selection,
    variants,
)

PRODUCER_VERSION = "transformers/{}"


def _parser(default_device: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_torch_llama",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 3)[3],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="all", choices=["all", *MODELS])
    p.add_argument("--encoding", default="all", choices=["all", *ENCODINGS])
    p.add_argument("--device", default=default_device, help=f"default: {default_device}")
    p.add_argument("--output-dir", help="where to write goldens (default: the testdata folder)")
    p.add_argument(
        "--llama3-1-gguf", type=user_path, help=f"a Llama-3.1-8B-Instruct GGUF (or ${LLAMA3_1_ENV})"
    )
    p.add_argument("--verbose", action="store_true", help="print each case's continuation")
    return p


@torch.inference_mode()
def greedy(model, input_ids: list[int], steps: int, eos_ids: set[int], device: str, positions=()):
    """Greedy decoding with transformers' KV cache; returns tokens, per-step logits and the
    prefill's logits at the prompt `positions` (None without positions).

    The final norm and the LM head run in float32 whatever the model's dtype, as the
    engine's do: bfloat16 logits of ~40 sit on a 0.25 grid and make exact ties.
    """
    with float32_head(model) as head:
        return _greedy(model, head, input_ids, steps, eos_ids, device, list(positions))


def _greedy(model, head, input_ids, steps, eos_ids, device, positions):
    ids = torch.tensor([input_ids], device=device)
    out = model.model(ids, use_cache=True)
    prompt_rows = None
    if positions:  # the LM head on those rows only ([seq, vocab] would be GiBs at 8k)
        prompt_rows = (out.last_hidden_state[0, positions].float() @ head.T).cpu().numpy()
    tokens, rows = [], []
    for _ in range(steps):
        logits = out.last_hidden_state[0, -1].float() @ head.T
        token = int(torch.argmax(logits))
        tokens.append(token)
        rows.append(logits.cpu().numpy())
        if token in eos_ids:
            break
        out = model.model(
            torch.tensor([[token]], device=device),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return tokens, np.stack(rows), prompt_rows


def torch_golden(variant: Variant, device: str, verbose: bool = False) -> schema.Golden:
    import transformers

    model, tokenizer = load_reference(variant, device)
    eos_ids = {tokenizer.eos_token_id} - {None}
    cases = []
    for spec in case_specs(variant.model):
        input_ids = tokenizer.encode(spec.prompt)
        positions = spec.positions(len(input_ids))
        tokens, logits, prompt_logits = greedy(
            model, input_ids, spec.steps, eos_ids, device, positions
        )
        cases.append(
            record_case(
                spec,
                input_ids,
                tokens,
                logits,
                tokenizer.decode,
                eos_ids,
                positions=positions,
                prompt_logits=prompt_logits,
            )
        )
        if verbose:
            shown = spec.prompt if len(spec.prompt) < 80 else f"{spec.prompt[:60]}..."
            print(
                f"  {spec.id} ({len(input_ids)} tokens): {shown!r} -> {tokenizer.decode(tokens)!r}",
                file=sys.stderr,
            )
    prov = golden_files.provenance(
        variant, "torch", PRODUCER_VERSION.format(transformers.__version__), device
    )
    return schema.Golden(provenance=prov, cases=cases)


def torch_golden_file_name(golden: schema.Golden) -> str:
    p = golden.provenance
    return schema.golden_file_name(p.model, p.encoding, p.hardware, producer="torch")


def main(argv: list[str] | None = None, default_device: str = "cpu") -> int:
    parser = _parser(default_device)
    args = parser.parse_args(argv)
    testdata = checkout_testdata()  # under bazel run: the checkout's, not the runfiles'
    os.environ["PIPELINES_TESTDATA"] = str(testdata)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"run_torch_llama: error: --device={args.device} but torch sees no CUDA device "
            "(run on a GPU machine, or pass --device=cpu)",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    selected = variants(args.model, args.encoding, args.llama3_1_gguf)
    if not selected:
        print(
            f"run_torch_llama: error: --model={args.model} has no --encoding={args.encoding} "
            "checkpoint",
            file=sys.stderr,
        )
        return 2
    nothing = unavailable_selection(selected)
    if nothing is not None:
        print(f"run_torch_llama: error: {nothing}", file=sys.stderr)
        return 2
    try:
        output_dir = golden_files.output_folder(args.output_dir, testdata)
    except PathError as error:
        print(f"run_torch_llama: error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(engine_runs.GOLDEN_THREADS)
    for variant in selected:
        if variant.path is None:
            print(
                f"run_torch_llama: {variant.model}: unavailable: {variant.unavailable_reason}",
                file=sys.stderr,
            )
            continue
        print(
            f"run_torch_llama: {variant.model} {variant.encoding} on {args.device} ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        golden = torch_golden(variant, args.device, verbose=args.verbose)
        name = torch_golden_file_name(golden)
        schema.write(golden, output_dir / name)
        print(f"{name}\t{len(golden.cases)} cases\t{time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
