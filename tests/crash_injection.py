"""Test-only fault injection: pipeline stages whose worker process dies for real (os._exit, no exception
for Ray to catch) when a given batch arrives, once per marker file.

    CrashingDecode = crashing(Decode, after_batches=2, marker=tmp_path / "crashed")
    monkeypatch.setattr(batchgen.pipelines.pipeline, "Decode", CrashingDecode)

`crashing` makes a subclass of the stage whose trigger (K, marker path) is held in class attributes.
The subclass is built per test and pickled BY VALUE (this module is registered with Ray's cloudpickle
below), so the attributes set here reach every worker with the class, and a restarted actor, which
Ray rebuilds from the same pickled class and constructor arguments, gets the same trigger. The first
worker to see batch K + 1 creates the marker exclusively (open(path, "x")), writes which stage class
crashed, its pid and how many batches were in flight in it, and exits; every other worker, and every
restarted one, finds the marker and runs on. So exactly one worker process dies per marker.
`min_in_flight` delays the crash until that many batches are in flight in the actor (with one batch
per block, that many Ray Data tasks: an engine actor over-subscribed across blocks holds sequences of
all of them when it dies).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from pathlib import Path
from typing import Any

from ray import cloudpickle

EXIT_CODE = 17

# Ray workers cannot import this module (tests/ is not on their path): ship its code with the classes.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _Trigger:
    """Counts one worker's batches; from batch `after_batches + 1` on, the first one that arrives while
    `min_in_flight` batches are in flight (itself included) kills the worker, if it is the first to claim
    the marker."""

    def __init__(self, stage: str, after_batches: int, marker: str, min_in_flight: int) -> None:
        self.stage, self.after_batches, self.marker = stage, after_batches, marker
        self.min_in_flight = min_in_flight
        self.seen = 0
        self.armed = True

    def on_batch(self, in_flight: int) -> None:
        self.seen += 1
        if not self.armed or self.seen <= self.after_batches or in_flight < self.min_in_flight:
            return
        self.armed = False
        _die_first(self.marker, f"{self.stage} pid={os.getpid()} batch={self.seen} in_flight={in_flight}")


def _die_first(marker: str, record: str) -> None:
    """Exit the process unless another worker claimed `marker` first."""
    try:
        with open(marker, "x") as f:
            f.write(record + "\n")
    except FileExistsError:
        return  # another worker (or this actor before its restart) crashed already
    os._exit(EXIT_CODE)


def crashing(stage: type, *, after_batches: int, marker: str | Path, min_in_flight: int = 1) -> type:
    """A subclass of the stage class `stage` (BatchGen, Prefill, Decode) that kills its worker process
    when its batch number `after_batches + 1` (or the first after it that finds `min_in_flight` batches in
    flight) arrives, with earlier batches possibly still in flight. Sync or async like the stage itself,
    so Ray Data runs it the same way."""
    name, marker = stage.__name__, str(marker)

    def init(self, *args: Any, **kwargs: Any) -> None:
        self._crash = _Trigger(name, after_batches, marker, min_in_flight)
        self._in_flight = 0
        stage.__init__(self, *args, **kwargs)

    if inspect.iscoroutinefunction(stage.__call__):
        async def call(self, batch: Any) -> Any:
            self._in_flight += 1
            try:
                self._crash.on_batch(self._in_flight)
                return await stage.__call__(self, batch)
            finally:
                self._in_flight -= 1
    else:
        def call(self, batch: Any) -> Any:
            self._crash.on_batch(1)
            return stage.__call__(self, batch)

    return type(f"Crashing{name}", (stage,), {"__init__": init, "__call__": call, "__module__": __name__})


def read_marker(marker: str | Path) -> dict[str, str]:
    """{"stage": "Decode", "pid": "1234", "batch": "3", "in_flight": "1"} from a marker a crashing stage wrote."""
    stage, *fields = Path(marker).read_text().split()
    return {"stage": stage, **dict(field.split("=", 1) for field in fields)}


def crashing_agent(stage: type, *, marker: str | Path, moment: str, stores: int = 1) -> type:
    """A subclass of the engine stage `stage` (given a balancer) whose worker dies at a MIGRATE `moment`:
    "adopted", right after it took requests another actor exported (they are in its engine, their owner
    waits for them), or "checkpointed", right after its `stores`-th store of checkpoints of suspended requests."""
    name, marker = stage.__name__, str(marker)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        stage.__init__(self, *args, **kwargs)
        agent = self.agent
        if moment == "adopted":
            adopt = agent.loop.adopt

            def adopt_then_die(migrated: Any, on_result: Any) -> Any:
                done = adopt(migrated, on_result)
                done.result()
                _die_first(marker, f"{name} pid={os.getpid()} moment=adopted requests={len(migrated)}")
                return done

            agent.loop.adopt = adopt_then_die
        elif moment == "checkpointed":
            store, snapshot = agent._store_checkpoints, agent.loop.snapshot
            holds: list[threading.Event] = []
            stored: list[bool] = []  # whether each store held any snapshot

            def snapshot_then_hold(skip: Any) -> Any:
                """The engine thread waits right after the snapshot until it is stored and this worker dead: no
                request can finish meanwhile (its task would then drop its checkpoints before the crash)."""
                taken = snapshot(skip)
                holds.append(threading.Event())
                agent.loop._call(holds[-1].wait)
                return taken

            async def store_then_die(snapshots: Any) -> None:
                try:
                    await store(snapshots)
                    stored.append(bool(snapshots))
                    if snapshots and sum(stored) >= stores:
                        _die_first(marker, f"{name} pid={os.getpid()} moment=checkpointed requests={len(snapshots)}")
                finally:
                    holds.pop(0).set()

            agent.loop.snapshot = snapshot_then_hold
            agent._store_checkpoints = store_then_die
        else:
            raise ValueError(f"unknown moment {moment!r}")

    return type(f"Crashing{name}", (stage,), {"__init__": init, "__module__": __name__})
