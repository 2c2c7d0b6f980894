"""Crash injection for fault-tolerance tests: a real process death, not an exception."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class CrashAfter:
    """Kill this worker (os._exit: no cleanup, no exception for Ray to catch) when its batch number
    `batches + 1` arrives, with the batches before it possibly still in flight.

    `marker` is a file path visible to every worker: the first worker to create it crashes, the
    others and every restarted actor (which gets the same constructor arguments) run on, so one
    failure happens per marker. Built from an operator's `crash_after={"batches": K, "marker": PATH}`.
    """

    batches: int
    marker: str
    seen: int = 0
    armed: bool = True

    def on_batch(self) -> None:
        self.seen += 1
        if not self.armed or self.seen <= self.batches:
            return
        self.armed = False
        try:
            with open(self.marker, "x") as f:
                f.write(f"pid {os.getpid()} crashed at batch {self.seen}\n")
        except FileExistsError:
            return
        os._exit(17)


def crash_injector(spec: dict | None) -> CrashAfter | None:
    return None if spec is None else CrashAfter(int(spec["batches"]), str(spec["marker"]))
