"""The engine's `ggml` execution mode: llama.cpp's CPU numerics for quantized checkpoints.

The quantized mode multiplies float32 activations by exactly dequantized weights; llama.cpp
does not. Before every product with Q4_0, Q4_1, Q4_K or Q8_0 weights, ggml quantizes the
activation row to 8 bits (the weight type's `vec_dot_type`: Q8_0, Q8_1 or Q8_K) and takes
integer dot products per block, so its log-probabilities on those files differ from the
float goldens by 0.4 to 2.3: another program. This mode computes that program, on the GGUF
blocks (Q4_0 and Q4_1 rows repacked two blocks at a time at load: the same bytes and values,
fewer instructions to unpack), in kernels/ggml_dot.c (whose header gives each rule):

    GgmlLinear       y = x . W^T: x quantized per row as ggml does, integer block dots,
                     float accumulation in the order of ggml's AVX2 vec_dot kernels
    GgmlParts        fused q/k/v or gate/up parts of several weight types, each its own
                     GgmlLinear
    GgmlRMSNorm      RMSNorm with ggml's double sum of squares
    GgmlFeedForward  SwiGLU with ggml's SiLU (its AVX2 expf algorithm, lane by lane)
    GgmlAttention    rope, cache writes and attention in one call, prefill and decode:
                     ggml's rotation and softmax (expf as above, the sum in double, in
                     an order of its own)
    rope_tables      ggml's rope angles: float32, multiplied up pair by pair
    FusedDecode      a decode step through every layer in one kernel call
    GgmlTransformer  the model with ggml's rope tables and the fused decode step

The rest is the quantized mode's structure (packed.py: the fused q/k/v and gate/up products,
the embedding lookups). Every kernel build computes the same bits (plain C, AVX2, AVX-512
VNNI) and nothing in front of a quantizer is left to torch's kernel level, so this mode's
goldens hold on any x86 CPU. What is not ggml's to the bit: the lane order of the
attention's float32 dot products, and the softmax's sum (ggml adds each 8 exponentials in
float first, and takes a row's last n mod 8 from libm's expf); where llama.cpp still differs,
docs/goldens.md says ("The ggml mode").

Float weights (F32, BF16) and NVFP4 stay float, as in the quantized mode: ggml's
vec_dot_type for F32 is F32, and this mode transcribes no other.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pipelines.llama3 import packed, profiling
from pipelines.llama3.kernel_library import GGML_ORDER, library
from pipelines.llama3.model import is_causal, rope_inverse_frequencies, slots_of
from pipelines.llama3.packing import RawMatrix

# kernels/ggml_dot.c's weight codes, and the activations ggml quantizes for each
WEIGHT_CODES = {
    GGMLQuantizationType.Q4_0: 0,
    GGMLQuantizationType.Q4_1: 1,
    GGMLQuantizationType.Q4_K: 2,
    GGMLQuantizationType.Q8_0: 3,
}
# The codes of Q4_0 and Q4_1 rows repacked at load (paired_rows; ggml_dot.c's pair_q4_0 and
# pair_q4_1): each pair of blocks computed with the same operations as the two GGUF blocks
PAIRED_CODES = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 5}
VEC_DOT_TYPES = {
    GGMLQuantizationType.Q4_0: "Q8_0",
    GGMLQuantizationType.Q4_1: "Q8_1",
    GGMLQuantizationType.Q4_K: "Q8_K",
    GGMLQuantizationType.Q8_0: "Q8_0",
}


def kernels():
    """The kernel build this mode runs (VNNI first: kernel_library.GGML_ORDER)."""
    return library(GGML_ORDER)


def _scale_bytes(qtype: GGMLQuantizationType) -> int:
    return {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}[qtype]


def paired_rows(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows [rows, row bytes] of Q4_0 or Q4_1 GGUF blocks in ggml_dot.c's pair layout: blocks
    2i and 2i + 1 become their float16 scales (and minimums) side by side, then 32 bytes whose
    low nibbles are block 2i's values 0..31 and high nibbles block 2i + 1's; an odd last block
    stays as it is. gguf_rows undoes it."""
    scale_bytes, rows = _scale_bytes(qtype), blocks.shape[0]
    b = blocks.reshape(rows, -1, scale_bytes + 16)
    n = b.shape[1] // 2
    first, second = b[:, 0 : 2 * n : 2], b[:, 1 : 2 * n : 2]
    scales = [first[..., 0:2], second[..., 0:2]]
    if scale_bytes == 4:
        scales += [first[..., 2:4], second[..., 2:4]]

    def values(qs: np.ndarray) -> np.ndarray:  # a GGUF block's 32 values, in order
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    qs = values(first[..., scale_bytes:]) | (values(second[..., scale_bytes:]) << 4)
    pairs = np.concatenate([*scales, qs], axis=-1).reshape(rows, -1)
    return np.ascontiguousarray(np.concatenate([pairs, b[:, 2 * n :].reshape(rows, -1)], axis=1))


