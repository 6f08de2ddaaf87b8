"""One macro for every pytest-based test: a py_test whose main is the shared runner."""

load("@pip//:requirements.bzl", "requirement")
load("@rules_python//python:defs.bzl", "py_test")

def pytest_test(name, srcs, deps = [], data = [], args = [], env = {}, **kwargs):
    """A py_test that runs pytest over `srcs`.

    Extra pytest arguments reach the runner through `args` here or `--test_arg` on the
    command line, so `--test_arg=-k --test_arg='test_llama[tiny-float32-llama3_1]'` selects
    one case.
    """
    py_test(
        name = name,
        srcs = srcs + ["//bazel:pytest_runner.py"],
        main = "//bazel:pytest_runner.py",
        deps = deps + [requirement("pytest")],
        data = data + ["//:pyproject.toml"],
        # Only test modules are collected; conftest.py and helpers are imported by pytest.
        args = ["$(rootpath %s)" % src for src in srcs if src.split("/")[-1].startswith("test_")] + args,
        env = env,
        **kwargs
    )

def gpu_pytest_test(name, size = "enormous", tags = [], exec_properties = {}, **kwargs):
    """A pytest_test that needs a CUDA device.

    Incompatible (reported SKIPPED) unless --config=gpu; `size = "enormous"` and the
    gpu-memory resource let a remote executor place it on a GPU worker. Under --config=gpu
    without a GPU the tests fail with "no CUDA device" instead of skipping.
    """
    props = {"test.resources:gpu-memory": "2"}
    props.update(exec_properties)
    pytest_test(
        name = name,
        size = size,
        tags = tags + ["gpu"],
        exec_properties = props,
        target_compatible_with = select({
            "//:gpu_enabled": [],
            "//conditions:default": ["@platforms//:incompatible"],
        }),
        **kwargs
    )
