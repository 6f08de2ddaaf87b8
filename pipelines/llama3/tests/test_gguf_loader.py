"""Reading config and weights from GGUF files, and the one-line errors for files we cannot use."""

import pathlib

import gguf
import numpy as np
import pytest
import torch

from pipelines.llama3 import CheckpointError, Llama3Engine, load_config
from pipelines.llama3.gguf_loader import (
    DequantizedCache,
    load_weights,
    open_gguf,
    permute_qk,
    read_config,
    unpermute_qk,
)
from testing import gguf_files, gguf_reader
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

# gguf-py's reader, the reference here, opened 4x faster (same parsing: testing/gguf_reader.py)
gguf_reader.install()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path)
    return path


def test_config_comes_from_llama_metadata(tiny_gguf: pathlib.Path) -> None:
    config = load_config(tiny_gguf)
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 2, 4, 2)
    assert (config.ffn_dim, config.head_dim, config.context_length) == (128, 16, 256)
    assert config.rope_theta == 10000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert not config.tie_word_embeddings
    assert config.rope_scaling_type is None
    assert config.n_rep == 2


def test_missing_output_weight_means_tied_embeddings(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tied.gguf"
    weights = write_tiny_llama(path, tied=True)
    engine = Llama3Engine.from_gguf(path)
    assert engine.config.tie_word_embeddings
    assert engine.model.output.weight is engine.model.tok_embeddings.weight
    assert torch.equal(engine.model.output.weight, torch.from_numpy(weights["token_embd.weight"]))


def test_rope_freqs_tensor_turns_on_llama3_scaling(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "rope.gguf"
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
    write_tiny_llama(path, rope_freqs=factors)
    config = load_config(path)
    assert config.rope_scaling_type == "llama3"
    assert config.rope_freq_factors == pytest.approx(tuple(factors))
    assert config.rope_scaling_factor == pytest.approx(8.0)


def test_weights_are_unpermuted_back_to_the_written_layout(tiny_gguf: pathlib.Path) -> None:
    written = write_tiny_llama(tiny_gguf.parent / "again.gguf")
    reader = open_gguf(tiny_gguf)
    weights = load_weights(reader, read_config(reader, tiny_gguf), tiny_gguf)
    for gguf_name, param in [
        ("blk.1.attn_q.weight", "layers.1.attention.wq.weight"),
        ("blk.1.attn_k.weight", "layers.1.attention.wk.weight"),
        ("blk.0.ffn_down.weight", "layers.0.feed_forward.w2.weight"),
    ]:
        assert torch.equal(weights[param], torch.from_numpy(written[gguf_name]))


def test_permute_interleaves_each_heads_halves_as_llama_cpp_does() -> None:
    # Head rows (x0, x1, x2, y0, y1, y2): rotate-half pairs (x_i, y_i) -> adjacent rows.
    assert permute_qk(np.arange(12), 2).tolist() == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]


def test_unpermute_inverts_permute() -> None:
    weight = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)  # 3 heads of head_dim 8
    restored = unpermute_qk(torch.from_numpy(permute_qk(weight, 3)), 3)
    assert torch.equal(restored, torch.from_numpy(weight))
    as_tensor = permute_qk(torch.from_numpy(weight), 3)  # torch tensors permute alike
    assert torch.equal(as_tensor, torch.from_numpy(permute_qk(weight, 3)))


def test_overrides_replace_config_fields(tiny_gguf: pathlib.Path) -> None:
    engine = Llama3Engine.from_gguf(
        tiny_gguf, overrides={"rope_theta": 500.0, "rms_norm_eps": 1e-3}
    )
    assert engine.config.rope_theta == 500.0
    assert engine.model.norm.eps == 1e-3
    with pytest.raises(TypeError, match="rope_thetta"):
        Llama3Engine.from_gguf(tiny_gguf, overrides={"rope_thetta": 1.0})


def test_truncated_file_is_one_line_error_naming_it(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    data = tiny_gguf.read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 40):
        truncated = tmp_path / f"truncated_{keep}.gguf"
        truncated.write_bytes(data[:keep])
        with pytest.raises(CheckpointError) as error:
            Llama3Engine.from_gguf(truncated)
        message = str(error.value)
        assert str(truncated) in message and "\n" not in message


