#!/usr/bin/env bash
# Lint the repository: ruff (lint rules and formatting) over the Python files, buildifier
# (formatting and lint warnings) over BUILD, .bzl and MODULE.bazel files, and the documents'
# bit-level claims against the tests (tools/claims.py). CI runs it first.
#
#   tools/lint/lint.sh          check; exit 1 and name each file and the fix command
#   tools/lint/lint.sh --fix    apply ruff's safe fixes, ruff format and buildifier's format
#
# The tools are pinned here and installed on first use through pip and npm into
# ${XDG_CACHE_HOME:-~/.cache}/llama-goldens/lint: ruff's wheel with `pip install --target`, and
# buildifier from the npm package @bazel/buildifier, which carries the Linux binary inside it
# (nothing downloaded at install time). The binary's sha256 is checked before it runs.
set -euo pipefail

RUFF_VERSION=0.17.6
BUILDIFIER_VERSION=8.2.1
BUILDIFIER_LINUX_AMD64_SHA256=6ceb7b0ab7cf66fceccc56a027d21d9cc557a7f34af37d2101edb56b92fcfa1a

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }
fix=0
case "${1:-}" in
  "") ;;
  --fix) fix=1 ;;
  -h | --help) usage; exit 0 ;;
  *) echo "lint.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac

cd "$(dirname "$0")/../.."
tools_dir="${XDG_CACHE_HOME:-$HOME/.cache}/llama-goldens/lint"

die() { echo "lint.sh: $*" >&2; exit 2; }

install_ruff() {
  local dir="$tools_dir/ruff-$RUFF_VERSION"
  if [ ! -x "$dir/bin/ruff" ]; then
    echo "installing ruff $RUFF_VERSION into $dir" >&2
    rm -rf "$dir.tmp"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --only-binary=:all: \
      --target "$dir.tmp" "ruff==$RUFF_VERSION" >&2 \
      || die "pip could not install ruff==$RUFF_VERSION (is the package index reachable?)"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  ruff="$dir/bin/ruff"
}

install_buildifier() {
  [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
    || die "buildifier is pinned for Linux x86_64 only; this is $(uname -s)-$(uname -m)"
  local dir="$tools_dir/buildifier-$BUILDIFIER_VERSION"
  local binary="$dir/node_modules/@bazel/buildifier/buildifier-linux_amd64"
  if [ ! -x "$binary" ]; then
    command -v npm >/dev/null || die "npm is missing: install Node.js (Debian: apt-get install npm)"
    echo "installing buildifier $BUILDIFIER_VERSION into $dir" >&2
    rm -rf "$dir.tmp"
    npm install --silent --no-audit --no-fund --prefix "$dir.tmp" \
      "@bazel/buildifier@$BUILDIFIER_VERSION" >&2 \
      || die "npm could not install @bazel/buildifier@$BUILDIFIER_VERSION"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  echo "$BUILDIFIER_LINUX_AMD64_SHA256  $binary" | sha256sum --check --quiet >&2 \
    || die "$binary does not match the pinned sha256; delete $dir to reinstall"
  buildifier="$binary"
}

install_ruff
install_buildifier
mapfile -t starlark < <(git ls-files -- '*.bazel' '*.bzl' 'BUILD' 'MODULE.bazel')

if [ "$fix" = 1 ]; then
  "$ruff" check --fix --quiet .
  "$ruff" format --quiet .
  "$buildifier" -mode=fix -lint=off "${starlark[@]}"
fi

status=0
echo "ruff $RUFF_VERSION: check"
"$ruff" check --quiet . || status=1
echo "ruff $RUFF_VERSION: format --check"
"$ruff" format --check --quiet . || status=1
echo "buildifier $BUILDIFIER_VERSION: format and lint, ${#starlark[@]} files"
"$buildifier" -mode=check -lint=warn "${starlark[@]}" || status=1
# Documents: every bit-level property README.md and docs/ state names the test that backs it,
# and every test they name exists (tools/claims.py).
python3 -m tools.claims --quiet || status=1
if [ "$status" != 0 ]; then
  echo "lint failed: tools/lint/lint.sh --fix applies the formatting; lint warnings are fixed by hand" >&2
fi
exit "$status"
