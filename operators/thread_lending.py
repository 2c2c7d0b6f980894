"""Engine actors of one node lend their threads to each other while they have nothing to compute.

Ray grants each engine actor a share of its node's CPUs for the whole job, but an actor's work does not last
the whole job: a disaggregated decode actor waits for the first prefilled block, the prefill actor has nothing
left once the input is read, and in single mode an actor whose tail drained waits for the others. Meanwhile
its cores idle. So each engine actor of a node keeps a small file (one directory per Ray job and node) saying
how many threads it was granted, since when it is idle and when its process started (a pid alone may by now name
another process); a busy engine computes with its own grant plus an even share of the grants of the peers idle for
at least IDLE_S, never with more threads than the node has cores; an actor that left while the others ran (its
stage done) lends its grant for the rest of their run. A peer that gets work again takes its grant back at once;
the borrowers give theirs back at their next recount (at most CHECK_S later, after the step in progress).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from batchgen.engine import EngineConfig
from batchgen.engine.process_identity import process_alive, process_start

IDLE_S = 0.5  # a peer idle this long lends its threads: not one that is between two batches
CHECK_S = 0.25  # a busy engine recounts its threads at most this often
PREFIX = "batchgen-threads-"  # the lending directories' names in the node's temp folder
ENDED_AGE_S = 60.0  # a lending directory untouched this long, all of whose engines ended, is an ended job's


@dataclass(frozen=True)
class Peer:
    """Another engine actor of this node, as its file says."""

    granted: int  # threads Ray's CPU grant gives it
    idle_since: float | None  # wall clock; None while it computes


def lent_threads(granted: int, peers: Iterable[Peer], cores: int, now: float) -> int:
    """Threads for a busy engine granted `granted`: its own, plus an even share (rounded down) of the threads of
    the peers idle since IDLE_S or longer among the busy engines, itself included; at most `cores`."""
    peers = list(peers)
    idle = sum(p.granted for p in peers if p.idle_since is not None and now - p.idle_since >= IDLE_S)
    busy = 1 + sum(1 for p in peers if p.idle_since is None or now - p.idle_since < IDLE_S)
    return max(1, min(cores, granted + idle // busy))


class ThreadLending:
    """This process's engine in its node's lending directory; `busy()` before each step, `idle()` when out of
    work, both on the thread that computes (torch's thread count is that thread's)."""

    def __init__(self, directory: Path, granted: int, cores: int | None = None) -> None:
        self.directory = directory
        self.granted = granted
        self.cores = cores or os.cpu_count() or 1
        self.path = directory / str(os.getpid())
        self.started = process_start(os.getpid())
        self.changes = 0  # thread-count changes made: how often threads were borrowed or given back
        # computing from the start: its engine loads (and may profile) before its loop first reports it idle; a
        # peer borrowing these cores meanwhile slowed the start and skewed the timings cached for this machine
        self._idle_since: float | None = None
        self._checked = 0.0
        self._met: set[int] = set()  # peers' pids seen alive
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self._publish()
        except FileNotFoundError:  # removed as an ended job's (remove_ended_jobs) between the two
            directory.mkdir(parents=True, exist_ok=True)
            self._publish()
        # the files of engines that ended go now, not at this engine's first step: a replacement takes the grant
        # of the actor it replaces, which peers that met that actor would lend on meanwhile (all its loading)
        self.peers()

    def on_work(self, busy: bool) -> None:
        """EngineLoop's hook: `busy()` or `idle()`."""
        if busy:
            self.busy()
        else:
            self.idle()

    def busy(self) -> int:
        """About to compute: take this engine's grant back if it was lent, and (every CHECK_S) borrow what idle
        peers lend. Returns the thread count in use."""
        now = time.time()
        if self._idle_since is not None:
            self._idle_since, self._checked = None, 0.0
            self._publish()
        if now - self._checked >= CHECK_S:
            self._checked = now
            threads = lent_threads(self.granted, self.peers(), self.cores, now)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
                self.changes += 1
        return torch.get_num_threads()

    def idle(self) -> None:
        """Out of work: from IDLE_S on, busy peers may compute with this engine's threads."""
        if self._idle_since is None:
            self._idle_since = time.time()
            self._publish()

    def peers(self) -> list[Peer]:
        """The other engine actors of this job on this node, as their files say; one that ended after this
        engine saw it alive (its stage done, or crashed and replaced) is idle for good, one that ended before
        (an earlier pipeline of the same Ray job) is forgotten."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name == self.path.name or not entry.name.isdigit():
                continue
            try:
                granted, idle_since, started = Path(entry.path).read_text().split()
            except (OSError, ValueError):  # being replaced
                continue
            pid = int(entry.name)
            if process_alive(pid, started):
                self._met.add(pid)
                found.append(Peer(int(granted), None if idle_since == "-" else float(idle_since)))
            elif pid in self._met:  # its stage is done while this one runs: its grant stays the job's to lend
                found.append(Peer(int(granted), 0.0))
            else:  # an engine of an earlier run of the job
                Path(entry.path).unlink(missing_ok=True)
        return found

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def _publish(self) -> None:
        """Write this engine's state; a reader sees the old file or the new one, never half of one."""
        since = "-" if self._idle_since is None else repr(self._idle_since)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(f"{self.granted} {since} {self.started}")
        os.replace(partial, self.path)


def lend_threads(granted: int, engine_options: dict[str, Any]) -> ThreadLending | None:
    """In an engine actor granted `granted` threads: its place in the lending of its Ray job and node. None
    outside a Ray worker, and for an engine over several ranks (each rank process has its fixed share)."""
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    if EngineConfig.from_kwargs(**engine_options).ranks > 1:
        return None
    context = ray.get_runtime_context()
    directory = Path(tempfile.gettempdir()) / f"{PREFIX}{context.get_job_id()}-{context.get_node_id()[:16]}"
    remove_ended_jobs(directory.parent, keep=directory, now=time.time())
    return ThreadLending(directory, granted)


def remove_ended_jobs(root: Path, keep: Path, now: float) -> list[Path]:
    """Remove the lending directories under `root` (other than `keep`) of jobs that ended: untouched for ENDED_AGE_S
    and naming only processes that no longer run. Nothing else removes them (an engine's file stays after it ends, for
    its peers to lend its grant), and each Ray job of each node would leave one behind. Returns those removed."""
    removed = []
    for entry in os.scandir(root):
        if not entry.name.startswith(PREFIX) or entry.path == str(keep):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or now - entry.stat().st_mtime < ENDED_AGE_S:
                continue
            files = list(os.scandir(entry.path))
            if not all(_ended(f) for f in files):
                continue
            for f in files:
                Path(f.path).unlink(missing_ok=True)
            os.rmdir(entry.path)  # fails, and the directory stays, if an engine wrote its file meanwhile
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _ended(entry: os.DirEntry) -> bool:
    """Whether a lending file names a process that ended (one that does not read as a lending file has not). A
    partial file (`.tmp`) is a `_publish` whose replace never came, its writer killed between the two (a live one
    replaces it at once, and remove_ended_jobs looks only in directories untouched for ENDED_AGE_S): ended, whatever
    it holds (an empty one, often: killed between creating and writing it)."""
    if entry.name.endswith(".tmp"):
        return True
    pid = entry.name
    try:
        started = Path(entry.path).read_text().split()[2]
    except (OSError, IndexError):
        return False
    return pid.isdigit() and not process_alive(int(pid), started)
