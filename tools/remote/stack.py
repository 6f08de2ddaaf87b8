"""A local REAPI stack for Bazel's --config=remote and --config=remote-cache.

    tools/remote/stack.sh start [--state DIR] [--port N] [--pg-port N] [--workers N]
                                [--gpu-worker] [--cache-only] [--venv DIR]
    tools/remote/stack.sh status [--state DIR]
    tools/remote/stack.sh stop [--state DIR]

`start` runs, all on 127.0.0.1 and recorded in the state folder (default
~/.cache/llama-goldens/remote-stack):

- PostgreSQL: a private cluster for BuildGrid's scheduler, created fresh by each start and
  deleted by stop. PostgreSQL refuses to run as root, so as root it runs as the `postgres`
  system user, its data in a folder of /tmp that user can reach (root's home is private).
- BuildGrid 0.9.1 (`bgd server start STATE/buildgrid.yml`, rendered from buildgrid.yml.in):
  CAS, ActionCache and Execution on one port; the instance name is "".
- buildbox-casd: the workers' local CAS, a proxy of BuildGrid's, on a unix socket.
- N buildbox-worker processes (--workers, default 2), each running one action at a time with
  buildbox-run-hosttools (unsandboxed, as this user; inputs staged through FUSE, as copies
  would take 2.4 GB per running test); with --gpu-worker one more that advertises the
  platform property resources:gpu-memory=2, which GPU tests ask for.

--cache-only starts BuildGrid alone (CAS and ActionCache, no database, no workers).
README.md ("Scaling out") says how Bazel uses the stack. A second `start` reports the running
stack and exits 0; `stop` stops every recorded process and its children, and detaches the
FUSE mounts a worker killed mid-action leaves below the state folder; `status` exits 0 when
every process runs. Missing programs are installed on Debian as root (deps.py).
Exit status: 0 done, 1 a port is taken (the line names it and its option), a start failed
(the line names the log) or `stop` could not detach a mount (the line names it), 2 bad input
or a dependency that cannot be installed here.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from goldens.cli_files import OneLineParser, PathError, output_directory, user_path
from tools.remote import deps, processes

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-goldens"
DEFAULT_STATE = CACHE / "remote-stack"
DEFAULT_VENV = CACHE / "remote" / f"buildgrid-{deps.BUILDGRID_VERSION}"
DEFAULT_PORT = 8980  # the endpoint .bazelrc's remote configs name
DEFAULT_PG_PORT = 55432
GPU_PROPERTY = "resources:gpu-memory=2"
TEMPLATE = Path(__file__).with_name("buildgrid.yml.in")


class StartFailed(Exception):
    """One line saying which part did not start and where its log is."""


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="stack.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument(
        "--state", default=str(DEFAULT_STATE), help="state folder (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="BuildGrid's port (default: %(default)s)"
    )
    parser.add_argument(
        "--pg-port",
        type=int,
        default=DEFAULT_PG_PORT,
        help="PostgreSQL's port (default: %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=2, help="CPU workers (default: %(default)s)")
    parser.add_argument(
        "--gpu-worker", action="store_true", help=f"one more worker advertising {GPU_PROPERTY}"
    )
    parser.add_argument(
        "--cache-only", action="store_true", help="BuildGrid's CAS and ActionCache only"
    )
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="BuildGrid's virtual environment")
    return parser


def _check_args(parser: OneLineParser, args) -> None:
    for flag, port in (("--port", args.port), ("--pg-port", args.pg_port)):
        if not 1024 <= port <= 65535:
            parser.error(f"{flag}={port} is not a port in 1024..65535")
    if args.port == args.pg_port:
        parser.error(f"--port and --pg-port are both {args.port}")
    if not 0 <= args.workers <= 64:
        parser.error(f"--workers={args.workers} is not in 0..64")
    if args.workers == 0 and not args.gpu_worker and not args.cache_only:
        parser.error(
            "--workers=0 without --gpu-worker leaves no worker to run actions (or use --cache-only)"
        )


def _read_stack(state: Path) -> dict | None:
    try:
        return json.loads((state / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def _pg_prefix(pg_dir: Path) -> list[str]:
    """How to run PostgreSQL's programs: as `postgres` when we are root (it refuses root)."""
    if os.geteuid() != 0:
        return []
    shutil.chown(pg_dir, "postgres", "postgres")
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


