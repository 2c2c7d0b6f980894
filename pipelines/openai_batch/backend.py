"""What the server needs from a batch backend, and the batch bookkeeping every backend shares.

The server only hands a new batch to `validate`, calls `wake` after a cancel, and reports `failure` on
/health. A backend runs the validated batches its own way: runner.py feeds one in-process engine,
ray_backend.py runs each batch as a Ray job (`batchgen serve --backend`, chosen once at start-up). What
is the same for both lives here, once: checking the input file, the status moves, resuming after a
restart, each request's result line, and the output and error files in input order, so the two
backends write the same lines for the same input.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchgen.engine import RequestNormalizer, Result
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


class BatchBackend(Protocol):
    """What the server calls; `failure` set means every batch fails from now on (/health says why)."""

    failure: str | None

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wake(self) -> None: ...

    def validate(self, batch_id: str) -> None: ...


@dataclass
class BackendConfig:
    served_model: str
    default_sampling: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    max_in_flight: int = 256
    max_batch_requests: int = 50_000
    idle_poll_s: float = 0.2


@dataclass
class QueuedBatch:
    """A validated batch a backend works on; `stop_code` is batch_cancelled / batch_expired once it must stop."""

    record: BatchRecord
    lines: list[BatchLine]
    stop_code: str | None = None

    @property
    def id(self) -> str:
        return self.record.id


class BatchBackendBase(ABC):
    """The shared half of a backend: a worker thread (`_run`, the subclass's) fed with validated batches."""

    def __init__(self, store: BatchStore, config: BackendConfig, normalizer: RequestNormalizer) -> None:
        """`normalizer` carries the model's tokenizer and limits; the server's --chat-template is applied here.
        Raises InvalidRequestError when `config.default_sampling` is not valid sampling values."""
        self.store = store
        self.config = config
        self.tokenizer = normalizer.tokenizer
        normalizer = RequestNormalizer(normalizer.tokenizer, normalizer.vocab_size, normalizer.max_model_len,
                                       config.chat_template)
        self.builders = {e: RequestBuilder(e, normalizer, config.default_sampling) for e in ENDPOINTS}
        self.failure: str | None = None  # set when the engine raised: the backend then fails every batch
        self._incoming: queue.Queue[QueuedBatch] = queue.Queue()  # resumed batches, then checked new ones
        self._to_check: queue.Queue[str] = queue.Queue()  # new batches' ids, checked on the worker thread
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)

    # ---- called from the server --------------------------------------------------------------------

    def start(self) -> None:
        """Resume what a previous server left unfinished, then start the worker thread."""
        for record in self.store.batches_with_status("in_progress", "finalizing", "cancelling"):
            self._resume(record)
        for record in self.store.batches_with_status("validating"):
            self.validate(record.id)
        self._thread.start()

    def stop(self) -> None:
        """Stop working; unfinished batches stay in_progress and resume at the next start."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()

    def wake(self) -> None:
        self._wake.set()

    def validate(self, batch_id: str) -> None:
        """Queue a new batch for its check on the worker thread, which retries a check the storage failed (it ran
        after the server's response: a failure there left the batch validating, and a cancel cancelling, for good)."""
        self._to_check.put(batch_id)
        self._wake.set()

    def _check(self, batch_id: str) -> None:
        """Check the input file; a valid batch goes in_progress and joins the queue, else it fails."""
        record = self.store.get_batch(batch_id)
        lines, errors = self._parse(record)
        if self.failure is not None:
            errors = self._failure_errors()
        if errors:
            if not self.store.set_status(batch_id, "failed", only_from=("validating",), errors=errors):
                self.store.set_status(batch_id, "cancelled", only_from=("cancelling",))
            return
        if not self.store.set_status(batch_id, "in_progress", only_from=("validating",), total=len(lines)):
            self.store.set_status(batch_id, "cancelled", only_from=("cancelling",))
            return
        self._incoming.put(self._queued(self.store.get_batch(batch_id), lines, set(), None))

    # ---- for the subclasses ------------------------------------------------------------------------

    @abstractmethod
    def _queued(self, record: BatchRecord, lines: list[BatchLine], done: set[int],
                stop_code: str | None) -> QueuedBatch:
        """The batch as the backend tracks it; `done`: the line indices that already have a result."""

    @abstractmethod
    def _run(self) -> None:
        """The worker thread: take batches from `_incoming`, run them, `_finalize` each one."""

    def _take_incoming(self) -> list[QueuedBatch]:
        """The batches validated or resumed since the last call, oldest first."""
        unchecked = drain(self._to_check)
        for position, batch_id in enumerate(unchecked):
            try:
                self._check(batch_id)
            except Exception:  # the storage (a full disk, an S3 error): checked again next round
                log.exception("batch %s: its check failed; retrying", batch_id)
                for later in unchecked[position:]:
                    self._to_check.put(later)
                break
        return drain(self._incoming)

    def _resume(self, record: BatchRecord) -> None:
        if record.status == "cancelling" and record.in_progress_at is None:  # cancelled before it started
            self.store.set_status(record.id, "cancelled")
            return
        lines, errors = self._parse(record)
        if errors and record.in_progress_at is not None:  # it ran before (the server's settings changed since)
            results = self.store.results(record.id)
            self.store.finalize(record.id, "failed", _result_lines(results, True), _result_lines(results, False),
                                unfinished=record.total - len(results), errors=errors)
            return
        if errors:
            self.store.set_status(record.id, "failed", errors=errors)
            return
        done = self.store.done_indices(record.id)
        stop_code = "batch_cancelled" if record.status == "cancelling" else None
        log.info("resuming batch %s: %d of %d requests left", record.id,
                 0 if stop_code else len(lines) - len(done), len(lines))
        self._incoming.put(self._queued(record, lines, done, stop_code))

    def _parse(self, record: BatchRecord) -> tuple[list[BatchLine], list[dict[str, Any]]]:
        try:
            data = self.store.read_file(record.input_file_id)
        except (OSError, ValueError) as exc:  # (ValueError: not a file id of this store)
            return [], [{"code": "input_file_unreadable", "message": f"cannot read the input file: {exc}",
                         "param": "input_file_id", "line": None}]
        parsed = parse_batch_input(data, record.endpoint, self.config.served_model,
                                   self.config.max_batch_requests)
        return parsed.lines, parsed.errors

    def _stop_code(self, batch: QueuedBatch) -> str | None:
        """Why the batch must stop now (it is being cancelled, or its window passed), or None."""
        if self.store.get_batch(batch.id).status == "cancelling":
            return "batch_cancelled"
        if time.time() >= batch.record.expires_at:
            return "batch_expired"
        return None

    def _rejected_row(self, batch: QueuedBatch, index: int, exc: Exception) -> ResultRow:
        """A line whose body the checks refused (ValueError, TypeError: a 400 line in the error file), or whose
        request could not be built for another reason (a fault of ours: a 500 line; the batch goes on)."""
        custom_id = batch.lines[index].custom_id
        if isinstance(exc, (ValueError, TypeError)):
            return ResultRow(index, False, request_error_line(custom_id, str(exc)))
        log.error("batch %s: line %d could not be prepared", batch.id, index, exc_info=exc)
        return ResultRow(index, False, request_error_line(custom_id, f"the request could not be prepared: {exc!r}",
                                                          status_code=500, type_="server_error"))

    def _result_row(self, batch: QueuedBatch, index: int, result: Result) -> ResultRow:
        custom_id = batch.lines[index].custom_id
        if result.error is not None:
            return ResultRow(index, False, request_error_line(custom_id, result.error))
        try:
            body = response_body(batch.record.endpoint, result, self.config.served_model, self.tokenizer)
        except Exception as exc:  # the request's own result line fails, not the round that records every batch's
            log.exception("batch %s: the result of line %d could not be written", batch.id, index)
            return ResultRow(index, False, request_error_line(custom_id, f"the result could not be written: {exc}",
                                                              status_code=500, type_="server_error"))
        usage = body["usage"]
        return ResultRow(index, True, success_line(custom_id, body), usage["prompt_tokens"],
                         usage["completion_tokens"])

    def _finalize(self, batch: QueuedBatch) -> None:
        """Write the output file (successes) and the error file (failures, never-run lines) in input order."""
        code = batch.stop_code
        if code == "batch_expired" and len(self.store.results(batch.id)) == len(batch.lines):
            code = None  # every request had finished when the window passed: nothing expired
        if code != "batch_cancelled" and self._cancelled_meanwhile(batch):
            code = "batch_cancelled"
        self._write_files(batch, _FINAL_STATUS[code], code)

    def _cancelled_meanwhile(self, batch: QueuedBatch) -> bool:
        """Move the batch to finalizing unless a cancel came first (True then): a cancel is accepted only before
        this move, so the status the cancel answered with is the one the batch ends in."""
        return (not self.store.set_status(batch.id, "finalizing", only_from=("in_progress",))
                and self.store.get_batch(batch.id).status == "cancelling")

    def _fail(self, batch: QueuedBatch, errors: list[dict[str, Any]]) -> None:
        """The batch's engine or job failed: the lines that finished keep their results in the output and error
        files, the others are failed with the failure's code and message (a batch being cancelled ends cancelled)."""
        if self._cancelled_meanwhile(batch):
            self._write_files(batch, "cancelled", "batch_cancelled")
        else:
            self._write_files(batch, "failed", errors[0]["code"], errors[0]["message"], errors=errors)

    def _write_files(self, batch: QueuedBatch, status: str, code: str | None, message: str | None = None,
                     **values: Any) -> None:
        """Write the output file (successes) and the error file (failures, never-run lines: `code`) in input order,
        and move the batch to `status`."""
        results = self.store.results(batch.id)
        unfinished = [i for i in range(len(batch.lines)) if i not in results]
        self.store.finalize(
            batch.id, status,
            output_lines=_result_lines(results, True),
            error_lines=self._error_lines(batch, results, code, message),
            unfinished=len(unfinished), **values)
        log.info("batch %s %s", batch.id, status)

    @staticmethod
    def _error_lines(batch: QueuedBatch, results: dict[int, tuple[bool, str]], code: str | None,
                     message: str | None):
        for index, entry in enumerate(batch.lines):
            if index in results:
                ok, line = results[index]
                if not ok:
                    yield line
            else:
                yield json.dumps(unfinished_line(entry.custom_id, code, message))

    def _failure_errors(self) -> list[dict[str, Any]]:
        return [{"code": "engine_error", "message": self.failure, "param": None, "line": None}]


def drain(items: queue.Queue | queue.SimpleQueue) -> list:
    """Everything in the queue now, in order."""
    out = []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out


def _result_lines(results: dict[int, tuple[bool, str]], ok: bool) -> Iterator[str]:
    """The stored lines of the finished requests that succeeded (`ok`) or failed, in input order."""
    return (line for _, (good, line) in sorted(results.items()) if good is ok)
