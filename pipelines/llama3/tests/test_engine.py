"""The model and generation API on tiny random checkpoints (milliseconds each)."""

import dataclasses
import itertools
import os
import pathlib
import time

import gguf
import numpy as np
import pytest
import torch

from pipelines.llama3 import Llama3Engine, load_config
from pipelines.llama3 import engine as engine_module
from pipelines.llama3.gguf_file import CheckpointError
from pipelines.llama3.gguf_loader import DequantizedCache
from pipelines.llama3.model import RMSNorm, causal_mask, is_causal, rope_inverse_frequencies
from pipelines.llama3.tests.recompute import greedy_decode_without_cache
from tools.gen_tiny_model.tiny_llama import write_tiny_llama

PROMPT = [261, 83, 257, 259, 260, 5, 17, 99]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The default tiny checkpoint, written once for the tests that only load it."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def engine(tiny_gguf: pathlib.Path) -> Llama3Engine:
    return Llama3Engine.from_gguf(tiny_gguf)


def test_forward_logits_shape_and_dtype(engine: Llama3Engine) -> None:
    logits = engine.forward_logits(PROMPT)
    assert logits.shape == (len(PROMPT), engine.config.vocab_size)
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"


def test_kv_cache_decode_equals_recomputation(engine: Llama3Engine) -> None:
    cached = engine.generate(PROMPT, 32, stop_on_eos=False)
    recomputed = greedy_decode_without_cache(engine, PROMPT, 32)
    assert cached.tokens == recomputed.tokens
    assert len(set(cached.tokens)) > 4  # the case discriminates: not one token repeated
    # Bitwise equal: recompute uses the cached run's row groups (recompute.py), so every kernel
    # sees the rows it saw in the cached run (docs/architecture.md, model.py's row).
    assert torch.equal(cached.logits, recomputed.logits)


def test_recomputation_reads_no_cache(engine: Llama3Engine) -> None:
    clean = greedy_decode_without_cache(engine, PROMPT, 4)  # sizes the caches the NaNs go in
    with torch.inference_mode():
        for layer in engine.model.layers:
            layer.attention.cache_k.fill_(float("nan"))
            layer.attention.cache_v.fill_(float("nan"))
        poisoned = greedy_decode_without_cache(engine, PROMPT, 4)
        for layer in engine.model.layers:
            layer.attention.cache_k.zero_()
            layer.attention.cache_v.zero_()
    assert torch.equal(poisoned.logits, clean.logits)


def test_recomputation_agrees_with_one_full_forward(engine: Llama3Engine) -> None:
    out = greedy_decode_without_cache(engine, PROMPT, 8)
    full = engine.forward_logits(PROMPT + out.tokens[:-1])
    torch.testing.assert_close(out.logits, full[len(PROMPT) - 1 :], atol=5e-5, rtol=0)


def test_generate_logits_are_the_ones_that_chose_each_token(engine: Llama3Engine) -> None:
    out = engine.generate(PROMPT, 6, stop_on_eos=False)
    assert out.logits.shape == (6, engine.config.vocab_size)
    assert out.tokens == out.logits.argmax(-1).tolist()
    full = engine.forward_logits(PROMPT + out.tokens[:-1])
    torch.testing.assert_close(out.logits, full[len(PROMPT) - 1 :], atol=5e-5, rtol=0)


def test_perturbed_cache_position_is_detected(engine: Llama3Engine) -> None:
    model = engine.model
    forward = model.forward

    def off_by_one(tokens: torch.Tensor, start_pos: int, **kwargs: object) -> torch.Tensor:
        return forward(tokens, start_pos + 1 if start_pos > 0 else 0, **kwargs)

    reference = engine.generate(PROMPT, 8, stop_on_eos=False)
    model.forward = off_by_one
    try:
        broken = engine.generate(PROMPT, 8, stop_on_eos=False)
        recomputed = greedy_decode_without_cache(engine, PROMPT, 8)
    finally:
        del model.forward
    assert (broken.logits[1:] - reference.logits[1:]).abs().max() > 1e-2
    assert (broken.logits[1:] - recomputed.logits[1:]).abs().max() > 1e-2  # no shared bug


