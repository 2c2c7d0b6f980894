"""Runs batches through one engine owned by a worker thread.

The thread feeds the engine request by request (at most `max_in_flight` at a time, oldest batch
first, the next batch back-filling as the previous one drains) and steps it; between steps it
applies cancellation and expiry. Every finished request is committed to the store at once, so a
restarted server resumes each batch from the requests that have no result yet.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.request import Result
from batchgen.pipelines.batch_store import BatchRecord, BatchStore, ResultRow
from batchgen.pipelines.openai_format import (
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
class RunningBatch:
    record: BatchRecord
    lines: list[BatchLine]
    pending: deque[int]  # indices not yet handed to the engine
    in_flight: set[int] = field(default_factory=set)
    stop_code: str | None = None  # batch_cancelled / batch_expired once it must stop

    @property
    def id(self) -> str:
        return self.record.id


@dataclass
class RunnerConfig:
    served_model: str
    default_sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    max_in_flight: int = 256
    max_batch_requests: int = 50_000
    idle_poll_s: float = 0.2


class BatchRunner:
    def __init__(self, engine: Any, store: BatchStore, config: RunnerConfig) -> None:
        self.engine = engine
        self.store = store
        self.config = config
        self.builders = {e: RequestBuilder(e, engine.tokenizer, engine.max_model_len, config.default_sampling,
                                           config.chat_template) for e in ENDPOINTS}
        self.failure: str | None = None  # set when the engine raised: the runner then fails new batches
        self._incoming: queue.Queue[RunningBatch] = queue.Queue()
        self._active: list[RunningBatch] = []
        self._owner: dict[str, tuple[RunningBatch, int]] = {}  # engine request id -> (batch, line index)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-runner", daemon=True)

    # ---- called from the server --------------------------------------------------------------------

    def start(self) -> None:
        """Resume what a previous server left unfinished, then start the worker thread."""
        for record in self.store.batches_with_status("in_progress", "finalizing", "cancelling"):
            self._resume(record)
        for record in self.store.batches_with_status("validating"):
            self.validate(record.id)
        self._thread.start()

    def stop(self) -> None:
        """Stop between steps; unfinished batches stay in_progress and resume at the next start."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    def wake(self) -> None:
        self._wake.set()

    def validate(self, batch_id: str) -> None:
        """Check the input file; a valid batch goes in_progress and joins the queue, else it fails."""
        record = self.store.get_batch(batch_id)
        lines, errors = self._parse(record)
        if self.failure is not None:
            errors = [{"code": "engine_error", "message": self.failure, "param": None, "line": None}]
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

    # ---- the worker thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._admit()
                self._apply_stops()
                self._fill()
                if self.engine.has_unfinished():
                    self._record(self.engine.step())
                self._finish_drained()
            except Exception:
                self._fail_all(traceback.format_exc())
                return
            if not self.engine.has_unfinished():
                self._wake.wait(self.config.idle_poll_s)
                self._wake.clear()

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
            if batch.stop_code is not None:
                batch.pending.clear()
                for index in list(batch.in_flight):  # stop work now; finished requests stay in the output
                    request_id = f"{batch.id}:{index}"
                    self.engine.abort(request_id)
                    self._owner.pop(request_id, None)
                    batch.in_flight.discard(index)

    def _fill(self) -> None:
        rejected: dict[str, list[ResultRow]] = {}
        for batch in self._active:
            while batch.pending and len(self._owner) < self.config.max_in_flight:
                index = batch.pending.popleft()
                line = batch.lines[index]
                request_id = f"{batch.id}:{index}"
                try:
                    request = self.builders[batch.record.endpoint].build(request_id, line.body)
                except (ValueError, TypeError) as exc:
                    rejected.setdefault(batch.id, []).append(
                        ResultRow(index, False, request_error_line(line.custom_id, str(exc))))
                    continue
                self._owner[request_id] = (batch, index)
                batch.in_flight.add(index)
                self.engine.add_request(request)
        for batch_id, rows in rejected.items():
            self.store.add_results(batch_id, rows)

    def _record(self, results: list[Result]) -> None:
        rows: dict[str, list[ResultRow]] = {}
        for result in results:
            batch, index = self._owner.pop(result.request_id)
            batch.in_flight.discard(index)
            rows.setdefault(batch.id, []).append(self._result_row(batch, index, result))
        for batch_id, batch_rows in rows.items():
            self.store.add_results(batch_id, batch_rows)

    def _result_row(self, batch: RunningBatch, index: int, result: Result) -> ResultRow:
        custom_id = batch.lines[index].custom_id
        if result.error is not None:
            return ResultRow(index, False, request_error_line(custom_id, result.error))
        body = response_body(batch.record.endpoint, result, self.config.served_model, self.engine.tokenizer)
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

    def _fail_all(self, trace: str) -> None:
        """The engine raised: fail every batch it held; later batches fail at validation."""
        log.error("engine failed, failing all running batches:\n%s", trace)
        self.failure = f"the engine failed: {trace.strip().splitlines()[-1]}"
        error = [{"code": "engine_error", "message": self.failure, "param": None, "line": None}]
        self._admit()
        for batch in self._active:
            self.store.set_status(batch.id, "failed", errors=error)
        self._active.clear()
