"""Restore a lost request from its checkpointed KV, or recompute it from its prompt: whichever the
measured costs say is faster.

Restoring copies the checkpoint's KV bytes (at the bandwidth measured when checkpoints were stored);
recomputing prefills the prompt again and decodes the tokens it had generated again (at the engine's
measured prefill time per token and decode step time). A request with no checkpoint is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.engine.metrics import EngineMetrics


@dataclass(frozen=True)
class RecoveryCosts:
    copy_bytes_per_s: float  # checkpoint bytes over the time to store them
    prefill_s_per_token: float  # engine time in prefill steps per token prefilled
    decode_step_s: float  # engine time per decode step


@dataclass(frozen=True)
class Checkpoint:
    """A stored snapshot of a request (engine.migration.MigratedRequest) and what it would save."""
    request_id: str
    kv_bytes: int
    prompt_tokens: int
    generated: int  # tokens decoded at the snapshot
    ref: Any = None  # its object reference, once stored

    def with_ref(self, ref: Any) -> Checkpoint:
        return replace(self, ref=ref)


def restore_is_faster(point: Checkpoint, costs: RecoveryCosts) -> bool:
    restore_s = point.kv_bytes / costs.copy_bytes_per_s
    recompute_s = point.prompt_tokens * costs.prefill_s_per_token + point.generated * costs.decode_step_s
    return restore_s < recompute_s


def measured_costs(stats: EngineMetrics, copied_bytes: int, copy_s: float) -> RecoveryCosts | None:
    """Costs from an engine's counters and the checkpoint copies timed so far; None until a prefill, a
    decode-only step and a copy were measured."""
    decode_only = stats.decode_steps - stats.mixed_steps
    if not (copied_bytes and copy_s > 0 and stats.prompt_tokens and decode_only and stats.prefill_step_seconds):
        return None
    prefilled = stats.prompt_tokens + stats.recomputed_tokens  # (recompute preemptions prefill in those steps too)
    return RecoveryCosts(copied_bytes / copy_s, stats.prefill_step_seconds / prefilled,
                         stats.decode_step_seconds / decode_only)