def test_generation_stops_at_eos(engine: Llama3Engine) -> None:
    out = engine.generate(PROMPT, 16, stop_on_eos=False)
    eos = out.tokens[2]
    engine.tokenizer.eos_ids.add(eos)
    try:
        stopped = engine.generate(PROMPT, 16)
    finally:
        engine.tokenizer.eos_ids.discard(eos)
    assert stopped.tokens == out.tokens[: out.tokens.index(eos) + 1]


def test_stop_on_eos_false_runs_past_an_end_of_sequence_choice(engine: Llama3Engine) -> None:
    """docs/architecture.md:56 (`generate(input_ids, max_new_tokens, stop_on_eos, ...)`):
    with stop_on_eos=False a choice among the end-of-sequence ids does not end the run; all
    max_new_tokens steps are taken (the tools and many tests take such a run as the
    reference). Planted, the end-of-sequence ids handed to the decoder whatever stop_on_eos
    says: the run stopped at the third token, and test_engine.py and test_decoder.py passed
    (they ran stop_on_eos=False only before an id it chose was made an end-of-sequence id)."""
    out = engine.generate(PROMPT, 16, stop_on_eos=False)
    eos = out.tokens[2]
    engine.tokenizer.eos_ids.add(eos)
    try:
        ignoring = engine.generate(PROMPT, 16, stop_on_eos=False)
    finally:
        engine.tokenizer.eos_ids.discard(eos)
    assert len(ignoring.tokens) == 16
    assert ignoring.tokens == out.tokens
    assert torch.equal(ignoring.logits, out.logits)


