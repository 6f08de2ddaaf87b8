"""The chain Bazel -> pip hub -> pytest works: the pinned libraries import and compute."""

import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]


def test_torch_is_the_pinned_cpu_build():
    assert torch.__version__.startswith("2.13.0")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(x @ x.T, torch.tensor([[5.0, 14.0], [14.0, 50.0]]))


def test_gguf_round_trips_a_tensor(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_tensor("w", np.array([1.5, -2.0, 0.25], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["llama.block_count"].parts[-1][0] == 3
    assert reader.tensors[0].data.tolist() == [1.5, -2.0, 0.25]


def test_transformers_builds_a_llama_config():
    config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    assert config.head_dim == 8
    assert config.model_type == "llama"


def test_certifi_bundle_is_no_action_input():
    """certifi's CA bundle is kept out of the runfiles (MODULE.bazel, pip_data_exclude).

    A machine may append its own CA to that file after pip writes it; as an input it gave
    every test that imports requests a new cache key on such a machine. Under Bazel the file
    must be absent (a dropped exclusion fails here) while requests and certifi still import.
    """
    import certifi
    import requests

    if "TEST_SRCDIR" not in os.environ:
        pytest.skip("plain pytest: certifi comes from the pip hub's folder, not runfiles")
    assert requests.__version__
    bundle = certifi.where()
    assert "runfiles" in bundle, bundle
    assert not os.path.exists(bundle), f"{bundle} is an input of this test again"


def test_bazelrc_and_module_hold_the_offline_settings():
    """docs/environment.md:22-32: offline resolution with Debian's Bazel needs
    `common --noenable_workspace` and MODULE.bazel overriding exactly the four modules
    bazel_tools asks the registry for with their stand-ins in third_party/bazel_standins/;
    `--lockfile_mode=off` keeps the stand-ins out of the lock file, `build --nosandbox_debug`
    quiets Debian's bazelrc, and every run shares one disk cache capped at 5 GB. Nothing fails
    when the last three go, so they are held here (planted: `common --lockfile_mode=off`
    dropped; protobuf's override pointed at another folder)."""
    bazelrc = {line.strip() for line in (REPO / ".bazelrc").read_text().splitlines()}
    assert {
        "common --noenable_workspace",
        "common --lockfile_mode=off",
        "build --nosandbox_debug",
        "build --disk_cache=~/.cache/llama-goldens/bazel-disk-cache",
        "build --experimental_disk_cache_gc_max_size=5G",
    } <= bazelrc
    overrides = re.findall(
        r'local_path_override\(\s*module_name = "(\w+)",\s*path = "([^"]+)",\s*\)',
        (REPO / "MODULE.bazel").read_text(),
    )
    names = ["zlib", "protobuf", "buildozer", "apple_support"]
    assert overrides == [(name, f"third_party/bazel_standins/{name}") for name in names]
