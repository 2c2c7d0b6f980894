"""Runs batches through the engine's EngineLoop: a feeder thread here, the engine on the loop's thread.

The runner thread turns input lines into requests (at most `max_in_flight` in the engine at a time,
oldest batch first, the next batch back-filling as the previous one drains), submits them to the
EngineLoop, and commits each request's result to the store as its future completes, so a restarted
server resumes each batch from the requests that have no result yet. Cancellation and expiry abort
a batch's requests in flight through the loop; requests that finished before the abort keep their
results. Only the EngineLoop thread touches the engine.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine import Engine, EngineLoop, Request, RequestNormalizer, Result
from batchgen.pipelines.openai_batch.store import BatchRecord, BatchStore, ResultRow
from batchgen.pipelines.openai_batch.wire_format import (
    ENDPOINTS,
    BatchLine,
    RequestBuilder,
    parse_batch_input,
    request_error_line,
    response_body,
    success_line,
    unfinished_line,
)

log = logging.getLogger(__name__)
_FINAL_STATUS = {None: "completed", "batch_expired": "expired", "batch_cancelled": "cancelled"}


@dataclass
class RunnerConfig:
    served_model: str
    default_sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    max_in_flight: int = 256
    max_batch_requests: int = 50_000
    idle_poll_s: float = 0.2


@dataclass
class RunningBatch:
    record: BatchRecord
    lines: list[BatchLine]
    pending: deque[int]  # indices not yet handed to the engine
    in_flight: set[int] = field(default_factory=set)  # submitted, their futures not settled yet
    stop_code: str | None = None  # batch_cancelled / batch_expired once it must stop

    @property
    def id(self) -> str:
        return self.record.id


class BatchRunner:
    def __init__(self, loop: EngineLoop, store: BatchStore, config: RunnerConfig) -> None:
        """Raises InvalidRequestError when `config.default_sampling` is not valid sampling values."""
        self.loop = loop
        self.store = store
        self.config = config
        engine_normalizer = loop.engine.normalizer
        self.tokenizer = engine_normalizer.tokenizer
        normalizer = RequestNormalizer(self.tokenizer, engine_normalizer.vocab_size, engine_normalizer.max_model_len,
                                       config.chat_template)
        self.builders = {e: RequestBuilder(e, normalizer, config.default_sampling) for e in ENDPOINTS}
        self.failure: str | None = None  # set when the engine raised: the runner then fails every batch
        self._incoming: queue.Queue[RunningBatch] = queue.Queue()
        self._settled: queue.SimpleQueue[tuple[str, Future]] = queue.SimpleQueue()  # futures done, to record
        self._active: list[RunningBatch] = []
        self._owner: dict[str, tuple[RunningBatch, int]] = {}  # request id in flight -> (batch, line index)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)

    # ---- called from the server --------------------------------------------------------------------

    def start(self) -> None:
        """Resume what a previous server left unfinished, then start the runner thread."""
        for record in self.store.batches_with_status("in_progress", "finalizing", "cancelling"):
            self._resume(record)
        for record in self.store.batches_with_status("validating"):
            self.validate(record.id)
        self._thread.start()

    def stop(self) -> None:
        """Stop feeding and abort what is in flight; unfinished batches stay in_progress and resume at the
        next start (the loop itself belongs to whoever built it)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        if self._owner:
            self.loop.abort(list(self._owner))

    def wake(self) -> None:
        self._wake.set()

    def validate(self, batch_id: str) -> None:
        """Check the input file; a valid batch goes in_progress and joins the queue, else it fails."""
        record = self.store.get_batch(batch_id)
        lines, errors = self._parse(record)
        if self.failure is not None:
            errors = self._engine_errors()
        if errors:
            if not self.store.set_status(batch_id, "failed", only_from=("validating",), errors=errors):
                self.store.set_status(batch_id, "cancelled", only_from=("cancelling",))
            return
        if not self.store.set_status(batch_id, "in_progress", only_from=("validating",), total=len(lines)):
            self.store.set_status(batch_id, "cancelled", only_from=("cancelling",))
            return
        self._incoming.put(RunningBatch(self.store.get_batch(batch_id), lines, deque(range(len(lines)))))
        self._wake.set()

    def _resume(self, record: BatchRecord) -> None:
        if record.status == "cancelling" and record.in_progress_at is None:  # cancelled before it started
            self.store.set_status(record.id, "cancelled")
            return
        lines, errors = self._parse(record)
        if errors:
            self.store.set_status(record.id, "failed", errors=errors)
            return
        done = self.store.done_indices(record.id)
        stop_code = "batch_cancelled" if record.status == "cancelling" else None
        pending = deque(i for i in range(len(lines)) if i not in done and stop_code is None)
        log.info("resuming batch %s: %d of %d requests left", record.id, len(pending), len(lines))
        self._incoming.put(RunningBatch(record, lines, pending, stop_code=stop_code))

    def _parse(self, record: BatchRecord) -> tuple[list[BatchLine], list[dict[str, Any]]]:
        try:
            data = self.store.read_file(record.input_file_id)
        except OSError as exc:
            return [], [{"code": "input_file_unreadable", "message": f"cannot read the input file: {exc}",
                         "param": "input_file_id", "line": None}]
        parsed = parse_batch_input(data, record.endpoint, self.config.served_model,
                                   self.config.max_batch_requests)
        return parsed.lines, parsed.errors

    # ---- the runner thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # a wake-up during the work below makes the wait return at once
            self._admit()
            self._record()
            if self.failure is None and self.loop.failure is not None:
                self._engine_failed(self.loop.failure)
            if self.failure is not None:
                self._fail_active()
            else:
                self._apply_stops()
                self._fill()
                self._finish_drained()
            self._wake.wait(self.config.idle_poll_s)

    def _admit(self) -> None:
        while True:
            try:
                self._active.append(self._incoming.get_nowait())
            except queue.Empty:
                return

    def _apply_stops(self) -> None:
        now = time.time()
        for batch in self._active:
            if batch.stop_code is not None:
                continue
            if now >= batch.record.expires_at:
                batch.stop_code = "batch_expired"
            elif self.store.get_batch(batch.id).status == "cancelling":
                batch.stop_code = "batch_cancelled"
            if batch.stop_code is not None:  # stop work now; what finishes before the abort is kept
                batch.pending.clear()
                if batch.in_flight:
                    self.loop.abort([_request_id(batch, i) for i in batch.in_flight])

    def _fill(self) -> None:
        rejected: dict[str, list[ResultRow]] = {}
        admitted: list[tuple[RunningBatch, int, Request]] = []
        for batch in self._active:
            while batch.pending and len(self._owner) + len(admitted) < self.config.max_in_flight:
                index = batch.pending.popleft()
                line = batch.lines[index]
                try:
                    request = self.builders[batch.record.endpoint].build(_request_id(batch, index), line.body)
                except (ValueError, TypeError) as exc:
                    rejected.setdefault(batch.id, []).append(
                        ResultRow(index, False, request_error_line(line.custom_id, str(exc))))
                    continue
                admitted.append((batch, index, request))
        for batch_id, rows in rejected.items():
            self.store.add_results(batch_id, rows)
        if admitted:
            self._submit(admitted)

    def _submit(self, admitted: list[tuple[RunningBatch, int, Request]]) -> None:
        requests = [request for _, _, request in admitted]

        def admit(engine: Engine) -> None:  # runs on the engine thread
            for request in requests:
                engine.add_request(request)

        futures = self.loop.submit([r.request_id for r in requests], admit)
        for (batch, index, request), future in zip(admitted, futures):
            self._owner[request.request_id] = (batch, index)
            batch.in_flight.add(index)
            future.add_done_callback(lambda f, rid=request.request_id: self._settle(rid, f))

    def _settle(self, request_id: str, future: Future) -> None:
        """A future resolved (on the engine thread): hand it to the runner thread."""
        self._settled.put((request_id, future))
        self._wake.set()

    def _record(self) -> None:
        """Commit every settled request: its result, or nothing when aborted (it then counts as unfinished)."""
        rows: dict[str, list[ResultRow]] = {}
        while True:
            try:
                request_id, future = self._settled.get_nowait()
            except queue.Empty:
                break
            batch, index = self._owner.pop(request_id)
            batch.in_flight.discard(index)
            if future.cancelled():
                continue
            if future.exception() is not None:
                self._engine_failed(future.exception())
                continue
            rows.setdefault(batch.id, []).append(self._result_row(batch, index, future.result()))
        for batch_id, batch_rows in rows.items():
            self.store.add_results(batch_id, batch_rows)

    def _result_row(self, batch: RunningBatch, index: int, result: Result) -> ResultRow:
        custom_id = batch.lines[index].custom_id
        if result.error is not None:
            return ResultRow(index, False, request_error_line(custom_id, result.error))
        body = response_body(batch.record.endpoint, result, self.config.served_model, self.tokenizer)
        usage = body["usage"]
        return ResultRow(index, True, success_line(custom_id, body), usage["prompt_tokens"],
                         usage["completion_tokens"])

    def _finish_drained(self) -> None:
        for batch in [b for b in self._active if not b.pending and not b.in_flight]:
            self._active.remove(batch)
            self._finalize(batch)

    def _finalize(self, batch: RunningBatch) -> None:
        """Write the output file (successes) and the error file (failures, never-run lines) in input order."""
        code = batch.stop_code
        if code is None and not self.store.set_status(batch.id, "finalizing", only_from=("in_progress",)):
            if self.store.get_batch(batch.id).status == "cancelling":
                code = "batch_cancelled"
        results = self.store.results(batch.id)
        unfinished = [i for i in range(len(batch.lines)) if i not in results]
        self.store.finalize(
            batch.id, _FINAL_STATUS[code],
            output_lines=(line for _, (ok, line) in sorted(results.items()) if ok),
            error_lines=self._error_lines(batch, results, code),
            unfinished=len(unfinished))
        log.info("batch %s %s", batch.id, _FINAL_STATUS[code])

    @staticmethod
    def _error_lines(batch: RunningBatch, results: dict[int, tuple[bool, str]], code: str | None):
        for index, entry in enumerate(batch.lines):
            if index in results:
                ok, line = results[index]
                if not ok:
                    yield line
            else:
                yield json.dumps(unfinished_line(entry.custom_id, code))

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine raised: from now on every batch fails, running ones now, later ones at validation."""
        if self.failure is None:
            log.error("engine failed, failing all running batches", exc_info=exc)
            self.failure = str(exc)

    def _engine_errors(self) -> list[dict[str, Any]]:
        return [{"code": "engine_error", "message": self.failure, "param": None, "line": None}]

    def _fail_active(self) -> None:
        for batch in self._active:
            self.store.set_status(batch.id, "failed", errors=self._engine_errors())
        self._active.clear()


def _request_id(batch: RunningBatch, index: int) -> str:
    return f"{batch.id}:{index}"
