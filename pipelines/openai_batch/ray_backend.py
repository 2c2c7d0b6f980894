"""The Ray backend (`batchgen serve --backend ray`): each batch runs as a `batchgen run` job on the Ray
engine-actor pool, so the Batch API scales with the cluster instead of stopping at one in-process engine.

The job is pipelines/pipeline.py's own (plan_job / execute_job with the server's JobConfig: mode, actor
counts, engine options), so a batch gets what `batchgen run` gives: input order, and a rerun on the same
output skips the rows already written. A batch's job lives in `<storage>/jobs/<batch id>/`:

  job.json       the sampling defaults the job runs with (the server's when the batch started)
  input.parquet  a row per line that passed the body checks: `line_index`, `custom_id`,
                 `prompt_token_ids`, and the line's own sampling values as the `sampling_params` struct
  output/        the job's part files

Lines are read by the engine backend's RequestBuilder, with the tokenizer, vocabulary size and context
length read from the checkpoint's small files (no weights): a bad line gets the same error text, the
server's --chat-template applies, and a chat line without max_tokens gets the rest of the context, as
with the engine backend. Token ids go to the job, so its tokenize stage only checks them.

While the job runs (its on_progress callback), its new part files become result rows in the store, as
the engine backend commits each finished request: request_counts move, a restarted server resumes the
job from its output, and the shared finalize writes the output and error files in input order.

One job runs at a time, oldest batch first: a job takes the whole actor pool, whose actors load the model
as the job starts. Cancellation and expiry shut the running job down (pipelines/job_stop.py): rows already
written are kept, rows still in the engines are dropped and count as unfinished, as with the engine
backend. What differs from it: a line asking for logprobs fails (the job's output carries none), and
finished rows reach the store a part file at a time, not a request at a time.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.connectors.checkpoint_files import load_config, load_tokenizer
from batchgen.connectors.indexed_parquet import written_parts
from batchgen.connectors.io import filesystem, write_atomically
from batchgen.engine import Completion, EngineConfig, InvalidRequestError, RequestNormalizer, Result, SamplingParams
from batchgen.operators.columns import ERROR, PROMPT_TOKEN_IDS, SAMPLING_PARAMS
from batchgen.operators.stage_columns import SAMPLING_TYPE
from batchgen.pipelines.job_stop import JobStopper
from batchgen.pipelines.openai_batch.backend import BackendConfig, BatchBackendBase, QueuedBatch
from batchgen.pipelines.openai_batch.store import TERMINAL, BatchRecord, BatchStore, ResultRow
from batchgen.pipelines.openai_batch.wire_format import BatchLine
from batchgen.pipelines.pipeline import JobConfig, execute_job, plan_job
from batchgen.pipelines.progress import Progress

log = logging.getLogger(__name__)

LINE_INDEX, CUSTOM_ID = "line_index", "custom_id"
SETTINGS, INPUT, OUTPUT = "job.json", "input.parquet", "output"
NO_LOGPROBS = "logprobs are not available with this server's Ray backend (batchgen serve --backend ray)"
_RESULT_COLUMNS = [LINE_INDEX, PROMPT_TOKEN_IDS, "generated_text", "generated_token_ids", "finish_reason", ERROR]
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]
# typed, as the split stages carry sampling params: a field no line sets stays typed, and logit_bias is a map
_INPUT_SCHEMA = pa.schema([(LINE_INDEX, pa.int64()), (CUSTOM_ID, pa.string()),
                           (PROMPT_TOKEN_IDS, pa.list_(pa.int64())), (SAMPLING_PARAMS, SAMPLING_TYPE)])
_POLL_S = 0.5  # how often the running job reports progress (and a cancel is noticed)


@dataclass
class RayBatch(QueuedBatch):
    recorded: set[int] = field(default_factory=set)  # line indices with a result in the store
    parts_read: set[str] = field(default_factory=set)  # the job's part files already recorded
    rows_seen: int = 0  # the job's written-row count when its part files were last read


@dataclass(frozen=True)
class JobFiles:
    """One batch's job folder: `uri` for the job (plan_job, written_parts), `path` the same inside the backend's
    filesystem."""

    uri: str
    path: str


def model_normalizer(job: JobConfig) -> RequestNormalizer:
    """The engine's request checks without its weights: the tokenizer, vocabulary size and context length
    come from the checkpoint's small files, the context capped by the engine's max_model_len as it caps it."""
    config = load_config(job.model, job.storage_options)
    context = int(config.max_position_embeddings)
    cap = EngineConfig.from_kwargs(**job.engine).max_model_len
    return RequestNormalizer(load_tokenizer(job.model, job.storage_options), int(config.vocab_size),
                             min(cap or context, context))


class RayBackend(BatchBackendBase):
    def __init__(self, store: BatchStore, config: BackendConfig, job: JobConfig, jobs_uri: str) -> None:
        """`job`: the settings of every batch's job (model, mode, actor counts, engine and storage options; input,
        output and sampling defaults are set per batch); `jobs_uri`: the folder of the jobs' folders. The
        caller has connected this process to Ray. Raises InvalidRequestError for bad default sampling."""
        super().__init__(store, config, model_normalizer(job))
        self.job = job
        self.jobs_uri = jobs_uri.rstrip("/")
        self.fs, self.jobs_path = filesystem(self.jobs_uri, job.storage_options)
        self._waiting: deque[RayBatch] = deque()
        self._stopper: JobStopper | None = None  # the running job's

    def start(self) -> None:
        self._remove_finished_jobs()
        super().start()

    def stop(self) -> None:
        """Shut the running job down too; its batch stays in_progress and its job resumes at the next start."""
        self._stopping.set()
        stopper = self._stopper
        if stopper is not None:
            stopper.stop()
        super().stop()

    def _queued(self, record: BatchRecord, lines: list[BatchLine], done: set[int],
                stop_code: str | None) -> RayBatch:
        return RayBatch(record, lines, stop_code, recorded=set(done))

    # ---- the worker thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                if self._round():
                    continue
            except Exception:  # the storage (a full disk, an S3 error): the same work is tried again next round
                log.exception("batch backend: a round failed; retrying")
            self._wake.wait(self.config.idle_poll_s)

    def _round(self) -> bool:
        """Run the oldest waiting batch; False when none waits."""
        self._check_waiting()
        if not self._waiting:
            return False
        batch = self._waiting.popleft()
        try:
            self._process(batch)
        except Exception:
            if self.store.get_batch(batch.id).status not in TERMINAL:  # (finalized already: not again)
                self._waiting.appendleft(batch)
            raise
        return True

    def _check_waiting(self) -> None:
        """Queue new batches; close the waiting ones that were cancelled or expired."""
        self._waiting.extend(self._take_incoming())
        for batch in list(self._waiting):
            batch.stop_code = batch.stop_code or self._stop_code(batch)
            if batch.stop_code is not None:
                try:
                    self._close(batch)
                except Exception:  # (called during another batch's job too: that job goes on)
                    log.exception("batch %s: closing it failed; retrying", batch.id)
                    continue
                self._waiting.remove(batch)

    def _process(self, batch: RayBatch) -> None:
        """Run the batch's job until it ends or must stop, then finalize (unless the server is stopping)."""
        try:
            self._run_job(batch)
        except Exception as exc:  # the job failed (JobError), or its files did: this batch fails, others go on
            if self._stopping.is_set():
                return
            if batch.stop_code is None:
                log.error("batch %s: its job failed", batch.id, exc_info=exc)
                self._fail(batch, [{"code": "job_failed", "message": str(exc) or repr(exc), "param": None,
                                    "line": None}])
                self._remove_job(batch)
                return
        if not self._stopping.is_set():
            self._close(batch)

    def _run_job(self, batch: RayBatch) -> None:
        files = self._files(batch)
        defaults, rows = self._prepare(batch, files)
        if rows == 0:
            return
        plan = plan_job(replace(self.job, input=f"{files.uri}/{INPUT}", output=f"{files.uri}/{OUTPUT}",
                                sampling_params=defaults, list_outputs=True))
        try:
            self._record_parts(batch, files)  # what a job before a restart wrote
            if plan.source.skip.count:
                log.info("batch %s: its job resumes with %d of %d rows written", batch.id, plan.source.skip.count,
                         plan.source.num_rows)
            self._stopper = stopper = JobStopper()
            try:
                with stopper.armed():
                    if not self._stopping.is_set():
                        execute_job(plan, on_progress=lambda p: self._on_progress(batch, files, p), poll_s=_POLL_S)
            except BaseException:
                stopper.stop()  # on_progress itself may have raised: the job must not run on unwatched
                raise
            finally:
                self._stopper = None
        finally:
            plan.lease.release()  # execute_job's own release, unless the job never started
        self._record_parts(batch, files)

    def _on_progress(self, batch: RayBatch, files: JobFiles, progress: Progress) -> None:
        """Called by the running job every _POLL_S on this thread: record new rows, act on cancels."""
        self._check_waiting()
        if progress.rows != batch.rows_seen:
            batch.rows_seen = progress.rows
            self._record_parts(batch, files)
        batch.stop_code = batch.stop_code or self._stop_code(batch)
        if batch.stop_code is not None or self._stopping.is_set():
            self._stopper.stop()

    # ---- the job's files ---------------------------------------------------------------------------

    def _files(self, batch: QueuedBatch) -> JobFiles:
        return JobFiles(f"{self.jobs_uri}/{batch.id}", f"{self.jobs_path}/{batch.id}")

    def _prepare(self, batch: RayBatch, files: JobFiles) -> tuple[dict[str, Any], int]:
        """The job's sampling defaults and input row count; on the first run, read every line: the ones the
        checks refuse become error results now, the others the job's input."""
        input_path = f"{files.path}/{INPUT}"
        if self.fs.exists(input_path):
            with self.fs.open(input_path, "rb") as f:
                rows = pq.ParquetFile(f).metadata.num_rows
            return json.loads(self.fs.cat_file(f"{files.path}/{SETTINGS}"))["sampling_defaults"], rows
        builder = self.builders[batch.record.endpoint]
        rows, rejected = [], []
        for line in batch.lines:
            try:
                request = builder.resolve(line.body)
                if request.sampling.logprobs is not None:
                    raise InvalidRequestError(NO_LOGPROBS)
            except Exception as exc:  # the line fails alone: a check's error (400), or a fault of ours (500)
                if line.index not in batch.recorded:
                    rejected.append(self._rejected_row(batch, line.index, exc))
                continue
            rows.append({LINE_INDEX: line.index, CUSTOM_ID: line.custom_id, PROMPT_TOKEN_IDS: request.prompt_token_ids,
                         SAMPLING_PARAMS: {name: request.own_sampling.get(name) for name in _SAMPLING_FIELDS}})
        self.store.add_results(batch.id, rejected)
        batch.recorded.update(r.index for r in rejected)
        if rows:  # the settings first: an input file means a prepared job
            settings = {"sampling_defaults": self.config.default_sampling}
            write_atomically(self.fs, f"{files.path}/{SETTINGS}", json.dumps(settings).encode())
            table = pa.Table.from_pylist(rows, schema=_INPUT_SCHEMA)
            write_atomically(self.fs, input_path, _parquet_bytes(table, self.job.rows_per_block))
        return self.config.default_sampling, len(rows)

    def _record_parts(self, batch: RayBatch, files: JobFiles) -> None:
        """Commit the rows of the job's part files not read yet (a row already recorded is skipped)."""
        for part in written_parts(f"{files.uri}/{OUTPUT}", self.job.storage_options):
            if part.path in batch.parts_read:
                continue
            with self.fs.open(part.path, "rb") as f:
                rows = pq.read_table(f, columns=_RESULT_COLUMNS).to_pylist()
            new = [self._job_row(batch, row) for row in rows if row[LINE_INDEX] not in batch.recorded]
            self.store.add_results(batch.id, new)
            batch.recorded.update(r.index for r in new)
            batch.parts_read.add(part.path)

    def _job_row(self, batch: RayBatch, row: dict[str, Any]) -> ResultRow:
        """An output row as the engine's Result for its line (list outputs: one entry per sample)."""
        index = row[LINE_INDEX]
        result = Result(f"{batch.id}:{index}", row[PROMPT_TOKEN_IDS], error=row[ERROR])
        if result.error is None:
            result.outputs = [Completion(i, ids, text, reason) for i, (ids, text, reason) in enumerate(
                zip(row["generated_token_ids"], row["generated_text"], row["finish_reason"]))]
        return self._result_row(batch, index, result)

    def _close(self, batch: RayBatch) -> None:
        """Record what the job wrote, write the batch's files, drop the job's."""
        self._record_parts(batch, self._files(batch))
        self._finalize(batch)
        self._remove_job(batch)

    def _remove_job(self, batch: QueuedBatch) -> None:
        """Drop the job's folder; one that cannot be removed now goes at the next start (_remove_finished_jobs)."""
        path = self._files(batch).path
        try:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        except OSError as exc:
            log.warning("batch %s: its job folder stays until the next start (%s)", batch.id, exc)

    def _remove_finished_jobs(self) -> None:
        """Job folders a server stopped before removing them (their batches are finished or gone)."""
        if not self.fs.exists(self.jobs_path):
            return
        for path in self.fs.ls(self.jobs_path, detail=False):
            record = self.store.get_batch(posixpath.basename(path.rstrip("/")))
            if record is None or record.status in TERMINAL:
                self.fs.rm(path, recursive=True)


def _parquet_bytes(table: pa.Table, rows_per_group: int) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=rows_per_group)
    return sink.getvalue().to_pybytes()
