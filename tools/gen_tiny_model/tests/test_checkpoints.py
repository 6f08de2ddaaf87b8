"""The committed tiny checkpoints, read by gguf-py, transformers and the engine.

transformers' GGUF loader drops Llama 3.1 rope scaling, so it gets `config=` with the scaling
(config.json for the hidden-16 files). The llama.cpp-style reference applies RoPE to
interleaved pairs straight from the file, so its agreement with transformers (which
un-permutes Q/K) shows the writer's permutation and rope_freqs are right.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from testing import gguf_reader
from tools.gen_tiny_model.tests.llama_cpp_reference import ReferenceLlama
from tools.gen_tiny_model.tiny_llama import TinyLlamaConfig

# gguf-py's reader and transformers' GGUF loader opened 4x faster (testing/gguf_reader.py)
gguf_reader.install()

TESTDATA = Path("max_tests/integration/architectures/llama3/testdata")
# Prompts of the checkpoints' own check, deliberately not cases.yaml's: the golden prompts'
# properties are checked on the published goldens themselves (llama3 test_golden_sanity).
PROBE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "What is the boiling point of water?",
    "Translate to French: good morning",
]
# A step whose top-1/top-2 logit gap is under this counts as a near-tie here.
# The logits spread with a standard deviation of ~12, so 0.05 is about 0.4% of it.
NEAR_TIE_MARGIN = 0.05
MIN_DISTINCT_TOKENS = 5  # of 10 greedy steps
LOGIT_ATOL = 1e-4

CHECKPOINTS = {
    "tiny_llama.gguf": (TinyLlamaConfig(1, 1, 1, 16, 64), GGMLQuantizationType.F32, 0),
    "tiny_llama_bf16.gguf": (TinyLlamaConfig(1, 1, 1, 16, 64), GGMLQuantizationType.BF16, 32),
    "tiny_llama_q4_k.gguf": (TinyLlamaConfig(1, 4, 2, 256, 512), GGMLQuantizationType.Q4_K, 14),
    "tiny_llama_nvfp4.gguf": (TinyLlamaConfig(1, 4, 2, 256, 512), GGMLQuantizationType.NVFP4, 39),
}
# transformers dequantizes NVFP4 with gguf-py; config_nvfp4.json carries the rope scaling.
HF_CONFIG_FILES = {"tiny_llama_nvfp4.gguf": "config_nvfp4.json"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request):
    name = request.param
    config, weight_type, file_type = CHECKPOINTS[name]
    reader = GGUFReader(TESTDATA / name)
    return name, config, weight_type, file_type, reader


@pytest.fixture(scope="module")
def reference(checkpoint):
    return ReferenceLlama(checkpoint[4])


def _engine(name: str):
    """The engine (a dependency of this target: a broken import fails, it never skips)."""
    from pipelines.llama3 import Llama3Engine

    return Llama3Engine.from_gguf(TESTDATA / name, device="cpu", dtype=torch.float32)


def _prompt_ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TESTDATA / "tokenizer.json")).encode(text).ids


def test_gguf_reader_shows_llama_keys_and_tensor_types(checkpoint):
    _, config, weight_type, file_type, reader = checkpoint
    fields = {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("tokenizer.ggml.") or key.endswith("_id")
    }
    assert reader.fields["GGUF.version"].contents() == 3
    expected = {
        "general.architecture": "llama",
        "general.file_type": file_type,
        "general.quantization_version": 2,
        "llama.block_count": config.n_layers,
        "llama.context_length": 131072,
        "llama.embedding_length": config.hidden_dim,
        "llama.feed_forward_length": config.intermediate_dim,
        "llama.attention.head_count": config.n_heads,
        "llama.attention.head_count_kv": config.n_kv_heads,
        "llama.rope.freq_base": 500000.0,
        "llama.rope.dimension_count": config.head_dim,
        "llama.vocab_size": 128256,
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128009,
    }
    assert {k: fields.get(k) for k in expected} == expected
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 128256
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 280147
    assert "<|start_header_id|>" in reader.fields["tokenizer.chat_template"].contents()

    types = {t.name: GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    assert "output.weight" not in types  # tied to token_embd
    for tensor in reader.tensors:
        want = GGMLQuantizationType.F32 if len(tensor.shape) == 1 else weight_type
        assert types[tensor.name] == want, tensor.name
    assert types["rope_freqs.weight"] == GGMLQuantizationType.F32
    rope_freqs = np.asarray(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data)
    assert rope_freqs[0] == 1.0 and rope_freqs[-1] == 8.0  # Llama 3.1: high freqs kept, low x8


def test_transformers_agrees_with_llama_cpp_reference_and_engine(checkpoint, reference):
    from transformers import AutoModelForCausalLM, LlamaConfig

    name, config, *_ = checkpoint
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if config.hidden_dim == 16:
        hf_config = LlamaConfig(**json.loads((TESTDATA / "config.json").read_text()))
        assert json.loads((TESTDATA / "config.json").read_text()) == config.hf_config()
    elif name in HF_CONFIG_FILES:
        hf_config = LlamaConfig.from_json_file(TESTDATA / HF_CONFIG_FILES[name])
    else:
        hf_config = LlamaConfig(**config.hf_config())
    model = AutoModelForCausalLM.from_pretrained(
        TESTDATA, gguf_file=name, config=hf_config, dtype=torch.float32
    )
    ids = _prompt_ids(PROBE_PROMPTS[2])
    with torch.no_grad():
        hf_logits = model(torch.tensor([ids])).logits[0]
    assert torch.isfinite(hf_logits).all()
    assert hf_logits.std(-1).min() > 1.0
    torch.testing.assert_close(reference.logits(ids), hf_logits, atol=LOGIT_ATOL, rtol=0)
    engine = _engine(name)
    torch.testing.assert_close(engine.forward_logits(ids), hf_logits, atol=LOGIT_ATOL, rtol=0)


def test_greedy_continuations_are_useful_golden_subjects(checkpoint):
    name = checkpoint[0]
    engine = _engine(name)
    for prompt in PROBE_PROMPTS:
        ids = _prompt_ids(prompt)
        out = engine.generate(ids, max_new_tokens=10, stop_on_eos=False)
        tokens, logits = out.tokens, out.logits
        top2 = logits.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        where = f"{name} {prompt!r} tokens={tokens} gaps={[round(g, 3) for g in gaps]}"
        assert len(tokens) == 10, where
        assert min(gaps) >= NEAR_TIE_MARGIN, where
        assert len(set(tokens)) >= MIN_DISTINCT_TOKENS, where
        assert logits.std(-1).min() > 4.0, where
