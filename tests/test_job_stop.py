"""Stopping a pipeline job from another thread (pipelines/job_stop.py) on a real Ray runtime."""

from __future__ import annotations

import pytest


def _slow(batch):
    import time

    time.sleep(0.2)
    return batch


def test_a_stop_that_comes_before_the_job_starts_ends_it_at_its_first_step(ray_cluster):
    """A stop before the job's executor registered (or before it started: its shutdown returns at once then) was
    lost, and the job ran to its end with nothing watching it."""
    import ray

    from batchgen.pipelines.job_stop import JobStopper

    stopper = JobStopper()
    with stopper.armed():
        stopper.stop()
        with pytest.raises(Exception, match="the job was stopped"):
            ray.data.range(40, override_num_blocks=40).map_batches(_slow, batch_size=1, num_cpus=0.25).materialize()
