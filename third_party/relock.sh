#!/usr/bin/env bash
# Re-lock third_party/requirements_lock.txt from requirements.in (hash-pinned).
# --allow-unsafe keeps setuptools and pip in the lock: rules_python turns every name a wheel's
# Requires-Dist lists into a Bazel dependency, and a missing one fails analysis.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --quiet pip-tools
python3 -m piptools compile --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links -o requirements_lock.txt requirements.in
