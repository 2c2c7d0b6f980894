"""Stopping a running pipeline job (`execute_job`) from another thread, now, not after its last row.

Ray Data has no public call that ends a running write. Its streaming executor does shut down from
another thread (that is how Ray Data ends a dataset that is garbage-collected), and `force=True` kills
the operators' actors, so the engines drop the batches they hold instead of finishing them. While a
`JobStopper` is armed, every executor that starts in this process registers with it through a Ray
Data execution callback; `stop()` shuts them down. The job then ends short of rows (execute_job
raises JobError), and the part files written so far stay: the output is a valid start for a rerun.

The callback interface is internal to Ray Data (ray.data._internal, as in the pinned Ray 2.60); with a Ray
without it, `stop()` cannot reach the executor and the job runs to its end (a warning says so).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

try:
    from ray.data._internal.execution.execution_callback import ExecutionCallback
except ImportError:  # a Ray without execution callbacks
    ExecutionCallback = None

log = logging.getLogger(__name__)
_lock = threading.Lock()
_armed: list[JobStopper] = []


class JobStopper:
    """Arm it around one `execute_job` call; `stop()` may come from any thread, before or during the job."""

    def __init__(self) -> None:
        self._executors: list[Any] = []
        self.stopped = False  # sticky: an executor that registers, or starts, after the stop ends at its first step

    @contextmanager
    def armed(self) -> Iterator[JobStopper]:
        hooks = getattr(ray.data.DataContext.get_current(), "custom_execution_callback_classes", None)
        if hooks is None or ExecutionCallback is None:
            log.warning("this Ray Data has no execution callbacks: a cancelled batch's job runs to its end")
            yield self
            return
        with _lock:
            _armed.append(self)
            if _RegisterExecutors not in hooks:
                hooks.append(_RegisterExecutors)
        try:
            yield self
        finally:
            with _lock:
                _armed.remove(self)
                if not _armed and _RegisterExecutors in hooks:
                    hooks.remove(_RegisterExecutors)

    def stop(self) -> None:
        """Shut down the job's executors (again: one that registered since the last call is caught too); one that
        had not started yet (its shutdown does nothing then) or registers later stops at its first step."""
        with _lock:
            self.stopped = True
            executors = list(self._executors)
        for executor in executors:
            executor.shutdown(force=True)  # returns at once for one already shut down or not started yet


if ExecutionCallback is not None:
    class _RegisterExecutors(ExecutionCallback):
        """Ray Data makes one per execution; module-level, as the DataContext that lists it goes to every worker."""

        def before_execution_starts(self, executor: Any) -> None:
            with _lock:
                for stopper in _armed:
                    stopper._executors.append(executor)

        def on_execution_step(self, executor: Any) -> None:
            with _lock:
                stopped = any(stopper.stopped and executor in stopper._executors for stopper in _armed)
            if stopped:  # ends the execution: the error reaches whoever consumes the job's output
                raise JobStopped("the job was stopped")


class JobStopped(RuntimeError):
    """A stopped job's execution ended at its next step."""