def test_bfloat16_runs_and_mostly_agrees(tiny_gguf: pathlib.Path, engine: Llama3Engine) -> None:
    bf16 = Llama3Engine.from_gguf(tiny_gguf, dtype=torch.bfloat16)
    assert bf16.model.tok_embeddings.weight.dtype == torch.bfloat16
    reference = engine.forward_logits(PROMPT)
    logits = bf16.forward_logits(PROMPT)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_a_bfloat16_engine_keeps_its_lm_head_in_float32(tmp_path: pathlib.Path) -> None:
    """docs/architecture.md:56 (engine.py: "keeps the LM head in float32 for bfloat16
    engines") and :54 (model.py: the final norm and LM head run in the head's dtype): the
    layers compute in bfloat16, the head is a float32 matrix, so the logits are float32
    products, not bfloat16 values (on a grid of 0.25 at ~40, where exact ties hide real
    differences). Planted, the engine's float32 copy of the head dropped: the logits all
    bfloat16 values cast up, which test_bfloat16_runs_and_mostly_agrees (float32 dtype,
    top-1 agreement) passed."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=True)  # the committed checkpoints' tied head
    bf16 = Llama3Engine.from_gguf(path, dtype=torch.bfloat16)
    assert bf16.model.layers[0].attention.wq.weight.dtype == torch.bfloat16
    assert bf16.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert bf16.model.output.weight.dtype == torch.float32
    logits = bf16.forward_logits(PROMPT)
    off_grid = (logits != logits.to(torch.bfloat16).float()).float().mean()
    assert off_grid > 0.9, f"{off_grid:.2f} of the logits are not bfloat16 values"


def test_rmsnorm_normalizes_a_bfloat16_input_in_float32() -> None:
    """docs/architecture.md:54 (model.py: "RMSNorm (normalizes in float32)"): a bfloat16
    input's mean square and scaling are computed in float32 and rounded to bfloat16 once,
    then scaled by the weight. Planted, the normalization in the input's dtype (`h = x`, no
    `.float()`): the outputs differ, and test_engine.py and test_gguf_loader.py passed (the
    bfloat16 engine test checks top-1 agreement only)."""
    generator = torch.Generator().manual_seed(3)
    dim = 64
    norm = RMSNorm(dim, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dim, generator=generator))
    x = (torch.randn(6, dim, generator=generator) * 3).to(torch.bfloat16)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(
        torch.bfloat16
    )
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_llama3_rope_factors_match_meta_formula(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, dim=128, n_heads=2, n_kv_heads=1)
    config = dataclasses.replace(
        load_config(path),
        rope_theta=500000.0,
        rope_scaling_type="llama3",
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_context_length=8192,
    )
    from_parameters = rope_inverse_frequencies(config)
    # The same scaling as llama.cpp's converter stores it: a per-frequency divisor tensor.
    base = 1.0 / (config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim))
    factors = []
    for freq in base:
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    from_tensor = rope_inverse_frequencies(
        dataclasses.replace(config, rope_freq_factors=tuple(factors))
    )
    torch.testing.assert_close(from_parameters, from_tensor, rtol=1e-6, atol=0)
    assert (
        from_parameters[-1] < torch.tensor(base[-1], dtype=torch.float32) / 7.9
    )  # long waves slowed 8x


def test_out_of_vocabulary_ids_are_refused(engine: Llama3Engine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.forward_logits([engine.config.vocab_size])


def test_second_load_reuses_parsed_metadata_but_not_weights(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_tiny_llama(path)
    first = Llama3Engine.from_gguf(path)
    with torch.no_grad():
        first.model.layers[0].attention.wq.weight[0, 0] += 0.05
        first.model.tok_embeddings.weight[3, 1] += 0.05  # a zero-copy view of the file's pages
    first.tokenizer.eos_ids.add(5)
    second = Llama3Engine.from_gguf(path)
    assert second.tokenizer is not first.tokenizer
    assert second.tokenizer.backend is first.tokenizer.backend  # built once per process
    assert 5 not in second.tokenizer.eos_ids
    assert torch.equal(
        second.model.tok_embeddings.weight, torch.from_numpy(written["token_embd.weight"])
    )
    assert torch.equal(
        second.model.layers[0].attention.wq.weight,
        torch.from_numpy(written["blk.0.attn_q.weight"]),
    )
    assert not torch.equal(first.model.tok_embeddings.weight, second.model.tok_embeddings.weight)


def test_a_replaced_file_is_parsed_again(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, seed=0)
    before = Llama3Engine.from_gguf(path)
    write_tiny_llama(tmp_path / "other.gguf", seed=1, ffn_dim=64)
    (tmp_path / "other.gguf").replace(path)
    after = Llama3Engine.from_gguf(path)
    assert (before.config.ffn_dim, after.config.ffn_dim) == (128, 64)


def _rewrite_in_place(path: pathlib.Path, rewrite) -> None:
    """Runs `rewrite` on the file's own bytes (same inode, same size), then moves its mtime a
    second on: a rewrite within one timestamp tick of the last write (the kernel's clock is
    coarse, some milliseconds) leaves mtime and ctime as they were, so the new version would
    only be told apart by chance."""
    before = path.stat()
    rewrite()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)


def test_a_file_rewritten_in_place_is_parsed_again(tmp_path: pathlib.Path) -> None:
    """Same path, inode and size, new bytes: another version by mtime and ctime (_FileVersion),
    so the new values are read and the new tensors checked. Planted: the parse cache keyed
    without mtime and ctime kept rope_theta at 10000 and loaded the NaN weight; keyed without
    ctime, it kept the rope_theta of a version whose mtime the rewrite restored."""
    path, other = tmp_path / "tiny.gguf", tmp_path / "other.gguf"
    write_tiny_llama(path, seed=0, rope_theta=10000.0)
    write_tiny_llama(other, seed=0, rope_theta=20000.0)
    assert Llama3Engine.from_gguf(path).config.rope_theta == 10000.0

    def copy_other() -> None:
        with open(path, "r+b") as f:
            f.write(other.read_bytes())

    _rewrite_in_place(path, copy_other)
    assert Llama3Engine.from_gguf(path).config.rope_theta == 20000.0

    def poison_a_weight() -> None:
        # at the tensor's offset in the file (testing/gguf_reader.py, which the Bazel targets
        # install, views gguf-py's memmap as a plain array, with no flush of its own)
        tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        with open(path, "r+b") as f:
            f.seek(tensor.data_offset)
            f.write(np.float32(np.nan).tobytes())

    _rewrite_in_place(path, poison_a_weight)
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.attn_q\.weight holds NaN"):
        Llama3Engine.from_gguf(path)

    # A rewrite that keeps the file's mtime (rsync --inplace --times, a copy that restores
    # times): its ctime alone tells the versions apart. (mtime cannot move alone: setting it
    # moves ctime too.) Planted, the key without ctime: the cached parse's rope_theta 20000.
    write_tiny_llama(other, seed=0, rope_theta=30000.0)
    before = path.stat()
    for _ in range(100):  # until the coarse clock has moved past the last change's ctime
        with open(path, "r+b") as f:
            f.write(other.read_bytes())
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        if path.stat().st_ctime_ns != before.st_ctime_ns:
            break
        time.sleep(0.01)
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns,
    )  # fmt: skip
    assert after.st_ctime_ns != before.st_ctime_ns
    assert Llama3Engine.from_gguf(path).config.rope_theta == 30000.0


def test_one_file_under_two_names_is_parsed_once(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    (tmp_path / "link.gguf").symlink_to(path)
    engine_module.clear_checkpoint_cache()
    Llama3Engine.from_gguf(path)
    Llama3Engine.from_gguf(tmp_path / "link.gguf")
    info = engine_module._parse.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    engine_module.clear_checkpoint_cache()
    assert engine_module._parse.cache_info().currsize == 0


def _compiled_regions_in_generate(engine: Llama3Engine, steps: int):
    """How many compiled graphs a `generate` of `steps` tokens ran (torch.profiler's
    "Torch-Compiled Region" events: counted as they run, not as they compile), and its output."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = engine.generate(PROMPT, steps, stop_on_eos=False)
    regions = sum(e.name.startswith("Torch-Compiled Region") for e in profile.events())
    return regions, out