def gguf_rows(paired: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """paired_rows' rows back in the GGUF blocks' layout."""
    scale_bytes, rows = _scale_bytes(qtype), paired.shape[0]
    block_bytes = scale_bytes + 16
    n = paired.shape[1] // block_bytes // 2
    pairs = paired[:, : 2 * n * block_bytes].reshape(rows, n, 2 * block_bytes)
    qs = pairs[..., 2 * scale_bytes :]

    def block(values: np.ndarray) -> np.ndarray:  # 32 values -> a GGUF block's 16 bytes
        return values[..., :16] | (values[..., 16:] << 4)

    halves = scale_bytes // 2  # float16 fields per block: d, or d and m
    first = [pairs[..., 4 * k : 4 * k + 2] for k in range(halves)] + [block(qs & 0x0F)]
    second = [pairs[..., 4 * k + 2 : 4 * k + 4] for k in range(halves)] + [block(qs >> 4)]
    both = np.stack([np.concatenate(first, -1), np.concatenate(second, -1)], axis=2)
    tail = paired[:, 2 * n * block_bytes :]
    return np.ascontiguousarray(np.concatenate([both.reshape(rows, -1), tail], axis=1))


class GgmlMatrix:
    """A [rows, cols] matrix as GGUF blocks, rows in the engine's order: `blocks` uint8
    [rows, row bytes] (the parts' rows one after the other, each part's row_order applied;
    Q4_0 and Q4_1 rows in the pair layout, `code` saying so: gguf_blocks() gives the file's
    layout)."""

    # Where and in what it computes: the model reads these as it would a dense weight's.
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, parts: list[RawMatrix]) -> None:
        qtype, cols = parts[0].qtype, parts[0].cols
        if any(p.qtype != qtype or p.cols != cols for p in parts):
            raise ValueError("fused parts must share the weight type and the column count")
        if qtype not in WEIGHT_CODES:
            raise ValueError(f"the ggml mode has no {qtype.name} products")
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = cols // block_values * block_bytes
        rows = []
        for part in parts:
            raw = np.ascontiguousarray(part.raw).view(np.uint8).reshape(part.rows, row_bytes)
            if part.row_order is not None:
                raw = raw[part.row_order.numpy()]
            rows.append(raw)
        blocks = np.ascontiguousarray(np.concatenate(rows))
        self.qtype, self.code = qtype, WEIGHT_CODES[qtype]
        if qtype in PAIRED_CODES:
            blocks, self.code = paired_rows(blocks, qtype), PAIRED_CODES[qtype]
        self.blocks = torch.from_numpy(blocks)
        self.rows, self.cols = self.blocks.shape[0], cols

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def gguf_blocks(self) -> np.ndarray:
        """The rows [rows, row bytes] as GGUF stores them."""
        blocks = self.blocks.numpy()
        return gguf_rows(blocks, self.qtype) if self.qtype in PAIRED_CODES else blocks


