"""--cpu-level: the command that runs a bench at a lower x86 level (tools/bench/cpu_level.py).

Against a fake llama-bench and a fake backends folder: the environment of each level, the copy
of the level's backend that the private mount puts in the folder's place, and every way the
level cannot be had (a CPU without it, a folder without its backend, no mount namespace). Then
the real thing where this machine has it: Debian's llama-bench run by the command loads the
level's backend and no other, and a Python started with its environment runs ATen's and the
engine's kernels of that level.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.llama3 import kernel_library
from tools.bench import cpu_level

LEVEL = cpu_level.LEVELS["avx2"]


def _fake_llama_bench(tmp_path: Path, backend: Path) -> Path:
    """A llama-bench whose --version says it loaded `backend`."""
    script = tmp_path / "bin" / "llama-bench"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"print('load_backend: loaded CPU backend from {backend}', file=sys.stderr)\n"
        "print('version: 0.7.0 (build 11669, commit Debian)', file=sys.stderr)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def backends(tmp_path: Path, monkeypatch) -> Path:
    """A backends folder of two CPU backends, the best one loaded; copies kept in tmp_path."""
    folder = tmp_path / "backends0"
    folder.mkdir()
    for name in ("sapphirerapids", "haswell"):
        (folder / f"libggml-cpu-{name}.so").write_bytes(name.encode() * 100)
    script = _fake_llama_bench(tmp_path, folder / "libggml-cpu-sapphirerapids.so")
    monkeypatch.setenv("PATH", str(script.parent))
    monkeypatch.setattr(cpu_level, "COPIES", tmp_path / "copies")
    monkeypatch.setattr(cpu_level, "_check_namespace", lambda: None)
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    return folder


def test_the_command_mounts_a_copy_of_the_levels_backend_over_the_folder(backends: Path):
    argv, environment = cpu_level.command("avx2", ["python3", "bench.py", "--cpu-level=avx2"])
    copy = cpu_level.COPIES / "haswell"
    assert argv == [
        "unshare", "--mount", "sh", "-c", cpu_level._MOUNT_THEN_RUN, "sh",
        str(copy), str(backends), "python3", "bench.py", "--cpu-level=avx2",
    ]  # fmt: skip
    assert sorted(p.name for p in copy.iterdir()) == ["libggml-cpu-haswell.so"]
    assert (copy / "libggml-cpu-haswell.so").read_bytes() == b"haswell" * 100
    assert environment["LLAMA_GOLDENS_KERNELS"] == "avx2"
    assert environment["ATEN_CPU_CAPABILITY"] == "avx2"
    assert environment["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert environment["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert environment[cpu_level.ENV] == "avx2"


def test_without_llama_cpp_only_the_engines_side_changes(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    argv, environment = cpu_level.command("avx2", ["python3", "bench.py"])
    assert argv == ["python3", "bench.py"]
    assert environment["ATEN_CPU_CAPABILITY"] == "avx2"


def test_a_level_this_cpu_lacks_is_named(backends: Path, monkeypatch):
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(cpu_level.LevelUnavailable, match="this CPU lacks avx512f"):
        cpu_level.command("avx512", ["python3"])


def test_a_folder_without_the_levels_backend_says_what_it_holds(backends: Path):
    (backends / "libggml-cpu-haswell.so").unlink()
    with pytest.raises(cpu_level.LevelUnavailable) as error:
        cpu_level.command("avx2", ["python3"])
    assert "holds no libggml-cpu-haswell.so (it holds libggml-cpu-sapphirerapids.so)" in str(
        error.value
    )


def test_no_mount_namespace_exits_2_naming_the_fix(backends: Path, monkeypatch, capsys):
    def refused() -> None:
        raise cpu_level.LevelUnavailable("`unshare --mount` failed (Operation not permitted)")

    monkeypatch.setattr(cpu_level, "_check_namespace", refused)
    monkeypatch.delenv(cpu_level.ENV, raising=False)
    parser = argparse.ArgumentParser(prog="bench")
    with pytest.raises(SystemExit) as exit_:
        cpu_level.enter("avx2", parser)
    assert exit_.value.code == 2
    assert "--cpu-level=avx2: `unshare --mount` failed" in capsys.readouterr().err


def test_the_process_at_the_level_says_so_and_runs_on(monkeypatch):
    monkeypatch.setenv(cpu_level.ENV, "avx2")
    line = cpu_level.enter("avx2", argparse.ArgumentParser())
    assert line.startswith("cpu level avx2: this engine with LLAMA_GOLDENS_KERNELS=avx2, ")
    assert "llama.cpp with libggml-cpu-haswell.so alone" in line
    assert cpu_level.enter(None, argparse.ArgumentParser()) is None


def _real_level_or_skip() -> Path:
    if not kernel_library.runnable(LEVEL.kernels):
        pytest.skip("this CPU has no AVX2")
    if shutil.which("llama-bench") is None:
        missing = "llama-bench not installed (tools/llama_cpp/install.sh installs it)"
        if os.environ.get("CI_REQUIRE_LLAMA_CPP") == "1":  # .ci/run installs it: run, not skip
            pytest.fail(missing + "; CI_REQUIRE_LLAMA_CPP=1")
        pytest.skip(missing)
    try:
        cpu_level._check_namespace()
    except cpu_level.LevelUnavailable as error:
        unavailable = f"no private mount namespace here: {error}"
        if os.environ.get("CI_REQUIRE_LLAMA_CPP") == "1":  # CI runs as root: it must run
            pytest.fail(unavailable + "; CI_REQUIRE_LLAMA_CPP=1")
        pytest.skip(unavailable)
    return Path(shutil.which("llama-bench"))


def test_at_the_level_llama_cpp_loads_that_backend_and_the_engine_runs_its_kernels(
    tmp_path: Path, monkeypatch
):
    binary = _real_level_or_skip()
    monkeypatch.setattr(cpu_level, "COPIES", tmp_path)
    argv, environment = cpu_level.command("avx2", [str(binary), "--version"])
    done = subprocess.run(argv, env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = [line for line in done.stderr.splitlines() if "loaded CPU backend" in line]
    assert [Path(line.split()[-1]).name for line in loaded] == ["libggml-cpu-haswell.so"]
    child = (
        "import torch\n"
        "from pipelines.llama3 import kernel_library as k\n"
        "print(torch.backends.cpu.get_cpu_capability(), k.chosen(k.GGML_ORDER), k.chosen())\n"
    )
    python = [sys.executable, "-c", child]
    environment["PYTHONPATH"] = ":".join(p for p in sys.path if p)
    done = subprocess.run(python, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AVX2", "avx2", "avx2"]
