"""Job progress: rows are counted as they leave the engines, before any part file is written (the Ray
pipeline tests check the engine stages really report every row)."""

from __future__ import annotations

import ray

from batchgen.pipelines.progress import Progress, ProgressTracker


def test_progress_counts_rows_out_of_the_engines_and_estimates_from_the_start():
    p = Progress(total_rows=100, skipped_rows=10, rows=5, finished_rows=30, finished_tokens=300, elapsed_s=10.0)
    assert p.done_rows == 30  # out of the engines, though only 5 are written
    assert p.tokens_per_s == 30.0
    assert p.eta_s == 60 * 10.0 / 30  # 60 rows left at 3 rows/s
    p.finished_rows = 500  # never more than the rows to do
    assert p.done_rows == 90 and p.eta_s == 0.0


def test_the_tracker_counts_a_retried_tasks_rows_once(ray_cluster):
    """A task retried after its actor died reports its rows again: counted twice, the live ETA read 0 with rows
    still to do."""
    tracker = ProgressTracker.remote()
    ray.get(tracker.add_finished.remote([0, 1, 9], [4, 5, 6]))
    ray.get(tracker.add_finished.remote([1, 9, 2], [5, 6, 7]))  # rows 1 and 9 again, from a rerun of their task
    ray.get(tracker.add_finished.remote([None, None], [1, 1]))  # rows without a position: counted as they come
    # a dataset's own row_index column, holding what it holds: no position either (a TypeError, or a negative bit)
    ray.get(tracker.add_finished.remote(["a", -3], [2, 2]))
    snapshot = ray.get(tracker.snapshot.remote())
    ray.kill(tracker)
    assert snapshot["finished_rows"] == 8 and snapshot["finished_tokens"] == 4 + 5 + 6 + 7 + 1 + 1 + 2 + 2


def test_the_finished_jobs_throughput_counts_the_written_rows_tokens_once():
    """Tasks retried after an actor died count their rows' tokens again in the engines' count: the summary's
    tokens/s took that larger count, and its rate times the BCT was not the token count it printed."""
    p = Progress(total_rows=10, skipped_rows=2, rows=8, generated_tokens=80, finished_rows=12, finished_tokens=120,
                 elapsed_s=4.0)
    assert p.tokens_per_s == 20.0
