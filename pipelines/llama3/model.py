"""The Llama 3 transformer, in the order data flows through it (after Meta's llama3 model.py).

Differences from Meta's file: the Q/K weights are in the "rotate half" layout (the loader
undoes llama.cpp's permutation), so RoPE rotates the two halves of each head instead of
complex pairs; the KV cache is allocated on demand by `setup_caches`; the model is built
on the meta device and given its weights by `load_state_dict(assign=True)`; and Attention's
projection and cache write are methods of their own (`project`, `update_cache`), which the
quantized mode's subclass (packed.PackedAttention) and the tests' planted bugs replace.

Two entries run the same layers: `Transformer.forward` (a batch of equal-length sequences over
the contiguous cache that `setup_caches` allocates: `Llama3Engine.generate`) and
`Transformer.forward_paged` (a ragged batch over a paged cache that `PagedBatch` describes:
the serving engine, serving.py, which keeps the blocks and the schedule and computes nothing
of the transformer itself). Every layer's arithmetic is the same code in both, and so are the
layer loop (`run_layers`), the mask (`attention_mask`), the rope tables (`setup_rope`) and the
head. Each has its own cache write (`update_cache`; `write_paged`): an override of one of
those reaches one entry only.
"""

import dataclasses
import math
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.llama3.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # One fused kernel; bit-identical to the steps below in float32 (every golden of
            # the eager mode regenerates byte for byte with it).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in float32 whatever the compute dtype (bfloat16 has too few mantissa bits).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama 3.1 scaling when configured."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_freq_factors is not None:
        # llama.cpp's semantics of the rope_freqs tensor: theta_i / factor_i
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if config.rope_scaling_type == "llama3":
        return _llama3_scaled(inv_freq, config)
    if config.rope_scaling_type == "linear":
        return inv_freq / config.rope_scaling_factor
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """Meta's apply_scaling: long wavelengths slowed by `factor`, short kept, smooth between."""
    factor = config.rope_scaling_factor
    low_freq_wavelen = config.rope_original_context_length / config.rope_low_freq_factor
    high_freq_wavelen = config.rope_original_context_length / config.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (config.rope_original_context_length / wavelen - config.rope_low_freq_factor) / (
        config.rope_high_freq_factor - config.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def precompute_rope(
    config: LlamaConfig, max_seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim] float32."""
    inv_freq = rope_inverse_frequencies(config).to(device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [seq, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim]: both halves share a frequency
    if angles.device.type != "cpu":
        return angles.cos(), angles.sin()
    # On one thread: elementwise, so the same values as any thread count computes correctly,
    # but a fresh process's first multi-threaded cos was measured wrong in one thread's half
    # (by up to 1.5e-4, in 6 of 30 processes, torch 2.13, pure torch), which moved the
    # quantized mode's decode logits by up to 0.019. The tables are small.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return angles.cos(), angles.sin()
    finally:
        torch.set_num_threads(threads)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [bsz, n_heads, seq, head_dim]; cos, sin [seq, head_dim] float32.

    The rotation runs in x's dtype with the tables rounded to it, where transformers rounds:
    in bfloat16 the engine and the torch reference then agree bit for bit on the CPU.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_mask(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor:
    """[seq, start_pos + seq] bool: query i (at start_pos + i) sees keys 0..start_pos + i."""
    return torch.ones(seqlen, start_pos + seqlen, dtype=torch.bool, device=device).tril(
        diagonal=start_pos
    )


def is_causal(mask: torch.Tensor, seqlen: int, start_pos: int) -> bool:
    """Whether `mask` is causal_mask's for these positions (a windowed model's is not): every
    earlier position seen, the piece's own keys lower-triangular. Checked without building a
    second [seq, start_pos + seq] mask (a 512-row chunk after 7,600 positions: 13 -> 3 ms)."""
    if mask.dtype != torch.bool or mask.shape != (seqlen, start_pos + seqlen):
        return False
    own = torch.ones(seqlen, seqlen, dtype=torch.bool, device=mask.device).tril()
    return bool(mask[:, :start_pos].all()) and bool(torch.equal(mask[:, start_pos:], own))


def attention_mask(seqlen: int, start_pos: int, device: torch.device) -> torch.Tensor | None:
    """The mask of `seqlen` queries from `start_pos`, or None where none is needed: one query
    sees every cached key, and a prefill from position 0 is causal, which SDPA computes
    without materializing a [seq, seq] mask (bit-identical to the explicit one; a 8k-token
    prompt would otherwise allocate its square). Only a chunk after cached positions needs
    the explicit `causal_mask`."""
    if seqlen == 1 or start_pos == 0:
        return None
    return causal_mask(seqlen, start_pos, device)


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """SDPA of q [bsz, heads, seq, hd] over keys and values [bsz, kv_heads, ctx, hd] in
    float32, rounded to q's dtype once at the end (each KV head serves heads / kv_heads
    query heads)."""
    return F.scaled_dot_product_attention(
        q.float(),
        keys.float(),
        values.float(),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=True,
    ).to(q.dtype)


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """A ragged batch over a paged KV cache: the pieces' rows concatenated, never padded.

    Piece i is `counts[i]` consecutive rows (a prefill chunk, or one decode token) of one
    sequence; it attends to the keys in slots `contexts[i]`, whose last `counts[i]` are its own
    rows'. Row r's keys and values go to slot `write[r]` where `fresh[r]` (a position kept
    from before, as a preempted sequence's, is not written again).
    """

    k: torch.Tensor  # [layers, slots, n_kv_heads, head_dim]: every layer's keys
    v: torch.Tensor
    counts: list[int]
    contexts: list[torch.Tensor]  # per piece: long slot indices
    write: torch.Tensor  # [rows] long
    fresh: torch.Tensor  # [rows] bool
    # per piece: Transformer.attention_mask of its rows after its earlier positions, set by
    # Transformer.with_masks (None until then; a piece's None: no mask needed)
    masks: tuple[torch.Tensor | None, ...] | None = None
    # whether every piece's mask is None or causal_mask of its positions (what the kernels'
    # attention computes), found once a forward by with_masks (None: not yet known)
    plain: bool | None = None

    def unmasked_decode_rows(self) -> torch.Tensor:
        """[rows] bool: the rows of one-row pieces (a decode step) that need no mask: the ones
        the kernels' decode attention computes (a windowed model's are not)."""
        masks = self.masks or (None,) * len(self.counts)
        rows = [c == 1 and m is None for c, m in zip(self.counts, masks, strict=True)]
        return torch.tensor([r for r, c in zip(rows, self.counts, strict=True) for _ in range(c)])


def write_paged(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    xk: torch.Tensor,
    xv: torch.Tensor,
    batch: PagedBatch,
    rows: torch.Tensor,
) -> None:
    """Keys and values [1, n_kv_heads, rows, head_dim] of the `rows` (bool) into their slots of
    one layer's caches [slots, n_kv_heads, head_dim]."""
    new_k, new_v = xk[0].transpose(0, 1), xv[0].transpose(0, 1)  # [rows, kv_heads, hd]
    cache_k[batch.write[rows]] = new_k[rows].to(cache_k.dtype)
    cache_v[batch.write[rows]] = new_v[rows].to(cache_v.dtype)


def paged_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    context: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One piece's attention, q [1, heads, count, hd] over the keys of slots `context` of one
    layer's caches (the piece's own the last `count` of them): grouped_attention under the
    piece's `mask` (PagedBatch.masks; None: one query, or causal from position 0)."""
    count = q.shape[2]
    keys = slots_of(cache_k, context).transpose(0, 1)[None]  # [1, kv_heads, ctx, hd]
    values = slots_of(cache_v, context).transpose(0, 1)[None]
    return grouped_attention(q, keys, values, mask, mask is None and count > 1, scale)


def slots_of(cache: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The rows `context` (long slot indices) of one layer's cache [slots, n_kv_heads,
    head_dim], [len(context), n_kv_heads, head_dim] contiguous: a view where the slots are
    consecutive (a sequence whose blocks the pool handed out in order: most of them), else
    gathered by index_select (a third of advanced indexing's time). The same values and
    strides either way, so attention over them computes the same bits (test_serving)."""
    first = int(context[0]) if len(context) else 0
    if torch.equal(context, torch.arange(first, first + len(context), device=context.device)):
        return cache[first : first + len(context)]
    return torch.index_select(cache, 0, context)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)  # softmax(q.k * scale), as Meta's
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.cache_k: torch.Tensor | None = None  # [max_batch, n_kv_heads, max_seq_len, head_dim]
        self.cache_v: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.project(x, cos, sin)
        keys, values = self.update_cache(xk, xv, start_pos)

        # Grouped-query attention: each KV head serves n_heads / n_kv_heads query heads.
        # No mask: one query sees every key, several from position 0 are causal.
        # In float32 whatever the compute dtype, rounded once at the end: SDPA's bfloat16
        # kernels round the softmax probabilities to bfloat16, and which way each rounds
        # depends on the vectorized exp of the CPU's kernel level (portable kernels moved
        # bfloat16 log-probabilities by 0.151); the transformers reference does the same.
        # `causal` a Python bool, not `seqlen > 1` itself: under torch.compile seqlen is
        # symbolic and SDPA's is_causal takes no symbolic bool (the block's graph would break
        # in two around the attention); the branch makes dynamo guard on it instead.
        causal = False
        if mask is None and seqlen > 1:
            causal = True
        output = grouped_attention(xq, keys, values, mask, causal, self.scale)
        output = output.transpose(1, 2).reshape(bsz, seqlen, -1)  # [bsz, seq, heads * head_dim]
        return self.wo(output)

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        """`forward` for a ragged batch x [1, rows, dim] over one layer's paged caches
        [slots, n_kv_heads, head_dim]: the same projection, then each piece's attention."""
        xq, xk, xv = self.project(x, cos, sin)
        return self.wo(self.attend_paged(xq, xk, xv, cache_k, cache_v, batch))

    def attend_paged(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        xv: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        """The rows' keys and values into their slots, then each piece's attention over its
        context: rows [1, rows, heads * head_dim], before the output projection."""
        write_paged(cache_k, cache_v, xk, xv, batch, batch.fresh)
        outputs, offset = [], 0
        for count, context, mask in zip(batch.counts, batch.contexts, batch.masks, strict=True):
            q = xq[:, :, offset : offset + count]
            outputs.append(paged_attention(q, cache_k, cache_v, context, self.scale, mask))
            offset += count
        return self.merge_pieces(outputs, xq.shape[2])

    @staticmethod
    def merge_pieces(outputs: list[torch.Tensor], rows: int) -> torch.Tensor:
        """The pieces' outputs [1, heads, count, hd] as rows [1, rows, heads * hd]."""
        return torch.cat(outputs, dim=2).transpose(1, 2).reshape(1, rows, -1)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x [bsz, seq, dim], each [bsz, heads, seq, head_dim],
        the queries and keys rotated."""
        bsz, seqlen, _ = x.shape
        # [bsz, seq, heads * head_dim] -> [bsz, heads, seq, head_dim]
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary_emb(xq, cos, sin), apply_rotary_emb(xk, cos, sin), xv

    def update_cache(
        self, xk: torch.Tensor, xv: torch.Tensor, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values [bsz, n_kv_heads, seq, head_dim] at start_pos..; return every
        cached key and value up to the last of them, [bsz, n_kv_heads, end_pos, head_dim]."""
        bsz, _, seqlen, _ = xk.shape
        end_pos = start_pos + seqlen
        self.cache_k[:bsz, :, start_pos:end_pos] = xk
        self.cache_v[:bsz, :, start_pos:end_pos] = xv
        return self.cache_k[:bsz, :, :end_pos], self.cache_v[:bsz, :, :end_pos]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)
        self.attention_norm = RMSNorm(config.dim, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), start_pos, cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        """`forward` for a ragged batch [1, rows, dim] over this layer's paged caches."""
        attended = self.attention.forward_paged(
            self.attention_norm(x), cos, sin, cache_k, cache_v, batch
        )
        h = x + attended
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    # A mode whose layers compute otherwise subclasses both (compiled.CompiledTransformer).
    block_class: type[TransformerBlock] = TransformerBlock

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # _weight skips the random init: the loader supplies every weight anyway.
        self.tok_embeddings = nn.Embedding(
            config.vocab_size, config.dim, _weight=torch.empty(config.vocab_size, config.dim)
        )
        self.layers = nn.ModuleList(self.block_class(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.rms_norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.max_seq_len = 0
        self.max_batch_size = 0
        self.rope_len = 0  # positions the rope tables cover (setup_rope)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def rope_tables(self, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [positions, head_dim] of precompute_rope. A mode whose angles are
        another program's overrides it (ggml_mode.GgmlTransformer: llama.cpp's)."""
        return precompute_rope(self.config, positions, device)

    def run_layers(
        self, h, start_pos: int, cos, sin, mask, batch: PagedBatch | None = None
    ) -> torch.Tensor:
        """Every layer over h, in order: `forward`'s batch over the contiguous cache (from
        `start_pos`, under `mask`), or with `batch` `forward_paged`'s ragged one, h [1, rows,
        dim] over the batch's paged caches (each piece's context and mask in the batch). The
        one layer loop of both entries: a mode with a fused path through the layers overrides
        it (packed.PackedTransformer: one kernel call per decode step, solo or served), and an
        override reaches generate and the served requests alike (test_serving)."""
        for index, layer in enumerate(self.layers):
            if batch is None:
                h = layer(h, start_pos, cos, sin, mask)
            else:
                h = layer.forward_paged(h, cos, sin, batch.k[index], batch.v[index], batch)
        return h

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (files without output.weight)."""
        self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_seq_len: int, max_batch_size: int = 1) -> None:
        """Allocate KV caches and RoPE tables for `max_seq_len` positions, once, up front.

        Decoding then writes into preallocated memory instead of growing tensors every step.
        Does nothing when the current caches are big enough.
        """
        if max_seq_len <= self.max_seq_len and max_batch_size <= self.max_batch_size:
            return
        max_seq_len = max(max_seq_len, self.max_seq_len)
        max_batch_size = max(max_batch_size, self.max_batch_size)
        weight = self.tok_embeddings.weight
        self.setup_rope(max_seq_len)
        shape = (max_batch_size, self.config.n_kv_heads, max_seq_len, self.config.head_dim)
        for layer in self.layers:
            layer.attention.cache_k = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
            layer.attention.cache_v = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size

    def setup_rope(self, positions: int) -> None:
        """RoPE tables for `positions` positions at least (no KV cache: a paged forward's
        caches are its caller's). Each entry depends on its position only, so the tables of
        a longer run hold the same values for the positions they share."""
        if positions > self.rope_len:
            device = self.tok_embeddings.weight.device
            self.rope_cos, self.rope_sin = self.rope_tables(positions, device)
            self.rope_len = positions

    def forward(
        self, tokens: torch.Tensor, start_pos: int, outputs: Sequence[int] | None = None
    ) -> torch.Tensor:
        """tokens [bsz, seq] at positions start_pos.. -> logits [bsz, seq, vocab] float32.

        Keys and values of these positions are written to the cache; attention reads every
        cached position before them. `outputs` (indices into the seq axis) runs the final
        norm and LM head on those rows only, [bsz, len(outputs), vocab]: a long prompt's
        head over every position would be [seq, vocab] (8k x 128k floats, 4 GiB).
        """
        bsz, seqlen = tokens.shape
        end_pos = start_pos + seqlen
        if end_pos > self.max_seq_len or bsz > self.max_batch_size:
            raise ValueError(
                f"positions {start_pos}..{end_pos} x batch {bsz} exceed the caches "
                f"({self.max_seq_len} x {self.max_batch_size}); call setup_caches first"
            )
        h = self.tok_embeddings(tokens)  # [bsz, seq, dim]
        cos, sin = self.rope_cos[start_pos:end_pos], self.rope_sin[start_pos:end_pos]

        mask = self.attention_mask(seqlen, start_pos, tokens.device)
        h = self.run_layers(h, start_pos, cos, sin, mask)
        if outputs is not None:
            h = h[:, list(outputs)]
        return self._logits(h)

    def forward_paged(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        batch: PagedBatch,
        outputs: Sequence[Sequence[int]],
    ) -> list[torch.Tensor | None]:
        """A ragged batch: tokens [rows] at `positions` [rows] (long, within setup_rope's) ->
        per piece, the logits [len(outputs[i]), vocab] float32 of its rows `outputs[i]`
        (indices into the batch's rows; None where it asks for none). Keys and values go to
        `batch`'s caches; each piece reads its own context (PagedBatch) under its mask
        (`with_masks`)."""
        batch = self.with_masks(batch)
        h = self.tok_embeddings(tokens)[None]  # [1, rows, dim]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.run_layers(h, 0, cos, sin, None, batch)
        return self._piece_logits(h[0], outputs)

    def _piece_logits(
        self, h: torch.Tensor, outputs: Sequence[Sequence[int]]
    ) -> list[torch.Tensor | None]:
        """The head over each piece's rows of h [rows, dim], the pieces' rows pooled into as
        few calls as the head's `pool_rows` allows: a decode batch reads the head's weights
        once, not once per sequence (128k x 256 float32 is 131 MB a read). A head that computes
        each row alone (packed.RowProduct) gives every row the bits of the piece's own call so
        long as the pooled call stays on the path the piece took (`pool_rows`: fewer rows than
        its dense switch); a dense head's batched product rounds otherwise than its one-row
        product, within tolerance (the eager batch is not bitwise: test_serving's table)."""
        limit = getattr(self.output, "pool_rows", None) or sys.maxsize
        logits: list[torch.Tensor | None] = [None] * len(outputs)
        group: list[int] = []  # pieces of the current pooled call

        def flush() -> None:
            if group:
                rows = [r for piece in group for r in outputs[piece]]
                pooled = self._logits(h[rows])
                start = 0
                for piece in group:
                    logits[piece] = pooled[start : start + len(outputs[piece])]
                    start += len(outputs[piece])
                group.clear()

        pooled_rows = 0
        for piece, rows in enumerate(outputs):
            if not rows:
                continue
            if len(rows) >= limit:  # on the head's other path alone, as the piece alone is
                logits[piece] = self._logits(h[list(rows)])
                continue
            if pooled_rows + len(rows) >= limit:
                flush()
                pooled_rows = 0
            group.append(piece)
            pooled_rows += len(rows)
        flush()
        return logits

    def attention_mask(
        self, seqlen: int, start_pos: int, device: torch.device
    ) -> torch.Tensor | None:
        """The mask every layer's attention gets, in every mode, solo (`forward`) and served
        (`with_masks`): the module's `attention_mask`. A model that windows its attention
        differs here alone; the kernels compute the plain causal attention only, and a mask
        they do not compute sends its rows to SDPA (test_serving's windowed model)."""
        return attention_mask(seqlen, start_pos, device)

    def with_masks(self, batch: PagedBatch) -> PagedBatch:
        """`batch` with each piece's mask, `attention_mask` of its rows after its earlier
        positions, and whether they are all plain causal (`PagedBatch.plain`): made once a
        forward rather than once a layer."""
        if batch.masks is not None and batch.plain is not None:
            return batch
        device = batch.k.device
        pieces = list(zip(batch.counts, batch.contexts, strict=True))
        masks = batch.masks or tuple(
            self.attention_mask(count, len(context) - count, device) for count, context in pieces
        )
        plain = all(
            mask is None or is_causal(mask, count, len(context) - count)
            for (count, context), mask in zip(pieces, masks, strict=True)
        )
        return dataclasses.replace(batch, masks=masks, plain=plain)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head in the head's dtype (float32 for bfloat16 engines: bfloat16
        logits of ~40 sit on a 0.25 grid, which makes exact ties); float32 out."""
        return self.output(self.norm(h.to(self.output.weight.dtype))).float()
