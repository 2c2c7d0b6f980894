"""Quantiles of a stream of non-negative values (completion times) in bounded memory.

The engine records one completion time per request and a job summary one per output row; kept as
lists they grow with the rows of a job, millions in a scheduled ETL run. Here a value only bumps the
count of its log-spaced bucket ((g^(i-1), g^i], g = (1 + e) / (1 - e)), and a quantile is the middle
of the bucket that holds the value of that rank: within relative error e of the exact nearest-rank
value, and a few thousand buckets at most whatever the count (every value from a microsecond to a
week, at e = 0.5 %). Sketches of parts of a stream merge into the sketch of the whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

RELATIVE_ERROR = 0.005


class QuantileSketch:
    def __init__(self, relative_error: float = RELATIVE_ERROR) -> None:
        if not 0 < relative_error < 1:
            raise ValueError(f"relative_error must be in (0, 1), got {relative_error!r}")
        self.relative_error = relative_error
        self._gamma = (1 + relative_error) / (1 - relative_error)
        self._log_gamma = math.log(self._gamma)
        self.buckets: dict[int, int] = {}  # bucket index -> values in it
        self.zeros = 0  # values <= 0 (kept apart: no log)
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        if value <= 0:
            self.zeros += 1
            return
        index = math.ceil(math.log(value) / self._log_gamma)
        self.buckets[index] = self.buckets.get(index, 0) + 1

    def add_many(self, values: Iterable[float] | np.ndarray) -> None:
        """Add many values at once (NaN skipped: a null completion time is no value)."""
        array = np.asarray(values, dtype=np.float64)
        array = array[~np.isnan(array)]
        positive = array[array > 0]
        self.count += len(array)
        self.zeros += len(array) - len(positive)
        indices, counts = np.unique(np.ceil(np.log(positive) / self._log_gamma).astype(np.int64), return_counts=True)
        for index, count in zip(indices.tolist(), counts.tolist()):
            self.buckets[index] = self.buckets.get(index, 0) + count

    def merge(self, other: QuantileSketch) -> None:
        if other.relative_error != self.relative_error:
            raise ValueError("cannot merge sketches of different relative errors")
        self.count += other.count
        self.zeros += other.zeros
        for index, count in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0) + count

    def quantile(self, q: float) -> float | None:
        """The value of rank floor(q * count) (0-based, nearest rank), within the relative error; None
        when empty."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        if not self.count:
            return None
        rank = min(self.count - 1, int(q * self.count))
        seen = self.zeros
        if rank < seen:
            return 0.0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if rank < seen:
                return 2 * self._gamma ** index / (self._gamma + 1)
        raise AssertionError("bucket counts disagree with the total")  # unreachable: counts sum to count
