"""Batch API state: file contents under an fsspec storage URI, metadata and per-request results in SQLite.

Each finished request is committed as its own result row the moment it comes out of the engine, so
a killed server resumes a batch from exactly the requests that have no row yet. The output and error
files are written once, at the end, from those rows in input order.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import IO, Any

from batchgen.connectors.io import filesystem
from batchgen.pipelines.openai_batch.wire_format import new_id

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
DB_NAME = "batchgen_batches.sqlite"
TERMINAL = ("completed", "failed", "expired", "cancelled")
_TIMESTAMPED = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0, metadata TEXT,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_index));
"""


@dataclass
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


@dataclass
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    metadata: dict[str, str] | None = field(default=None)
    input_tokens: int = 0
    output_tokens: int = 0

    def to_openai(self, model: str) -> dict[str, Any]:
        """Every field of OpenAI's Batch object."""
        errors = None if self.errors is None else {"object": "list", "data": self.errors}
        usage = {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.input_tokens + self.output_tokens}
        plain = ("id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id",
                 "error_file_id", "created_at", "expires_at", *(f"{s}_at" for s in _TIMESTAMPED), "metadata")
        return {
            **{key: getattr(self, key) for key in plain}, "object": "batch", "model": model, "errors": errors,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": usage,
        }


@dataclass
class ResultRow:
    """One finished request: the output or error line, and the tokens it used."""

    index: int
    ok: bool
    line: dict[str, Any]
    input_tokens: int = 0
    output_tokens: int = 0


_BATCH_COLUMNS = [f.name for f in fields(BatchRecord)]
_FILE_COLUMNS = [f.name for f in fields(FileRecord)]


def _is_local(storage_uri: str) -> bool:
    return "://" not in storage_uri or storage_uri.startswith("file://")


