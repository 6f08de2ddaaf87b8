"""config_nvfp4.json says what tiny_llama_nvfp4.gguf holds: its shape, and which tensors are
NVFP4 (in whole 64-value blocks) and which stay float32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, LlamaFileType

from testing import gguf_reader
from tools.gen_tiny_model import nvfp4
from tools.gen_tiny_model.tiny_llama import TinyLlamaConfig, hf_config_for, tensor_shapes

# gguf-py's reader and transformers' GGUF loader opened 4x faster (testing/gguf_reader.py)
gguf_reader.install()

TESTDATA = Path("max_tests/integration/architectures/llama3/testdata")
CONFIG = TinyLlamaConfig(1, 4, 2, 256, 512)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(TESTDATA / "tiny_llama_nvfp4.gguf")


@pytest.fixture(scope="module")
def hf_config() -> dict:
    return json.loads((TESTDATA / "config_nvfp4.json").read_text())


def test_config_is_what_write_hf_config_writes_for_the_checkpoint(hf_config):
    assert hf_config == hf_config_for(CONFIG, "nvfp4")


def test_shape_fields_match_the_gguf_metadata(reader, hf_config):
    def field(key: str) -> object:
        return reader.fields[key].contents()

    assert {
        "num_hidden_layers": field("llama.block_count"),
        "hidden_size": field("llama.embedding_length"),
        "intermediate_size": field("llama.feed_forward_length"),
        "num_attention_heads": field("llama.attention.head_count"),
        "num_key_value_heads": field("llama.attention.head_count_kv"),
        "head_dim": field("llama.rope.dimension_count"),
        "max_position_embeddings": field("llama.context_length"),
        "vocab_size": field("llama.vocab_size"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    } == {key: hf_config[key] for key in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
        "bos_token_id", "eos_token_id",
    )}  # fmt: skip
    assert hf_config["rope_theta"] == field("llama.rope.freq_base")
    assert hf_config["rms_norm_eps"] == pytest.approx(
        field("llama.attention.layer_norm_rms_epsilon")
    )
    assert field("general.file_type") == LlamaFileType.MOSTLY_NVFP4


def test_quantized_and_ignored_tensors_are_the_files_nvfp4_and_float32_tensors(reader, hf_config):
    quant = hf_config["quantization_config"]
    types = {t.name: GGMLQuantizationType(t.tensor_type) for t in reader.tensors}
    assert set(quant["quantized"]).isdisjoint(quant["ignore"])
    assert sorted(quant["quantized"] + quant["ignore"]) == sorted(types)
    assert {types[name] for name in quant["quantized"]} == {GGMLQuantizationType.NVFP4}
    assert {types[name] for name in quant["ignore"]} == {GGMLQuantizationType.F32}
    assert quant["ignore_format"] == "float32"
    assert quant["tied_lm_head"] in quant["quantized"] and "output.weight" not in types
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert shapes == tensor_shapes(CONFIG)
    assert all(shapes[name][-1] % quant["block_size"] == 0 for name in quant["quantized"])


def test_format_fields_match_gguf_py_and_the_blocks_in_the_file(reader, hf_config):
    quant = hf_config["quantization_config"]
    qtype = GGMLQuantizationType(quant["ggml_type_id"])
    assert qtype.name == quant["ggml_type"] == "NVFP4"
    assert GGML_QUANT_SIZES[qtype] == (quant["block_size"], quant["block_bytes"])
    assert quant["group_size"] * nvfp4.SUB_BLOCKS == quant["block_size"]
    assert (quant["format"], quant["weight_format"], quant["scale_format"]) == (
        "nvfp4", "e2m1", "ue4m3",
    )  # fmt: skip
    assert quant["global_scale"] is None
    for tensor in reader.tensors:
        if tensor.name in quant["quantized"]:
            blocks = np.asarray(tensor.data).reshape(-1, quant["block_bytes"])
            scales = blocks[:, : nvfp4.SUB_BLOCKS]
            assert scales.max() <= nvfp4.UE4M3_SATURATED, tensor.name  # never the NaN byte
            assert tensor.n_elements // quant["block_size"] == blocks.shape[0], tensor.name
