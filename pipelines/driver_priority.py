"""The job's driver yields the CPU to the engines it feeds.

Where engine actors compute on the cores the driver runs on (a CPU job on one machine), each burst of the driver's
own work (Ray Data's executor loop, progress, the write bookkeeping) preempts one of an engine's OpenMP threads, and
the engine's whole thread team waits for it at the next barrier. On the 2-core dev box a co-running process taking a
third of one core slowed bench-moe's 128-sequence decode steps by ~30 % at niceness 0 and not measurably at niceness
10. In `bench/pipeline.py` the effect is within its run-to-run spread (the single shape's steady-state overhead
6.9 / 14.5 % with the driver at 10, 13.9 / 16.1 % at 0).
Ray already starts its worker processes at niceness 15 (engine actors return to 0: operators/engine_actor.py);
`driver_yields_cpu` lowers the driver's threads to DRIVER_NICENESS for a job and gives them their niceness back after
it, where the OS lets a process raise its priority again (an unprivileged one stays at DRIVER_NICENESS).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)

DRIVER_NICENESS = 10


@contextlib.contextmanager
def driver_yields_cpu(niceness: int = DRIVER_NICENESS) -> Iterator[None]:
    """Every thread of this process at niceness `niceness` or lower priority while the block runs (threads started
    inside inherit it), then back to what each had (a thread started inside: to what the calling thread had)."""
    before = {tid: value for tid in _threads() if (value := _niceness(tid)) is not None}
    caller = os.getpriority(os.PRIO_PROCESS, 0)
    for tid, value in before.items():
        _set_niceness(tid, max(value, niceness))
    try:
        yield
    finally:
        for tid in _threads():
            _set_niceness(tid, before.get(tid, caller))


def _threads() -> list[int]:
    """This process's thread ids where niceness is per thread (Linux), else [0]: the process."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _niceness(tid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:  # the thread ended meanwhile
        return None


def _set_niceness(tid: int, value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except ProcessLookupError:  # the thread ended meanwhile
        pass
    except PermissionError as exc:  # raising priority again needs privilege
        log.debug("thread %d keeps its niceness: %s", tid, exc)
