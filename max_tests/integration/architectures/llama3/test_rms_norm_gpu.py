"""RMSNorm on the device under test against a float64 CPU reference (gpu_reference.py)."""

from __future__ import annotations

import pytest
import torch

from max_tests.integration.architectures.llama3.gpu_reference import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    generator,
)
from pipelines.llama3.model import RMSNorm

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scale", [3.0, 1e-3], ids=["unit", "small"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_gpu(dtype, device, scale):
    """At `small` the rows' mean square (1e-6) is below eps, so eps decides the result: an
    eps dropped or added outside the square root fails there (at `unit` it cannot matter)."""
    dim, eps = 576, 1e-5
    x = torch.randn(2, 7, dim, generator=generator(0), dtype=torch.float64) * scale
    weight = torch.rand(dim, generator=generator(1), dtype=torch.float64) + 0.5
    norm = RMSNorm(dim, eps).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    # The reference sees the same rounded inputs the device sees.
    x_in, w_in = x.to(dtype).double(), weight.to(dtype).double()
    reference = w_in * x_in / torch.sqrt(x_in.pow(2).mean(-1, keepdim=True) + eps)
    assert_close(norm(x.to(device, dtype)), reference, dtype, "RMSNorm")