class GgmlLinear(packed.RowProduct):
    """y = x . W^T as ggml computes it; x float32 [..., cols] on the CPU (RowProduct)."""

    what = "the ggml mode's products"

    def __init__(self, weight: GgmlMatrix, splits: tuple[int, ...] | None = None) -> None:
        super().__init__(weight, splits)
        self._lib = kernels()
        self._w = weight.blocks.data_ptr()
        self._row_bytes = self._lib.ggml_act_row_bytes(weight.code, weight.cols)
        self._act = torch.empty(0, dtype=torch.uint8)  # the quantized activations, kept

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._act.numel() < rows * self._row_bytes:
            self._act = torch.empty(rows * self._row_bytes, dtype=torch.uint8)
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        with profiling.region("ggml_gemm"):
            self._lib.ggml_gemm(
                self.weight.code,
                x.data_ptr(),
                rows,
                self.in_features,
                self._w,
                self.out_features,
                y.data_ptr(),
                self._act.data_ptr(),
                self._threads(rows),
            )
        return y


class GgmlParts(packed.RowProduct):
    """Fused parts of several weight types (a file whose q/k/v or gate/up mix Q4_0, Q4_1, Q4_K
    and Q8_0, as `llama-quantize --tensor-type` writes): each part's GgmlLinear, its rows
    after the previous part's. llama.cpp multiplies each tensor on its own, its activations
    quantized to that tensor's vec_dot_type, and so does each part here: the same bits as
    separate products. No one-call decode step takes it (FusedDecode.applies)."""

    what = "the ggml mode's products"

    @dataclasses.dataclass(frozen=True)
    class Shape:
        rows: int
        cols: int
        nbytes: int

    def __init__(self, parts: list[GgmlLinear], splits: tuple[int, ...] | None = None) -> None:
        cols = parts[0].in_features
        if any(part.in_features != cols for part in parts):
            raise ValueError("fused parts must share the column count")
        rows = sum(part.out_features for part in parts)
        nbytes = sum(part.weight.nbytes for part in parts)
        super().__init__(self.Shape(rows, cols, nbytes), splits)
        self.parts = nn.ModuleList(parts)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part._product(x) for part in self.parts], dim=1)


def ggml_linear(
    parts: list[RawMatrix], splits: tuple[int, ...] | None = None
) -> GgmlLinear | GgmlParts:
    """One product over `parts`' rows: fused into one GgmlLinear when they share a weight
    type, else a GgmlParts of one GgmlLinear each."""
    if len({part.qtype for part in parts}) == 1:
        return GgmlLinear(GgmlMatrix(parts), splits)
    return GgmlParts([GgmlLinear(GgmlMatrix([part])) for part in parts], splits)


def _same_width(matrix: RawMatrix) -> int:
    return matrix.cols


class GgmlRMSNorm(packed.KernelRMSNorm):
    """RMSNorm as ggml computes it (kernels/ggml_dot.c: ggml_rms_norm) for float32 CPU rows."""

    kernel = "ggml_rms_norm"

    @staticmethod
    def _library():
        return kernels()


class GgmlFeedForward(packed.PackedFeedForward):
    """The fused gate/up product, then SwiGLU with ggml's SiLU (ggml_swiglu_rows)."""

    def __init__(self, dim: int, hidden_dim: int, w13: GgmlLinear, w2: nn.Module) -> None:
        super().__init__(dim, hidden_dim, w13, w2)
        self._lib = kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13.unsplit(x)  # [..., 2 * hidden], gate then up
        hidden = self.w13.splits[0]
        leading = gate_up.shape[:-1]
        out = torch.empty(*leading, hidden, dtype=torch.float32)
        with profiling.region("ggml_swiglu_rows"):
            self._lib.ggml_swiglu_rows(
                gate_up.data_ptr(), gate_up.numel() // (2 * hidden), hidden, out.data_ptr()
            )
        return self.w2(out)


