"""The tiny-checkpoint writers' promises that the committed files do not exercise: a draft of a
grouped-query, untied, block-typed target (the committed draft's target is float32, tied, one
head); write_tiny_llama's output matrix of its own and unit rows; the random stream past one
chunk; the Llama 3.1 rope factors."""

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pipelines.llama3 import Llama3Engine
from pipelines.llama3.gguf_file import GGUFFile
from tools.gen_tiny_model import counter_rng, write_draft
from tools.gen_tiny_model.tiny_llama import (
    TinyLlamaConfig,
    rope_freq_factors,
    unit_rows,
    write_tiny_llama,
)

PROMPT = [5, 70, 101, 258, 33, 9]


def test_a_draft_of_an_untied_grouped_query_bfloat16_target_is_its_bigram(tmp_path):
    """write_draft (README.md:72) on a target with 4 heads over 2 KV heads, an output.weight of
    its own and BF16 matrices: the block's attention tensors have the target's shapes (what
    llama.cpp's --model-draft loads), the embedding and the head are the target's bytes, and
    the draft's logits are the target's 0-layer self-draft's exactly. Planted: attn_k sized by
    the query heads (a 4-head target with 4 KV heads' worth of rows), output.weight not copied
    (the draft silently tied to its embedding), the BF16 bytes written without their type."""
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_llama(
        target, n_heads=4, n_kv_heads=2, tied=False, weight_type=GGMLQuantizationType.BF16
    )
    assert write_draft.main([f"--target={target}", f"--output={draft}"]) == 0
    ours, theirs = GGUFFile(draft), GGUFFile(target)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        name = f"blk.0.{name}.weight"
        assert ours.tensors[name].shape == theirs.tensors[name].shape, name
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert ours.tensors[name].tensor_type == theirs.tensors[name].tensor_type, name
        assert ours.tensor_data(name).tobytes() == theirs.tensor_data(name).tobytes(), name
    bigram = Llama3Engine.from_gguf(target, overrides={"n_layers": 0})
    with torch.inference_mode():
        got = Llama3Engine.from_gguf(draft).forward_logits(PROMPT)
        assert torch.equal(got, bigram.forward_logits(PROMPT))


def test_write_draft_refuses_a_target_of_another_architecture(tmp_path, capsys):
    """The draft is a Llama (its block's tensors are Llama's): a 'qwen2' target exits 2 naming
    it and writes nothing. Planted: the architecture check reduced to "has one" (the draft
    was written, qwen2 keys around Llama tensors, exit 0)."""
    target, draft = tmp_path / "qwen.gguf", tmp_path / "out" / "draft.gguf"
    write_tiny_llama(target, architecture="qwen2")
    assert write_draft.main([f"--target={target}", f"--output={draft}"]) == 2
    err = capsys.readouterr().err
    assert f"--target={target} is a 'qwen2' checkpoint; give a llama one" in err, err
    assert err.count("\n") == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["qwen.gguf"]


def test_write_tiny_llama_writes_an_output_matrix_of_its_own_with_unit_rows(tmp_path):
    """tiny_llama.py: untied, the output is "an output matrix of its own" (not the embedding's
    draw), and embedding and output rows have norm 1 (`unit_rows`: what keeps greedy decoding
    from settling on one token); the file holds the returned weights. Planted: output.weight
    drawn from token_embd's stream; the rows divided by the squared norm."""
    path = tmp_path / "untied.gguf"
    weights = write_tiny_llama(path, tied=False)
    embedding, output = weights["token_embd.weight"], weights["output.weight"]
    assert embedding.shape == output.shape == (263, 64)
    assert not np.allclose(embedding, output)
    for matrix in (embedding, output):
        np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, rtol=1e-5)
    reader = GGUFFile(path)
    stored = reader.tensor_data("output.weight").view(np.float32).reshape(output.shape)
    np.testing.assert_array_equal(stored, output)
    # more rows than one chunk of unit_rows (2048): every chunk is scaled
    rows = counter_rng.normal(0, "unit", (5000, 3))
    np.testing.assert_allclose(np.linalg.norm(unit_rows(rows), axis=1), 1.0, rtol=1e-6)


def test_the_random_stream_continues_across_chunks():
    """counter_rng.uniform: "element i depends only on (seed, stream, offset + i)", past the
    32768-value chunk too, and `normal` draws element i from the uniforms' element i. Planted:
    a chunk's counters started at `offset` alone (every chunk the same values), and normal's
    chunks drawn without their offset (the committed checkpoints' embeddings are 2M values:
    only the slow regenerate_testdata_test saw either)."""
    chunk = counter_rng._CHUNK
    whole = counter_rng.uniform(3, "s", chunk + 8)
    np.testing.assert_array_equal(whole[chunk:], counter_rng.uniform(3, "s", 8, offset=chunk))
    assert not np.array_equal(whole[:8], whole[chunk:])
    values = counter_rng.normal(3, "n", (chunk + 8,), std=2.0)
    total = sum(counter_rng.uniform(3, f"n#{t}", 8, offset=chunk) for t in range(4))
    expected = ((total - 2.0) * (np.sqrt(3.0) * 2.0)).astype(np.float32)
    np.testing.assert_allclose(values[chunk:], expected, rtol=1e-6)


def test_rope_freq_factors_keep_high_frequencies_and_divide_low_ones_by_the_factor():
    """Llama 3.1 rope scaling, as llama.cpp's converter computes the rope_freqs divisors:
    wavelengths under original_context / high_freq_factor keep 1, those over
    original_context / low_freq_factor get `rope_factor` (8), those between a smooth divisor
    between the two, rising with the wavelength. Planted: the low frequencies given
    1 / rope_factor (a multiplier where llama.cpp divides)."""
    config = TinyLlamaConfig(1, 1, 1, 128, 256)  # head dim 128, as Llama 3.1 8B
    factors = rope_freq_factors(config)
    assert factors.shape == (64,) and factors.dtype == np.float32
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert (np.diff(factors) >= 0).all() and ((factors >= 1.0) & (factors <= 8.0)).all()
    wavelen = 2 * np.pi * 500000.0 ** (np.arange(0, 128, 2) / 128)
    assert (factors[wavelen < 8192 / 4] == 1.0).all() and (factors[wavelen > 8192] == 8.0).all()
    between = (wavelen > 8192 / 4) & (wavelen < 8192)
    assert between.any() and ((factors[between] > 1.0) & (factors[between] < 8.0)).all()
