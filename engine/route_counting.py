"""Which engine a model's routing decisions count for: the one whose step runs the forward.

Engines share a loaded model (the planner profiles on it, a process may build several), and each counts the routing
its steps see (moe_calls, the expert histogram, the mean expert batch). The model's MoE modules report to `observe`
(set once, the same for every engine), which hands each decision to the engine stepping on this thread: an observer
of each engine's own set on the shared modules sent every engine's counts to the newest one, and a recorded forward
replayed the routing effects into whichever engine had recorded it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_stepping = threading.local()  # `record`: the counter of the engine whose forward runs on this thread


def observe(topk_ids: torch.Tensor, num_experts: int) -> None:
    """A MoE module's routing decision: counted by the engine stepping on this thread (none outside a step)."""
    record = getattr(_stepping, "record", None)
    if record is not None:
        record(topk_ids, num_experts)


@contextmanager
def counting_for(record: Callable[[torch.Tensor, int], None]) -> Iterator[None]:
    """Within: the routing of forwards on this thread counts for `record`."""
    before = getattr(_stepping, "record", None)
    _stepping.record = record
    try:
        yield
    finally:
        _stepping.record = before
