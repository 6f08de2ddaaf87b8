#!/usr/bin/env bash
# Packs golden files into a content-addressed archive, publishes it, prints its http_archive
# stanza: tools/upload-public-bazel-artifact.sh NAME VERSION FILE... [--update-module] [...]
#
# A thin wrapper over tools/artifacts/upload_artifact.py, run with the system python3 so it
# needs no Bazel and starts in well under a second (`./bazelw run //tools:upload_artifact -- ...`
# runs the same code). It runs from the caller's folder, so relative FILE paths work; the
# local store and MODULE.bazel are found from this script's checkout. With --store=s3 the archive
# is made public-read and its pinned URL checked by an anonymous GET before anything is pinned.
# `--help` lists the rest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# PYTHONSAFEPATH keeps a `tools` folder in the caller's cwd from shadowing the repo's package.
PYTHONSAFEPATH=1 PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}" \
  exec python3 -m tools.artifacts.upload_artifact "$@"
