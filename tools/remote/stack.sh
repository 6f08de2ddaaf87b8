#!/usr/bin/env bash
# The local REAPI stack (BuildGrid, buildbox workers, PostgreSQL) for --config=remote and
# --config=remote-cache: tools/remote/stack.sh start|stop|status [--state DIR] [...].
#
# A thin wrapper over tools/remote/stack.py (its docstring, or --help, says what runs where),
# run with the system python3 so it needs no Bazel. It runs from the caller's folder, so a
# relative --state works.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# PYTHONSAFEPATH keeps a `tools` folder in the caller's cwd from shadowing the repo's package.
PYTHONSAFEPATH=1 PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}" \
  exec python3 -m tools.remote.stack "$@"
