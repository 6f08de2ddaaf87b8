"""The engine's `quantized` execution mode: modules on weights that stay 4-bit or 8-bit.

`install` puts these modules into a loaded Transformer in place of the plain ones, on the
matrices the loader kept as raw GGUF blocks (packing.RawMatrix):

    PackedLinear       y = x . W^T on packed weights, in the C kernels (kernel_library.py)
    PackedEmbedding    embedding rows dequantized as they are looked up
    PackedAttention    Attention with one fused q/k/v product and a one-call decode step
    PackedFeedForward  FeedForward with one fused gate/up product, SwiGLU in one kernel call
    KernelRMSNorm      RMSNorm in one kernel call
    FusedDecode        a decode step through every layer in one kernel call
    PackedTransformer  the model that takes FusedDecode for its decode steps

The kernels multiply float32 activations by groupwise int4/int8 weights (packing.py). Per 32
weights int4 keeps 16 bytes of nibbles and a float32 scale and offset (8 bytes): 6 bits a
weight, 3/16 (~1/5.3) of float32's 32 bits; int8 keeps 32 bytes and a float32 scale, 9 bits
(~1/3.6). A decode step reads each weight once, so those are the bytes it reads.

Why not torch's own int4 kernels: on the CPU, `_weight_int4pack_mm_for_cpu` is vectorized
for bfloat16 activations and scales only; its float32 path ran a 1536x576 product of one
activation row in 10 ms against 0.06 ms dense (README.md; 3.0 ms against 0.10 ms on another
run), and bfloat16 activations or scales move SmolLM2's log-probabilities far past the
float32 tolerances. These kernels keep float32 activations and exact scales.
"""

from __future__ import annotations

import ctypes
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.llama3 import profiling
from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.kernel_library import library
from pipelines.llama3.model import (
    Attention,
    FeedForward,
    PagedBatch,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    paged_attention,
    write_paged,
)
from pipelines.llama3.packing import GROUP, PackedWeight, RawMatrix, dequantize, pack_rows

# Weight bytes x activation rows from which a product uses threads. Measured on SmolLM2 with
# 2 threads: 1 << 17 gives 117 tok/s, 1 << 19 105, 1 << 15 114 (the pool wakes for nothing).
PARALLEL_BYTES = 1 << 17
# From this many rows (prompt tokens) a product runs dense on the dequantized weights: the
# kernels are made for decode's one row. Short golden prompts (<= 16 tokens) stay packed.
DENSE_ROWS = 64
# Score x value multiply-adds from which the attention uses threads (the modules' and the
# one-call steps': below it, waking the threads costs more than they save)
PARALLEL_ATTENTION = 1 << 16


class RowProduct(nn.Module):
    """y = x . W^T over the rows of float32 CPU activations x [..., cols]: the shapes and the
    thread choice the quantized and ggml modes' products share (PackedLinear,
    ggml_mode.GgmlLinear), each computing `_product` of the rows. `splits` cuts the output
    into several tensors (a fused gate/up projection); `unsplit` leaves it whole."""

    what = "packed weights"  # for the error a wrong input gets
    # Rows of separate calls may be pooled into one call of fewer rows than this and keep their
    # bits (None: any number; each row is computed alone)
    pool_rows: int | None = None

    def __init__(self, weight, splits: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.splits = splits
        self.in_features, self.out_features = weight.cols, weight.rows

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, out] of contiguous float32 rows x [rows, cols]."""
        raise NotImplementedError

    @property
    def parallel_rows(self) -> int:
        """The fewest rows whose product uses threads (rows x weight bytes >= PARALLEL_BYTES).
        Small products run on one thread: waking the pool costs more than it saves there."""
        return -(-PARALLEL_BYTES // self.weight.nbytes)

    def _threads(self, rows: int) -> int:
        return torch.get_num_threads() if rows >= self.parallel_rows else 1

    def unsplit(self, x: torch.Tensor) -> torch.Tensor:
        """The product [..., out], whatever `splits` says."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"{self.what} take float32 CPU activations, not {x.dtype}")
        y = self._product(x.reshape(-1, self.in_features).contiguous())
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y = self.unsplit(x)
        return y if self.splits is None else y.split(self.splits, dim=-1)


