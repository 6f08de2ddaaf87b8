"""Load a GGUF checkpoint, then prefill and greedy-decode with the KV cache."""

import dataclasses
import functools
import gc
import os
import pathlib
import time
from collections.abc import Sequence

import torch

from pipelines.llama3 import constrained, ggml_mode, packed, profiling, speculative
from pipelines.llama3.compiled import CompiledTransformer, compile_blocks
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.decoder import Decoder
from pipelines.llama3.gguf_file import GGUFFile
from pipelines.llama3.gguf_loader import (
    CheckpointError,
    DequantizedCache,
    load_weights,
    metadata_value,
    open_gguf,
    read_config,
)
from pipelines.llama3.model import Transformer
from pipelines.llama3.packing import RawMatrix
from pipelines.llama3.sampling import SamplerSettings
from pipelines.llama3.tokenizer import Tokenizer


@dataclasses.dataclass
class GenerationOutput:
    tokens: list[int]  # the greedy choice of each step
    logits: (
        torch.Tensor
    )  # [steps, vocab] float32 cpu; row i chose tokens[i] (row 0: last prompt position)
    prefill_seconds: float
    decode_seconds: float  # the forward passes after prefill (one per token but the first)
    # [len(prompt_positions), vocab] float32 cpu: the prefill's next-token logits at the
    # prompt positions asked for (row j after input_ids[: prompt_positions[j] + 1])
    prompt_logits: torch.Tensor | None = None
    speculation: speculative.Stats | None = None  # with speculation: proposals and acceptances
    # with a constraint and record_allowed: each step's allowed ids (np.ndarray)
    allowed: list | None = None

    @property
    def decode_tokens_per_second(self) -> float:
        decode_steps = max(len(self.tokens) - 1, 0)
        return decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclasses.dataclass
class _ParsedCheckpoint:
    """What loading a file computes besides its weights; shared, so never handed out as is."""

    gguf: GGUFFile
    config: LlamaConfig  # frozen
    tokenizer: Tokenizer | None  # engines get a copy()
    verified: set[str]  # tensors already checked for NaN and infinity
    dequantized: DequantizedCache  # for the next load of the same file


@dataclasses.dataclass(frozen=True)
class _FileVersion:
    """A file as it is on disk now: equal for the same real path, inode, size, mtime and
    ctime (a file replaced or rewritten is another version), whatever the spelling of `path`."""

    real_path: str
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    path: pathlib.Path = dataclasses.field(compare=False)  # as the caller named it (messages)


# How many parsed files `_parse` keeps (the least recently used goes first). Each keeps its
# file mapped, so only a few; but more than the golden suite's checkpoints (5 and the 8B),
# which a test process visits once per mode: with fewer, the least recently used one would
# always be the next one needed.
_PARSED_CACHE_SIZE = 8


def _parsed_checkpoint(path: pathlib.Path) -> _ParsedCheckpoint:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    version = _FileVersion(
        os.path.realpath(path),
        stat.st_ino,
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ctime_ns,
        path,
    )
    return _parse(version)


@functools.lru_cache(maxsize=_PARSED_CACHE_SIZE)
def _parse(version: _FileVersion) -> _ParsedCheckpoint:
    path = version.path
    reader = open_gguf(path)
    config = read_config(reader, path)
    tokenizer = None
    if metadata_value(reader, "tokenizer.ggml.tokens") is not None:
        tokenizer = Tokenizer.from_gguf_reader(reader, path)
    return _ParsedCheckpoint(reader, config, tokenizer, set(), DequantizedCache())


def clear_checkpoint_cache() -> None:
    """Forget every parsed file (the next from_gguf parses again)."""
    _parse.cache_clear()


def freeze_imported_objects() -> None:
    """Exempt every object alive now from garbage collection (gc.freeze), for a program's main.

    Importing torch leaves about a million objects for the collector, and a fresh process is
    due a full collection within its next few hundred allocations: it landed in the first
    from_gguf, 90 ms of SmolLM2's 0.26 s load. Frozen right after the imports, those objects
    are never scanned again (they live as long as the process anyway), so that collection
    and every later one only scan what the program made since. The command-line tools call
    this first; a library never should, as it is the host program's decision.
    """
    gc.freeze()


# Execution modes, all held to the same goldens and tolerances (the goldens come from eager):
#   eager      dense weights (float32 or bfloat16), plain PyTorch: the reference.
#   compiled   eager's weights, each transformer block run through torch.compile
#              (compiled.py).
#   quantized  Q4_0/Q4_1/Q4_K/Q8_0 matrices stay packed (packed.py) on the CPU in float32;
#              other tensors, other devices and bfloat16 compute stay as in eager.
#   ggml       llama.cpp's numerics (ggml_mode.py): those matrices' products with 8-bit
#              activations as ggml quantizes them, integer dot products; held to goldens of
#              its own (made by evaluate_llama --mode=ggml) on the files where it differs
#              from eager (Q4_K, Q4_1), to eager's elsewhere.
MODES = ("eager", "compiled", "quantized", "ggml")


