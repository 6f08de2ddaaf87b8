#!/usr/bin/env bash
# Installs Debian's llama.cpp command-line tools (llama-server, llama-bench, llama-perplexity,
# llama-quantize, and from llama.cpp-tools-extra llama-batched-bench): the server the llama.cpp
# lane judges (//max_tests/integration:tests_engines, `golden_check --engine=llama_cpp`), the
# peer the serving benchmark runs (//tools:bench_serving), and the eval slice's peer
# (//tools:eval_slice, //tools/eval_slice:eval_slice_llama_cpp_test). Idempotent:
#
#   tools/llama_cpp/install.sh    prints llama-batched-bench's path; installs the pinned
#                                 versions first (replacing any other)
#
# The packages come from Debian's unstable suite, which ./bazelw adds to apt at a low pin
# priority when it installs Bazel (nothing else comes from unstable unless asked with -t),
# at the versions pinned below: the llama.cpp whose figures the llama.cpp lane's tolerance
# entries hold (goldens/engines/llama_server.py PINNED_VERSION is its `--version`; another
# version installed is replaced by these, or named as the wrong one by the lane).
# Exit status: 0 installed (the path on stdout); 1 apt-get failed; 2 it cannot be installed
# from here (not root, no apt-get, or no unstable suite: run ./bazelw first).
set -euo pipefail

LLAMA_CPP_DEBIAN="1:0.7.0+dfsg-2" # llama.cpp-tools, llama.cpp-tools-extra, libllama0
GGML_DEBIAN="0.27.0-1"            # libggml0
pinned=(
  "llama.cpp-tools=$LLAMA_CPP_DEBIAN"
  "llama.cpp-tools-extra=$LLAMA_CPP_DEBIAN"
  "libllama0=$LLAMA_CPP_DEBIAN"
  "libggml0=$GGML_DEBIAN"
)

# Every pinned package at its version (dpkg's record), and the tools on the PATH.
installed_as_pinned() {
  local entry
  for entry in "${pinned[@]}"; do
    [ "$(dpkg-query -W -f='${Version}' "${entry%%=*}" 2>/dev/null)" = "${entry#*=}" ] || return 1
  done
  command -v llama-server >/dev/null && command -v llama-batched-bench >/dev/null
}

if command -v dpkg-query >/dev/null && installed_as_pinned; then
  command -v llama-batched-bench
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install.sh: llama.cpp $LLAMA_CPP_DEBIAN is not installed and there is no apt-get;" \
    "install llama.cpp's tools at that version so that llama-server and llama-batched-bench" \
    "are on the PATH" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: llama.cpp $LLAMA_CPP_DEBIAN is not installed; install it as root:" >&2
  echo "  sudo apt-get install -y -t unstable --no-install-recommends --allow-downgrades ${pinned[*]}" >&2
  exit 2
fi
if ! grep -rqs "unstable" /etc/apt/sources.list.d/; then
  echo "install.sh: no Debian unstable suite in apt's sources; run ./bazelw once (it adds" \
    "it to install Bazel), then this script again" >&2
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
install=(apt-get install -y -t unstable --no-install-recommends --allow-downgrades "${pinned[@]}")
if ! "${install[@]}" >&2; then
  apt-get update >&2 || exit 1
  if ! "${install[@]}" >&2; then
    echo "install.sh: apt has no ${pinned[*]}: the pinned llama.cpp left Debian's archive;" \
      "pin the version it has now here and in goldens/engines/llama_server.py, then measure" \
      "the llama.cpp lane's entries again" >&2
    exit 1
  fi
fi
installed_as_pinned || { echo "install.sh: installed, but not as pinned: ${pinned[*]}" >&2; exit 1; }
command -v llama-batched-bench
