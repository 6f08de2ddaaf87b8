"""The one configuration dataclass of the Llama 3 engine, filled from GGUF metadata."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int  # llama.embedding_length
    n_layers: int  # llama.block_count
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # llama.feed_forward_length
    head_dim: int  # llama.rope.dimension_count, else dim // n_heads
    rope_theta: float  # llama.rope.freq_base
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool  # true when the file has no output.weight
    # Llama 3.1 frequency scaling. `rope_freq_factors` is the file's rope_freqs tensor (llama.cpp
    # divides each inverse frequency by it); without the tensor the factors are computed from
    # the "llama3" parameters below, as Meta's apply_scaling does.
    rope_scaling_type: str | None = None  # "llama3", "linear" or None
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context_length: int = 8192
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads
