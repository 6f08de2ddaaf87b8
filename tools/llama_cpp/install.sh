#!/usr/bin/env bash
# Installs Debian's llama.cpp command-line tools (llama-server, llama-bench, and from
# llama.cpp-tools-extra llama-batched-bench): the server the llama.cpp lane judges
# (//max_tests/integration:tests_engines, `golden_check --engine=llama_cpp`) and the peer the
# serving benchmark runs (//tools:bench_serving). Idempotent:
#
#   tools/llama_cpp/install.sh    prints llama-batched-bench's path; installs it first
#
# The packages come from Debian's unstable suite, which ./bazelw adds to apt at a low pin
# priority when it installs Bazel (nothing else comes from unstable unless asked with -t).
# Exit status: 0 installed (the path on stdout); 1 apt-get failed; 2 it cannot be installed
# from here (not root, no apt-get, or no unstable suite: run ./bazelw first).
set -euo pipefail

if command -v llama-server >/dev/null && path="$(command -v llama-batched-bench)"; then
  echo "$path"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install.sh: llama-batched-bench is missing and there is no apt-get; install" \
    "llama.cpp's tools so that llama-batched-bench is on the PATH" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: llama-batched-bench is missing; install it as root:" >&2
  echo "  sudo apt-get install -y -t unstable --no-install-recommends llama.cpp-tools llama.cpp-tools-extra" >&2
  exit 2
fi
if ! grep -rqs "unstable" /etc/apt/sources.list.d/; then
  echo "install.sh: no Debian unstable suite in apt's sources; run ./bazelw once (it adds" \
    "it to install Bazel), then this script again" >&2
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
packages=(llama.cpp-tools llama.cpp-tools-extra)
if ! apt-get install -y -t unstable --no-install-recommends "${packages[@]}" >&2; then
  apt-get update >&2 || exit 1
  apt-get install -y -t unstable --no-install-recommends "${packages[@]}" >&2 || exit 1
fi
command -v llama-batched-bench
