"""Macros for the llama3 golden package: what each test and tool sees of the checkpoints and goldens.

A target that reads checkpoints gets the tiny GGUF files (`PIPELINES_TESTDATA`) in its runfiles.
One that reads goldens also gets the SmolLM2 checkpoint (`SMOLLM2_GGUF`) and the two pinned
golden archives (`TEST_LLAMA_GOLDENS`, `TORCH_LLAMA_GOLDENS`), which
goldens/locate.py reads in preference to anything in the source tree.
"""

load("@rules_python//python:defs.bzl", "py_binary")
load("//bazel:pytest.bzl", "gpu_pytest_test", "pytest_test")

_TESTDATA_PACKAGE = "max_tests/integration/architectures/llama3/testdata"

_CHECKPOINTS = ["//" + _TESTDATA_PACKAGE]

_CHECKPOINTS_ENV = {"PIPELINES_TESTDATA": _TESTDATA_PACKAGE}

_SMOLLM2 = ["@smollm2//:gguf"]

_SMOLLM2_ENV = {"SMOLLM2_GGUF": "$(rootpath @smollm2//:gguf)"}

_GOLDEN_ARCHIVES = [
    "@test_llama_golden",
    "@torch_llama_golden",
]

_GOLDEN_ARCHIVES_ENV = {
    "TEST_LLAMA_GOLDENS": "$(rootpaths @test_llama_golden)",
    "TORCH_LLAMA_GOLDENS": "$(rootpaths @torch_llama_golden)",
}

# What the package's conftest.py imports; a test adds what its own files import (`deps`), and
# nothing more, so an edit reruns only the tests it can change.
_CONFTEST_IMPORTS = [
    "//harness/llama3:harness",
    "//goldens",
    "//max_tests:conftest",
]

def llama3_test(name, size, goldens = True, gpu = False, deps = [], srcs = None, env = {}, data = [], **kwargs):
    """The pytest file `<name>.py` (or the files `srcs`) with the package's conftest, over the tiny checkpoints.

    Every test gets what the package's conftest.py imports (`_CONFTEST_IMPORTS`) and its
    `deps`. The suites in //max_tests/integration are its only users.

    Args:
      name: the target, and `<name>.py` its test file.
      size: the test's size; for a GPU test, that of its `<name>_on_cpu` twin (the CUDA
        target is `enormous`, for placement).
      goldens: adds SmolLM2 and the pinned golden archives.
      gpu: makes it a GPU test: `name` runs on CUDA (SKIPPED as incompatible unless
        --config=gpu) and `<name>_on_cpu` runs the same file with the CPU as the device under
        test (gpu_pytest_test).
      deps: what its test files import (beyond the conftest's `_CONFTEST_IMPORTS`).
      srcs: the test files, when they are not `<name>.py`: several small files in one
        process (each target pays for starting Python and importing torch), or a second
        target over the same file.
      env: more environment for the test.
      data: more files for the test (e.g. `@llama_cpp_installed//:fingerprint`).
      **kwargs: more attributes of the test (`env_inherit`, `tags`).
    """
    kwargs = kwargs | dict(
        srcs = ["conftest.py"] + (srcs or [name + ".py"]),
        data = _CHECKPOINTS + (_SMOLLM2 + _GOLDEN_ARCHIVES if goldens else []) + data,
        env = _CHECKPOINTS_ENV | (_SMOLLM2_ENV | _GOLDEN_ARCHIVES_ENV if goldens else {}) | env,
        visibility = ["//max_tests/integration:__pkg__"],
        deps = _CONFTEST_IMPORTS + [dep for dep in deps if dep not in _CONFTEST_IMPORTS],
    )
    if gpu:
        gpu_pytest_test(name = name, cpu_size = size, **kwargs)
    else:
        pytest_test(name = name, size = size, **kwargs)

def llama3_tool(name, srcs, deps, goldens = False, env = {}, visibility = None, main = None):
    """A `bazel run` tool (main `<name>.py`) over the tiny checkpoints and SmolLM2.

    `goldens` adds the pinned golden archives, for tools that compare against them.
    """
    py_binary(
        name = name,
        srcs = srcs,
        main = main,
        data = _CHECKPOINTS + _SMOLLM2 + (_GOLDEN_ARCHIVES if goldens else []),
        env = _SMOLLM2_ENV | (_GOLDEN_ARCHIVES_ENV if goldens else {}) | env,
        visibility = visibility,
        deps = deps,
    )

def llama3_tool_test(name, srcs, deps, size = "medium", env = {}):
    """A pytest test of a tool outside the llama3 package, with the golden data.

    It sees the tiny checkpoints, SmolLM2 and the pinned golden archives, as
    `llama3_tool(goldens = True)` does.

    Args:
      name: the target.
      srcs: the test files and what they import of the tool.
      deps: what they import.
      size: the test's size.
      env: more environment for the test.
    """
    pytest_test(
        name = name,
        size = size,
        srcs = srcs,
        data = _CHECKPOINTS + _SMOLLM2 + _GOLDEN_ARCHIVES,
        env = _CHECKPOINTS_ENV | _SMOLLM2_ENV | _GOLDEN_ARCHIVES_ENV | env,
        deps = deps,
    )