def test_compiled_mode_runs_compiled_graphs_and_follows_eager(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block of every forward (the prefill and each decode step) runs compiled, and the
    tokens and logits follow eager's. Planted: every block but the first run eagerly (its
    compiled call dropped) still compiled a graph, broke none and matched eager; only the
    count of compiled regions run tells."""
    import torch._dynamo.utils

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    engine = Llama3Engine.from_gguf(path)
    compiled = Llama3Engine.from_gguf(path, mode="compiled")
    torch._dynamo.utils.counters.clear()
    steps = 12  # the prefill and 11 decode steps: 12 forwards
    regions, out = _compiled_regions_in_generate(compiled, steps)
    layers = len(compiled.model.layers)
    assert layers == 2
    assert regions >= layers * steps, f"{regions} compiled regions in {steps} forwards"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # not silently eager
    # Each block's whole forward one graph (compiled.py): no break around its attention
    # (SDPA's is_causal given a symbolic bool broke it in two, prefill and decode alike).
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    expected = engine.generate(PROMPT, steps, stop_on_eos=False)
    assert out.tokens == expected.tokens
    assert (out.logits - expected.logits).abs().max() <= 1e-4

    for layer in compiled.model.layers[1:]:
        monkeypatch.setattr(layer, "_compiled_call_impl", None)
    planted, planted_out = _compiled_regions_in_generate(compiled, steps)
    assert planted_out.tokens == expected.tokens  # eager blocks compute the same tokens
    print(f"compiled regions: {regions} in {steps} forwards of {layers} blocks; planted {planted}")
    assert planted < layers * steps, f"{planted} compiled regions with one block compiled"


def test_a_second_load_copies_the_kept_dequantized_tensors(tmp_path: pathlib.Path) -> None:
    """A file's dequantized tensors are kept for its next load (DequantizedCache): the second
    engine's weights are the first's bit for bit, and each engine owns its copy (a weight
    edited in one, as the mutation proofs edit them, is not in the other, nor in a third)."""
    path = tmp_path / "tiny_q8.gguf"
    write_tiny_llama(path, weight_type=gguf.GGMLQuantizationType.Q8_0)
    first = Llama3Engine.from_gguf(path)
    kept = engine_module._parsed_checkpoint(path).dequantized.tensors
    assert kept, "nothing dequantized was kept"
    second = Llama3Engine.from_gguf(path)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    name = "layers.0.attention.wq.weight"
    with torch.no_grad():
        b[name].add_(1.0)  # the second engine's weight: the first copy of the kept one
    third = Llama3Engine.from_gguf(path)
    assert torch.equal(a[name], third.model.state_dict()[name])
    assert not torch.equal(a[name], b[name])


def test_the_dequantized_cache_holds_its_limit_and_no_float32_views(tmp_path: pathlib.Path) -> None:
    """DequantizedCache keeps at most `limit` bytes (an 8B checkpoint's weights are never
    doubled) and nothing of a float32 file on the CPU (its tensors are views of the map)."""
    q8 = tmp_path / "tiny_q8.gguf"
    write_tiny_llama(q8, weight_type=gguf.GGMLQuantizationType.Q8_0)
    Llama3Engine.from_gguf(q8)
    full = engine_module._parsed_checkpoint(q8).dequantized
    assert full.bytes == sum(t.numel() * t.element_size() for t in full.tensors.values()) > 0
    limit = full.bytes // 2
    small = DequantizedCache(limit=limit)
    for key, tensor in full.tensors.items():
        small.keep(key, tensor)
    assert 0 < small.bytes <= limit
    assert 0 < len(small.tensors) < len(full.tensors)
    f32 = tmp_path / "tiny_f32.gguf"
    write_tiny_llama(f32)
    Llama3Engine.from_gguf(f32)
    assert engine_module._parsed_checkpoint(f32).dequantized.tensors == {}


@pytest.mark.parametrize(("seqlen", "start_pos"), [(1, 0), (1, 9), (5, 0), (5, 20), (16, 3)])
def test_is_causal_names_the_plain_mask_and_no_other(seqlen: int, start_pos: int) -> None:
    """`is_causal` (what sends a served forward's rows to the kernels' plain causal attention
    instead of SDPA with the mask) holds for causal_mask's own mask and for no mask that hides
    one key it shows, shows one it hides, has another shape or is not boolean. Planted
    `mask[:, :start_pos].all()` dropped: a window over the cached keys passes as plain."""
    plain = causal_mask(seqlen, start_pos, torch.device("cpu"))
    assert is_causal(plain, seqlen, start_pos)
    assert not is_causal(plain.float(), seqlen, start_pos)
    assert not is_causal(plain[:, 1:], seqlen, start_pos)  # one key short
    for row, key in itertools.product(range(seqlen), range(start_pos + seqlen)):
        flipped = plain.clone()
        flipped[row, key] = not flipped[row, key]  # hides a key it showed, or shows a future one
        assert not is_causal(flipped, seqlen, start_pos), (row, key)


def test_compiled_mode_compiles_once_for_every_prompt_length(tiny_gguf: pathlib.Path) -> None:
    """The compiled blocks take the rows as a dynamic dimension (compiled.compile_blocks:
    dynamic=True): after the first prefill and the first decode steps have compiled, prompts
    of other lengths and decode steps at other positions compile nothing more. Planted: the
    blocks compiled with dynamic=False recompiled at every new prompt length and decode
    position (4 graphs more here, ~14 s), silently until the recompile limit."""
    import torch._dynamo.utils

    engine = Llama3Engine.from_gguf(tiny_gguf, mode="compiled")
    engine.generate(PROMPT, 3, stop_on_eos=False)  # the prefill and the decode graphs
    torch._dynamo.utils.counters.clear()
    engine.generate(PROMPT[:5], 6, stop_on_eos=False)
    engine.generate(PROMPT + PROMPT, 4, stop_on_eos=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert dict(torch._dynamo.utils.counters["frames"]) == {}


def test_a_compiled_load_makes_the_process_wide_settings(tiny_gguf: pathlib.Path) -> None:
    """Loading a compiled engine sets what compile_blocks' docstring promises for the whole
    process, whatever was set before: inductor rounds bfloat16 intermediates as eager does
    (emulate_precision_casts), and a block that keeps recompiling raises at a limit of at
    least 64 rather than run eagerly (fail_on_recompile_limit_hit); a higher limit is kept.
    Planted: fail_on_recompile_limit_hit left False (a recompiling block would silently run
    eager under the compiled mode's name); emulate_precision_casts False (bfloat16 logits
    move; the tiny-bfloat16 compiled golden also tells, in ~35 s)."""
    import torch._dynamo.config
    import torch._inductor.config

    # The config modules' own patch: it puts the values back (pytest's monkeypatch deletes
    # them, which hides a torch config entry).
    before = torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False)
    with before, torch._inductor.config.patch(emulate_precision_casts=False):
        Llama3Engine.from_gguf(tiny_gguf, mode="compiled")
        assert torch._inductor.config.emulate_precision_casts is True
        assert torch._dynamo.config.recompile_limit == 64
        assert torch._dynamo.config.fail_on_recompile_limit_hit is True
        with torch._dynamo.config.patch(recompile_limit=100):
            Llama3Engine.from_gguf(tiny_gguf, mode="compiled")
            assert torch._dynamo.config.recompile_limit == 100


def test_compile_blocks_refuses_a_model_of_another_class(tiny_gguf: pathlib.Path) -> None:
    """compile_blocks takes only the compiled mode's model (CompiledTransformer): another
    model's blocks have no compiled paged parts, so a ragged batch would run them eagerly
    under the compiled mode's name. It is refused by name, its blocks left uncompiled.
    Planted: the class check dropped compiled the eager model's blocks without a word."""
    from pipelines.llama3.compiled import compile_blocks

    model = Llama3Engine.from_gguf(tiny_gguf).model
    with pytest.raises(TypeError) as error:
        compile_blocks(model)
    assert str(error.value) == "compile_blocks takes a CompiledTransformer, not Transformer"
    assert [layer._compiled_call_impl for layer in model.layers] == [None] * len(model.layers)


