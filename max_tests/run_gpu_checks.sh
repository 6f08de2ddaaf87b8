#!/usr/bin/env bash
# The GPU checks as one script, for a CUDA machine without Bazel (for example the device
# tool's H200, which has torch with CUDA, transformers and pytest but no gguf and no network).
#
#   max_tests/run_gpu_checks.sh [OUT_DIR]
#
# 1. installs wheels carried in .whl/ (gguf, and anything else missing) into /tmp/site;
# 2. runs every GPU test with plain pytest on CUDA (kernels, RMSNorm, NVFP4 linear and
#    attention vs a float64 CPU reference; goldens on CUDA);
# 3. writes this GPU's bfloat16 goldens (engine and torch) into OUT_DIR, ready for
#    tools/upload-public-bazel-artifact.sh on a machine with the repository.
# Prepare the wheels once, on the machine with the repository (see the device tool's README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu-goldens}}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:${PYTHONPATH}}"
fi
# GPU_TEST_DEVICE pinned: one left at cpu in the caller's shell would test the CPU instead.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 GPU_TESTS_REQUIRED=1 GPU_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

status=0
python3 -m pytest max_tests -m gpu -v --durations=10 2>&1 | tee "$out/gpu_pytest.log"
status=$((status | PIPESTATUS[0]))
python3 -m max_tests.integration.architectures.llama3.evaluate_llama \
  --model=tinyllama --encoding=bfloat16 --device=cuda --output-dir="$out" || status=1
python3 -m max_tests.integration.architectures.llama3.testdata.run_torch_llama_gpu \
  --model=tinyllama --encoding=bfloat16 --output-dir="$out" --verbose || status=1
ls -la "$out"
exit "$status"
