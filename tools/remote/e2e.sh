#!/usr/bin/env bash
# The remote stack end to end; .ci/run runs it after the main tests.
#
#   tools/remote/e2e.sh [--full]
#
# Starts tools/remote/stack.sh with a fresh state folder on free ports, then, in a fresh Bazel
# output base of its own (no disk cache, no convenience symlinks, so the workspace's bazel-*
# links and the main output base are untouched), runs SUBSET:
#   1. --config=remote, cold (first uploads)       every action and test remote
#   2. with --full: --config=remote, warm (inputs uploaded, results not reused): executed
#      again remotely
#   3. after `bazel clean`, --config=remote-cache   every test a remote cache hit, none local
#   4. with --full: the same locally, for comparison (steps 2 and 4 each cost the suite's run
#      time again, so CI leaves them out)
# Remote runs are checked on Bazel's own "INFO: N processes: ..." line. Then the stack
# stops; with it down, --config=remote must fail and --config=remote-cache succeed (one small
# test, run here); the Bazel server shuts down, and no process of the stack may be left (ps). Exit 0
# when every check holds, 1 otherwise; each Bazel run's output is in the work folder, printed
# in part on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

SUBSET=(//max_tests/integration:tests //goldens/artifacts:archive_test)
full=0
case "${1:-}" in
  "") ;;
  --full) full=1 ;;
  *) echo "e2e.sh: unknown argument '$1' (usage: tools/remote/e2e.sh [--full])" >&2; exit 2 ;;
esac

work="$(mktemp -d "${XDG_CACHE_HOME:-$HOME/.cache}/llama-goldens/remote-e2e.XXXXXX")"
state="$work/stack"
output_base="$work/output_base"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"
pg_port="$(free_port)"
endpoint="grpc://127.0.0.1:$port"

