"""`llama_cpp_installed`: what the machine's llama.cpp is, as a file the llama.cpp lanes depend on.

The lanes that run Debian's llama.cpp (llama-server, llama-perplexity, llama-quantize,
llama-bench, libggml-cpu-*.so) judge files Bazel does not build. Their verdicts used to be
never cached (`tags = ["external"]`), so every `bazel test //...` ran them again: about 150 s
of test time on the 2-core Xeon, in a run where nothing else changed. Instead each depends on
`@llama_cpp_installed//:fingerprint`, a text file naming, with their sha256:

- each tool wherever the tests could find it (`$LLAMA_SERVER`, every folder of `$PATH`, and
  /usr/local/bin, /usr/bin and /bin, which Bazel's test PATH holds), and "absent" where none is;
- the llama.cpp and ggml libraries each tool loads (`ldd`), and every CPU backend ggml can
  load at run time (`ggml/backends0/libggml-cpu-*.so`);
- the CPU's model name and flags (`/proc/cpuinfo`): ggml picks its backend by them, so a
  verdict from another CPU, through a shared cache, is not this one's.

Bazel watches every one of those paths (`repository_ctx.watch`: a change of contents, or a
file appearing or going away), and the loader's cache (/etc/ld.so.cache) and dpkg's database,
so installing, upgrading or removing llama.cpp writes a new fingerprint: each lane's cache key
changes with it, and it runs again. A fingerprint with the same text keeps the cached verdicts.
"""

TOOLS = [
    "llama-server",
    "llama-perplexity",
    "llama-quantize",
    "llama-bench",
    "llama-batched-bench",
]
BACKENDS = "/usr/lib/x86_64-linux-gnu/ggml/backends0"
STANDARD_BINS = ["/usr/local/bin", "/usr/bin", "/bin"]

def _candidates(rctx, tool):
    folders = [f for f in rctx.os.environ.get("PATH", "").split(":") if f.startswith("/")]
    paths = [folder + "/" + tool for folder in folders + STANDARD_BINS]
    if tool == "llama-server" and rctx.os.environ.get("LLAMA_SERVER"):
        paths = [rctx.os.environ["LLAMA_SERVER"]] + paths
    unique = []
    for path in paths:
        if path not in unique:
            unique.append(path)
    return unique

def _sha256(rctx, paths):
    if not paths:
        return {}

    # a file sha256sum cannot read keeps no digest: "unreadable" below (llama.cpp cannot load
    # it either), rather than failing every build of the workspace
    result = rctx.execute(["sha256sum", "--"] + paths)
    digests = {}
    for line in result.stdout.splitlines():
        digest, _, path = line.partition("  ")
        digests[path] = digest
    return digests

def _libraries(rctx, binary):
    """The llama.cpp and ggml libraries `binary` loads, resolved by ldd."""
    result = rctx.execute(["ldd", binary])
    found = []
    for line in result.stdout.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if arrow and ("llama" in name or "ggml" in name):
            path = rest.split(" (")[0].strip()
            if path.startswith("/"):
                found.append(path)
    return found

def _cpu(rctx):
    text = rctx.read("/proc/cpuinfo", watch = "no")
    model, flags = "unknown", "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        if key.strip() == "flags" and flags == "unknown":
            flags = " ".join(sorted([f for f in value.strip().split(" ") if f]))
    return model, flags

def _impl(rctx):
    for path in ["/etc/ld.so.cache", "/var/lib/dpkg/status"]:
        rctx.watch(path)
    lines = []
    files = []
    for tool in TOOLS:
        found = None
        for path in _candidates(rctx, tool):
            rctx.watch(path)
            if found == None and rctx.path(path).exists and not rctx.path(path).is_dir:
                found = str(rctx.path(path).realpath)  # watched with the files below
        if found == None:
            lines.append("tool %s: absent" % tool)
            continue
        lines.append("tool %s: %s" % (tool, found))
        files.append(found)
        for library in _libraries(rctx, found):
            if library not in files:
                files.append(library)
    backends = rctx.path(rctx.attr.backends)
    rctx.watch(rctx.attr.backends)
    if backends.exists and backends.is_dir:
        for entry in sorted([str(p) for p in backends.readdir(watch = "yes")]):
            if entry.endswith(".so"):
                files.append(entry)
    for path in files:
        rctx.watch(path)
    digests = _sha256(rctx, files)
    for path in files:
        lines.append("file %s %s" % (digests.get(path, "unreadable"), path))
    model, flags = _cpu(rctx)
    lines.append("cpu model: " + model)
    lines.append("cpu flags: " + flags)
    rctx.file("fingerprint.txt", "\n".join(lines) + "\n")
    rctx.file("BUILD.bazel", """\
# What the machine's llama.cpp is (tools/llama_cpp/installed.bzl): a data dependency of every
# test that runs it, so that its cached verdicts follow the installed files.
filegroup(
    name = "fingerprint",
    srcs = ["fingerprint.txt"],
    visibility = ["//visibility:public"],
)
""")

llama_cpp_installed = repository_rule(
    implementation = _impl,
    attrs = {
        "backends": attr.string(
            default = BACKENDS,
            doc = "The folder of ggml's CPU backends (Debian's; a scratch one in the test).",
        ),
    },
    environ = ["LLAMA_SERVER", "PATH"],
    doc = "The installed llama.cpp's fingerprint (the module docstring).",
)
