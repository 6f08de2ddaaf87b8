"""A Llama 3 inference engine in PyTorch that reads GGUF checkpoints (CPU and CUDA).

engine = Llama3Engine.from_gguf(path, device="cpu", dtype=torch.float32)
out = engine.generate(engine.tokenizer.encode("The capital of France is"), max_new_tokens=8)
"""

from pipelines.llama3.config import LlamaConfig
from pipelines.llama3.engine import GenerationOutput, Llama3Engine
from pipelines.llama3.gguf_loader import CheckpointError, load_config
from pipelines.llama3.model import Transformer
from pipelines.llama3.tokenizer import Tokenizer

__all__ = [
    "CheckpointError",
    "GenerationOutput",
    "Llama3Engine",
    "LlamaConfig",
    "Tokenizer",
    "Transformer",
    "load_config",
]