say() { printf 'e2e: %s\n' "$*"; }
fail() { say "FAILED: $*"; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

bazel() { ./bazelw --output_base="$output_base" "$@"; }
# Flags of every run: no disk cache (it would answer instead of the server), no bazel-* links.
common=(--disk_cache= --symlink_prefix=/ --remote_cache="$endpoint")

cleanup() {
  local rc=$?
  tools/remote/stack.sh stop --state "$state" >/dev/null 2>&1 || true
  if [ -d "$output_base" ]; then bazel shutdown >/dev/null 2>&1 || true; fi
  if [ "$rc" -eq 0 ]; then rm -rf "$work"; else say "work folder kept: $work"; fi
}
trap cleanup EXIT

# The "INFO: N processes: ..." line of a Bazel log.
processes_line() { grep -E "^INFO: [0-9]+ process(es)?:" "$1" | tail -n 1 || true; }

# Runs bazel, logging to $work/$1.log; fails (with the log's tail) unless it succeeds.
bazel_run() {
  local name="$1"; shift
  local log="$work/$name.log" began
  began="$(now)"
  if ! bazel "$@" >"$log" 2>&1; then
    tail -n 30 "$log"
    fail "$name: bazel $* failed (log $log)"
  fi
  wall="$(since "$began")"
}

# The pytest counts of the run NAME (bazel.test_summary over the reports its build events name,
# `events NAME`; a remote test's report is the file Bazel downloaded, found by its digest). Not
# for a run with the server down: Bazel fails writing build events that name remote files.
events() { printf -- '--build_event_json_file=%s' "$work/$1.bep"; }
summary() { python3 -m bazel.test_summary "$work/$1.bep"; }

# Every process of a run was one of the allowed kinds (comma-separated: "internal,remote").
check_kinds() {
  local name="$1" line="$2" allowed="$3" kinds
  kinds="$(sed -E 's/^INFO: [0-9]+ process(es)?: //; s/\.$//' <<<"$line" | tr ',' '\n' | sed -E 's/^ *[0-9]+ //')"
  while read -r kind; do
    [[ ",$allowed," == *",$kind,"* ]] || fail "$name: '$kind' processes in '$line' (expected only $allowed)"
  done <<<"$kinds"
}

# The workspace's bazel-* links belong to the main output base: this check leaves them as they are.
links_before="$(ls -l bazel-* 2>/dev/null | awk '{print $(NF-2), $NF}' || true)"

began="$(now)"
tools/remote/stack.sh start --state "$state" --port "$port" --pg-port "$pg_port" >"$work/stack.log" 2>&1 \
  || { cat "$work/stack.log"; fail "the stack did not start"; }
say "stack start: $(since "$began") s (BuildGrid $endpoint, PostgreSQL 127.0.0.1:$pg_port, 2 workers)"

# A fresh output base: analysis and the pip hub's extraction, timed apart from the tests.
bazel_run analysis build --nobuild "${SUBSET[@]}" "${common[@]}"
say "fresh output base, analysis and pip hub: $wall s"

remote=(--config=remote --remote_executor="$endpoint" "${common[@]}")
bazel_run remote-cold test "${SUBSET[@]}" "${remote[@]}" "$(events remote-cold)"
line="$(processes_line "$work/remote-cold.log")"
check_kinds remote-cold "$line" "internal,remote"
# A cold run executes: every test, and at least one process remotely (a line of internal
# processes alone, or tests taken from a cache, proves nothing of remote execution).
grep -qE ' [1-9][0-9]* remote' <<<"$line" || fail "remote-cold: no remote process in '$line'"
grep -qE '^Executed ([0-9]+) out of \1 tests?' "$work/remote-cold.log" \
  || fail "remote-cold: not every test executed (log $work/remote-cold.log)"
say "--config=remote, cold: $wall s; $line"
remote_tests="$(summary remote-cold)"
say "remote results: $remote_tests"

if [ "$full" = 1 ]; then
  bazel_run remote-warm test "${SUBSET[@]}" "${remote[@]}" --nocache_test_results --noremote_accept_cached
  line="$(processes_line "$work/remote-warm.log")"
  check_kinds remote-warm "$line" "internal,remote"
  grep -qE ' [0-9]+ remote' <<<"$line" || fail "remote-warm: no remote process in '$line'"
  say "--config=remote, warm: $wall s; $line"
fi

# --symlink_prefix=/: a clean removes the workspace's bazel-* links, which are the main output
# base's, unless told the links it made have no prefix (measured: bazel-bin gone after the run).
bazel clean --symlink_prefix=/ >/dev/null 2>&1
bazel_run remote-cache test "${SUBSET[@]}" --config=remote-cache "${common[@]}" "$(events remote-cache)"
line="$(processes_line "$work/remote-cache.log")"
check_kinds remote-cache "$line" "internal,remote cache hit"
grep -q 'remote cache hit' <<<"$line" || fail "remote-cache: no remote cache hit in '$line'"
say "--config=remote-cache after bazel clean: $wall s; $line"
grep -qE '^Executed 0 out of [0-9]+ tests?' "$work/remote-cache.log" \
  || fail "remote-cache: tests executed instead of coming from the cache (log $work/remote-cache.log)"
cached_tests="$(summary remote-cache)"
[ "$cached_tests" = "$remote_tests" ] || fail "cached results '$cached_tests' differ from remote '$remote_tests'"

# Last, as local runs of the no-sandbox tests write bytecode next to their inputs (the
# remote-cache step above missed for some tests when it came after this).
if [ "$full" = 1 ]; then
  bazel_run local test "${SUBSET[@]}" --disk_cache= --symlink_prefix=/ --nocache_test_results "$(events local)"
  say "local (no remote config): $wall s; $(processes_line "$work/local.log")"
  local_tests="$(summary local)"
  [ "$local_tests" = "$remote_tests" ] || fail "local results '$local_tests' differ from remote '$remote_tests'"
fi

# Stop everything, then nothing of the stack may be left: no process naming the state folder or
# the database folder, and none of the recorded pids.
pg_dir="$(cat "$state/postgres.dir")"
pids="$(cat "$state"/pids/*.pid | awk '{print $1}' | tr '\n' ' ')"
tools/remote/stack.sh stop --state "$state"

# The server down (README, "Remote execution"): --config=remote fails, no silent local
# fallback; --config=remote-cache still succeeds, its test run here. One small test, run again.
down=(//goldens/artifacts:archive_test --nocache_test_results)
if timeout 600 ./bazelw --output_base="$output_base" test "${down[@]}" "${remote[@]}" \
  >"$work/down-remote.log" 2>&1; then
  fail "--config=remote with the server down succeeded (log $work/down-remote.log)"
fi
say "--config=remote, server down: failed, as it must ($(grep -m1 -oE 'UNAVAILABLE[^.]*' "$work/down-remote.log" || echo 'exit non-zero'))"
bazel_run down-cache test "${down[@]}" --config=remote-cache "${common[@]}"
line="$(processes_line "$work/down-cache.log")"
if grep -q remote <<<"$line" || ! grep -qE '^Executed 1 out of 1 test' "$work/down-cache.log"; then
  fail "down-cache: expected the test executed here, uncached: '$line' (log $work/down-cache.log)"
fi
say "--config=remote-cache, server down: $wall s, the test run here; $line"
bazel shutdown
left="$(ps -eo pid=,stat=,args= | awk '$2 !~ /^Z/' | grep -F -e "$state" -e "$pg_dir" | grep -v -e grep -e awk || true)"
for pid in $pids; do
  if [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; then
    left+=$'\n'"$(ps -o pid=,args= -p "$pid")"
  fi
done
[ -z "${left//[$'\n ']/}" ] || fail "processes of the stack are still running:$left"
say "stack stopped: no BuildGrid, buildbox or PostgreSQL process left"
links_after="$(ls -l bazel-* 2>/dev/null | awk '{print $(NF-2), $NF}' || true)"
[ "$links_after" = "$links_before" ] \
  || fail "the workspace's bazel-* links changed: before '$links_before', after '$links_after'"
say "PASSED"