class PackedLinear(RowProduct):
    """y = x . W^T with W packed; x float32 [..., cols] on the CPU (RowProduct)."""

    # Calls of fewer rows than this take the kernels, row by row: rows of several calls pooled
    # into one such call keep their bits (Transformer._piece_logits pools the head's rows).
    pool_rows = DENSE_ROWS

    def __init__(self, weight: PackedWeight, splits: tuple[int, ...] | None = None) -> None:
        super().__init__(weight, splits)
        self._lib = library()
        self._q = weight.q.data_ptr()
        self._scales = weight.scales.data_ptr()
        self._sums = torch.empty(0, dtype=torch.float32)  # the kernel's scratch, kept
        self._kernel = "q4_gemm" if weight.kind == "int4" else "q8_gemm"  # its profile region

    def _scratch(self, size: int) -> torch.Tensor:
        """The kernel's per-call scratch (group sums of x), allocated once per largest size."""
        if self._sums.numel() < size:
            self._sums = torch.empty(size, dtype=torch.float32)
        return self._sums

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= DENSE_ROWS:
            # A long prefill: the kernels stream the packed weights once per row, so at M rows
            # they read M times the weights (a 2k-token SmolLM2 prompt took 40 s against 6 s in
            # eager). Dequantized once (bit-identical to eager's weights), BLAS reads them once.
            return F.linear(x, dequantize(self.weight))
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        threads = self._threads(rows)
        with profiling.region(self._kernel):  # "q4_gemm" or "q8_gemm"
            if self.weight.kind == "int4":
                sums = self._scratch(rows * (self.in_features // GROUP))
                self._lib.q4_gemm(
                    x.data_ptr(),
                    rows,
                    self.in_features,
                    self._q,
                    self._scales,
                    self.out_features,
                    y.data_ptr(),
                    sums.data_ptr(),
                    threads,
                )
            else:
                self._lib.q8_gemm(
                    x.data_ptr(),
                    rows,
                    self.in_features,
                    self._q,
                    self._scales,
                    self.out_features,
                    y.data_ptr(),
                    threads,
                )
        return y


class PackedEmbedding(nn.Module):
    """Embedding rows read from packed weights (only the looked-up rows are dequantized)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        q, scales = w.q[tokens], w.scales[tokens]
        if w.kind == "int8":
            return scales.repeat_interleave(GROUP, dim=-1) * q.float()
        values = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # [..., groups, 32]
        out = torch.addcmul(scales[..., 1:], scales[..., :1], values)
        return out.reshape(*tokens.shape, w.cols)


class KernelRMSNorm(RMSNorm):
    """RMSNorm in one kernel call for float32 CPU rows; anything else as RMSNorm does.

    The quantized mode's norms: same weight and eps, same arithmetic as torch's float32
    rms_norm up to the summation order of the mean of squares.
    """

    kernel = "rms_norm"  # the library's function (ggml_mode.GgmlRMSNorm: ggml_rms_norm)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._lib = self._library()

    @staticmethod
    def _library():
        return library()

    @classmethod
    def of(cls, norm: RMSNorm) -> KernelRMSNorm:
        """`norm` with this forward, sharing its weight."""
        kernel = cls(norm.weight.shape[0], norm.eps)
        kernel.weight = norm.weight
        return kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        usable = x.dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu"
        if not (usable and self.weight.is_contiguous()):
            return super().forward(x)
        x = x.contiguous()
        y = torch.empty_like(x)
        dim = x.shape[-1]
        getattr(self._lib, self.kernel)(
            x.data_ptr(),
            self.weight.data_ptr(),
            x.numel() // dim,
            dim,
            self.eps,
            y.data_ptr(),
        )
        return y


class PackedAttention(Attention):
    """Attention whose q, k and v come from one packed product, `wqkv` (output [..., (n_heads
    + 2 n_kv_heads) * head_dim] as q, k, v): one kernel call and one read of the activations
    instead of three.

    A decode step (one new position of one sequence) runs the rotation, the cache writes and
    grouped-query attention over the cache in one kernel call (`decode_attention`) instead of
    about ten torch operators; prefill, batches and anything else take Attention's path
    (SDPA) on the fused product. The kernel differs from SDPA in summation order only; its
    rotation is bit-identical.
    """

    def __init__(self, config: LlamaConfig, wqkv: PackedLinear, wo: nn.Module) -> None:
        with torch.device("meta"):  # wq, wk, wv are replaced by wqkv: no memory for them
            super().__init__(config)
        del self.wq, self.wk, self.wv
        self.wqkv = wqkv
        self.wo = wo
        self._lib = library()
        self._scores = torch.empty(0, dtype=torch.float32)  # the kernel's scratch, kept

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if x.shape[0] == x.shape[1] == 1 and mask is None and self._decode_applies(cos, sin):
            return self.wo(self._decode_step(x, start_pos, cos, sin))
        return super().forward(x, start_pos, cos, sin, mask)

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        """Attention.forward_paged, the decode rows through the paged kernel
        (`decode_attention_paged`, bit-identical to the contiguous one `forward` runs) where
        it reads these caches (float32, CPU): the kernel writes a decode row's keys and values
        itself, into the row's write slot, the last of the slots it reads, where the row is
        fresh (`PagedBatch.fresh`: a kept position keeps its keys)."""
        if not (cache_k.dtype == torch.float32 and cache_k.device.type == "cpu"):
            return super().forward_paged(x, cos, sin, cache_k, cache_v, batch)
        qkv = self.wqkv(x)
        xq, xk, xv = self.rotate(qkv, cos, sin)
        write_paged(cache_k, cache_v, xk, xv, batch, batch.fresh & ~batch.unmasked_decode_rows())
        outputs, offset = [], 0
        for count, context, mask in zip(batch.counts, batch.contexts, batch.masks, strict=True):
            if count == 1 and mask is None:
                slots = context.clone()
                slots[-1] = batch.write[offset]
                row = qkv[0, offset].clone()  # the kernel rotates it in place
                fresh = bool(batch.fresh[offset])
                out = self.decode_paged(
                    row, cos[offset], sin[offset], cache_k, cache_v, slots, fresh
                )
                outputs.append(out.view(1, self.n_heads, 1, self.head_dim))
            else:
                q = xq[:, :, offset : offset + count]
                outputs.append(paged_attention(q, cache_k, cache_v, context, self.scale, mask))
            offset += count
        return self.wo(self.merge_pieces(outputs, x.shape[1]))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # One product for q, k and v, and one rotation for the q and k heads together
        # (elementwise, so each head is rotated exactly as Attention.project rotates it).
        return self.rotate(self.wqkv(x), cos, sin)

    def rotate(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project` after the fused product: qkv [bsz, seq, (n_heads + 2 n_kv_heads) *
        head_dim] into rotated queries, rotated keys and values (the serving engine computes
        qkv once for a batch whose decode rows go to the kernel unrotated)."""
        bsz, seqlen, _ = qkv.shape
        qk_heads = self.n_heads + self.n_kv_heads
        qkv = qkv.view(bsz, seqlen, qk_heads + self.n_kv_heads, self.head_dim)
        qk = apply_rotary_emb(qkv[:, :, :qk_heads].transpose(1, 2), cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], qkv[:, :, qk_heads:].transpose(1, 2)

    def decode_paged(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        slots: torch.Tensor,
        fresh: bool = True,
    ) -> torch.Tensor:
        """One new position's attention output before wo, [n_heads * head_dim], over a paged
        cache (`decode_attention_paged`): qkv [(n_heads + 2 n_kv_heads) * head_dim] unrotated
        (rotated in place), caches [slots, n_kv_heads, head_dim] float32, slots[t] the slot of
        position t, the last one where the new keys and values are written (`fresh`; else the
        slot keeps its own, PagedBatch.fresh)."""
        pos = slots.numel() - 1
        if self._scores.numel() < pos + 1:
            self._scores = torch.empty(max(pos + 1, 2 * self._scores.numel()), dtype=torch.float32)
        out = torch.empty(self.n_heads * self.head_dim, dtype=torch.float32)
        with profiling.region("decode_attention_paged"):
            self._lib.decode_attention_paged(
                qkv.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                cache_k.data_ptr(),
                cache_v.data_ptr(),
                self.n_heads,
                self.n_kv_heads,
                self.head_dim,
                slots.data_ptr(),
                pos,
                self.scale,
                self._scores.data_ptr(),
                out.data_ptr(),
                int(fresh),
            )
        return out

    def _decode_applies(self, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the kernel reads these tables and caches: float32, contiguous."""
        cache_k, cache_v = self.cache_k, self.cache_v
        tables = cos.dtype == sin.dtype == cache_k.dtype == cache_v.dtype == torch.float32
        contiguous = cos.is_contiguous() and sin.is_contiguous()
        return tables and contiguous and cache_k.is_contiguous() and cache_v.is_contiguous()

    def _decode_step(
        self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The attention output before wo, [1, 1, n_heads * head_dim], of one new position."""
        cache_k, cache_v = self.cache_k, self.cache_v
        qkv = self.wqkv(x)  # [1, 1, (n_heads + 2 n_kv_heads) * head_dim], our own tensor
        if self._scores.numel() < start_pos + 1:
            self._scores = torch.empty(cache_k.shape[2], dtype=torch.float32)
        out = torch.empty(1, 1, self.n_heads * self.head_dim, dtype=torch.float32)
        with profiling.region("decode_attention"):
            self._lib.decode_attention(
                qkv.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                cache_k.data_ptr(),
                cache_v.data_ptr(),
                self.n_heads,
                self.n_kv_heads,
                self.head_dim,
                cache_k.shape[2],
                start_pos,
                self.scale,
                self._scores.data_ptr(),
                out.data_ptr(),
            )
        return out


class PackedFeedForward(FeedForward):
    """FeedForward whose gate and up projections are one packed product, `w13` (returning
    (gate, up)): one kernel call and one read of the activations instead of two; then SwiGLU
    in one kernel call (`swiglu_rows`: torch's SiLU formula with the C library's exp, which
    rounds alike on every CPU where ATen's vector exp does not), as the one-call decode step
    (FusedDecode) computes it."""

    def __init__(self, dim: int, hidden_dim: int, w13: PackedLinear, w2: nn.Module) -> None:
        with torch.device("meta"):  # w1, w3 are replaced by w13: no memory for them
            super().__init__(dim, hidden_dim)
        del self.w1, self.w3
        self.w13 = w13
        self.w2 = w2
        self._lib = library()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13.unsplit(x)  # [..., 2 * hidden], gate then up (float32, CPU)
        hidden = self.w13.splits[0]
        out = torch.empty(*gate_up.shape[:-1], hidden, dtype=torch.float32)
        with profiling.region("swiglu_rows"):
            self._lib.swiglu_rows(
                gate_up.data_ptr(), gate_up.numel() // (2 * hidden), hidden, out.data_ptr()
            )
        return self.w2(out)


class _PackedLayer(ctypes.Structure):
    """kernels/packed_gemm.c's packed_layer (products in the order wqkv, wo, w13, w2)."""

    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("q", ctypes.c_void_p * 4),
        ("scales", ctypes.c_void_p * 4),
        ("parallel_rows", ctypes.c_int64 * 4),
        ("int4", ctypes.c_int32 * 4),
        ("cache_k", ctypes.c_void_p),
        ("cache_v", ctypes.c_void_p),
    ]


class FusedDecode:
    """One decode step of one sequence through every layer in one kernel call: the kernels the
    layers' modules call, in the same order, so the same bits, without about a dozen
    Python-level calls per layer (PackedTransformer.run_layers takes it for one position).

    This is the quantized mode's (`packed_decode_layers` over a table of `_PackedLayer`);
    ggml_mode.FusedDecode fills its own table for `ggml_decode_layers`. `applies(model)` says
    whether every layer is the mode's own; a planted bug in a module the call bypasses
    unsets model.fused_decode."""

    # The library's functions (also the profile regions' names): one sequence's step, and a
    # serving step of decode rows (both paged functions take the same arguments).
    function, paged_function = "packed_decode_layers", "packed_decode_paged"
    entry: type[ctypes.Structure] = _PackedLayer
    entry_bytes = "packed_layer_bytes"  # the library's sizeof of its entry
    # The classes of a layer's attention, wo/w2 products, feed-forward and norms (applies)
    layer_classes = (PackedAttention, PackedLinear, PackedFeedForward, KernelRMSNorm)
    attention_work = PARALLEL_ATTENTION  # from here a step's attention runs on the threads

    def __init__(self, model: Transformer) -> None:
        self.model, self._lib = model, self._library()
        if getattr(self._lib, self.entry_bytes)() != ctypes.sizeof(self.entry):
            raise RuntimeError(f"the kernels' layer table is not {type(self).__name__}.entry")
        self._layers, self._caches = None, None

    @staticmethod
    def _library():
        return library()

    @classmethod
    def applies(cls, model: Transformer) -> bool:
        """Whether every layer is the mode's own: its attention with a fused q/k/v product, its
        feed-forward with a fused gate/up product, its products for wqkv, wo, w13 and w2, its
        norms (exactly the mode's classes, `layer_classes`: a subclass computes otherwise; the
        ggml mode's product of parts of several weight types has no kernel table entry)."""
        attention, linear, feed_forward, norm = cls.layer_classes
        for layer in model.layers:
            parts = [
                (layer.attention, attention),
                (getattr(layer.attention, "wqkv", None), linear),
                (getattr(layer.attention, "wo", None), linear),
                (layer.feed_forward, feed_forward),
                (getattr(layer.feed_forward, "w13", None), linear),
                (getattr(layer.feed_forward, "w2", None), linear),
                (layer.attention_norm, norm),
                (layer.ffn_norm, norm),
            ]
            if not all(type(part) is kind for part, kind in parts):
                return False
        return len(model.layers) > 0  # a draft of no layers (self_draft(path, 0)) has no step

    def fill(self, entry: ctypes.Structure, layer: nn.Module) -> None:
        """`entry` from `layer`'s weights (the caches are set by _table)."""
        attention, ffn = layer.attention, layer.feed_forward
        entry.attn_norm = layer.attention_norm.weight.data_ptr()
        entry.ffn_norm = layer.ffn_norm.weight.data_ptr()
        products = (attention.wqkv, attention.wo, ffn.w13, ffn.w2)
        for i, linear in enumerate(products):
            entry.q[i] = linear.weight.q.data_ptr()
            entry.scales[i] = linear.weight.scales.data_ptr()
            entry.int4[i] = linear.weight.kind == "int4"
            entry.parallel_rows[i] = linear.parallel_rows

    def shared(self) -> tuple[float, float] | None:
        """(epsilon, attention scale): the one call takes one of each for every layer and both
        norms, read here from the modules at each call (a planted epsilon or scale reaches it);
        None where the layers or norms differ (a plant on one of them): the call cannot compute
        that, and the modules' path runs instead."""
        layers = self.model.layers
        eps, scale = layers[0].attention_norm.eps, layers[0].attention.scale
        for layer in layers:
            norms = (layer.attention_norm.eps, layer.ffn_norm.eps)
            if norms != (eps, eps) or layer.attention.scale != scale:
                return None
        return eps, scale

    def _table(self) -> ctypes.Array:
        """The layers' entries, remade when setup_caches has allocated other caches (a serving
        engine's model has none: its caches are the pool's)."""
        layers = self.model.layers
        caches = [(layer.attention.cache_k, layer.attention.cache_v) for layer in layers]
        key = [None if k is None else (k.data_ptr(), v.data_ptr()) for k, v in caches]
        if self._layers is None or self._caches != key:
            table = (self.entry * len(caches))()
            for entry, layer, (k, v) in zip(table, layers, caches, strict=True):
                self.fill(entry, layer)
                if k is not None:
                    entry.cache_k, entry.cache_v = k.data_ptr(), v.data_ptr()
            self._layers, self._caches = table, key
        return self._layers

    def __call__(
        self, h: torch.Tensor, start_pos: int, cos, sin, shared: tuple[float, float]
    ) -> torch.Tensor:
        """h [1, 1, dim] of one sequence's decode step after every layer, with `shared`'s
        epsilon and scale (`shared()`, read once by the step's caller)."""
        model, config = self.model, self.model.config
        layers = self._table()
        max_seq = model.layers[0].attention.cache_k.shape[2]
        h = h.float().contiguous().clone()  # [1, 1, dim], updated in place
        eps, scale = shared
        with profiling.region(self.function):
            failed = getattr(self._lib, self.function)(
                layers, len(model.layers), h.data_ptr(), config.dim, config.n_heads,
                config.n_kv_heads, config.head_dim, config.ffn_dim, max_seq, start_pos,
                cos.data_ptr(), sin.data_ptr(), eps, scale, torch.get_num_threads(),
                self.attention_work,
            )  # fmt: skip
        if failed:
            raise MemoryError(f"{self.function}: no memory for one decode step's scratch")
        return h

    def takes(self, batch: PagedBatch) -> bool:
        """Whether `decode_paged` computes this serving batch: decode rows only (no prefill
        chunk, no verification piece) that need no mask, float32 caches on the CPU (the
        caller checks `shared` as well)."""
        k = batch.k
        return (
            bool(batch.unmasked_decode_rows().all())
            and k.dtype == torch.float32
            and (k.device.type == "cpu" and k.is_contiguous() and batch.v.is_contiguous())
        )

    def decode_paged(
        self, h: torch.Tensor, cos, sin, batch: PagedBatch, shared: tuple[float, float]
    ) -> torch.Tensor:
        """h [rows, dim] of a serving batch of decode rows (`takes`) after every layer, with
        `shared`'s epsilon and scale, in one call (`paged_function`): each row's attention
        over its context slots as the mode's attention module's forward_paged runs it, its new
        keys and values to its write slot, the products over every row."""
        model, config = self.model, self.model.config
        starts = torch.tensor([0, *itertools.accumulate(len(c) for c in batch.contexts)])
        slots = torch.cat(batch.contexts).contiguous()
        write = batch.write.contiguous()
        fresh = batch.fresh.to(torch.uint8).contiguous()
        h = h.float().contiguous().clone()  # [rows, dim], updated in place
        cos, sin = cos.contiguous(), sin.contiguous()
        k, v = batch.k, batch.v
        with profiling.region(self.paged_function):
            failed = getattr(self._lib, self.paged_function)(
                self._table(), len(model.layers), h.data_ptr(), h.shape[0], config.dim,
                config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim,
                slots.data_ptr(), starts.data_ptr(), write.data_ptr(), fresh.data_ptr(),
                k.data_ptr(), v.data_ptr(), k[0].numel(), cos.data_ptr(), sin.data_ptr(),
                *shared, torch.get_num_threads(),
                self.attention_work,
            )  # fmt: skip
        if failed:
            raise MemoryError(f"{self.paged_function}: no memory for one serving step's scratch")
        return h


class PackedTransformer(Transformer):
    """The quantized mode's model (a file with packed matrices; install() gives it its
    layers): one kernel call per decode step through every layer where every layer is the
    mode's (fused_decode; else None: the layers' modules one by one, as for a batch or a
    prefill), and so is a serving step of decode rows only (run_layers)."""

    fused_decode: FusedDecode | None = None

    def run_layers(self, h, start_pos: int, cos, sin, mask, batch=None) -> torch.Tensor:
        """Transformer.run_layers; one sequence's decode step, or a serving step of decode rows
        only, in one call where the fused step takes it (FusedDecode.shared, .takes)."""
        fused = self.fused_decode
        shared = None if fused is None else fused.shared()
        if shared is not None and batch is None:
            if h.shape[:2] == (1, 1) and mask is None:
                return fused(h, start_pos, cos, sin, shared)
        elif shared is not None and fused.takes(batch):  # a serving step
            return fused.decode_paged(h[0], cos, sin, batch, shared)[None]
        return super().run_layers(h, start_pos, cos, sin, mask, batch)


def _same_kind_and_width(matrix: RawMatrix) -> tuple:
    return matrix.kind, matrix.cols


def _fusable(
    matrices: dict[str, RawMatrix], names: list[str], key=_same_kind_and_width
) -> list[RawMatrix] | None:
    """The matrices of `names` when all are packed and alike by `key` (default: one kind and
    width, which pack_rows needs), else None."""
    parts = [matrices.get(name) for name in names]
    if all(parts) and len({key(m) for m in parts}) == 1:
        return parts
    return None


def packed_linear(parts: list[RawMatrix], splits: tuple[int, ...] | None = None) -> PackedLinear:
    """The quantized mode's product over `parts`' rows, one after the other (fused when
    several; `splits` cuts its output as PackedLinear says)."""
    return PackedLinear(pack_rows(parts), splits)


def _pack_each(owner: nn.Module, prefix: str, parts: tuple[str, ...], matrices, linear) -> None:
    """Each of owner's `parts` (nn.Linear) that has a packed matrix becomes `linear([it])`."""
    for part in parts:
        matrix = matrices.get(f"{prefix}.{part}.weight")
        if matrix is not None:
            setattr(owner, part, linear([matrix]))


def install(
    model: Transformer,
    matrices: dict[str, RawMatrix],
    linear=packed_linear,
    norm=None,
    feed_forward=None,
    attention=None,
    fused_decode: type[FusedDecode] | None = None,
    fuse_key=_same_kind_and_width,
) -> None:
    """Put `matrices` (parameter name -> RawMatrix) into a Transformer whose other
    parameters are loaded, each product made by `linear(parts, splits=None)`
    (`packed_linear`: the quantized mode; ggml_mode.py passes its own, with its own `norm`,
    `feed_forward`, `attention`, `fused_decode` classes and `fuse_key`).

    A layer's attention becomes a PackedAttention (wq/wk/wv fused into `wqkv`) and its
    feed-forward a PackedFeedForward (w1/w3 into `w13`) when all their parts are packed and
    alike by `fuse_key` (default: one kind and width); otherwise each packed projection
    becomes a `linear` in the plain module.
    Float32 CPU norms become KernelRMSNorm (or `norm`). Where every layer came out the mode's
    own, a PackedTransformer's decode steps run through them in one call (`fused_decode`).
    """
    if not matrices:
        return  # nothing packed (a float file): the model stays exactly the eager one
    config = model.config
    norm = norm or KernelRMSNorm
    feed_forward_class = feed_forward or PackedFeedForward
    fused_decode = fused_decode or FusedDecode
    attention_class = attention or PackedAttention
    float_norms = (
        model.norm.weight.dtype == torch.float32 and model.norm.weight.device.type == "cpu"
    )
    if float_norms:
        model.norm = norm.of(model.norm)
    for i, layer in enumerate(model.layers):
        if float_norms:
            layer.attention_norm = norm.of(layer.attention_norm)
            layer.ffn_norm = norm.of(layer.ffn_norm)
        attention, ffn = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        qkv = _fusable(matrices, [f"{attention}.{p}.weight" for p in ("wq", "wk", "wv")], fuse_key)
        if qkv is not None:
            wqkv = linear(qkv)  # one tensor: the attention splits it
            layer.attention = attention_class(config, wqkv, layer.attention.wo)
        else:
            _pack_each(layer.attention, attention, ("wq", "wk", "wv"), matrices, linear)
        gate_up = _fusable(matrices, [f"{ffn}.{p}.weight" for p in ("w1", "w3")], fuse_key)
        if gate_up is not None:
            w13 = linear(gate_up, tuple(m.rows for m in gate_up))
            layer.feed_forward = feed_forward_class(
                config.dim, config.ffn_dim, w13, layer.feed_forward.w2
            )
        else:
            _pack_each(layer.feed_forward, ffn, ("w1", "w3"), matrices, linear)
        _pack_each(layer.attention, attention, ("wo",), matrices, linear)
        _pack_each(layer.feed_forward, ffn, ("w2",), matrices, linear)
    embedding = None
    if "tok_embeddings.weight" in matrices:
        embedding = pack_rows([matrices["tok_embeddings.weight"]])
        model.tok_embeddings = PackedEmbedding(embedding)
    if "output.weight" in matrices:
        model.output = linear([matrices["output.weight"]])
    elif embedding is not None and model.config.tie_word_embeddings:
        if linear is packed_linear:
            model.output = PackedLinear(embedding)  # the lookups' packed copy, shared
        else:
            model.output = linear([matrices["tok_embeddings.weight"]])
    if isinstance(model, PackedTransformer):
        model.fused_decode = fused_decode(model) if fused_decode.applies(model) else None
