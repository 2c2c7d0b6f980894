"""How engine actors run inside Ray: their CPU threads, their priority, and how many tasks they hold.

Ray starts a worker for a fractional-CPU actor with OMP_NUM_THREADS=1 and at niceness 15, below the
driver and Ray's own processes: an engine there computes on one thread and loses its core to every
bookkeeping process. `prepare_engine_process` gives it the threads of the CPUs it was granted and
normal priority, and freezes the heap its imports left (engine/process_heap.py), so the collector's full passes
stop walking it mid-step. `engine_actor_pool` keeps several tasks (blocks) in flight per actor, so an engine
refills from the next block while the last one's long tail drains; the engine loop's admission
bound (engine/engine_loop.py) keeps that from becoming an unbounded queue.
"""

from __future__ import annotations

import logging
import math
import os

import ray
import torch

from batchgen.engine.process_heap import freeze_heap

log = logging.getLogger(__name__)

TASKS_IN_FLIGHT = 4  # blocks an engine actor holds at once


def engine_actor_pool(size: int, tasks_in_flight: int = TASKS_IN_FLIGHT) -> ray.data.ActorPoolStrategy:
    """The `compute=` for map_batches(BatchGen / Decode): `size` actors, each fed `tasks_in_flight` blocks
    at once (their async calls all land in the actor's one engine)."""
    return ray.data.ActorPoolStrategy(size=size, max_tasks_in_flight_per_actor=tasks_in_flight,
                                      max_concurrent_calls_per_actor=tasks_in_flight)


def engine_threads(granted_cpus: float) -> int:
    """Torch threads for an actor granted `granted_cpus`: rounded up, at least one, at most this machine's
    cores (logical CPUs beyond the cores would only make threads wait on each other)."""
    return max(1, min(math.ceil(granted_cpus - 1e-9), os.cpu_count() or 1))


def prepare_engine_process() -> int:
    """In a Ray actor: torch threads for the CPUs Ray granted it (engine_threads), its share of a GPU granted a
    fraction of one as its memory limit (kv_budget.available_memory_bytes), niceness 0 where the OS allows, the heap
    frozen (the actor holds its engine for its life). Outside Ray nothing changes. Returns the
    thread count in use."""
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        granted = ray.get_runtime_context().get_assigned_resources()
        threads = engine_threads(granted.get("CPU", 0.0))
        gpus = granted.get("GPU", 0.0)
        if 0 < gpus < 1 and torch.cuda.is_available():  # a share of one GPU: the engine sizes its pools within it
            torch.cuda.set_per_process_memory_fraction(gpus)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            if os.getpriority(os.PRIO_PROCESS, 0) > 0:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError as exc:  # unprivileged: stay at Ray's niceness
            log.warning("engine actor keeps niceness %d: %s", os.getpriority(os.PRIO_PROCESS, 0), exc)
        freeze_heap()
    return torch.get_num_threads()

