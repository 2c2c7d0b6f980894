"""The engine backend (`batchgen serve --backend engine`, the default): batches through one in-process
engine's EngineLoop, a feeder thread here, the engine on the loop's thread.

The runner thread turns input lines into requests (at most `max_in_flight` in the engine at a time,
oldest batch first, the next batch back-filling as the previous one drains), submits them to the
EngineLoop, and commits each request's result to the store as its future completes, so a restarted
server resumes each batch from the requests that have no result yet. Cancellation and expiry abort
a batch's requests in flight through the loop; requests that finished before the abort keep their
results. Only the EngineLoop thread touches the engine.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine import EngineLoop, Request
from batchgen.engine.request_future import RequestFuture
from batchgen.pipelines.openai_batch.backend import BackendConfig, BatchBackendBase, QueuedBatch, drain
from batchgen.pipelines.openai_batch.store import BatchRecord, BatchStore, ResultRow
from batchgen.pipelines.openai_batch.wire_format import BatchLine

log = logging.getLogger(__name__)


@dataclass
class RunningBatch(QueuedBatch):
    pending: deque[int] = field(default_factory=deque)  # indices not yet handed to the engine
    in_flight: set[int] = field(default_factory=set)  # submitted, their futures not settled yet


class BatchRunner(BatchBackendBase):
    def __init__(self, loop: EngineLoop, store: BatchStore, config: BackendConfig) -> None:
        """Raises InvalidRequestError when `config.default_sampling` is not valid sampling values."""
        super().__init__(store, config, loop.engine.normalizer)
        self.loop = loop
        self._settled: queue.SimpleQueue[tuple[str, RequestFuture]] = queue.SimpleQueue()  # futures done, to record
        self._active: list[RunningBatch] = []
        self._owner: dict[str, tuple[RunningBatch, int]] = {}  # request id in flight -> (batch, line index)

    def stop(self) -> None:
        """Stop feeding and abort what is in flight (the loop itself belongs to whoever built it)."""
        super().stop()
        if self._owner:
            self.loop.abort(list(self._owner))

    def _queued(self, record: BatchRecord, lines: list[BatchLine], done: set[int],
                stop_code: str | None) -> RunningBatch:
        pending = deque(i for i in range(len(lines)) if i not in done and stop_code is None)
        return RunningBatch(record, lines, stop_code, pending)

    # ---- the runner thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # a wake-up during the work below makes the wait return at once
            try:
                self._work()
            except Exception:  # the storage (a full disk, an S3 error): the same work is tried again next round
                log.exception("batch runner: a round failed; retrying")
            self._wake.wait(self.config.idle_poll_s)

    def _work(self) -> None:
        self._active.extend(self._take_incoming())
        self._record()
        if self.failure is None and self.loop.failure is not None:
            self._engine_failed(self.loop.failure)
        if self.failure is not None:
            self._fail_active()
        else:
            self._apply_stops()
            self._fill()
            self._finish_drained()

    def _apply_stops(self) -> None:
        for batch in self._active:
            if batch.stop_code is not None or not (batch.pending or batch.in_flight):  # (all done: it completes)
                continue
            batch.stop_code = self._stop_code(batch)
            if batch.stop_code is not None:  # stop work now; what finishes before the abort is kept
                batch.pending.clear()
                if batch.in_flight:
                    self.loop.abort([_request_id(batch, i) for i in batch.in_flight])

    def _fill(self) -> None:
        rejected: dict[str, tuple[RunningBatch, list[ResultRow]]] = {}
        admitted: list[tuple[RunningBatch, int, Request]] = []
        for batch in self._active:
            while batch.pending and len(self._owner) + len(admitted) < self.config.max_in_flight:
                index = batch.pending.popleft()
                line = batch.lines[index]
                try:
                    request = self.builders[batch.record.endpoint].build(_request_id(batch, index), line.body)
                except Exception as exc:  # the line fails alone: a check's error (400), or a fault of ours (500)
                    rejected.setdefault(batch.id, (batch, []))[1].append(self._rejected_row(batch, index, exc))
                    continue
                admitted.append((batch, index, request))
        if admitted:
            self._submit(admitted)
        failure = None
        for batch, rows in rejected.values():
            try:
                self.store.add_results(batch.id, rows)
            except Exception as exc:  # not stored: those lines are checked again next round (every batch's)
                batch.pending.extendleft(reversed([row.index for row in rows]))
                failure = exc
        if failure is not None:
            raise failure

    def _submit(self, admitted: list[tuple[RunningBatch, int, Request]]) -> None:
        requests = [request for _, _, request in admitted]

        futures = self.loop.submit([r.request_id for r in requests],
                                   lambda engine, i: engine.add_request(requests[i]))  # on the engine thread
        for (batch, index, request), future in zip(admitted, futures):
            self._owner[request.request_id] = (batch, index)
            batch.in_flight.add(index)
            future.add_done_callback(lambda f, rid=request.request_id: self._settle(rid, f))

    def _settle(self, request_id: str, future: RequestFuture) -> None:
        """A future resolved (on the engine thread): hand it to the runner thread."""
        self._settled.put((request_id, future))
        self._wake.set()

    def _record(self) -> None:
        """Commit every settled request: its result, or nothing when aborted (it then counts as unfinished)."""
        # (one whose request is not in `_owner` any more: its batch failed while it ran, its line in the error file)
        settled = [(request_id, future) for request_id, future in drain(self._settled) if request_id in self._owner]
        rows: dict[str, list[ResultRow]] = {}
        for request_id, future in settled:
            batch, index = self._owner[request_id]
            if future.cancelled():
                continue
            if future.exception() is not None:
                self._engine_failed(future.exception())
                continue
            rows.setdefault(batch.id, []).append(self._result_row(batch, index, future.result()))
        stored: set[str] = set()
        try:
            for batch_id, batch_rows in rows.items():
                self.store.add_results(batch_id, batch_rows)
                stored.add(batch_id)
        finally:  # a batch whose rows were not stored keeps its requests in flight, recorded again next round
            for request_id, future in settled:
                batch, index = self._owner[request_id]
                if batch.id in rows and batch.id not in stored:
                    self._settled.put((request_id, future))
                    continue
                del self._owner[request_id]
                batch.in_flight.discard(index)

    def _finish_drained(self) -> None:
        for batch in [b for b in self._active if not b.pending and not b.in_flight]:
            self._finalize(batch)
            self._active.remove(batch)

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine raised: from now on every batch fails, running ones now, later ones at validation."""
        if self.failure is None:
            log.error("engine failed, failing all running batches", exc_info=exc)
            self.failure = str(exc) or repr(exc)  # (a bare `assert` has no message)

    def _fail_active(self) -> None:
        for batch in list(self._active):
            self._fail(batch, self._failure_errors())
            self._active.remove(batch)
            for index in batch.in_flight:  # a request that finishes now stays out of the finalized batch
                del self._owner[_request_id(batch, index)]
            batch.in_flight.clear()


def _request_id(batch: RunningBatch, index: int) -> str:
    return f"{batch.id}:{index}"
