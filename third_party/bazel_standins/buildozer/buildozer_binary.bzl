"""Offline stand-in for buildozer's module extension, which bazel_tools uses only for
`bazel mod tidy`. It defines the repository bazel_tools names, holding nothing."""

def _empty_repo_impl(rctx):
    rctx.file("BUILD.bazel", "# Offline stand-in: no buildozer binary.\n")

_empty_repo = repository_rule(implementation = _empty_repo_impl)

def _buildozer_binary_impl(_module_ctx):
    _empty_repo(name = "buildozer_binary")

buildozer_binary = module_extension(implementation = _buildozer_binary_impl)
