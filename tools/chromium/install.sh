#!/usr/bin/env bash
# Installs Debian's chromium, the headless browser that goldens/tests/
# test_report_browser.py opens the golden report in. Idempotent:
#
#   tools/chromium/install.sh    prints chromium's path; installs it first when missing
#
# Exit status: 0 chromium is there (its path on stdout); 1 apt-get failed; 2 chromium is
# missing and cannot be installed from here (not root, or no apt-get): the command to run is
# printed. Installing takes about 35 s (about 150 MB of packages, fonts included).
set -euo pipefail

if path="$(command -v chromium)"; then
  echo "$path"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install.sh: chromium is missing and there is no apt-get; install Debian's chromium" \
    "package, or any chromium that runs as 'chromium' on the PATH" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: chromium is missing; install it as root:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y chromium" >&2
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet, or stale ones: update only when needed.
if ! apt-get install -y chromium >&2; then
  apt-get update >&2 || exit 1
  apt-get install -y chromium >&2 || exit 1
fi
command -v chromium
