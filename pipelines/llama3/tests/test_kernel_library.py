"""How the engine finds, picks and loads a kernel build (kernel_library.py), in milliseconds.

The CPU's flags as /proc/cpuinfo lists them, the flags each build needs, the error that names
the builds a CPU runs, where a library is looked for (the runfiles before bazel-bin), a tree
without the kernels' sources, and the library's own report of its instruction set. The kernels'
arithmetic and the default choices are test_packed.py's and test_ggml_mode.py's.
"""

from __future__ import annotations

import pathlib
import platform
import shutil

import pytest

from pipelines.llama3 import kernel_library

# The CPU flags each build's compiler flags need (kernels/BUILD.bazel's ISA_COPTS: -mavx512f,
# -mavx512vl, -mavx512bw, -mavx512vnni, -mavx2, -mfma, -mf16c), as /proc/cpuinfo spells them.
EXPECTED_FLAGS = {
    "vnni": {"avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "portable": set(),
}
ALL_FLAGS = frozenset().union(*EXPECTED_FLAGS.values())


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, flags) -> None:
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset(flags))


def test_cpu_flags_are_the_flags_line_of_proc_cpuinfo() -> None:
    """cpu_flags() is the set of words after the colon of /proc/cpuinfo's `flags` line: on
    x86-64 it holds the baseline every such CPU lists (fpu, sse2), and neither the line's
    name nor its colon. Planted: the part before the colon taken (partition(":")[0]) read the
    flags as {"flags"}: every build but portable then looked unrunnable, and the tests of the
    other builds skipped (a skip, not a failure) while the default fell to portable."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.is_file():
        pytest.skip("the kernels' flags are x86-64's, read from Linux's /proc/cpuinfo")
    line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    flags = kernel_library.cpu_flags()
    assert flags == frozenset(line.split(":", 1)[1].split())
    assert {"fpu", "sse2"} <= flags
    assert not {"flags", ":"} & flags


def test_each_build_needs_every_flag_its_compiler_flags_use(monkeypatch) -> None:
    """A CPU that lacks any one of the flags a build is compiled for cannot run it: the build
    names exactly that flag as missing, is refused when $LLAMA_GOLDENS_KERNELS names it
    (rather than crash on an illegal instruction) and is passed over as a default. The case
    that matters: AVX-512 without VNNI (Skylake-X), where the ggml mode must take avx2.
    Planted: avx512_vnni dropped from the vnni build's flags chose vnni on such a CPU."""
    monkeypatch.delenv(kernel_library.KERNELS_ENV, raising=False)
    for isa, needed in EXPECTED_FLAGS.items():
        assert set(kernel_library.REQUIRED_FLAGS[isa]) == needed, isa
        for flag in sorted(needed):
            _fake_cpu(monkeypatch, ALL_FLAGS - {flag})
            assert kernel_library.missing_flags(isa) == [flag], (isa, flag)
            assert not kernel_library.runnable(isa)
            monkeypatch.setenv(kernel_library.KERNELS_ENV, isa)
            with pytest.raises(kernel_library.KernelUnavailable, match=f"lacks {flag} "):
                kernel_library.chosen()
            monkeypatch.delenv(kernel_library.KERNELS_ENV)
    skylake_x = {"sse2", "avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512dq"}
    _fake_cpu(monkeypatch, skylake_x)
    assert kernel_library.chosen(kernel_library.GGML_ORDER) == "avx2"
    assert kernel_library.chosen() == "avx2"


def test_an_unrunnable_choice_lists_every_build_the_cpu_runs(monkeypatch) -> None:
    """The refusal of a build the CPU cannot run names the flags it lacks and every build it
    does run, avx512 included though no default order holds it. Planted: the runnable builds
    listed from the default order (avx2, portable) left avx512 out."""
    _fake_cpu(monkeypatch, {"sse2", "avx2", "fma", "f16c", "avx512f"})
    monkeypatch.setenv(kernel_library.KERNELS_ENV, "vnni")
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library.chosen()
    assert str(error.value) == (
        "$LLAMA_GOLDENS_KERNELS=vnni: this CPU lacks avx512vl avx512bw avx512_vnni "
        "(/proc/cpuinfo); it runs avx512, avx2, portable (unset $LLAMA_GOLDENS_KERNELS for the "
        "default)"
    )


