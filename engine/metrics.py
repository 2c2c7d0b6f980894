"""Engine counters, cheap enough to leave on: sums, bincounts and a quantile sketch (no per-request list:
an engine actor may serve millions of requests), summarised on demand."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchgen.engine.quantile_sketch import QuantileSketch

ROUTES_PER_FOLD = 64  # MoE calls' routing decisions kept before one bincount counts them

# what a PARTITIONed straggler's engine adds to its rank's counters
ABSORBED = ("generated_tokens", "recomputed_tokens", "finished_requests", "failed_requests", "aborted_requests",
            "prefill_steps", "decode_steps", "mixed_steps", "chunked_prefills", "model_seconds", "forward_seconds",
            "step_seconds", "prefill_step_seconds", "decode_step_seconds", "sequence_steps")


@dataclass
class EngineMetrics:
    started_at: float | None = None
    last_finished_at: float | None = None
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens prefilled (a cached prefix's not counted)
    recomputed_tokens: int = 0  # tokens prefilled again after a recompute preemption (prompt and generated ones)
    finished_requests: int = 0
    failed_requests: int = 0
    aborted_requests: int = 0
    prefill_steps: int = 0  # steps with prompt tokens (a mixed step counts here and as a decode step)
    decode_steps: int = 0
    mixed_steps: int = 0  # prefill and decode COMBINE-d in one forward
    chunked_prefills: int = 0  # prompt chunks that left the rest of their prompt for a later step
    handoff_prefills: int = 0  # adopted prompts prefilled again: their carried prefix was not cached here
    migrated_out: int = 0  # requests handed to another engine (export_request)
    migrated_in: int = 0  # requests taken over from another engine (import_request)
    # groups of host-resident sequences decoded (offloaded COMBINE): micro-batches of their own (through the staging
    # pool, or on a GPU's view of their host pages), or, where host pages are the device's memory, in the resident
    # sequences' micro-batches
    staged_decode_batches: int = 0
    decode_micro_batches: int = 0  # attention micro-batches of decoding sequences, over all steps
    yields: int = 0
    restores: int = 0
    recomputes: int = 0  # recompute preemptions: KV dropped, prefilled again (no host room to keep it)
    # steps with no sequence of its own in which this rank of an expert-parallel engine served its experts
    expert_only_steps: int = 0
    partitioned_steps: int = 0  # steps of a straggler decoded over every rank of its group (PARTITION)
    # decode steps whose forward was recorded, replayed from a recording, refused a recording (engine/decode_graphs)
    decode_graph_captures: int = 0
    decode_graph_replays: int = 0
    decode_graph_refusals: int = 0
    model_seconds: float = 0.0  # in the model runner: batch building + forward
    forward_seconds: float = 0.0  # the forward alone (layers + LM head)
    step_seconds: float = 0.0
    prefill_step_seconds: float = 0.0  # steps with prompt tokens (mixed ones included)
    decode_step_seconds: float = 0.0  # decode-only steps
    admission_seconds: float = 0.0  # add_request: validation, tokenization, queueing
    sequence_steps: int = 0  # sequences summed over steps (prompts in prefill steps, samples in decode steps)
    moe_calls: int = 0
    expert_tokens_sum: float = 0.0  # sum over MoE calls of tokens per expert (T * k / E)
    decoding: bool = False  # set by the engine around each forward, to tell decode MoE calls apart
    decode_moe_calls: int = 0
    decode_expert_tokens_sum: float = 0.0
    expert_histogram: torch.Tensor | None = None  # tokens routed to each expert, all folded calls summed
    # routing decisions not yet folded into expert_histogram, and the most experts any of them routes over
    pending_routes: list[torch.Tensor] = field(default_factory=list, repr=False)
    pending_experts: int = 0
    max_ffn_tokens: int = 0  # largest feed-forward (MoE) batch of any step
    peak_active: int = 0  # most sequences decoding from device pages at once
    peak_suspended: int = 0  # most sequences whose KV sat in host pages at once
    completion_times: QuantileSketch = field(default_factory=QuantileSketch)  # of every finished request

    def mark_start(self) -> None:
        if self.started_at is None:
            self.started_at = time.perf_counter()

    def record_route(self, topk_ids: torch.Tensor, num_experts: int) -> None:
        """Count one MoE call's routing. Its ids wait in a list, folded into the histogram by one bincount every
        ROUTES_PER_FOLD calls and before a summary, on their own device: a bincount and an add per layer cost
        ~20 us of a CPU decode step, and on a GPU the copy to the host each layer made waited for the device
        (a CUDA bincount still reads its input's maximum back: once per fold now)."""
        self.pending_routes.append(topk_ids.reshape(-1))
        self.pending_experts = max(self.pending_experts, num_experts)
        if len(self.pending_routes) >= ROUTES_PER_FOLD:
            self.fold_routes()
        per_expert = topk_ids.numel() / num_experts
        self.moe_calls += 1
        self.expert_tokens_sum += per_expert
        if self.decoding:
            self.decode_moe_calls += 1
            self.decode_expert_tokens_sum += per_expert

    def fold_routes(self) -> None:
        if not self.pending_routes:
            return
        previous = self.expert_histogram
        length = self.pending_experts if previous is None else max(self.pending_experts, len(previous))
        counts = torch.bincount(torch.cat(self.pending_routes), minlength=length)
        self.pending_routes.clear()
        if previous is not None:
            counts[: len(previous)] += previous
        self.expert_histogram = counts

    def expert_counts(self) -> list[int]:
        """Tokens routed to each expert so far (every pending call folded in)."""
        self.fold_routes()
        return [] if self.expert_histogram is None else self.expert_histogram.tolist()

    def record_ffn_batch(self, num_tokens: int) -> None:
        self.max_ffn_tokens = max(self.max_ffn_tokens, num_tokens)

    def record_step(self, scheduler) -> None:
        self.yields, self.restores, self.recomputes = scheduler.yields, scheduler.restores, scheduler.recomputes
        self.peak_active = max(self.peak_active, len(scheduler.running))
        self.peak_suspended = max(self.peak_suspended, len(scheduler.suspended))

    def record_step_time(self, plan, seconds: float) -> None:
        self.step_seconds += seconds
        if plan is not None and plan.prefill is not None:
            self.prefill_step_seconds += seconds
        elif plan is not None:
            self.decode_step_seconds += seconds

    def record_finished(self, finished_at: float, completion_time: float) -> None:
        self.finished_requests += 1
        self.last_finished_at = finished_at
        self.completion_times.add(completion_time)

    def absorb_partition(self, other: EngineMetrics) -> None:
        """Count a PARTITIONed straggler's steps (run by a tensor-parallel engine of this rank's) as this
        engine's own."""
        for name in ABSORBED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.partitioned_steps += other.prefill_steps + other.decode_steps
        if other.last_finished_at is not None:
            self.last_finished_at = max(self.last_finished_at or 0.0, other.last_finished_at)
        self.completion_times.merge(other.completion_times)

    def _host_overhead(self) -> dict:
        """Engine time outside the model forward (admission, scheduling, batch building, sampling, stop
        checks): what a GPU will not hide."""
        engine_s = self.step_seconds + self.admission_seconds
        host_s = engine_s - self.forward_seconds
        return {"host_share": host_s / engine_s if engine_s else 0.0,
                "host_us_per_sequence_step": host_s * 1e6 / self.sequence_steps if self.sequence_steps else 0.0}

    def summary(self, kv) -> dict:
        """Everything recorded, with the KV manager's own counters (`kv`: engine/kv_manager.KVManager)."""
        end = self.last_finished_at or time.perf_counter()
        bct = (end - self.started_at) if self.started_at is not None else 0.0
        return {
            "bct_s": bct,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "tokens_per_s": self.generated_tokens / bct if bct > 0 else 0.0,
            "finished_requests": self.finished_requests,
            "failed_requests": self.failed_requests,
            "aborted_requests": self.aborted_requests,
            "prefill_steps": self.prefill_steps,
            "decode_steps": self.decode_steps,
            "mixed_steps": self.mixed_steps,
            "chunked_prefills": self.chunked_prefills,
            "handoff_prefills": self.handoff_prefills,
            "migrated_out": self.migrated_out,
            "migrated_in": self.migrated_in,
            "staged_decode_batches": self.staged_decode_batches,
            "host_kv_streamed": kv.stream_host,  # host-resident sequences decode through staging pages, not in place
            "decode_micro_batches": self.decode_micro_batches,
            "yields": self.yields,
            "restores": self.restores,
            "recomputes": self.recomputes,
            "bytes_moved": kv.bytes_moved,
            "prefill_tokens_saved": kv.prefix_hit_tokens,  # prompt tokens whose KV came from cached pages
            "prefix_hit_rate": kv.prefix_hit_tokens / kv.prefix_query_tokens if kv.prefix_query_tokens else 0.0,
            "prefix_query_tokens": kv.prefix_query_tokens,  # prompt tokens looked up in the prefix cache
            "moe_calls": self.moe_calls,
            "decode_moe_calls": self.decode_moe_calls,
            "mean_expert_batch": self.expert_tokens_sum / self.moe_calls if self.moe_calls else 0.0,
            "mean_decode_expert_batch": (self.decode_expert_tokens_sum / self.decode_moe_calls
                                         if self.decode_moe_calls else 0.0),
            "expert_histogram": self.expert_counts(),
            "prefill_step_seconds": self.prefill_step_seconds,
            "decode_step_seconds": self.decode_step_seconds,
            "scheduler_share": 1 - self.model_seconds / self.step_seconds if self.step_seconds else 0.0,
            **self._host_overhead(),
            **completion_quantiles(self.completion_times),
            "max_ffn_tokens": self.max_ffn_tokens,
            "expert_only_steps": self.expert_only_steps,
            "partitioned_steps": self.partitioned_steps,
            "decode_graph_captures": self.decode_graph_captures,
            "decode_graph_replays": self.decode_graph_replays,
            "decode_graph_refusals": self.decode_graph_refusals,
            "peak_active": self.peak_active,
            "peak_suspended": self.peak_suspended,
        }


def completion_quantiles(times: QuantileSketch) -> dict[str, float | None]:
    """The completion-time quantiles a summary reports, from the sketch of every finished request."""
    return {f"completion_time_p{round(q * 100)}": times.quantile(q) for q in (0.50, 0.95, 0.99)}
