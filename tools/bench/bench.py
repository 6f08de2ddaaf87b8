"""Benchmark the Llama 3 engine against transformers on the same GGUF, in one process.

Both run greedy decoding on CPU in float32 with the same thread count; the table gives load
seconds, prefill and decode tokens/s for each and the ratios engine/transformers.

Example:
    bazel run //tools/bench -- --new-tokens 32 --threads 2
    bazel run //tools/bench -- --gguf /path/model.gguf --check   # exit 1 below the acceptance bar
"""

import argparse
import os
import pathlib
import sys
import tempfile
import time

# transformers must never reach a hub: everything comes from the local GGUF.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch

from pipelines.checkpoints import smollm2_gguf
from pipelines.llama3 import CheckpointError, Llama3Engine, LlamaConfig

DEFAULT_PROMPT = "The capital of France is a city with a long history. Its most famous monument is"
MIN_LOAD_SPEEDUP = 5.0  # issue 3 acceptance: engine load at least 5x faster
MIN_DECODE_RATIO = 1.0  # and decode at least as fast


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
    parser.add_argument("--check", action="store_true", help="exit 1 when below the acceptance bar")
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


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(
            f"--new-tokens={args.new_tokens} must be at least 2 (one prefill, then decode steps)"
        )
    torch.set_num_threads(args.threads)
    try:
        gguf_path = args.gguf or smollm2_gguf()
    except FileNotFoundError as error:
        parser.error(str(error))
    if args.gguf and os.environ.get("BUILD_WORKING_DIRECTORY") and not gguf_path.is_absolute():
        gguf_path = pathlib.Path(os.environ["BUILD_WORKING_DIRECTORY"]) / gguf_path
    gguf_path = gguf_path.resolve()

    _progress(f"engine: loading {gguf_path}")
    start = time.perf_counter()
    try:
        engine = Llama3Engine.from_gguf(gguf_path)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    engine_load = time.perf_counter() - start
    input_ids = engine.tokenizer.encode(args.prompt)
    engine.generate(
        input_ids, 4, stop_on_eos=False
    )  # warm-up: first-touch of caches, kernel selection
    _progress("engine: generating")
    out = engine.generate(input_ids, args.new_tokens, stop_on_eos=False)
    engine_prefill, engine_decode = out.prefill_seconds, out.decode_seconds

    _progress("transformers: loading (dequantizes the whole file)")
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as gguf_dir:
        # transformers wants a folder and a file name; a symlink avoids copying the checkpoint.
        link = pathlib.Path(gguf_dir) / gguf_path.name
        link.symlink_to(gguf_path)
        hf_config = _transformers_config(pathlib.Path(gguf_dir), link.name, engine.config)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=link.name,
            dtype=torch.float32,
            **({"config": hf_config} if hf_config else {}),
        )
        transformers_load = time.perf_counter() - start
    model.eval()
    _transformers_greedy(model, input_ids, 4)
    _progress("transformers: generating")
    hf_tokens, hf_prefill, hf_decode = _transformers_greedy(model, input_ids, args.new_tokens)

    decode_steps = args.new_tokens - 1
    rows = [
        ("load seconds", engine_load, transformers_load),
        ("prefill tok/s", len(input_ids) / engine_prefill, len(input_ids) / hf_prefill),
        ("decode tok/s", decode_steps / engine_decode, decode_steps / hf_decode),
    ]
    print(f"checkpoint: {gguf_path.name}  threads: {args.threads}  float32 cpu")
    print(f"prompt tokens: {len(input_ids)}  new tokens: {args.new_tokens}")
    print(f"{'':16}{'engine':>12}{'transformers':>14}{'engine/transformers':>22}")
    for name, ours, theirs in rows:
        print(f"{name:16}{ours:12.2f}{theirs:14.2f}{ours / theirs:22.3f}")
    load_speedup = transformers_load / engine_load
    decode_ratio = rows[2][1] / rows[2][2]
    same = sum(a == b for a, b in zip(out.tokens, hf_tokens, strict=True))
    print(
        f"load speedup: {load_speedup:.1f}x (bar {MIN_LOAD_SPEEDUP}x); "
        f"decode ratio {decode_ratio:.2f} (bar {MIN_DECODE_RATIO})"
    )
    print(f"greedy tokens identical: {same}/{len(hf_tokens)}")
    if args.check and (load_speedup < MIN_LOAD_SPEEDUP or decode_ratio < MIN_DECODE_RATIO):
        print("FAILED: below the acceptance bar", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
