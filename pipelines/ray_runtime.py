"""The Ray runtime a job runs on: the one at `address`, or a local one started for it.

A local runtime keeps its idle workers. Ray's default keeps about one worker per CPU, actors counted,
and kills any other a second after it goes idle; a job's engine, progress and Ray Data actors already
exceed that on a small machine, so each read and write task of a long job started and imported a
fresh Python worker (a quarter of the data plane's CPU time in 400,000 short rows on 2 cores).
"""

from __future__ import annotations

import os
from typing import Any

import ray

WORKERS_PER_CPU = 8  # 4 quarter-CPU task slots (read, tokenize, write) per CPU, and as many actors


def init_ray(address: str | None = None, **kwargs: Any) -> None:
    """ray.init: join `address`, or (None) start a local runtime that keeps enough idle workers: never a cluster
    that `ray start` left on this machine, which ray.init(address=None) would join."""
    if address in (None, "local"):
        address = "local"
        cpus = kwargs.get("num_cpus") or os.cpu_count() or 1
        kwargs["_system_config"] = {"num_workers_soft_limit": int(WORKERS_PER_CPU * cpus),
                                    **kwargs.get("_system_config", {})}
    ray.init(address=address, **kwargs)
