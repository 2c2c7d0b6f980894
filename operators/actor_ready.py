"""An engine actor telling the job it is ready: where, when, and how long its constructor took.

Kept free of torch: the job's progress tracker unpickles these reports, and it should not import
torch for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class EngineActorReady:
    """An engine actor that finished its constructor: where, when, and how long the constructor took."""

    stage: str  # BatchGen, Prefill or Decode
    node_id: str
    ready_at: float  # wall clock (time.time()) on the actor's node
    init_s: float  # the constructor: model load, KV pools, engine loop
    ranks: int = 1  # processes (devices) its engine spans (EngineConfig.ep_size)
    device_memory_bytes: int | None = None  # memory-constrained mode: the device budget its weights stream within


def announce_ready(progress: Any, stage: str, init_started: float, engine: Any) -> None:
    """From an engine actor's constructor (`init_started`: its time.perf_counter() at the start; `engine`: the
    one it built): tell the job's progress tracker (`actor_ready`), fire and forget. Outside Ray, or with no
    tracker, nothing."""
    if progress is not None and ray.is_initialized():
        progress.actor_ready.remote(EngineActorReady(stage, ray.get_runtime_context().get_node_id(), time.time(),
                                                     time.perf_counter() - init_started, engine.ranks,
                                                     engine.config.device_memory_bytes))
