"""bazelw's decisions, in a stubbed environment: no real Bazel, apt or /etc is touched.

Each test builds a PATH holding only the basic tools bazelw needs plus whatever fakes the case
calls for (a `bazel`, an `apt-get`), and points bazelw's test hooks at fake os-release and apt
configuration files.
"""

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASIC_TOOLS = ["bash", "awk", "stat", "tr", "dirname", "id", "mkdir", "cat", "env", "sh"]


def _write_exe(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def sandbox(tmp_path):
    """A copy of bazelw with a PATH of basic tools only and fake system files."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "bazelw", repo / "bazelw")
    shutil.copy(REPO / ".bazelversion", repo / ".bazelversion")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASIC_TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed by the test"
        (bin_dir / tool).symlink_to(found)
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.test/debian\nSuites: bookworm\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.test/debian-security\nSuites: bookworm-security\n"
    )
    os_release = tmp_path / "os-release"
    os_release.write_text('ID=debian\nVERSION_ID="12"\n')
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "BAZELW_OS_RELEASE": str(os_release),
        "BAZELW_APT_ROOT": str(apt),
        "BAZELW_UID": "0",
    }
    return {"repo": repo, "bin": bin_dir, "apt": apt, "os_release": os_release, "env": env}


def _run(sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(sandbox["repo"] / "bazelw"), *args],
        env=sandbox["env"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_not_debian_prints_instructions_and_exits_2(sandbox):
    sandbox["os_release"].write_text("ID=fedora\n")
    result = _run(sandbox, "version")
    assert result.returncode == 2
    assert "not Debian" in result.stderr
    assert "bazelisk" in result.stderr.lower()
    assert not (sandbox["apt"] / "sources.list.d" / "bazelw-unstable.sources").exists()


def test_not_root_prints_instructions_and_exits_2(sandbox):
    sandbox["env"]["BAZELW_UID"] = "1000"
    result = _run(sandbox, "version")
    assert result.returncode == 2
    assert "not running as root" in result.stderr
    assert "apt-get install -t unstable" in result.stderr


def test_fitting_bazel_on_path_is_execed_with_the_arguments(sandbox):
    _write_exe(
        sandbox["bin"] / "bazel",
        'if [ "$1" = --version ]; then echo "bazel 7.7.1"; else echo "ran: $*"; fi\n',
    )
    result = _run(sandbox, "test", "//...")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran: test //...\n"
    # The second call trusts the cached version check.
    assert _run(sandbox, "info").stdout == "ran: info\n"


def test_bazel_of_another_version_is_ignored(sandbox):
    _write_exe(sandbox["bin"] / "bazel", 'echo "bazel 6.4.0"\n')
    sandbox["os_release"].write_text("ID=arch\n")
    result = _run(sandbox, "version")
    assert result.returncode == 2
    assert "version '6.4.0' does not fit .bazelversion 7.7.1" in result.stderr


def test_debian_root_installs_from_unstable_of_the_machines_own_mirror(sandbox):
    log = sandbox["bin"].parent / "apt.log"
    # A fake apt-get that records its arguments and "installs" a fitting bazel.
    fake_bazel = 'if [ "$1" = --version ]; then echo "bazel 7.7.1"; else echo "ran: $*"; fi\n'
    _write_exe(
        sandbox["bin"] / "apt-get",
        f'echo "$*" >> {log}\n'
        f"cat > {sandbox['bin']}/bazel <<'EOF'\n#!/bin/sh\n{fake_bazel}EOF\n"
        f"{shutil.which('chmod')} +x {sandbox['bin']}/bazel\n",
    )
    result = _run(sandbox, "build", "//:x")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran: build //:x\n"
    sources = (sandbox["apt"] / "sources.list.d" / "bazelw-unstable.sources").read_text()
    assert "URIs: http://mirror.test/debian\n" in sources
    assert "Suites: unstable" in sources
    pin = (sandbox["apt"] / "preferences.d" / "bazelw-unstable").read_text()
    assert "Pin: release a=unstable" in pin and "Pin-Priority: 100" in pin
    calls = log.read_text().splitlines()
    install = next(c for c in calls if "bazel-bootstrap" in c)
    assert "-t unstable" in install
    assert "--no-install-recommends" in install
    assert "Dpkg::Options::=--force-overwrite" in install
    assert "installing Debian's bazel-bootstrap" in result.stderr


def test_one_line_sources_list_is_understood(sandbox):
    (sandbox["apt"] / "sources.list.d" / "debian.sources").unlink()
    (sandbox["apt"] / "sources.list").write_text(
        "deb http://security.test/debian-security bookworm-security main\n"
        "deb [arch=amd64] http://old.test/debian bookworm main\n"
    )
    _write_exe(sandbox["bin"] / "apt-get", "exit 0\n")
    result = _run(sandbox, "version")
    # The fake apt installs nothing, so bazelw reports that, after writing the source.
    assert result.returncode == 1
    sources = (sandbox["apt"] / "sources.list.d" / "bazelw-unstable.sources").read_text()
    assert "URIs: http://old.test/debian\n" in sources


def test_warm_call_overhead_is_one_stat(sandbox):
    """With the version check cached, bazelw does not run `bazel --version` again."""
    counter = sandbox["bin"].parent / "count"
    _write_exe(
        sandbox["bin"] / "bazel",
        f'if [ "$1" = --version ]; then echo x >> {counter}; echo "bazel 7.7.1"; fi\n',
    )
    for _ in range(3):
        assert _run(sandbox, "info").returncode == 0
    assert counter.read_text().count("x") == 1


def test_bazel_gets_one_path_whatever_the_shells_order(sandbox, tmp_path):
    """PATH is in every action's cache key: bazelw hands Bazel the directory of the shell's
    python3, then the system's directories, in that order, for any order of the shell's."""
    fake = 'echo "bazel 7.7.1"\nif [ "$1" = path ]; then echo "$PATH"; fi\n'
    _write_exe(sandbox["bin"] / "bazel", fake)
    python_dir = tmp_path / "python"
    python_dir.mkdir()
    _write_exe(python_dir / "python3", "exit 0\n")
    system = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    seen = set()
    for order in ([python_dir, sandbox["bin"]], [sandbox["bin"], tmp_path / "other", python_dir]):
        sandbox["env"]["PATH"] = ":".join(map(str, order))
        result = _run(sandbox, "path")
        assert result.returncode == 0, result.stderr
        seen.add(result.stdout.splitlines()[-1])
    assert seen == {f"{python_dir}:{system}"}
    sandbox["env"]["PATH"] = str(sandbox["bin"])  # no python3: the system's directories
    assert _run(sandbox, "path").stdout.splitlines()[-1] == system


def test_a_file_conflict_is_resolved_with_apt_get_f_install(sandbox):
    """docs/environment.md:17-19: the install's file conflict (libssl3 and
    openssl-provider-legacy both ship legacy.so) fails the first `apt-get install`; bazelw then
    runs `apt-get -f install` from unstable, and a last `apt-get -f install`, and the Bazel it
    leaves runs (planted: the `|| apt-get -f install` fallback dropped, exit 1; the closing
    `apt-get -f install` dropped)."""
    log = sandbox["bin"].parent / "apt.log"
    fake_bazel = 'if [ "$1" = --version ]; then echo "bazel 7.7.1"; else echo "ran: $*"; fi\n'
    _write_exe(
        sandbox["bin"] / "apt-get",
        f'echo "$*" >> {log}\n'
        # The install of bazel-bootstrap itself stops at the conflict; -f install finishes it.
        'case "$*" in *bazel-bootstrap*) exit 100 ;; esac\n'
        f"cat > {sandbox['bin']}/bazel <<'EOF'\n#!/bin/sh\n{fake_bazel}EOF\n"
        f"{shutil.which('chmod')} +x {sandbox['bin']}/bazel\n",
    )
    result = _run(sandbox, "build", "//:x")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran: build //:x\n"
    force = "-o Dpkg::Options::=--force-overwrite -o Dpkg::Options::=--force-confold"
    assert log.read_text().splitlines() == [
        "update -qq",
        f"install -y -qq -t unstable --no-install-recommends {force} bazel-bootstrap",
        f"-f install -y -qq -t unstable --no-install-recommends {force}",
        f"-f install -y -qq {force}",
    ]


def test_no_debian_mirror_prints_instructions_and_exits_2(sandbox):
    """docs/environment.md:14-15,20-21: the unstable source reuses the machine's own mirror and
    names no host of its own; with only a security source there is no mirror to reuse, so
    bazelw prints how to install Bazel and exits 2, writing no source (planted: the mirror
    check dropped, a source with an empty URIs written and apt-get run)."""
    (sandbox["apt"] / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.test/debian-security\nSuites: bookworm-security\n"
    )
    result = _run(sandbox, "version")
    assert result.returncode == 2
    assert "no Debian mirror found" in result.stderr
    assert "apt-get install -t unstable --no-install-recommends bazel-bootstrap" in result.stderr
    assert not (sandbox["apt"] / "sources.list.d" / "bazelw-unstable.sources").exists()


def test_the_security_source_is_never_the_mirror_reused(sandbox):
    """docs/environment.md:14-15: of a deb822 file listing the security archive first, bazelw
    reuses the main mirror for unstable (there is no unstable suite on the security host)
    (planted: the deb822 reader without its `security` filter, the first URIs taken)."""
    (sandbox["apt"] / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.test/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.test/debian\nSuites: bookworm\nComponents: main\n"
    )
    _write_exe(sandbox["bin"] / "apt-get", "exit 0\n")
    result = _run(sandbox, "version")
    assert result.returncode == 1  # the fake apt installs nothing
    sources = (sandbox["apt"] / "sources.list.d" / "bazelw-unstable.sources").read_text()
    assert "URIs: http://mirror.test/debian\n" in sources
