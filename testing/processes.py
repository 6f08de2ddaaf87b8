"""What tests ask of a process they started (or let a tool start), read from /proc: an oracle
of its own, so a test of code that stops processes does not ask that code whether it did."""

from pathlib import Path


def exited(pid: int) -> bool:
    """Whether `pid` has exited: no such process, or a zombie nobody has reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status
