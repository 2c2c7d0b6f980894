"""The runtime a job starts for itself is its own (never a cluster `ray start` left on the machine) and keeps
idle workers (no Python worker started per read or write task); joining a running cluster passes nothing it
would refuse."""

from __future__ import annotations

import os

import ray

from batchgen.pipelines.ray_runtime import WORKERS_PER_CPU, init_ray


def test_a_local_runtime_keeps_idle_workers_and_a_joined_one_is_left_as_it_is(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    init_ray(include_dashboard=False)
    init_ray("local", num_cpus=4)
    init_ray("10.0.0.1:6379", include_dashboard=False)
    assert calls[0]["_system_config"] == {"num_workers_soft_limit": WORKERS_PER_CPU * os.cpu_count()}
    assert calls[0]["address"] == calls[1]["address"] == "local"
    assert calls[1]["_system_config"] == {"num_workers_soft_limit": WORKERS_PER_CPU * 4}
    assert calls[2] == {"address": "10.0.0.1:6379", "include_dashboard": False}
