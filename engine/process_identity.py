"""A process named so that it cannot be mistaken for a later one: its pid, when it started and the boot it
runs in (a pid alone may by now name another process; after a reboot every pid does)."""

from __future__ import annotations

import os
from pathlib import Path

UNKNOWN_START = "?"  # a process's start time where /proc cannot tell it


def process_start(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot (the 22nd field of /proc/<pid>/stat; the command
    name before it may hold spaces and parentheses), or UNKNOWN_START where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return UNKNOWN_START
    return stat.rsplit(")", 1)[1].split()[19]


def process_alive(pid: int, started: str) -> bool:
    """Whether the process that was `pid` when it started at `started` (process_start) still runs on this machine;
    a process whose start cannot be read counts as the same one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = process_start(pid)
    return now == started or UNKNOWN_START in (now, started)


def pid_space() -> str:
    """Where a pid names one process: this boot of this machine (Linux's random boot id) and this process's pid
    namespace (containers on one host share its boot, not its pids), or "" where the system does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "/" + os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