def device_problem(device: str) -> str | None:
    """Why --device=`device` cannot run the engine (None when it can): it runs on cpu and
    cuda[:N], the CUDA ones only where torch sees that device. The command lines check it
    before they load or write anything (generate, evaluate_llama)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):  # "tpu", "cuda:x": torch lists every type, at length
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        return f"--device={device} is not a device here: the engine runs on cpu or cuda[:N]"
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return f"--device={device}: this torch has no CUDA device; use --device=cpu"
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        return (
            f"--device={device}: torch sees {torch.cuda.device_count()} CUDA device(s); "
            "pass a smaller index"
        )
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Llama3Engine:
    def __init__(
        self,
        config: LlamaConfig,
        model: Transformer,
        tokenizer: Tokenizer | None,
        device: torch.device,
        dtype: torch.dtype,
        mode: str = "eager",
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer  # None when the GGUF stores no vocabulary
        self.device = device
        self.dtype = dtype
        self.mode = mode

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        overrides: dict | None = None,
        mode: str = "eager",
    ) -> "Llama3Engine":
        """Read config, tokenizer and weights from one GGUF file, for one of MODES.

        `overrides` replaces LlamaConfig fields after reading (e.g. {"rope_theta": 1e4}; an
        unknown name is a TypeError), so the mutation tests can check that a wrong setting is
        caught by the goldens.
        Metadata and tokenizer of a file are parsed once per process; each call reads the
        weights again, into tensors of its own.
        """
        path = pathlib.Path(path)
        device = torch.device(device)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype} is not supported (float32 or bfloat16)")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        parsed = _parsed_checkpoint(path)
        config = dataclasses.replace(parsed.config, **(overrides or {}))
        tokenizer = parsed.tokenizer.copy() if parsed.tokenizer else None
        keep_packed = (
            mode in ("quantized", "ggml") and device.type == "cpu" and dtype == torch.float32
        )
        weights = load_weights(
            parsed.gguf,
            config,
            path,
            device=device,
            dtype=dtype,
            verified=parsed.verified,
            keep_packed=keep_packed,
            dequantized=parsed.dequantized,
        )
        packed_weights = {k: w for k, w in weights.items() if isinstance(w, RawMatrix)}
        # The quantized and ggml modes' model classes where they have matrices to run (a float
        # file stays eager's).
        model_class = Transformer
        if mode == "compiled":
            model_class = CompiledTransformer
        elif packed_weights:
            model_class = ggml_mode.GgmlTransformer if mode == "ggml" else packed.PackedTransformer
        with torch.device("meta"):
            model = model_class(config)
        # assign=True adopts the loaded tensors; nothing is randomly initialised and thrown away.
        dense = {k: w for k, w in weights.items() if k not in packed_weights}
        model.load_state_dict(
            dense, strict=not (config.tie_word_embeddings or packed_weights), assign=True
        )
        if mode == "ggml":
            ggml_mode.install(model, packed_weights)
        else:
            packed.install(model, packed_weights)
        if config.tie_word_embeddings and "tok_embeddings.weight" not in packed_weights:
            model.tie_weights()
        if dtype != torch.float32:
            # The LM head runs in float32 whatever the compute dtype: bfloat16 logits of ~40
            # sit on a 0.25 grid, which makes exact top-1 ties and hides real differences.
            model.output.weight = torch.nn.Parameter(
                model.output.weight.detach().float(), requires_grad=False
            )
        model.eval()
        if mode == "compiled":
            compile_blocks(model)
        return cls(config, model, tokenizer, device, dtype, mode)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a sequence: the tokenizer's end-of-sequence and end-of-turn ids,
        else the checkpoint's `tokenizer.ggml.eos_token_id` (none: nothing stops early)."""
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.eos_ids)
        return frozenset({self.config.eos_token_id} - {None})

    def text(self, tokens: list[int], stopped: bool) -> str:
        """The text of generated `tokens`; a sequence `stopped` on an end-of-sequence id
        (finish reason "stop") ends with that token, a stop condition and not text: it is left
        out (its id stays in the ids, log-probabilities and usage), as OpenAI's API and
        llama-server leave it out."""
        if stopped and tokens and tokens[-1] in self.eos_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens)

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every matrix once (embedding rows aside)."""
        total = 0
        for module in self.model.modules():
            if isinstance(module, packed.PackedLinear | ggml_mode.GgmlLinear):
                total += module.weight.nbytes
            elif isinstance(module, torch.nn.Linear):
                total += module.weight.numel() * module.weight.element_size()
        return total

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        if not ids:
            raise ValueError("input_ids is empty")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary (size {self.config.vocab_size})"
            )
        return torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, seq]

    @torch.inference_mode()
    def forward_logits(self, input_ids: list[int]) -> torch.Tensor:
        """One full forward without reusing any cache: [seq, vocab] float32 on cpu."""
        tokens = self._tensor(input_ids)
        self.model.setup_caches(len(input_ids))
        return self.model(tokens, 0)[0].cpu()

    @torch.inference_mode()
    def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_on_eos: bool = True,
        forced_tokens: list[int] | None = None,
        prompt_positions: Sequence[int] = (),
        sampling: SamplerSettings | None = None,
        speculation: speculative.Speculation | None = None,
        stop: Sequence[str] = (),
        constraint: constrained.Constraint | None = None,
        record_allowed: bool = False,
    ) -> GenerationOutput:
        """Prefill, then decode, each step reading the keys and values of the KV cache; the
        next token and the stop are the decoder's (decoder.Decoder: greedy, end-of-sequence ids;
        with `sampling`, drawn by sampling.SamplerSettings at each position under its seed).

        With `forced_tokens` (teacher forcing) step i feeds forced_tokens[i] to the next step
        instead of the greedy choice, for len(forced_tokens) steps (= max_new_tokens) and no
        EOS stop: every step's logits then follow the same prefix as the sequence checked, and
        `tokens` still holds the model's own greedy choice at each step.
        `prompt_positions` (0-based, before the last prompt position) also returns the same
        prefill's logits at those positions (`prompt_logits`); the LM head runs on them only.
        With `speculation` (speculative.Speculation) a draft proposes tokens that one forward
        verifies, the decoder accepting the longest prefix it would have chosen: the same
        tokens (greedy, or sampled under the same seed), fewer forwards (speculative.py; a
        draft that samples, `SamplingDraft`, is verified by rejection sampling: the target's
        distribution, other draws); with
        `forced_tokens` too, the forced tokens are the proposals, K + 1 rows per forward.
        `stop` (strings): the generation ends after the token whose text completes one.
        `constraint` (constrained.Constraint: JSON schema, regex, choice, grammar): each step
        chooses among the tokens its language allows, and ends with an end-of-sequence id
        once the text is a member; `record_allowed` returns each step's allowed ids
        (`allowed`).
        """
        if forced_tokens is not None:
            bad = [t for t in forced_tokens if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"forced tokens {bad[:5]} are outside the vocabulary")
        decoder = Decoder(
            max_new_tokens,
            self.eos_ids if stop_on_eos else frozenset(),
            forced_tokens,
            sampling=sampling,
            prompt=input_ids,
            stop_strings=tuple(stop),
            detokenize=None if self.tokenizer is None else self.tokenizer.decode,
            constraint=constrained.matcher(constraint, self.tokenizer),
            record_allowed=record_allowed,
        )
        max_new_tokens = decoder.max_new_tokens
        prompt = self._tensor(input_ids)
        positions = [int(p) for p in prompt_positions]
        if any(not 0 <= p < len(input_ids) - 1 for p in positions):
            raise ValueError(
                f"prompt positions {positions[:5]}... must lie in 0..{len(input_ids) - 2} "
                f"(a {len(input_ids)}-token prompt; its last position is the first step)"
            )
        self.model.setup_caches(len(input_ids) + max_new_tokens)
        step_logits = torch.empty(max_new_tokens, self.config.vocab_size, dtype=torch.float32)
        next_token = torch.empty(1, 1, dtype=torch.long, device=self.device)

        _synchronize(self.device)
        start = time.perf_counter()
        with profiling.region("prefill"):
            prefill = self.model(prompt, 0, outputs=[*positions, len(input_ids) - 1])[0]
        logits = prefill[-1]  # [vocab]
        _synchronize(self.device)
        prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        stats = None
        if speculation is not None:
            with profiling.region("speculative decode"):
                stats = speculative.decode(
                    self.model,
                    decoder,
                    logits,
                    len(input_ids),
                    speculation,
                    step_logits,
                    self.device,
                )
        else:
            for step in range(max_new_tokens):
                with profiling.region("decode step"):
                    step_logits[step] = logits
                    token = decoder.step(logits)
                    if token is None:
                        break
                    next_token.fill_(token)  # one preallocated [1, 1] input for every step
                    logits = self.model(next_token, len(input_ids) + step)[0, -1]
        _synchronize(self.device)
        decode_seconds = time.perf_counter() - start
        tokens = decoder.tokens
        return GenerationOutput(
            tokens,
            step_logits[: len(tokens)].clone(),
            prefill_seconds,
            decode_seconds,
            prefill[:-1].cpu() if positions else None,
            stats,
            decoder.allowed if constraint is not None and record_allowed else None,
        )


__all__ = [
    "CheckpointError",
    "GenerationOutput",
    "Llama3Engine",
    "clear_checkpoint_cache",
    "freeze_imported_objects",
]
