"""An engine's device-memory budget turned into a weight placement and the KV and MoE settings that go with it."""

from __future__ import annotations

import dataclasses
import math

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_budget import activation_bytes_per_token
from batchgen.engine.kv_pool import PoolGeometry
from batchgen.engine.models.expert_packing import experts_packed, pack_experts
from batchgen.engine.models.layers import SparseMoE
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.offload.offload_plan import OffloadPlan, plan_offload
from batchgen.engine.offload.weight_streamer import WeightStreamer
from batchgen.engine.offload.weight_units import WeightUnits, weight_units
from batchgen.engine.planner.planner import FIXED

RESERVE_PAGES = 2  # the KV manager keeps this many device pages free beside any sequence


def offload_plan(loaded: LoadedModel, config: EngineConfig, device_type: str) -> tuple[WeightUnits, OffloadPlan, int]:
    """The units of `loaded`, how `config.device_memory_bytes` is spent on them, and the activation bytes per
    feed-forward token that plan assumed."""
    model = loaded.model
    units = weight_units(model, config.weight_streaming)
    top_k = max((m.gate.top_k for m in model.modules() if isinstance(m, SparseMoE)), default=1)
    per_token = activation_bytes_per_token(loaded, top_k)
    max_len = loaded.context_length(config.max_model_len)
    geometry = PoolGeometry(model.kv_spec(), config.page_size, loaded.dtype)
    # the longest sequence's pages on the device beside the staging pool, which coroutine mode takes out of the same
    # budget (the planner picks no larger share than the fixed settings' where a larger one would leave it no room):
    # a budget at the minimum refused it otherwise
    staging = 0.0
    if config.mode == "coroutine":
        staging = FIXED["staging_fraction"] if config.staging_fraction is None else config.staging_fraction
    min_kv = geometry.page_bytes * (geometry.pages_for(max_len) + RESERVE_PAGES)
    if staging < 1:  # (all of it staging: the longest sequence decodes through it)
        min_kv = math.ceil(min_kv / (1 - staging))
    plan = plan_offload(units, config.device_memory_bytes, device_type, per_token, min_kv, config.b_moe,
                        config.kv_budget_bytes)
    return units, plan, per_token


def stream_weights(loaded: LoadedModel, config: EngineConfig, device: torch.device
                   ) -> tuple[WeightStreamer, EngineConfig]:
    """Place `loaded` (in host memory) for `config.device_memory_bytes` on `device`; the config comes back with
    the device KV budget and B_moe the plan gives (explicit values kept) and host KV streamed through staging."""
    if loaded.weight_placement != "resident":
        raise ValueError(f"this loaded model's weights are already placed ({loaded.weight_placement}); load the "
                         "model again for another memory-constrained engine")
    if device.type != "cpu" and experts_packed(loaded):
        raise ValueError(f"this loaded model's experts were packed for the CPU kernel by an engine on it; load the "
                         f"model again for a memory-constrained engine on {device.type}")
    units, plan, per_token = offload_plan(loaded, config, device.type)
    streamer = WeightStreamer(units, plan, device, per_token)
    loaded.streamer = streamer
    loaded.weight_placement = (f"streamed by {config.weight_streaming}, {plan.budget_bytes} device bytes, "
                               f"{len(plan.resident_modules)} modules and {len(plan.resident_expert_layers)} expert "
                               f"layers resident, {plan.expert_slots} expert slots")
    return streamer, dataclasses.replace(config, kv_budget_bytes=plan.kv_bytes, b_moe=plan.b_moe,
                                         stream_host_kv=True)


def place_as_engine(loaded: LoadedModel, config: EngineConfig) -> tuple[WeightStreamer | None, EngineConfig]:
    """`loaded` placed as an Engine with `config` places it (resident: its experts packed for the CPU kernel where it
    computes them; for a device memory budget: weights streamed from host memory as they are, which the node's
    processes may share) and the config that then holds: what a plan made outside an engine (a job's, `batchgen
    plan`) must profile and start from, or the engines it plans for refuse its settings."""
    if config.device_memory_bytes is None:
        pack_experts(loaded)
        return None, config
    return stream_weights(loaded, config, config.torch_device())
