"""run_torch_llama_gpu: run_torch_llama on the GPU (default --device=cuda)."""

import sys

from max_tests.integration.architectures.llama3.testdata.run_torch_llama import main

if __name__ == "__main__":
    sys.exit(main(default_device="cuda"))
