"""Job progress, counted where rows finish (the engine actors) and where they are committed (the
write tasks), and read by the driver.

Kept free of torch and the engine: every write task unpickles the hook and imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray


@dataclass
class Progress:
    total_rows: int  # rows of the input
    skipped_rows: int  # already in the output when the job started
    rows: int = 0  # written by this run
    errors: int = 0
    generated_tokens: int = 0  # in the rows written
    finished_rows: int = 0  # out of the engines (not yet all written); a retried task's rows once
    finished_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def done_rows(self) -> int:
        """Rows out of the engines, as far as known (written rows are out for sure)."""
        return min(self.total_rows - self.skipped_rows, max(self.rows, self.finished_rows))

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second: those of the written rows once every row is written (exact), before that
        the engines' count when larger (rows out of the engines, not yet written)."""
        written_all = self.rows >= self.total_rows - self.skipped_rows
        tokens = self.generated_tokens if written_all else max(self.generated_tokens, self.finished_tokens)
        return tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's pace since its start; None before the first row is out."""
        remaining = self.total_rows - self.skipped_rows - self.done_rows
        if remaining <= 0:
            return 0.0
        return remaining * self.elapsed_s / self.done_rows if self.done_rows else None


@ray.remote(num_cpus=0)
class ProgressTracker:
    def __init__(self) -> None:
        self.rows = self.errors = self.tokens = self.finished_rows = self.finished_tokens = 0
        self.actors: list[Any] = []  # operators.actor_ready.EngineActorReady, one per engine actor start
        self.finished = bytearray()  # bit i: the row of input position i is out of an engine

    def actor_ready(self, ready: Any) -> None:
        self.actors.append(ready)

    def ready_actors(self) -> list[Any]:
        return self.actors

    def add(self, rows: int, errors: int, tokens: int) -> None:
        self.rows += rows
        self.errors += errors
        self.tokens += tokens

    def add_finished(self, row_indexes: list[int | None], tokens: list[int]) -> None:
        """Rows out of an engine, by input position, and each one's generated tokens. A row already counted (its
        task retried after an actor died) is not counted again: the ETA would reach 0 with rows still to do. A row
        without a position (an engine stage used outside a job's pipeline) is counted each time."""
        for index, count in zip(row_indexes, tokens):
            if isinstance(index, int) and index >= 0:  # (a dataset's own row_index may hold anything)
                byte, bit = divmod(index, 8)
                if byte >= len(self.finished):
                    self.finished.extend(bytes(byte + 1 - len(self.finished)))
                if self.finished[byte] >> bit & 1:
                    continue
                self.finished[byte] |= 1 << bit
            self.finished_rows += 1
            self.finished_tokens += count

    def snapshot(self) -> dict[str, int]:
        return {"rows": self.rows, "errors": self.errors, "generated_tokens": self.tokens,
                "finished_rows": self.finished_rows, "finished_tokens": self.finished_tokens}


def update(progress: Progress, tracker: ray.actor.ActorHandle) -> None:
    """Copy the tracker's counters into `progress`."""
    for name, value in ray.get(tracker.snapshot.remote()).items():
        setattr(progress, name, value)


@dataclass
class ReportWritten:
    """Sink hook: adds each committed file's rows, error rows and generated tokens to the tracker."""

    tracker: ray.actor.ActorHandle
    tokens_column: str
    error_column: str

    def __call__(self, table: pa.Table) -> None:
        tokens = table.column(self.tokens_column)
        if pa.types.is_list(tokens.type):
            tokens = pc.list_flatten(tokens)
        errors = table.num_rows - table.column(self.error_column).null_count
        ray.get(self.tracker.add.remote(table.num_rows, errors, int(pc.sum(tokens).as_py() or 0)))