def _start_postgres(state: Path, pg_port: int, bin_dir: Path, bgd: Path) -> tuple[str, Path]:
    """A fresh private cluster on 127.0.0.1:pg_port with BuildGrid's schema; its URL and folder."""
    if os.geteuid() == 0:
        pg_dir = Path(tempfile.mkdtemp(prefix="llama-goldens-pg-"))
    else:
        pg_dir = state / "postgres"
        shutil.rmtree(pg_dir, ignore_errors=True)
        pg_dir.mkdir()
    (state / "postgres.dir").write_text(f"{pg_dir}\n")  # stop deletes it, even after a failed start
    prefix = _pg_prefix(pg_dir)
    password = secrets.token_hex(16)
    pwfile = pg_dir / "pwfile"
    pwfile.write_text(password + "\n")
    if prefix:
        shutil.chown(pwfile, "postgres", "postgres")
    log = processes.log_file(state, "postgres")
    initdb = [
        str(bin_dir / "initdb"),
        "-D",
        str(pg_dir / "data"),
        "-U",
        "bgd",
        f"--pwfile={pwfile}",
    ]
    initdb += ["--auth=scram-sha-256", "-E", "UTF8", "--no-sync", "--no-instructions"]
    with log.open("a") as out:
        done = subprocess.run([*prefix, *initdb], cwd=pg_dir, stdout=out, stderr=subprocess.STDOUT)
    pwfile.unlink()
    if done.returncode != 0:
        raise StartFailed(f"PostgreSQL's initdb failed; log: {log}")
    settings = [
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        "unix_socket_directories=",
        "-c",
        "fsync=off",
    ]
    postgres = [*prefix, str(bin_dir / "postgres"), "-D", str(pg_dir / "data"), "-p", str(pg_port)]
    proc = processes.spawn(state, "postgres", [*postgres, *settings], program="postgres")
    ready = [str(bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(pg_port)]
    if not processes.wait_for(
        lambda: subprocess.run(ready).returncode == 0,
        30,
        lambda: proc.poll() is None,
    ):
        raise StartFailed(f"PostgreSQL did not start on 127.0.0.1:{pg_port}; log: {log}")
    url = f"postgresql+psycopg://bgd:{password}@127.0.0.1:{pg_port}/postgres"
    migrate_log = processes.log_file(state, "migrate")
    with migrate_log.open("a") as out:
        if subprocess.run(
            [str(bgd), "migrate", "apply", url],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=processes.own_env(),
        ).returncode:
            raise StartFailed(f"BuildGrid's database migration failed; log: {migrate_log}")
    return url, pg_dir


def _render_config(state: Path, port: int, pg_url: str | None) -> Path:
    lines = TEMPLATE.read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("#"):  # the template's header, about the template
        lines.pop(0)
    header = (
        f"# Rendered by tools/remote/stack.py from {TEMPLATE.name}; the next start rewrites it.\n"
    )
    text = header + "".join(lines)
    if pg_url is None:  # cache only: drop the execution blocks
        kept, skipping = [], False
        for line in text.splitlines(keepends=True):
            if line.strip() == "# execution:begin":
                skipping = True
            elif line.strip() == "# execution:end":
                skipping = False
            elif not skipping:
                kept.append(line)
        text = "".join(kept)
    for key, value in {
        "ADDRESS": f"127.0.0.1:{port}",
        "PG_URL": pg_url or "",
        "CAS_DIR": str(state / "cas"),
        "INSTANCE": "",
    }.items():
        text = text.replace(f"@{key}@", value)
    config = state / "buildgrid.yml"
    config.write_text(text)
    config.chmod(0o600)  # it holds the database password
    return config


def _start(state: Path, args) -> dict:
    """Starts every part; raises StartFailed (after stopping what started) on the first failure."""
    install_log = processes.log_file(state, "install")
    install_log.parent.mkdir(parents=True, exist_ok=True)
    buildbox = {} if args.cache_only else deps.buildbox(install_log)
    pg_bin = None if args.cache_only else deps.postgres(install_log)
    bgd = deps.buildgrid(Path(args.venv), install_log)
    ports = [("BuildGrid", "--port", args.port)]
    if not args.cache_only:
        ports.append(("PostgreSQL", "--pg-port", args.pg_port))
    for what, flag, port in ports:
        if not processes.port_is_free(port):
            raise StartFailed(
                f"port {port} ({what}) on 127.0.0.1 is taken; choose another with {flag}"
            )

    stack = {
        "port": args.port,
        "pg_port": None if args.cache_only else args.pg_port,
        "cache_only": args.cache_only,
        "workers": [],
        "started": [],
    }
    (state / "stack.json").write_text(json.dumps(stack, indent=1) + "\n")
    pg_url = None
    if not args.cache_only:
        stack["started"].append("postgres")
        pg_url, stack["pg_dir"] = _start_postgres(state, args.pg_port, pg_bin, bgd)
        stack["pg_dir"] = str(stack["pg_dir"])

    config = _render_config(state, args.port, pg_url)
    (state / "cas").mkdir(exist_ok=True)
    stack["started"].append("buildgrid")
    proc = processes.spawn(state, "buildgrid", [str(bgd), "server", "start", str(config)])
    if not processes.wait_for(
        lambda: processes.port_answers(args.port), 60, lambda: proc.poll() is None
    ):
        log = processes.log_file(state, "buildgrid")
        raise StartFailed(f"BuildGrid did not start on 127.0.0.1:{args.port}; log: {log}")

    if not args.cache_only:
        socket_path = state / "casd.sock"
        socket_path.unlink(missing_ok=True)
        stack["started"].append("casd")
        casd = [
            buildbox["buildbox-casd"],
            f"--cas-remote=grpc://127.0.0.1:{args.port}",
            f"--bind=unix:{socket_path}",
        ]
        proc = processes.spawn(
            state, "casd", [*casd, "--log-level=warning", str(state / "casd-cache")]
        )
        if not processes.wait_for(socket_path.exists, 20, lambda: proc.poll() is None):
            raise StartFailed(
                f"buildbox-casd did not start; log: {processes.log_file(state, 'casd')}"
            )
        workers = [(f"worker-{i}", []) for i in range(1, args.workers + 1)]
        if args.gpu_worker:
            workers.append(("worker-gpu", [f"--platform={GPU_PROPERTY}"]))
        # FUSE stages an input tree without copying it; without /dev/fuse, copies (or links).
        fuse = Path("/dev/fuse").exists() and shutil.which("buildbox-fuse")
        staging = "fuse" if fuse else "copy-or-link"
        worker_procs = {}
        for name, platform in workers:
            stack["started"].append(name)
            stack["workers"].append(name + (f" ({GPU_PROPERTY})" if platform else ""))
            worker_procs[name] = processes.spawn(
                state,
                name,
                [
                    buildbox["buildbox-worker"],
                    f"--bots-remote=grpc://127.0.0.1:{args.port}",
                    f"--cas-remote=unix:{socket_path}",
                    f"--buildbox-run={buildbox['buildbox-run-hosttools']}",
                    f"--runner-arg=--staging-mode={staging}",
                    *platform,
                    name,
                ],
            )
        time.sleep(0.5)
        for name, proc in worker_procs.items():
            if proc.poll() is not None:
                raise StartFailed(
                    f"buildbox-worker {name} exited; log: {processes.log_file(state, name)}"
                )
    (state / "stack.json").write_text(json.dumps(stack, indent=1) + "\n")
    return stack


def _stop(state: Path) -> tuple[int, list[str], list[str]]:
    """Stops the recorded processes, workers first; detaches what they left mounted below the
    state folder; deletes the database. (How many ran, mounts detached, mounts left.)"""
    stack = _read_stack(state) or {}
    names = stack.get("started") or []
    names += [n for n in processes.recorded_names(state) if n not in names]
    stopped = 0
    for name in reversed(names):
        if name == "postgres":  # fast shutdown: SIGINT to the postmaster
            stopped += processes.stop(state, name, first_signal=signal.SIGINT, grace_s=20)
        else:
            stopped += processes.stop(state, name, grace_s=10)
    unmounted, left = processes.unmount_under(state)
    pg_dir_file = state / "postgres.dir"
    if pg_dir_file.exists():
        shutil.rmtree(pg_dir_file.read_text().strip(), ignore_errors=True)
        pg_dir_file.unlink()
    (state / "casd.sock").unlink(missing_ok=True)
    (state / "stack.json").unlink(missing_ok=True)
    return stopped, unmounted, left


def _report_stop(state: Path, stopped: int, unmounted: list[str], left: list[str]) -> int:
    """Prints what `stop` did; 1 when a mount below the state folder could not be detached."""
    line = f"stack: stopped {stopped} process{'es' if stopped != 1 else ''}"
    if unmounted:
        line += f", detached {len(unmounted)} stale mount{'s' if len(unmounted) != 1 else ''}"
    print(f"{line}; state folder {state}")
    for mount in left:
        print(f"stack: could not detach {mount}; as root: umount -l PATH", file=sys.stderr)
    return 1 if left else 0


def _describe(state: Path, stack: dict) -> str:
    port = stack["port"]
    endpoint = f"grpc://127.0.0.1:{port}"
    services = "CAS, ActionCache" + ("" if stack["cache_only"] else ", Execution")
    log = processes.log_file(state, "buildgrid")
    lines = [f'  BuildGrid   {endpoint}  ({services}; instance name ""; log {log})']
    if not stack["cache_only"]:
        pg = f"127.0.0.1:{stack['pg_port']}"
        lines.append(f"  PostgreSQL  {pg}  (BuildGrid's scheduler; data {stack.get('pg_dir')})")
        lines.append(f"  casd        unix:{state / 'casd.sock'}  (the workers' local CAS)")
        lines.append(f"  workers     {', '.join(stack['workers'])}")
    where = "already in .bazelrc" if port == DEFAULT_PORT else "put these lines in user.bazelrc"
    lines.append(f"bazelrc lines ({where}):")
    lines.append(f"  build:remote-cache --remote_cache={endpoint}")
    if not stack["cache_only"]:
        lines.append(f"  build:remote --remote_executor={endpoint}")
    configs = (
        "--config=remote-cache"
        if stack["cache_only"]
        else "--config=remote (or --config=remote-cache)"
    )
    lines.append(f"use: ./bazelw test //... {configs}")
    lines.append(f"stop: tools/remote/stack.sh stop --state {state}")
    return "\n".join(lines)


def _status(state: Path) -> tuple[dict | None, list[str], list[str]]:
    """The recorded stack, and which of its processes run and which do not."""
    stack = _read_stack(state)
    names = (stack or {}).get("started") or processes.recorded_names(state)
    running = [n for n in names if processes.running_pid(state, n) is not None]
    return stack, running, [n for n in names if n not in running]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    state = user_path(args.state).resolve()
    if args.command != "start" and not state.exists():
        print(f"stack: not running (no state folder {state})")
        return 0 if args.command == "stop" else 1
    try:
        state = output_directory(state, "--state")
    except PathError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 2
    with (state / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _command(args, state)


def _command(args, state: Path) -> int:
    stack, running, dead = _status(state)
    if args.command == "status":
        if stack and running and not dead:
            print(f"stack: running ({', '.join(running)}); state folder {state}")
            answers = processes.port_answers(stack["port"])
            answer = "answers" if answers else "does NOT answer"
            print(f"  BuildGrid {answer} on 127.0.0.1:{stack['port']}")
            print(_describe(state, stack))
            return 0 if answers else 1
        if running:
            print(f"stack: partly running: {', '.join(running)} run, {', '.join(dead)} do not")
            print(f"  state folder {state}; `stop` stops the rest")
        else:
            print(f"stack: not running; state folder {state}")
        return 1
    if args.command == "stop":
        return _report_stop(state, *_stop(state))
    if stack and running and not dead:
        print(f"stack: already running ({len(running)} processes); state folder {state}")
        print(_describe(state, stack))
        return 0
    if running:
        print(f"stack: {', '.join(dead)} of an earlier start stopped; restarting the stack")
    _stop(state)
    began = time.monotonic()
    try:
        stack = _start(state, args)
    except deps.MissingDependency as error:
        _stop(state)
        print(f"stack: {error}", file=sys.stderr)
        return 2
    except (StartFailed, OSError) as error:
        _stop(state)
        print(f"stack: {error}", file=sys.stderr)
        return 1
    print(f"stack: started in {time.monotonic() - began:.1f} s; state folder {state}")
    print(_describe(state, stack))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