def test_a_compiled_load_leaves_pathlib_as_it_was(tmp_path: pathlib.Path) -> None:
    """The compiled mode imports setuptools with a missing 'Lorem ipsum.txt' read as a sample
    text (compiled._import_setuptools, for Bazel's runfiles), and puts pathlib back after the
    import: a missing file of that name read later still raises. Planted: pathlib restored only
    when the import failed left the tolerant read_text in place for the whole process."""
    read_text = pathlib.Path.read_text
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    Llama3Engine.from_gguf(path, mode="compiled")
    assert pathlib.Path.read_text is read_text
    with pytest.raises(FileNotFoundError):
        (tmp_path / "Lorem ipsum.txt").read_text()


def test_prompt_logits_are_the_full_forwards_rows_at_the_positions_asked(
    engine: Llama3Engine,
) -> None:
    """generate's docstring and GenerationOutput: `prompt_positions` returns the prefill's
    logits at those positions, row j after input_ids[: prompt_positions[j] + 1], in the order
    asked, and the first step still reads the last prompt position. Planted (engine.py): the
    rows taken as prefill[1:] instead of prefill[:-1], and the last position put first in the
    head's outputs; both passed test_engine.py and test_decoder.py."""
    positions = [5, 1, 3]
    out = engine.generate(PROMPT, 3, stop_on_eos=False, prompt_positions=positions)
    full = engine.forward_logits(PROMPT)
    assert out.prompt_logits.shape == (3, engine.config.vocab_size)
    torch.testing.assert_close(out.prompt_logits, full[positions], atol=5e-5, rtol=0)
    torch.testing.assert_close(out.logits[0], full[-1], atol=5e-5, rtol=0)
    assert out.tokens == engine.generate(PROMPT, 3, stop_on_eos=False).tokens
    assert engine.generate(PROMPT, 3, stop_on_eos=False).prompt_logits is None


