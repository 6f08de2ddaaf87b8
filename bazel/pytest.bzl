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
        args = ["$(rootpath %s)" % src for src in srcs] + args,
        env = env,
        **kwargs
    )