class BatchStore:
    """Thread-safe: the HTTP handlers and the runner thread share one connection under a lock."""

    def __init__(self, storage_uri: str, state_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.fs, root = filesystem(storage_uri, storage_options)
        self.files_root = root.rstrip("/") + "/files"
        self.fs.makedirs(self.files_root, exist_ok=True)
        if state_dir is None:
            if not _is_local(storage_uri):
                raise ValueError(f"storage {storage_uri!r} is remote: pass --state-dir, a local directory "
                                 "for the SQLite metadata")
            state_dir = root
        os.makedirs(state_dir, exist_ok=True)
        self.db_path = os.path.join(state_dir, DB_NAME)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.db_path, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    # ---- files -------------------------------------------------------------------------------------

    def _blob_path(self, file_id: str) -> str:
        if not FILE_ID.match(file_id):  # ids are the only user input that reaches a storage path
            raise ValueError(f"invalid file id {file_id!r}")
        return f"{self.files_root}/{file_id}"

    def put_file(self, filename: str, purpose: str, chunks: Iterable[bytes]) -> FileRecord:
        file_id = new_id("file-")
        size = 0
        with self.fs.open(self._blob_path(file_id), "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
        record = FileRecord(file_id, size, int(time.time()), filename, purpose)
        with self._lock, self._db:
            self._insert_file(record)
        return record

    def _insert_file(self, record: FileRecord) -> None:
        self._db.execute(f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES (?, ?, ?, ?, ?)",
                         [getattr(record, c) for c in _FILE_COLUMNS])

    def get_file(self, file_id: str) -> FileRecord | None:
        if not FILE_ID.match(file_id):
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE id = ?",
                                   (file_id,)).fetchone()
        return None if row is None else FileRecord(*row)

    def list_files(self, purpose: str | None, after: str | None, limit: int,
                   ascending: bool) -> tuple[list[FileRecord], bool]:
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        rows, has_more = self._page("files", _FILE_COLUMNS, where, args, after, limit, ascending)
        return [FileRecord(*r) for r in rows], has_more

    def open_file(self, file_id: str) -> IO[bytes]:
        return self.fs.open(self._blob_path(file_id), "rb")

    def read_file(self, file_id: str) -> bytes:
        with self.open_file(file_id) as f:
            return f.read()

    def batches_using_file(self, file_id: str) -> list[str]:
        """Unfinished batches that still need this file as their input."""
        marks = ", ".join("?" for _ in TERMINAL)
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN ({marks})",
                (file_id, *TERMINAL)).fetchall()
        return [r[0] for r in rows]

    def delete_file(self, file_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        path = self._blob_path(file_id)
        if self.fs.exists(path):
            self.fs.rm(path)

    # ---- batches -----------------------------------------------------------------------------------

    def create_batch(self, endpoint: str, input_file_id: str, completion_window: str, window_seconds: int,
                     metadata: dict[str, str] | None) -> BatchRecord:
        now = int(time.time())
        record = BatchRecord(new_id("batch_"), endpoint, input_file_id, completion_window, "validating", now,
                             now + window_seconds, metadata=metadata)
        values = [_to_column(getattr(record, c)) for c in _BATCH_COLUMNS]
        with self._lock, self._db:
            self._db.execute(f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) "
                             f"VALUES ({', '.join('?' for _ in _BATCH_COLUMNS)})", values)
        return record

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE id = ?",
                                   (batch_id,)).fetchone()
        return None if row is None else _batch_from_row(row)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        rows, has_more = self._page("batches", _BATCH_COLUMNS, [], [], after, limit, ascending=False)
        return [_batch_from_row(r) for r in rows], has_more

    def batches_with_status(self, *statuses: str) -> list[BatchRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE status IN "
                f"({', '.join('?' for _ in statuses)}) ORDER BY seq", statuses).fetchall()
        return [_batch_from_row(r) for r in rows]

    def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...] | None = None,
                   **values: Any) -> bool:
        """Move a batch to `status` (stamping `<status>_at`); with only_from, only out of those statuses."""
        now = int(time.time())
        values = {"status": status, **({f"{status}_at": now} if status in _TIMESTAMPED else {}), **values}
        sql = f"UPDATE batches SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?"
        args = [_to_column(v) for v in values.values()] + [batch_id]
        if only_from is not None:
            sql += f" AND status IN ({', '.join('?' for _ in only_from)})"
            args += list(only_from)
        with self._lock, self._db:
            return self._db.execute(sql, args).rowcount == 1

    def add_results(self, batch_id: str, rows: list[ResultRow]) -> None:
        """Commit finished requests and their counts in one transaction."""
        if not rows:
            return
        ok = sum(r.ok for r in rows)
        with self._lock, self._db:
            self._db.executemany("INSERT INTO results (batch_id, line_index, ok, line) VALUES (?, ?, ?, ?)",
                                 [(batch_id, r.index, int(r.ok), json.dumps(r.line)) for r in rows])
            self._db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                (ok, len(rows) - ok, sum(r.input_tokens for r in rows), sum(r.output_tokens for r in rows),
                 batch_id))

    def done_indices(self, batch_id: str) -> set[int]:
        with self._lock:
            rows = self._db.execute("SELECT line_index FROM results WHERE batch_id = ?",
                                    (batch_id,)).fetchall()
        return {r[0] for r in rows}

    def results(self, batch_id: str) -> dict[int, tuple[bool, str]]:
        """line index -> (ok, the JSON line) for every finished request."""
        with self._lock:
            rows = self._db.execute("SELECT line_index, ok, line FROM results WHERE batch_id = ?",
                                    (batch_id,)).fetchall()
        return {index: (bool(ok), line) for index, ok, line in rows}

    def finalize(self, batch_id: str, status: str, output_lines: Iterable[str], error_lines: Iterable[str],
                 unfinished: int, **values: Any) -> None:
        """Write the output and error files, then in one transaction register them, count the unfinished
        requests as failed, move the batch to its final status (with `values`: a failure's errors) and drop its
        result rows."""
        files: list[FileRecord | None] = []
        try:  # a failed finalize (retried by the caller) leaves no file behind: each try writes new ones
            for kind, lines in (("output", output_lines), ("error", error_lines)):
                files.append(self._write_lines(f"{batch_id}_{kind}.jsonl", lines))
            values = {"status": status, f"{status}_at": int(time.time()), "output_file_id": files[0] and files[0].id,
                      "error_file_id": files[1] and files[1].id, **{k: _to_column(v) for k, v in values.items()}}
            with self._lock, self._db:
                for f in files:
                    if f is not None:
                        self._insert_file(f)
                self._db.execute(f"UPDATE batches SET {', '.join(f'{k} = ?' for k in values)}, failed = failed + ? "
                                 "WHERE id = ?", [*values.values(), unfinished, batch_id])
                self._db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
        except BaseException:
            for f in files:
                if f is not None:
                    self.fs.rm(self._blob_path(f.id))
            raise

    def _write_lines(self, filename: str, lines: Iterable[str]) -> FileRecord | None:
        """A batch_output file holding `lines`, or None (no file) when there are none."""
        file_id, size = new_id("file-"), 0
        try:
            with self.fs.open(self._blob_path(file_id), "wb") as out:
                for line in lines:
                    data = (line + "\n").encode()
                    out.write(data)
                    size += len(data)
        except BaseException:
            if self.fs.exists(self._blob_path(file_id)):
                self.fs.rm(self._blob_path(file_id))
            raise
        if size == 0:
            self.fs.rm(self._blob_path(file_id))
            return None
        return FileRecord(file_id, size, int(time.time()), filename, "batch_output")

    def _page(self, table: str, columns: list[str], where: list[str], args: list[Any], after: str | None,
              limit: int, ascending: bool) -> tuple[list[tuple], bool]:
        """Cursor pagination: `after` is the id of the last object of the previous page."""
        with self._lock:
            if after is not None:
                row = self._db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                where = [*where, "seq > ?" if ascending else "seq < ?"]
                args = [*args, row[0]]
            clause = f"WHERE {' AND '.join(where)}" if where else ""
            direction = "ASC" if ascending else "DESC"
            rows = self._db.execute(
                f"SELECT {', '.join(columns)} FROM {table} {clause} ORDER BY seq {direction} LIMIT ?",
                (*args, limit + 1)).fetchall()
        return rows[:limit], len(rows) > limit

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _to_column(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def _batch_from_row(row: tuple) -> BatchRecord:
    values = dict(zip(_BATCH_COLUMNS, row))
    for key in ("errors", "metadata"):
        if values[key] is not None:
            values[key] = json.loads(values[key])
    return BatchRecord(**values)
