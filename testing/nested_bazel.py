"""A real Bazel (Debian's, on PATH) in a scratch workspace, for tests of what Bazel itself does.

Such a test gets its own output base (and server, or `--batch`), so nothing is shared with
the repository's own server. The scratch workspace resolves modules offline through the
source tree's `third_party/bazel_standins`, as the repository does (MODULE.bazel). Under
`bazel test` the test's target runs it unsandboxed and local (tags `no-sandbox`,
`no-remote`; env `NESTED_BAZEL_OK=1`); in any other sandbox it skips, saying which target runs
it. Users: //tools/artifacts:bazel_distdir_test, //tools/llama_cpp:installed_watch_test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STANDINS = REPO / "third_party" / "bazel_standins"
STANDIN_MODULES = ("zlib", "protobuf", "buildozer", "apple_support")
# What the repository's .bazelrc sets for an offline Bazel 7 (docs/environment.md).
BAZELRC = "common --noenable_workspace\ncommon --lockfile_mode=off\n"


def marks(target: str) -> list[pytest.MarkDecorator]:
    """The module's `pytestmark`: slow, and skipped where a nested Bazel cannot run."""
    return [
        pytest.mark.slow,
        pytest.mark.skipif(shutil.which("bazel") is None, reason="bazel is not on PATH"),
        pytest.mark.skipif(
            "TEST_SRCDIR" in os.environ and os.environ.get("NESTED_BAZEL_OK") != "1",
            reason=f"a nested Bazel runs only in {target} (unsandboxed)",
        ),
        pytest.mark.skipif(not STANDINS.is_dir(), reason="third_party/bazel_standins is missing"),
    ]


def workspace(path: Path, name: str, module: str = "", build: str = "") -> Path:
    """A workspace at `path`: the stand-ins, MODULE.bazel (module `name`, the stand-ins'
    overrides, then `module`), BUILD.bazel (`build`) and the offline .bazelrc."""
    path.mkdir(parents=True)
    shutil.copytree(STANDINS, path / "bazel_standins")
    overrides = "".join(
        f'local_path_override(module_name = "{m}", path = "bazel_standins/{m}")\n'
        for m in STANDIN_MODULES
    )
    (path / "MODULE.bazel").write_text(f'module(name = "{name}")\n\n{overrides}\n{module}')
    (path / "BUILD.bazel").write_text(build)
    (path / ".bazelrc").write_text(BAZELRC)
    return path