def rope_tables(
    config, max_seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim] with ggml's angles (kernels/ggml_dot.c:
    ggml_rope_tables): float32 angles multiplied up pair by pair, the rope_freqs factors of
    the file (or the ones Llama 3.1's scaling implies), then cos and sin correctly rounded by
    the kernels' own double-precision functions (no libm: the same bits everywhere). model.py's
    tables compute each angle once in float32 from float64-free inverse frequencies; at 8k
    positions the two differ by up to 5e-4 in an angle, which llama.cpp's numbers follow."""
    factors = None  # the mode runs on the CPU only (engine.from_gguf keeps no raw blocks else)
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    elif config.rope_scaling_type is not None:
        plain = dataclasses.replace(config, rope_scaling_type=None)
        factors = (rope_inverse_frequencies(plain) / rope_inverse_frequencies(config)).float()
    cos = torch.empty(max_seq_len, config.head_dim, dtype=torch.float32)
    sin = torch.empty_like(cos)
    status = kernels().ggml_rope_tables(
        max_seq_len,
        config.head_dim,
        config.rope_theta,
        None if factors is None else factors.contiguous().data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
    )
    if status != 0:
        raise ValueError(
            f"the ggml mode's rope tables take angles up to 2^26 rad; {max_seq_len} positions "
            f"with rope_theta {config.rope_theta} and these rope factors exceed them: use a "
            "smaller max_seq_len"
        )
    return cos, sin


class GgmlAttention(packed.PackedAttention):
    """The fused q/k/v product, then rotation, cache writes and attention in one kernel call
    (ggml_attention: ggml's softmax but for its sum's order, the same bits on every build),
    prefill and decode alike, for one sequence with float32 caches; anything else (batches, an
    explicit mask, other dtypes) takes PackedAttention's path."""

    def __init__(self, config, wqkv: GgmlLinear, wo: nn.Module) -> None:
        super().__init__(config, wqkv, wo)
        self._lib = kernels()

    def forward(self, x, start_pos, cos, sin, mask):
        bsz, seqlen, _ = x.shape
        # A model without windows: the plain causal case (None: a decode step or a prefill
        # from position 0; a chunk after cached positions, e.g. a speculative verification
        # block, gets the explicit causal mask, which the kernel computes as well).
        causal = mask is None or is_causal(mask, seqlen, start_pos)
        if not (bsz == 1 and causal and self._decode_applies(cos, sin)):
            return super().forward(x, start_pos, cos, sin, mask)
        qkv = self.wqkv(x).contiguous()  # [1, seq, (n_heads + 2 n_kv_heads) * head_dim]
        out = torch.empty(1, seqlen, self.n_heads * self.head_dim, dtype=torch.float32)
        work = seqlen * (start_pos + seqlen) * self.n_heads * self.head_dim
        with profiling.region("ggml_attention"):
            self._lib.ggml_attention(
                qkv.data_ptr(),
                seqlen,
                cos.data_ptr(),
                sin.data_ptr(),
                self.cache_k.data_ptr(),
                self.cache_v.data_ptr(),
                self.n_heads,
                self.n_kv_heads,
                self.head_dim,
                self.cache_k.shape[2],
                start_pos,
                self.scale,
                out.data_ptr(),
                torch.get_num_threads() if work >= packed.PARALLEL_ATTENTION else 1,
            )
        return self.wo(out)

    def forward_paged(self, x, cos, sin, cache_k, cache_v, batch):
        """Each piece of a ragged batch through the same kernel call as `forward`: its context's
        keys gathered into a contiguous cache of its own, the piece's rotated keys and values
        (the kernel writes them there) then copied to the piece's write slots, where they are
        new (`batch.fresh`). A row's products, norms and attention see only its own sequence,
        so a served sequence computes the bits `generate` computes (test_serving)."""
        if not (batch.plain and cache_k.dtype == torch.float32 and cache_k.device.type == "cpu"):
            return packed.PackedAttention.forward_paged(self, x, cos, sin, cache_k, cache_v, batch)
        qkv = self.wqkv(x).contiguous()  # [1, rows, (n_heads + 2 n_kv_heads) * head_dim]
        out = torch.empty(1, x.shape[1], self.n_heads * self.head_dim, dtype=torch.float32)
        offset = 0
        for count, context in zip(batch.counts, batch.contexts, strict=True):
            past = len(context) - count
            keys = slots_of(cache_k, context).transpose(0, 1).contiguous()  # [kv_heads, ctx, hd]
            values = slots_of(cache_v, context).transpose(0, 1).contiguous()
            rows = slice(offset, offset + count)
            piece = qkv[:, rows].contiguous()
            work = count * len(context) * self.n_heads * self.head_dim
            result = torch.empty(1, count, self.n_heads * self.head_dim, dtype=torch.float32)
            with profiling.region("ggml_attention"):
                self._lib.ggml_attention(
                    piece.data_ptr(),
                    count,
                    cos[rows].contiguous().data_ptr(),
                    sin[rows].contiguous().data_ptr(),
                    keys.data_ptr(),
                    values.data_ptr(),
                    self.n_heads,
                    self.n_kv_heads,
                    self.head_dim,
                    len(context),
                    past,
                    self.scale,
                    result.data_ptr(),
                    torch.get_num_threads() if work >= packed.PARALLEL_ATTENTION else 1,
                )
            out[:, rows] = result
            fresh = batch.fresh[rows]
            slots = batch.write[rows][fresh]
            cache_k[slots] = keys[:, past:].transpose(0, 1)[fresh]
            cache_v[slots] = values[:, past:].transpose(0, 1)[fresh]
            offset += count
        return self.wo(out)


class _Layer(ctypes.Structure):
    """kernels/ggml_dot.c's ggml_layer."""

    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("wqkv", ctypes.c_void_p),
        ("wo", ctypes.c_void_p),
        ("w13", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("tqkv", ctypes.c_int32),
        ("to", ctypes.c_int32),
        ("t13", ctypes.c_int32),
        ("t2", ctypes.c_int32),
        ("cache_k", ctypes.c_void_p),
        ("cache_v", ctypes.c_void_p),
    ]


class FusedDecode(packed.FusedDecode):
    """One decode step through every layer in one kernel call (ggml_decode_layers; a serving
    step of decode rows, ggml_decode_paged): the same functions, in the same order, as this
    mode's modules, so the same bits."""

    function, paged_function = "ggml_decode_layers", "ggml_decode_paged"
    entry = _Layer
    entry_bytes = "ggml_layer_bytes"
    layer_classes = (GgmlAttention, GgmlLinear, GgmlFeedForward, GgmlRMSNorm)
    attention_work = packed.PARALLEL_ATTENTION

    @staticmethod
    def _library():
        return kernels()

    def fill(self, entry: ctypes.Structure, layer: nn.Module) -> None:
        attention, ffn = layer.attention, layer.feed_forward
        entry.attn_norm = layer.attention_norm.weight.data_ptr()
        entry.ffn_norm = layer.ffn_norm.weight.data_ptr()
        for name, linear in (
            ("wqkv", attention.wqkv), ("wo", attention.wo), ("w13", ffn.w13), ("w2", ffn.w2),
        ):  # fmt: skip
            setattr(entry, name, linear.weight.blocks.data_ptr())
        entry.tqkv, entry.to = attention.wqkv.weight.code, attention.wo.weight.code
        entry.t13, entry.t2 = ffn.w13.weight.code, ffn.w2.weight.code


class GgmlTransformer(packed.PackedTransformer):
    """The ggml mode's model (a file with quantized matrices; install() gives it its layers):
    ggml's rope angles, and one kernel call per decode step through every layer where every
    layer is this mode's (fused_decode: FusedDecode, else None: the layers' modules)."""

    def rope_tables(self, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.config, positions, device)


def install(model: nn.Module, matrices: dict[str, RawMatrix]) -> None:
    """The quantized mode's structure (packed.install) with this mode's products, norms and
    SwiGLU, on a GgmlTransformer. A matrix of a type without a ggml product here raises (none
    reach it: the loader keeps only Q4_0, Q4_1, Q4_K and Q8_0 as raw blocks)."""
    if not matrices:
        return  # a float file: ggml's vec_dot_type is F32, the model stays exactly eager's
    if not isinstance(model, GgmlTransformer):
        raise TypeError(f"the ggml mode installs on a GgmlTransformer, not {type(model).__name__}")
    unknown = sorted({m.qtype.name for m in matrices.values()} - {t.name for t in WEIGHT_CODES})
    if unknown:
        raise ValueError(f"the ggml mode has no products for {', '.join(unknown)} weights")
    packed.install(
        model,
        matrices,
        linear=ggml_linear,
        norm=GgmlRMSNorm,
        feed_forward=GgmlFeedForward,
        attention=GgmlAttention,
        fused_decode=FusedDecode,
        fuse_key=_same_width,  # parts of several weight types: GgmlParts
    )
