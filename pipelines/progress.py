"""Job progress, counted where rows are committed (the write tasks) and read by the driver.

Kept free of torch and the engine: every write task unpickles the hook and imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import ray


@dataclass
class Progress:
    total_rows: int  # rows of the input
    skipped_rows: int  # already in the output when the job started
    rows: int = 0  # written by this run
    errors: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's pace so far; None before the first row is written."""
        remaining = self.total_rows - self.skipped_rows - self.rows
        if remaining <= 0:
            return 0.0
        return remaining * self.elapsed_s / self.rows if self.rows else None


@ray.remote(num_cpus=0)
class ProgressTracker:
    def __init__(self) -> None:
        self.rows = self.errors = self.tokens = 0

    def add(self, rows: int, errors: int, tokens: int) -> None:
        self.rows += rows
        self.errors += errors
        self.tokens += tokens

    def snapshot(self) -> tuple[int, int, int]:
        return self.rows, self.errors, self.tokens


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