def test_generate_refuses_bad_inputs_with_their_messages(engine: Llama3Engine) -> None:
    """generate's input validation: an empty prompt ("input_ids is empty"), a prompt position
    outside 0..len-2 (the last position is the first step, not a prompt position), and a
    forced token outside the vocabulary are refused by name; forced id 0 and prompt position
    0 and len-2 are accepted. Planted (engine.py): the empty check dropped, the position
    bound `< len(input_ids)`, the forced-token bound `0 < t`; all passed test_engine.py and
    test_decoder.py."""
    vocab = engine.config.vocab_size
    with pytest.raises(ValueError, match="input_ids is empty"):
        engine.generate([], 2)
    with pytest.raises(ValueError, match=r"must lie in 0\.\.6 \(a 8-token prompt"):
        engine.generate(PROMPT, 2, prompt_positions=[len(PROMPT) - 1])
    with pytest.raises(ValueError, match="must lie in 0"):
        engine.generate(PROMPT, 2, prompt_positions=[-1])
    with pytest.raises(ValueError, match=rf"forced tokens \[{vocab}\] are outside"):
        engine.generate(PROMPT, 2, forced_tokens=[3, vocab])
    with pytest.raises(ValueError, match=r"forced tokens \[-1\] are outside"):
        engine.generate(PROMPT, 2, forced_tokens=[-1, 3])
    out = engine.generate(
        PROMPT, 2, forced_tokens=[0, vocab - 1], prompt_positions=[0, len(PROMPT) - 2]
    )
    assert len(out.tokens) == 2 and out.prompt_logits.shape == (2, vocab)


