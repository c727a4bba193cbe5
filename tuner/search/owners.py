"""Which process holds a trial, and whether it is still running.

A worker killed with `kill -9` cannot tell the trials it holds. Heartbeats (RDB storages) fail
them after the grace period; the journal storage has no heartbeats at all. So every trial
records its owner when it is asked (`TrialRecord`'s `owner` attribute: host, boot, pid and the
process's start time), and a search fails the running trials whose owner is certainly gone
(`gone`): same host and boot, and no process with that pid and start time. A trial owned by
another host (or an older version of the tool, which recorded no owner) is left to the
heartbeat.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (Linux): [state, ppid, ...]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot, Linux), to tell a reused pid apart."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def this_process() -> dict[str, Any]:
    """The owner record of this process (not cached: a forked child is another owner)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "start": _start_ticks(pid)}


def gone(owner: dict[str, Any] | None) -> bool:
    """True only when sure: the owner ran on this host (and boot) and no longer runs."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    if owner.get("boot") and _boot_id() and owner["boot"] != _boot_id():
        return True  # this host rebooted since: every process of that boot is gone
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user holds that pid: compare start times
    except OSError:
        return False
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return True  # killed, not yet reaped by its parent
    start = owner.get("start")
    now = _start_ticks(pid)
    return start is not None and now is not None and now != start  # the pid was reused
