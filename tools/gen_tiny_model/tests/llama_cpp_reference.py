"""A minimal forward pass that reads GGUF tensors the way llama.cpp does, for cross-checks.

It applies RoPE to interleaved pairs (llama.cpp's layout, no un-permutation) with the
`rope_freqs` divisors, so agreeing with transformers (which un-permutes Q/K and applies llama3
rope scaling from config.json) shows the writer permuted Q/K and wrote the scaling correctly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize


class ReferenceLlama:
    def __init__(self, source: Path | GGUFReader) -> None:
        reader = source if isinstance(source, GGUFReader) else GGUFReader(source)

        def field(key: str) -> object:
            return reader.fields[key].contents()

        self.n_layers = int(field("llama.block_count"))
        self.n_heads = int(field("llama.attention.head_count"))
        self.n_kv_heads = int(field("llama.attention.head_count_kv"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(field("llama.rope.freq_base"))
        self.w: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            data = dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
            self.w[t.name] = torch.from_numpy(np.array(data, dtype=np.float32))
        self.head_dim = self.w["token_embd.weight"].shape[1] // self.n_heads

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        # x: [seq, heads, head_dim]; pairs (2i, 2i+1) rotate by pos * theta^(-2i/d) / factor_i
        seq, _, dim = x.shape
        inv = self.theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        inv = inv / self.w["rope_freqs.weight"].double()
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [seq, vocab] for a prompt."""
        w, hd = self.w, self.head_dim
        x = w["token_embd.weight"][torch.tensor(ids)]
        seq = len(ids)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        for layer in range(self.n_layers):
            p = f"blk.{layer}."
            h = self._norm(x, w[p + "attn_norm.weight"])
            q = self._rope((h @ w[p + "attn_q.weight"].T).view(seq, self.n_heads, hd))
            k = self._rope((h @ w[p + "attn_k.weight"].T).view(seq, self.n_kv_heads, hd))
            v = (h @ w[p + "attn_v.weight"].T).view(seq, self.n_kv_heads, hd)
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5 + mask
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, -1)
            x = x + attn @ w[p + "attn_output.weight"].T
            h = self._norm(x, w[p + "ffn_norm.weight"])
            gate = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T)
            x = x + (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        out = w.get("output.weight", w["token_embd.weight"])
        return self._norm(x, w["output_norm.weight"]) @ out.T

    def greedy(self, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy continuation and the logits [steps, vocab] that chose each token."""
        ids, chosen, rows = list(ids), [], []
        for _ in range(steps):
            row = self.logits(ids)[-1]
            rows.append(row)
            chosen.append(int(row.argmax()))
            ids.append(chosen[-1])
        return chosen, torch.stack(rows)
