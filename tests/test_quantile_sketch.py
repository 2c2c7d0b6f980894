"""The bounded-memory quantile sketch behind the engine's and the job summary's completion-time quantiles:
within its relative error of the exact nearest-rank value, however many values, and mergeable."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen.engine.quantile_sketch import RELATIVE_ERROR, QuantileSketch

QUANTILES = (0.0, 0.01, 0.5, 0.9, 0.99, 1.0)


def nearest_rank(values: np.ndarray, q: float) -> float:
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def test_quantiles_within_the_relative_error_of_the_exact_ones():
    values = np.random.default_rng(0).lognormal(mean=-1.0, sigma=1.5, size=20_000)
    one_by_one, at_once = QuantileSketch(), QuantileSketch()
    for value in values:
        one_by_one.add(float(value))
    at_once.add_many(values)
    for q in QUANTILES:
        exact = nearest_rank(values, q)
        assert one_by_one.quantile(q) == at_once.quantile(q)
        assert abs(at_once.quantile(q) - exact) <= RELATIVE_ERROR * exact * (1 + 1e-9), q


def test_merged_parts_equal_the_whole_and_memory_stays_bounded():
    values = np.random.default_rng(1).uniform(1e-6, 1e5, size=1_000_000)  # eleven decades
    whole, merged = QuantileSketch(), QuantileSketch()
    whole.add_many(values)
    for part in np.array_split(values, 7):
        sketch = QuantileSketch()
        sketch.add_many(part)
        merged.merge(sketch)
    assert merged.count == whole.count == len(values)
    assert merged.buckets == whole.buckets
    assert len(whole.buckets) < 2_600  # ln(1e11) / ln(1.01005): buckets per decade, not per value


def test_nulls_zeros_and_empty():
    sketch = QuantileSketch()
    assert sketch.quantile(0.5) is None
    sketch.add_many(np.array([np.nan, 0.0, 0.0, 2.0]))  # NaN: a row with no completion time
    assert sketch.count == 3
    assert sketch.quantile(0.5) == 0.0
    assert sketch.quantile(1.0) == pytest.approx(2.0, rel=RELATIVE_ERROR)
    with pytest.raises(ValueError):
        sketch.quantile(1.5)