def test_corrupted_header_is_one_line_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"NOTAGGUF" * 64)
    with pytest.raises(CheckpointError, match=r"garbage\.gguf: not a readable GGUF"):
        load_config(path)


def test_non_llama_architecture_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    gguf_files.finish(writer)
    with pytest.raises(CheckpointError, match=r"gpt2\.gguf: architecture 'gpt2' is not supported"):
        Llama3Engine.from_gguf(path)


def test_unsupported_tensor_type_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "q5k.gguf"
    write_tiny_llama(
        path,
        dim=256,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=256,
        weight_type=gguf.GGMLQuantizationType.Q4_0,
    )
    # Relabel one tensor's type id in the tensor index: Q4_0 (2) -> Q5_0 (6), same block size.
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    # tensor info: name, n_dims, dims, type (uint32), offset (uint64)
    type_offset = tensor.field.offset + sum(int(p.nbytes) for p in tensor.field.parts[:-2])
    del reader
    data = bytearray(path.read_bytes())
    data[type_offset : type_offset + 4] = int(gguf.GGMLQuantizationType.Q5_0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight has unsupported type Q5_0"):
        Llama3Engine.from_gguf(path)


def test_nan_in_weights_is_reported(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nan.gguf"
    write_tiny_llama(path)
    offset = open_gguf(path).tensors["blk.0.ffn_norm.weight"].offset  # absolute position
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = np.array([np.nan], np.float32).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_norm\.weight holds NaN"):
        Llama3Engine.from_gguf(path)


@pytest.mark.parametrize("mode", ["quantized", "ggml"])
def test_nan_scale_in_packed_weights_is_reported(tmp_path: pathlib.Path, mode: str) -> None:
    """The quantized and ggml modes keep Q4_0 blocks packed (never dequantized at load), so
    they check the blocks' float16 scales instead: a NaN in one block's scale is refused with
    the tensor's name."""
    path = tmp_path / "nan_scale.gguf"
    write_tiny_llama(path, weight_type=gguf.GGMLQuantizationType.Q4_0)
    offset = open_gguf(path).tensors["blk.0.ffn_up.weight"].offset  # absolute position
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_0][1]  # float16 scale first
    data = bytearray(path.read_bytes())
    at = offset + 3 * block_bytes  # the fourth block's scale
    data[at : at + 2] = np.array([np.nan], np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        Llama3Engine.from_gguf(path, mode=mode)
    assert str(error.value) == (
        f"{path}: tensor blk.0.ffn_up.weight holds NaN or infinite values (corrupted?)"
    )


def test_missing_file_is_checkpoint_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        load_config(tmp_path / "absent.gguf")


def _write_llama_metadata(path: pathlib.Path, **fields: object) -> None:
    """A llama GGUF holding `fields` (None: key left out) and one block's tensors, zeros:
    enough for read_config, which never reads the weights' values."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(f"llama.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"llama.{key}", value)
        else:
            writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((40, 8), np.float32))
    for name in ["output_norm.weight", *(f"blk.0.{n}.weight" for n in "abcdefghi")]:
        writer.add_tensor(name, np.zeros(8, np.float32))
    gguf_files.finish(writer)


REQUIRED_METADATA = {
    "embedding_length": 64,
    "attention.head_count": 8,
    "block_count": 1,
    "feed_forward_length": 128,
    "attention.layer_norm_rms_epsilon": 1e-5,
}


def test_config_defaults_apply_only_where_the_file_is_silent(tmp_path: pathlib.Path) -> None:
    """Keys a file may leave out take llama.cpp's defaults (head_count_kv = head_count,
    head_dim = dim / heads, freq_base 1e4, context 2048, vocabulary = the embedding's rows, no
    scaling); keys it holds are read, never replaced by a default. The tiny checkpoints write
    every key, so no other test reaches either side. Planted: head_count_kv defaulting to 1,
    head_dim to dim // n_kv_heads, freq_base to 5e5, the vocabulary to the embedding's width."""
    silent = tmp_path / "silent.gguf"
    _write_llama_metadata(silent, **REQUIRED_METADATA)
    config = load_config(silent)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (8, 8, 8)
    assert (config.vocab_size, config.context_length, config.rope_theta) == (40, 2048, 10000.0)
    assert (config.rope_scaling_type, config.rope_scaling_factor) == (None, 1.0)
    assert (config.rope_original_context_length, config.rope_freq_factors) == (8192, None)

    grouped = tmp_path / "grouped.gguf"  # head_dim from dim / query heads, not key/value heads
    _write_llama_metadata(grouped, **REQUIRED_METADATA, **{"attention.head_count_kv": 2})
    config = load_config(grouped)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (8, 2, 8)

    explicit = tmp_path / "explicit.gguf"
    _write_llama_metadata(
        explicit,
        **REQUIRED_METADATA,
        **{
            "attention.head_count_kv": 2,
            "rope.dimension_count": 4,
            "rope.freq_base": 500000.0,
            "context_length": 4096,
            "vocab_size": 32,
        },
    )
    config = load_config(explicit)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (8, 2, 4)
    assert (config.vocab_size, config.context_length, config.rope_theta) == (32, 4096, 500000.0)


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({"type": "linear", "factor": 4.0}, ("linear", 4.0, 8192)),
        ({"type": "none", "factor": 4.0}, (None, 4.0, 8192)),
        (
            {"type": "llama3", "factor": 8.0, "original_context_length": 4096},
            ("llama3", 8.0, 4096),
        ),
    ],
)
def test_rope_scaling_fields_are_read_from_the_metadata(
    tmp_path: pathlib.Path, scaling: dict, expected: tuple
) -> None:
    """llama.rope.scaling.type, .factor and .original_context_length reach the config as
    written ("none" means no scaling), where a file without the rope_freqs tensor has them.
    Planted: original_context_length read from llama.context_length; "none" kept as a type."""
    path = tmp_path / "scaling.gguf"
    metadata = {f"rope.scaling.{key}": value for key, value in scaling.items()}
    _write_llama_metadata(path, **REQUIRED_METADATA, context_length=131072, **metadata)
    config = load_config(path)
    assert (
        config.rope_scaling_type,
        config.rope_scaling_factor,
        config.rope_original_context_length,
    ) == expected