def _tree(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A checkout in tmp_path: this module's folder, its kernels' sources, and bazel-bin."""
    here = tmp_path / "pipelines" / "llama3"
    sources = tuple(here / "kernels" / name for name in ("packed_gemm.c", "ggml_dot.c", "half.h"))
    bazel_bin = tmp_path / "bazel-bin" / "pipelines" / "llama3" / "kernels"
    monkeypatch.delenv(kernel_library.DIRECTORY_ENV, raising=False)
    monkeypatch.setattr(kernel_library, "_HERE", here)
    monkeypatch.setattr(kernel_library, "SOURCES", sources)
    monkeypatch.setattr(kernel_library, "BAZEL_BIN", bazel_bin)
    return here, sources, bazel_bin


def test_the_runfiles_library_comes_before_bazel_bins(tmp_path, monkeypatch) -> None:
    """Under Bazel the library beside this module (the runfiles) is the one loaded, never a
    checkout's bazel-bin, which may hold another version (here a stale one, which would be
    refused). Bazel's own runfiles have no bazel-bin, so only a tree with both tells. Planted:
    bazel-bin looked in first took (here: refused) the checkout's library."""
    here, sources, bazel_bin = _tree(tmp_path, monkeypatch)
    for folder in (here / "kernels", bazel_bin):
        folder.mkdir(parents=True)
        (folder / "packed_gemm_portable.so").write_bytes(b"")
    for source in sources:
        source.write_text(f"/* {source.name} */\n")
    (bazel_bin / "kernels.sha256").write_text("0" * 64 + "\n")
    beside = here / "kernels" / "packed_gemm_portable.so"
    assert kernel_library._locate("portable") == beside


def test_a_tree_without_the_sources_takes_the_library_as_it_is(tmp_path, monkeypatch) -> None:
    """Where the kernels' sources are not there (an installed tree), a library outside the
    runfiles is taken as it is, its folder's kernels.sha256 unchecked: from bazel-bin and from
    the folder $LLAMA_GOLDENS_KERNEL_DIR names. Planted: the staleness check run whenever a
    stamp is there read the absent sources (FileNotFoundError)."""
    _, sources, bazel_bin = _tree(tmp_path, monkeypatch)
    assert not any(source.exists() for source in sources)
    configured = tmp_path / "configured"
    for folder in (bazel_bin, configured):
        folder.mkdir(parents=True)
        (folder / "packed_gemm_portable.so").write_bytes(b"")
        (folder / "kernels.sha256").write_text("0" * 64 + "\n")
    assert kernel_library._locate("portable") == bazel_bin / "packed_gemm_portable.so"
    monkeypatch.setenv(kernel_library.DIRECTORY_ENV, str(configured))
    assert kernel_library._locate("portable") == configured / "packed_gemm_portable.so"


def test_a_library_reporting_another_instruction_set_is_refused(tmp_path, monkeypatch) -> None:
    """A library is checked against the build its name says: its vector width
    (packed_gemm_simd) and its dot products' instruction set (ggml_dot_isa). The avx512 build
    under the vnni build's name reports the same 512-bit vectors but AVX2's dot products, and is
    refused; under its own name, from the same folder, it loads. Planted: the two checks joined
    by `and` instead of `or` took it (a width that matched let any dot product through)."""
    lacks = kernel_library.missing_flags("avx512")
    if lacks:
        pytest.skip(f"this CPU cannot run the avx512 kernels: it lacks {' '.join(lacks)}")
    real = kernel_library._locate("avx512")
    for name in ("packed_gemm_vnni.so", "packed_gemm_avx512.so"):
        shutil.copyfile(real, tmp_path / name)
    monkeypatch.setenv(kernel_library.DIRECTORY_ENV, str(tmp_path))
    # load.__wrapped__: past load's cache, which keeps the process's own libraries.
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library.load.__wrapped__("vnni")
    assert str(error.value).startswith(
        f"{tmp_path / 'packed_gemm_vnni.so'} reports 512-bit vectors and dot products of "
        "level 1, not vnni's 512 and 2"
    )
    assert str(error.value).endswith(": run `./bazelw build //pipelines/llama3/kernels`")
    lib = kernel_library.load.__wrapped__("avx512")
    assert (lib.packed_gemm_simd(), lib.ggml_dot_isa()) == (512, 1)


def test_an_unknown_build_is_refused_by_name() -> None:
    """load() names the builds there are when asked for another, before looking for a file.
    Planted: the name check dropped refused it only as a missing file (the message of an
    absent library, with its build command) or, where such a file was there, a KeyError."""
    with pytest.raises(kernel_library.KernelUnavailable) as error:
        kernel_library.load("avx1024")
    assert str(error.value) == "no kernel build 'avx1024' (one of vnni, avx512, avx2, portable)"
