"""How many bytes each KV tier gets when the user did not say: a pure function of the config,
the model's cache geometry and the memory that is free."""

from __future__ import annotations

import os

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_manager import KVBudget
from batchgen.engine.models.context import KVSpec


def plan_kv_budget(config: EngineConfig, spec: KVSpec, dtype: torch.dtype, max_model_len: int,
                   device: torch.device, stream_host: bool) -> KVBudget:
    """Explicit budgets win; otherwise what `max_num_seqs` full contexts need, capped by a modest share
    of free memory (several engine actors may share one node)."""
    token_bytes = spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * dtype.itemsize
    wanted = token_bytes * config.max_num_seqs * max_model_len
    share = 0.5 if device.type == "cuda" else 0.05
    device_bytes = config.kv_budget_bytes or min(wanted, int(available_memory_bytes(device) * share))
    host_bytes = config.host_kv_budget_bytes or min(wanted, int(available_memory_bytes(torch.device("cpu")) * 0.05))
    if config.mode != "coroutine" or not stream_host:  # no staging pool: nothing streams through one
        return KVBudget(device_bytes, host_bytes, 0)
    staging = int(device_bytes * config.staging_fraction) if config.kv_budget_bytes else 0
    if not staging:
        staging = min(int(device_bytes * 0.05), token_bytes * max_model_len * config.b_attn)
    return KVBudget(device_bytes, host_bytes, staging)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
