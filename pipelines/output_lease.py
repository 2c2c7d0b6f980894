"""One run at a time on an output folder.

A job's output is shared state: a run deletes what a crashed run left (its temporary files, torn part files) before
writing, and checks at its end that every row is there once. Two runs of one job on one folder at the same time (a
scheduler starting the job again while it still runs, two Batch API servers on one store) would each take the other's
temporary files for a crash's leftovers, delete them and fail the other's writes, and write every row twice. So a run
holds a lease on the folder from its plan to its end: a small record saying which run holds it, on which machine and
process, refreshed every HEARTBEAT_S. Another run is refused while the lease is alive; one whose holder has ended is
taken over at once where the holder ran on the same machine (its process is gone, or it is this process and its run
let go), else once its heartbeat is older than STALE_S (clocks of the machines are assumed to agree to well within
that).

Object stores have no exclusive create, so a run writes its record and reads it back after a pause longer than
another run's read-then-write can take: of two runs that both found the folder free, the one whose record was
overwritten gives way.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from batchgen.connectors.io import filesystem, write_atomically
from batchgen.engine.process_identity import pid_space, process_alive, process_start

LEASE = "_batchgen_run.json"
HEARTBEAT_S = 10.0
STALE_S = 60.0
_MIN_SETTLE_S = 0.05
_HELD: set[str] = set()  # runs of this process holding a lease now (a record of this process naming another ended)

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another run holds the output folder; the message names it."""


@dataclass(frozen=True)
class Holder:
    """The run a lease record names."""

    run: str  # unique per run
    host: str
    pid_space: str  # the host's boot and pid namespace: a pid names the same process only within them
    pid: int
    started: str  # the process's start (process_identity.process_start)
    heartbeat: float  # wall clock of its last refresh

    @classmethod
    def this_process(cls) -> Holder:
        return cls(uuid.uuid4().hex, socket.gethostname(), pid_space(), os.getpid(), process_start(os.getpid()),
                   time.time())

    def ended(self, now: float) -> bool:
        """Whether the run is over, as far as this machine can tell."""
        if self.host == socket.gethostname() and self.pid_space and self.pid_space == pid_space():
            if self.pid == os.getpid() and self.started == process_start(self.pid):  # this very process (a server
                return self.run not in _HELD  # running job after job), whose run released it, or failed to remove it
            return not process_alive(self.pid, self.started)
        return now - self.heartbeat > STALE_S

    def describe(self, now: float) -> str:
        return f"run {self.run[:8]} (pid {self.pid} on {self.host}, last heartbeat {now - self.heartbeat:.0f} s ago)"


class OutputLease:
    """The lease of one run on one output folder: `acquire` it before touching the folder, `release` it at the end
    (also when the run fails). While held, a daemon thread refreshes it; `lost` is set when another run took it
    over meanwhile (this run's heartbeat went stale: a process stopped for longer than STALE_S)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, folder = filesystem(uri, storage_options)
        self.uri = uri
        self.path = posixpath.join(folder, LEASE)
        self.holder = Holder.this_process()
        self.lost = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Hold the folder, or raise LeaseHeld naming the run that does."""
        self.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
        began = time.monotonic()
        current = self._read()
        now = time.time()
        if current is not None and current.run != self.holder.run:
            if not current.ended(now):
                raise LeaseHeld(f"output {self.uri!r} is being written by another {current.describe(now)}; wait for "
                                f"it to end or give another output path (a run that ended without releasing it is "
                                f"taken over at once from its own machine once its process has ended, from any other "
                                f"once its heartbeat is {STALE_S:.0f} s old)")
            log.warning("output %r: taking over the lease of %s, which has ended", self.uri, current.describe(now))
        self._write()
        # a run that read the folder free before this write finishes its own write within the time both took here
        time.sleep(max(_MIN_SETTLE_S, 2 * (time.monotonic() - began)))
        winner = self._read()
        if winner is None or winner.run != self.holder.run:
            raise LeaseHeld(f"output {self.uri!r} was claimed at the same moment by another run"
                            + ("" if winner is None else f" ({winner.describe(time.time())})"))
        _HELD.add(self.holder.run)
        self._heartbeat = threading.Thread(target=self._beat, name="batchgen-output-lease", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Stop refreshing and remove the record if it is still this run's (idempotent)."""
        self._stop.set()
        if self._heartbeat is None:
            return
        self._heartbeat.join()
        self._heartbeat = None
        _HELD.discard(self.holder.run)
        if self.lost:
            return
        try:
            current = self._read()
            if current is not None and current.run == self.holder.run:
                self.fs.rm(self.path)
        except Exception as exc:  # the run's outcome stands; its record goes stale and is taken over
            log.warning("output %r: could not remove this run's lease: %s", self.uri, exc)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = self._read()
                if current is None or current.run != self.holder.run:
                    self.lost = True
                    log.error("output %r: another run took over this run's lease (%s)", self.uri,
                              "removed" if current is None else current.describe(time.time()))
                    return
                self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
                self._write()
            except Exception as exc:  # a storage hiccup (an object store's are not all OSErrors: botocore's
                # connection and credential errors) ends no heartbeat: the next beat tries again, inside STALE_S
                log.warning("output %r: the lease's heartbeat failed: %s", self.uri, exc)

    def _read(self) -> Holder | None:
        self.fs.invalidate_cache(posixpath.dirname(self.path))
        try:
            return Holder(**json.loads(self.fs.cat_file(self.path)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:  # torn or foreign: nobody can be shown to hold it
            log.warning("output %r: ignoring an unreadable lease record (%s)", self.uri, exc)
            return None

    def _write(self) -> None:
        """Whole or not at all: a record rewritten in place (truncated, then written) read as empty by a run checking
        the folder at that moment, which took it for free and claimed it beside this run."""
        write_atomically(self.fs, self.path, json.dumps(asdict(self.holder)).encode())