def test_dequantized_cache_keys_on_dtype_and_owns_its_copies(tmp_path: pathlib.Path) -> None:
    """load_weights' DequantizedCache hands a later load only what that load would compute:
    a bfloat16 load after a float32 one of the same file gets bfloat16 weights (the key holds
    the dtype), and writing into one load's weight in place changes no later load's (the
    cache keeps a copy, not the tensor it returned). Planted: the key without dtype; keep()
    storing the returned tensor itself."""
    path = tmp_path / "q8.gguf"
    write_tiny_llama(path, weight_type=gguf.GGMLQuantizationType.Q8_0)
    reader = open_gguf(path)
    config = read_config(reader, path)
    cache = DequantizedCache()
    name = "layers.0.feed_forward.w1.weight"
    first = load_weights(reader, config, path, dequantized=cache)
    assert cache.tensors, "nothing dequantized was kept"
    expected = first[name].clone()
    with torch.no_grad():
        first[name].add_(1.0)  # as the mutation proofs edit an engine's weights
    second = load_weights(reader, config, path, dequantized=cache)
    assert torch.equal(second[name], expected)
    as_bf16 = load_weights(reader, config, path, dtype=torch.bfloat16, dequantized=cache)
    assert as_bf16[name].dtype == torch.bfloat16
    assert torch.equal(as_bf16[name], expected.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        *(
            ({key: 0}, rf"metadata llama\.{key} = 0 is not a positive integer")
            for key in [
                "embedding_length",
                "attention.head_count",
                "attention.head_count_kv",
                "block_count",
                "feed_forward_length",
                "rope.dimension_count",
            ]
        ),
        ({"attention.head_count_kv": 3}, "head_count 8 is not a multiple of head_count_kv 3"),
        ({"block_count": 2}, "block_count 2 needs 9 tensors per layer; the file holds 11"),
    ],
)
def test_metadata_sizes_the_model_cannot_use_are_refused(
    tmp_path: pathlib.Path, changes: dict, message: str
) -> None:
    """A size of 0 (a division by zero later), query heads that do not share key/value heads
    evenly, and more blocks than the file has tensors for are refused by read_config, in one
    line naming the file and the value. Planted: `value < 0` for `value < 1` in _positive;
    the head_count % head_count_kv check dropped; the block_count bound dropped."""
    path = tmp_path / "sizes.gguf"
    _write_llama_metadata(path, **(REQUIRED_METADATA | changes))
    with pytest.raises(CheckpointError, match=message) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)
