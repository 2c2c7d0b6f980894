"""Stamps that leave the process travel as wall-clock time.

An engine stamps a request's submission, first step and finish with time.perf_counter() (monotonic, fine-grained),
which means nothing in another machine's process: a stamp that travels (a prefilled prompt to a decode stage, a
request MIGRATEd to another engine actor, either of them on another node) crosses as wall-clock time and is turned
into the receiving process's perf_counter on arrival, so a row's completion_time_s is one clock's difference (the
machines' clocks agreeing to the milliseconds NTP keeps them within).
"""

from __future__ import annotations

import time


def to_wall(stamp: float | None) -> float | None:
    """A perf_counter stamp of this process as wall-clock time."""
    return None if stamp is None else stamp + (time.time() - time.perf_counter())


def from_wall(stamp: float | None) -> float | None:
    """A wall-clock stamp as this process's perf_counter."""
    return None if stamp is None else stamp - (time.time() - time.perf_counter())