def test_text_leaves_out_only_a_final_end_of_sequence_of_a_stopped_sequence(
    engine: Llama3Engine,
) -> None:
    """Llama3Engine.text: a sequence `stopped` on an end-of-sequence id loses that last id
    from its text; a stopped sequence ending in another token (a stop string) and a sequence
    that ran to its length keep every token, an end-of-sequence id included. Planted
    (engine.py): the eos check dropped (a stop-string run lost its last token), and the
    `stopped` check dropped (a length run lost a final eos); both passed test_engine.py and
    test_decoder.py (test_server.py compares against the engine's own text)."""
    (eos,) = engine.eos_ids
    body = [261, 83, 257]
    decode = engine.tokenizer.decode
    assert decode(body) != decode(body[:-1])
    assert engine.text([*body, eos], stopped=True) == decode(body)
    assert engine.text(body, stopped=True) == decode(body)
    assert engine.text([*body, eos], stopped=False) == decode([*body, eos]) != decode(body)
    assert engine.text([], stopped=True) == ""


def test_weight_bytes_per_token_counts_each_matrix_in_its_own_dtype(
    tiny_gguf: pathlib.Path,
) -> None:
    """weight_bytes_per_token: the bytes one decode step reads, every Linear matrix at its
    own element size: a bfloat16 engine's layers 2 bytes an element, its float32 LM head 4.
    Planted (engine.py): 4 bytes an element whatever the dtype; test_engine.py, test_decoder.py
    and test_packed.py passed (they check float32 and packed engines only)."""
    f32 = Llama3Engine.from_gguf(tiny_gguf)
    bf16 = Llama3Engine.from_gguf(tiny_gguf, dtype=torch.bfloat16)
    linears = [m for m in f32.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * len(f32.model.layers) + 1  # q k v o, gate up down; the head
    head = f32.model.output.weight.numel()
    everything = sum(m.weight.numel() for m in linears)
    assert f32.weight_bytes_per_token == 4 * everything
    assert bf16.weight_bytes_per_token == 2 * (everything - head) + 4 * head


def test_decode_tokens_per_second_counts_the_steps_after_the_first() -> None:
    """GenerationOutput.decode_tokens_per_second: decode_seconds covers the forwards after
    prefill, one per token but the first, so 5 tokens over 2 s are 2 tokens a second; no
    decode time is nan. Planted (engine.py): len(tokens) counted (2.5); passed test_engine.py
    and test_decoder.py."""
    logits = torch.zeros(5, 3)
    out = engine_module.GenerationOutput([1, 2, 3, 4, 5], logits, 0.5, 2.0)
    assert out.decode_tokens_per_second == 2.0
    assert engine_module.GenerationOutput([], logits[:0], 0.5, 1.0).decode_tokens_per_second == 0
    assert np.isnan(
        engine_module.GenerationOutput([7], logits[:1], 0.5, 0.0).decode_tokens_per_second
    )


def test_device_problem_names_each_unusable_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.device_problem: the engine runs on cpu and cuda[:N] where torch sees device N;
    another device type torch knows (meta, mps) is not a device here, and with one CUDA
    device cuda:1 is refused while cuda and cuda:0 pass. Planted (engine.py): the type check
    dropped (meta passed), the index bound `>` (cuda:1 of one device passed); both passed
    test_engine.py and test_decoder.py (test_profiling.py checks tpu, which torch refuses)."""
    assert engine_module.device_problem("cpu") is None
    for device in ("meta", "mps"):
        problem = engine_module.device_problem(device)
        assert (
            problem == f"--device={device} is not a device here: the engine runs on cpu or cuda[:N]"
        )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert engine_module.device_problem("cuda") is None
    assert engine_module.device_problem("cuda:0") is None
    assert engine_module.device_problem("cuda:1") == (
        "--device=cuda:1: torch sees 1 CUDA device(s); pass a smaller index"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "this torch has no CUDA device" in engine_module.device_problem("cuda:0")


def test_overrides_replace_config_fields_and_an_unknown_one_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    """from_gguf's `overrides` replace LlamaConfig fields after reading (the mutation tests'
    wrong settings), in the engine's config and its model's numerics; an unknown name is a
    TypeError; the file's parsed config is untouched for the next load. Planted (engine.py):
    the overrides ignored; passed test_engine.py and test_decoder.py."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, rope_theta=10000.0)
    plain = Llama3Engine.from_gguf(path)
    moved = Llama3Engine.from_gguf(path, overrides={"rope_theta": 500.0})
    assert moved.config.rope_theta == 500.0
    assert moved.model.config.rope_theta == 500.0
    assert (moved.forward_logits(PROMPT) - plain.forward_logits(PROMPT)).abs().max() > 1e-3
    assert Llama3Engine.from_gguf(path).config.rope_theta == 10000.0
    with pytest.raises(TypeError):
        Llama3Engine.from_gguf(path, overrides={"no_such_field": 1})


def test_a_file_without_a_vocabulary_stops_on_its_config_eos_or_never(
    tmp_path: pathlib.Path,
) -> None:
    """Llama3Engine.eos_ids without a tokenizer: the checkpoint's eos_token_id, and with
    none an empty set (nothing stops early: every step runs). Planted (engine.py): the
    `- {None}` dropped, so eos_ids was {None}; passed test_engine.py and test_decoder.py."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, with_tokenizer=False)
    bare = Llama3Engine.from_gguf(path)
    assert bare.tokenizer is None and bare.config.eos_token_id is None
    assert bare.eos_ids == frozenset()
    out = bare.generate(PROMPT, 8)
    assert len(out.tokens) == 8
    eos = out.tokens[3]
    stopping = Llama3Engine.from_gguf(path, overrides={"eos_token_id": eos})
    assert stopping.eos_ids == frozenset({eos})
    assert stopping.generate(PROMPT, 8).tokens == out.tokens[: out.tokens.index(eos) + 1]
