"""The programs the local REAPI stack runs, found or installed.

- buildbox (buildbox-casd, buildbox-worker, buildbox-run-hosttools): Debian's `buildbox`
  package from the unstable suite, installed the way `bazelw` installs Bazel: a private apt
  source for unstable (the same file bazelw writes, with the mirror of the machine's own
  sources) pinned low, then `apt-get install -t unstable --no-install-recommends buildbox`.
- PostgreSQL (initdb, postgres, pg_isready): Debian's `postgresql` (stable). BuildGrid's
  scheduler needs it; --cache-only needs no database.
- BuildGrid: `buildgrid==0.9.1` from pip into a virtual environment, made with a Python >= 3.13
  (python3.13 on PATH, pyenv's, or Debian unstable's python3.13).

Installing needs Debian and root; anywhere else a missing program is reported with how to
install it (exit 2, raised as MissingDependency).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

from tools.remote import processes

BUILDGRID_VERSION = "0.9.1"
BUILDBOX_PROGRAMS = ("buildbox-casd", "buildbox-worker", "buildbox-run-hosttools")
POSTGRES_PROGRAMS = ("initdb", "postgres", "pg_isready")
APT_ROOT = Path("/etc/apt")
# Shared with bazelw (install_debian_bazel): one private source for Debian unstable.
UNSTABLE_SOURCE = APT_ROOT / "sources.list.d" / "bazelw-unstable.sources"
UNSTABLE_PIN = APT_ROOT / "preferences.d" / "bazelw-unstable"
DPKG_OPTS = ["-o", "Dpkg::Options::=--force-overwrite", "-o", "Dpkg::Options::=--force-confold"]


class MissingDependency(Exception):
    """A program is missing and cannot be installed here; the message says how to install it."""


def _can_install() -> str | None:
    """None when apt installs are possible here, else why not."""
    try:
        os_release = Path("/etc/os-release").read_text()
    except OSError:
        os_release = ""
    if "ID=debian" not in os_release.split():
        return "this machine is not Debian"
    if os.geteuid() != 0:
        return "not running as root"
    return None


def _run_logged(cmd: list[str], log: Path) -> None:
    env = processes.own_env(DEBIAN_FRONTEND="noninteractive")
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode != 0:
            raise MissingDependency(f"`{' '.join(cmd)}` failed; log: {log}")


def _debian_mirror() -> str:
    """The mirror URI of the machine's own Debian sources (as bazelw's debian_mirror)."""
    for sources in sorted((APT_ROOT / "sources.list.d").glob("*.sources")):
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    one_line = APT_ROOT / "sources.list"
    if one_line.exists():
        for line in one_line.read_text().splitlines():
            if line.startswith("deb ") and "security" not in line:
                return next((w for w in line.split() if "://" in w), "")
    return ""


def _add_unstable_source(log: Path) -> None:
    if not UNSTABLE_SOURCE.exists():
        mirror = _debian_mirror()
        if not mirror:
            raise MissingDependency(f"no Debian mirror found in {APT_ROOT}/sources.list*")
        UNSTABLE_SOURCE.write_text(
            "# Added by bazelw (or tools/remote): unstable packages; stable stays the default.\n"
            f"Types: deb\nURIs: {mirror}\nSuites: unstable\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        )
    if not UNSTABLE_PIN.exists():
        UNSTABLE_PIN.parent.mkdir(parents=True, exist_ok=True)
        UNSTABLE_PIN.write_text(
            "# Added by bazelw (or tools/remote): nothing comes from unstable unless asked for.\n"
            "Package: *\nPin: release a=unstable\nPin-Priority: 100\n"
        )
    _run_logged(["apt-get", "update", "-qq"], log)


def _apt_install(packages: list[str], unstable: bool, log: Path) -> None:
    why_not = _can_install()
    if why_not:
        suite = "-t unstable " if unstable else ""
        raise MissingDependency(
            f"missing {' '.join(packages)} and cannot install it ({why_not}); on Debian, as root: "
            f"apt-get install {suite}--no-install-recommends {' '.join(packages)}"
            + (
                " (with the unstable suite in apt's sources, pinned low; see bazelw)"
                if unstable
                else ""
            )
        )
    print(f"stack: installing {' '.join(packages)} with apt-get (log: {log})", flush=True)
    if unstable:
        _add_unstable_source(log)
        target = ["-t", "unstable"]
    else:
        _run_logged(["apt-get", "update", "-qq"], log)
        target = []
    base = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *DPKG_OPTS]
    try:
        _run_logged([*base, *target, *packages], log)
    except MissingDependency:
        _run_logged(["apt-get", "-f", "install", "-y", "-qq", *DPKG_OPTS, *target], log)
        _run_logged([*base, *target, *packages], log)


def buildbox(log: Path) -> dict[str, str]:
    """Paths of the buildbox programs, installing Debian's buildbox if one is missing."""
    if not all(shutil.which(p) for p in BUILDBOX_PROGRAMS):
        _apt_install(["buildbox"], unstable=True, log=log)
    paths = {p: shutil.which(p) for p in BUILDBOX_PROGRAMS}
    missing = [p for p, path in paths.items() if not path]
    if missing:
        raise MissingDependency(f"buildbox is installed but {', '.join(missing)} is not on PATH")
    return {p: str(path) for p, path in paths.items()}


def _postgres_bin_dir() -> Path | None:
    for bin_dir in sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]), reverse=True
    ):
        if all((Path(bin_dir) / p).exists() for p in POSTGRES_PROGRAMS):
            return Path(bin_dir)
    on_path = shutil.which("initdb")
    if on_path and all(shutil.which(p) for p in POSTGRES_PROGRAMS):
        return Path(on_path).parent
    return None


def postgres(log: Path) -> Path:
    """The folder holding initdb, postgres and pg_isready, installing Debian's postgresql."""
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        _apt_install(["postgresql"], unstable=False, log=log)
        bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        raise MissingDependency(
            "postgresql is installed but initdb/postgres/pg_isready were not found"
        )
    return bin_dir


def _python_313() -> str | None:
    """A Python >= 3.13 interpreter: on PATH, in pyenv, or Debian's."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(20, 12, -1)]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.1[3-9]*/bin/python3"), reverse=True)
    for candidate in candidates:
        if not candidate:
            continue
        probe = [candidate, "-c", "import sys, venv; sys.exit(sys.version_info < (3, 13))"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    return None


def buildgrid(venv: Path, log: Path) -> Path:
    """The `bgd` of a virtual environment holding buildgrid==0.9.1, made on first use."""
    bgd = venv / "bin" / "bgd"
    stamp = venv / f".buildgrid-{BUILDGRID_VERSION}"
    if bgd.exists() and stamp.exists():
        return bgd
    python = _python_313()
    if python is None:
        _apt_install(["python3.13", "python3.13-venv"], unstable=True, log=log)
        python = _python_313()
    if python is None:
        raise MissingDependency("BuildGrid needs Python >= 3.13 and none was found or installed")
    print(f"stack: installing buildgrid=={BUILDGRID_VERSION} into {venv} (log: {log})", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run_logged([python, "-m", "venv", str(venv)], log)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]
    _run_logged([*pip, f"buildgrid=={BUILDGRID_VERSION}"], log)
    stamp.touch()
    return bgd
