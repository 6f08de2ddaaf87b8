"""Tiny random Llama 3.1 GGUF checkpoints for golden tests."""
