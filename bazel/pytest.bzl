"""One macro for every pytest-based test: a py_test whose main is the shared runner."""

load("@pip//:requirements.bzl", "requirement")
load("@rules_python//python:defs.bzl", "py_test")

def pytest_test(name, srcs, deps = [], data = [], args = [], env = {}, tags = [], **kwargs):
    """A py_test that runs pytest over `srcs`.

    Extra pytest arguments reach the runner through `args` here or `--test_arg` on the
    command line, so `--test_arg=-k --test_arg='test_llama[tiny-float32-llama3_1]'` selects
    one case. A target depends on what its files import and nothing else: when a selection
    matches nothing here, the runner checks it against the package's other test files in the
    source tree (bazel/pytest_runner.py), so they are not data of this target and an edit of
    one reruns only its own target.
    """
    py_test(
        name = name,
        srcs = srcs + ["//bazel:pytest_runner.py"],
        main = "//bazel:pytest_runner.py",
        deps = deps + [requirement("pytest")],
        data = data + ["//:pyproject.toml"],
        # Only test modules are collected; conftest.py and helpers are imported by pytest.
        args = ["$(rootpath %s)" % src for src in srcs if src.split("/")[-1].startswith("test_")] + args,
        # One torch (OpenMP) thread per test unless the target says otherwise: Bazel runs as
        # many tests at once as there are cores, each holding one. With torch's default (a
        # thread per core) the tests oversubscribe the cores, and every parallel region waits
        # for a descheduled thread: after an edit of model.py, test_llama took 41 s in
        # //max_tests/integration:tests instead of 9 s alone. A test that runs more threads
        # itself (test_same_bits' 2-thread runs, test_packed's 3) shares the cores with the
        # other test: OpenMP's threads then sleep at a barrier instead of spinning for their
        # descheduled partner (OMP_WAIT_POLICY; numerics unchanged). test_same_bits' SmolLM2
        # check beside a busy core: portable 2 threads 20.4 -> 7.0 s, vnni 4.0 -> 0.9 s.
        #
        # glibc serves every allocation over 128 KiB (a 128k-entry logits row: 512 KiB, 1 MiB
        # in float64) with a fresh mmap, and gives it back at free: each temporary of the
        # comparisons and samplers then pays its page faults again. Below 64 MiB they come
        # from the heap, kept for the next (MALLOC_TRIM_THRESHOLD_: up to 128 MiB of freed
        # heap top). Measured on a 128k-entry row (AMD EPYC, 1 thread): a golden step's
        # comparison 3.2 -> 0.9 ms, logsumexp 1.3 -> 0.45 ms. Allocation only, same numbers.
        #
        # The compiled mode: inductor checks each vector ISA the CPU's flags list by building
        # a probe and loading it in a child Python, four ISAs on an AVX-512 machine, in
        # every process that compiles (~5 s of a test process on 2 busy cores). With
        # TORCHINDUCTOR_VEC_ISA_OK=1 it takes the CPU's flags as they are: the same ISAs and
        # the same pick on this Intel Xeon and under ATEN_CPU_CAPABILITY=avx2 and default; a
        # compiler that cannot build one fails the compile instead of silently falling back.
        env = {
            "MALLOC_MMAP_THRESHOLD_": "67108864",
            "MALLOC_TRIM_THRESHOLD_": "134217728",
            "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "passive",
            "TORCHINDUCTOR_VEC_ISA_OK": "1",
        } | env,
        # Not sandboxed (still cached, still remotely executable): Python can then keep the
        # bytecode of torch and the other pip packages in the runfiles tree between runs
        # (rules_python ships no .pyc, and a sandbox discards what Python writes). Measured
        # on the README's one-case command after an edit of model.py: 4.6 s instead of 8.5 s.
        tags = tags + ["no-sandbox"],
        **kwargs
    )

def gpu_pytest_test(
        name,
        cpu_size,
        size = "enormous",
        tags = [],
        exec_properties = {},
        env = {},
        **kwargs):
    """A pytest_test that needs a CUDA device, and its twin `<name>_on_cpu`.

    `name` is incompatible (reported SKIPPED) unless --config=gpu; `size = "enormous"` and the
    gpu-memory resource let a remote executor place it on a GPU worker. Under --config=gpu
    without a GPU the tests fail with "no CUDA device" instead of skipping.

    `<name>_on_cpu` runs the same files with GPU_TEST_DEVICE=cpu, the CPU as the device under
    test (max_tests/conftest.py), on every machine: GPU test code that only runs when someone
    has a GPU breaks unnoticed. It is tagged `gpu_code_on_cpu` (`--test_tag_filters=` selects
    them all), not `gpu`, so it stays out of the GPU suites and off GPU workers.

    Args:
      name: the GPU target; the CPU twin is `<name>_on_cpu`.
      cpu_size: the twin's size.
      size: the GPU target's size.
      tags: added to both targets.
      exec_properties: the GPU target's, over the gpu-memory resource.
      env: both targets' test environment; the twin adds GPU_TEST_DEVICE=cpu.
      **kwargs: the rest of pytest_test's arguments, for both targets.
    """
    props = {"test.resources:gpu-memory": "2"}
    props.update(exec_properties)
    pytest_test(
        name = name,
        size = size,
        tags = tags + ["gpu"],
        env = env,
        exec_properties = props,
        target_compatible_with = select({
            "//:gpu_enabled": [],
            "//conditions:default": ["@platforms//:incompatible"],
        }),
        **kwargs
    )
    pytest_test(
        name = name + "_on_cpu",
        size = cpu_size,
        tags = tags + ["gpu_code_on_cpu"],
        env = env | {"GPU_TEST_DEVICE": "cpu"},
        **kwargs
    )
