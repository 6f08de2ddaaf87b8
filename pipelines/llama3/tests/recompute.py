"""Greedy decoding without the KV cache: the reference the engine's cached decode is checked by.

Each step recomputes the whole sequence from its tokens, reading and writing no cache, through
the model's own submodules and weights. The result equals the cached decode bitwise only if
every kernel sees the rows it saw there: CPU matmul and attention kernels round a row
differently depending on how many rows share the call (1 decode row vs n rows; ~1e-7 per op,
6.4e-5 on SmolLM2's logits after 30 layers). So the recompute calls each kernel once per row
group of the cached run (the prompt, then one row per decoded token) and concatenates.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipelines.llama3 import Llama3Engine, Transformer
from pipelines.llama3.model import Attention, TransformerBlock, apply_rotary_emb, causal_mask

# Row groups [start, end) of a sequence, in the order the cached run computed them.
Steps = list[tuple[int, int]]


@dataclasses.dataclass
class Decoded:
    tokens: list[int]  # the greedy choice of each step
    logits: torch.Tensor  # [steps, vocab] float32 cpu; row i chose tokens[i]


def decode_steps(prompt_len: int, seqlen: int) -> Steps:
    """The cached run's row groups: the prompt in one prefill, then one decoded token each."""
    return [(0, prompt_len)] + [(pos, pos + 1) for pos in range(prompt_len, seqlen)]


def by_step(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, steps: Steps
) -> torch.Tensor:
    """fn applied to each row group [start, end) of x [bsz, seq, ...] on its own, concatenated,
    so that fn's kernels get the shapes they had in the cached run."""
    return torch.cat([fn(x[:, start:end]) for start, end in steps], dim=1)


def recompute_attention(
    attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: Steps
) -> torch.Tensor:
    """Attention.forward over the whole sequence from position 0, from fresh keys and values:
    the queries of each step see every key up to their own position, as in the cached run."""
    bsz, seqlen, _ = x.shape
    head_dim = attention.head_dim
    xq = by_step(attention.wq, x, steps).view(bsz, seqlen, attention.n_heads, head_dim)
    xk = by_step(attention.wk, x, steps).view(bsz, seqlen, attention.n_kv_heads, head_dim)
    xv = by_step(attention.wv, x, steps).view(bsz, seqlen, attention.n_kv_heads, head_dim)
    xq = apply_rotary_emb(xq.transpose(1, 2), cos, sin)  # [bsz, heads, seq, head_dim]
    xk = apply_rotary_emb(xk.transpose(1, 2), cos, sin)
    xv = xv.transpose(1, 2)
    outputs = []
    for start, end in steps:
        mask = causal_mask(end - start, start, x.device) if end - start > 1 else None
        outputs.append(
            F.scaled_dot_product_attention(
                xq[:, :, start:end],
                xk[:, :, :end],
                xv[:, :, :end],
                attn_mask=mask,
                scale=attention.scale,
                enable_gqa=True,
            )
        )
    output = torch.cat(outputs, dim=2).transpose(1, 2).reshape(bsz, seqlen, -1)
    return by_step(attention.wo, output, steps)


def recompute_block(
    block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, steps: Steps
) -> torch.Tensor:
    """TransformerBlock.forward over the whole sequence, in the cached run's row groups."""
    normed = by_step(block.attention_norm, x, steps)
    h = x + recompute_attention(block.attention, normed, cos, sin, steps)
    return h + by_step(lambda rows: block.feed_forward(block.ffn_norm(rows)), h, steps)


@torch.inference_mode()
def recompute_logits(model: Transformer, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits [bsz, 1, vocab] float32 of the last position of tokens [bsz, seq], from scratch.

    tokens are a prompt of prompt_len tokens followed by decoded tokens. Only the RoPE tables
    of `setup_caches` are read; the final norm and LM head are the model's own.
    """
    seqlen = tokens.shape[1]
    if seqlen > model.max_seq_len:
        raise ValueError(f"{seqlen} positions exceed {model.max_seq_len}; call setup_caches")
    steps = decode_steps(prompt_len, seqlen)
    h = model.tok_embeddings(tokens)  # [bsz, seq, dim]
    cos, sin = model.rope_cos[:seqlen], model.rope_sin[:seqlen]
    for layer in model.layers:
        h = recompute_block(layer, h, cos, sin, steps)
    return model._logits(h[:, -1:])


@torch.inference_mode()
def greedy_decode_without_cache(
    engine: Llama3Engine, input_ids: list[int], max_new_tokens: int
) -> Decoded:
    """What engine.generate(input_ids, max_new_tokens, stop_on_eos=False) computes, with every
    step's logits recomputed from the whole sequence so far instead of read off the KV cache."""
    engine.model.setup_caches(len(input_ids) + max_new_tokens)  # the RoPE tables
    tokens: list[int] = []
    rows = []
    for _ in range(max_new_tokens):
        sequence = torch.tensor([input_ids + tokens], dtype=torch.long, device=engine.device)
        logits = recompute_logits(engine.model, sequence, len(input_ids))[0, -1]  # [vocab]
        tokens.append(int(torch.argmax(logits)))
        rows.append(logits)
    return Decoded(tokens, torch.stack(rows).cpu())
