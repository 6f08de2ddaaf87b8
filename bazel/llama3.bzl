"""Macros for the llama3 golden package: what each test and tool sees of the checkpoints and goldens.

A target that reads checkpoints gets the tiny GGUF files (`PIPELINES_TESTDATA`) in its runfiles.
One that reads goldens also gets the SmolLM2 checkpoint (`SMOLLM2_GGUF`) and the two pinned
golden archives (`TEST_LLAMA_GOLDENS`, `TORCH_LLAMA_GOLDENS`), which
max_tests/goldens/locate.py reads in preference to anything in the source tree.
"""

load("@pip//:requirements.bzl", "requirement")
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

def llama3_test(name, size, goldens = True, gpu = False, srcs = [], deps = []):
    """The pytest file `<name>.py` with the package's conftest, over the tiny checkpoints.

    `goldens` adds SmolLM2 and the pinned golden archives; `gpu` makes it a GPU test
    (SKIPPED as incompatible unless --config=gpu); `srcs` are modules under test that no
    library holds (a tool's main file), `deps` what else it imports. The suites in
    //max_tests/integration are its only users.
    """
    rule = gpu_pytest_test if gpu else pytest_test
    rule(
        name = name,
        size = size,
        srcs = [
            "conftest.py",
            name + ".py",
        ] + srcs,
        data = _CHECKPOINTS + (_SMOLLM2 + _GOLDEN_ARCHIVES if goldens else []),
        env = _CHECKPOINTS_ENV | (_SMOLLM2_ENV | _GOLDEN_ARCHIVES_ENV if goldens else {}),
        visibility = ["//max_tests/integration:__pkg__"],
        deps = [
            ":golden_run",
            "//max_tests:conftest",
            requirement("gguf"),
        ] + deps,
    )

def llama3_tool(name, srcs, deps, goldens = False, env = {}, visibility = None):
    """A `bazel run` tool (main `<name>.py`) over the tiny checkpoints and SmolLM2.

    `goldens` adds the pinned golden archives, for tools that compare against them.
    """
    py_binary(
        name = name,
        srcs = srcs,
        data = _CHECKPOINTS + _SMOLLM2 + (_GOLDEN_ARCHIVES if goldens else []),
        env = _SMOLLM2_ENV | (_GOLDEN_ARCHIVES_ENV if goldens else {}) | env,
        visibility = visibility,
        deps = deps,
    )
