"""Engine counters, cheap enough to leave on: appends and bincounts, summarised on demand."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


@dataclass
class EngineMetrics:
    started_at: float | None = None
    last_finished_at: float | None = None
    generated_tokens: int = 0
    prompt_tokens: int = 0
    finished_requests: int = 0
    failed_requests: int = 0
    aborted_requests: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    yields: int = 0
    restores: int = 0
    model_seconds: float = 0.0
    step_seconds: float = 0.0
    moe_calls: int = 0
    expert_tokens_sum: float = 0.0  # sum over MoE calls of tokens per expert (T * k / E)
    decoding: bool = False  # set by the engine around each forward, to tell decode MoE calls apart
    decode_moe_calls: int = 0
    decode_expert_tokens_sum: float = 0.0
    expert_histogram: torch.Tensor | None = None  # tokens routed to each expert, all calls summed
    completion_times: list[float] = field(default_factory=list)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, active, suspended, done)

    def mark_start(self) -> None:
        if self.started_at is None:
            self.started_at = time.perf_counter()

    def record_route(self, topk_ids: torch.Tensor, num_experts: int) -> None:
        counts = torch.bincount(topk_ids.reshape(-1).cpu(), minlength=num_experts)
        self.expert_histogram = counts if self.expert_histogram is None else self.expert_histogram + counts
        per_expert = topk_ids.numel() / num_experts
        self.moe_calls += 1
        self.expert_tokens_sum += per_expert
        if self.decoding:
            self.decode_moe_calls += 1
            self.decode_expert_tokens_sum += per_expert

    def summary(self, bytes_moved: int) -> dict:
        end = self.last_finished_at or time.perf_counter()
        bct = (end - self.started_at) if self.started_at is not None else 0.0
        return {
            "bct_s": bct,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "tokens_per_s": self.generated_tokens / bct if bct > 0 else 0.0,
            "finished_requests": self.finished_requests,
            "failed_requests": self.failed_requests,
            "aborted_requests": self.aborted_requests,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "yields": self.yields,
            "restores": self.restores,
            "bytes_moved": bytes_moved,
            "moe_calls": self.moe_calls,
            "mean_expert_batch": self.expert_tokens_sum / self.moe_calls if self.moe_calls else 0.0,
            "mean_decode_expert_batch": (self.decode_expert_tokens_sum / self.decode_moe_calls
                                         if self.decode_moe_calls else 0.0),
            "expert_histogram": [] if self.expert_histogram is None else self.expert_histogram.tolist(),
            "scheduler_share": 1 - self.model_seconds / self.step_seconds if self.step_seconds else 0.0,
            "completion_time_p50": percentile(self.completion_times, 50),
            "completion_time_p95": percentile(self.completion_times, 95),
            "completion_time_p99": percentile(self.completion_times, 99),
            "peak_active": max((a for _, a, _, _ in self.timeline), default=0),
            "peak_suspended": max((s for _, _, s, _ in self.timeline), default=0),
        }
