"""Engine configuration: one dataclass, every knob with a default that runs on a laptop CPU."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineConfig:
    mode: str = "coroutine"  # "coroutine" (BatchGen) or "lockstep" (continuous-batching baseline)
    dtype: str = "float32"
    device: str = "auto"  # "auto" picks cuda when present
    page_size: int = 64
    kv_budget_bytes: int | None = None  # device KV budget; None = a share of free device memory
    host_kv_budget_bytes: int | None = None  # host KV store; None = a share of free host memory
    staging_fraction: float = 0.25  # coroutine mode: share of a set KV budget kept for streaming
    b_attn: int = 256  # max sequences per attention micro-batch
    b_moe: int = 8192  # max tokens per MoE (feed-forward) batch
    max_num_seqs: int = 256  # sequences resident in the engine (over-subscription bound)
    max_prefill_tokens: int = 4096
    refill_threshold: float = 0.5  # refill prompts when decoding sequences fall under this share
    max_model_len: int | None = None  # None = the checkpoint's context length
    seed: int = 0

    @classmethod
    def from_kwargs(cls, base: EngineConfig | None = None, **overrides: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(base or cls(), **overrides)


def available_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
