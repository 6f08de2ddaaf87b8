"""A MODULE.bazel shaped like the repository's, for tests that rewrite one."""

SAMPLE_MODULE = '''\
"""A module file shaped like the repository's."""

module(name = "llama_goldens", version = "0.1.0")

bazel_dep(name = "rules_python", version = "0.22.1")

pip = use_extension("@rules_python//python/extensions:pip.bzl", "pip")
use_repo(pip, "pip")

# Golden archives (content-addressed; written by tools/upload-public-bazel-artifact.sh).
http_archive = use_repo_rule("@bazel_tools//tools/build_defs/repo:http.bzl", "http_archive")
'''
