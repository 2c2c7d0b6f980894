"""A model's routed experts repacked for the CPU MoE kernel (kernels/moe_packed_cpu.py) when that kernel computes them.

A resident engine packs its model once, in place, before profiling it: a float32 model on the CPU whose fused_moe
runs on the C kernels, with expert widths the packed blocks divide. Any engine on the same loaded model then finds it
packed; its experts (and the CPU slots a later memory-constrained engine streams them through) run on
kernels.ops.fused_moe_packed. A memory-constrained engine does not pack: its host weights may be a file the node's
processes share (connectors/host_memory.py), whose pages a repacking would write or copy."""

from __future__ import annotations

import torch

from batchgen.engine.models.layers import FusedExperts
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.kernels import moe_packed_cpu, registry


def packing_refusal(loaded: LoadedModel) -> str | None:
    """Why `loaded`'s experts stay in the checkpoint layout, or None."""
    if loaded.host_weights_shared:
        return "its weights are a file mapping the node's processes share"
    if loaded.weight_placement != "resident":
        return f"its weights are placed for streaming ({loaded.weight_placement})"
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return f"the packed kernel takes float32 CPU tensors, the model is {loaded.dtype} on {loaded.device.type}"
    name = registry.resolve("fused_moe", "cpu", torch.float32)[0]
    if name != "cpu_c":
        return f"fused_moe runs on the {name} backend"
    return moe_packed_cpu.unavailable()


def pack_experts(loaded: LoadedModel) -> None:
    """Pack the routed-expert modules of `loaded` (in place), all of them or, when one's widths do not divide the
    kernel's blocks, none (the weight streamer's slots take one layout)."""
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    widths = [(m.down_proj.shape[1], m.down_proj.shape[2]) for m in experts if not m.packed]
    if packing_refusal(loaded) is None and all(moe_packed_cpu.packing_refusal(*w) is None for w in widths):
        for module in experts:
            module.pack_for_cpu()


def experts_packed(loaded: LoadedModel) -> bool:
    """Whether an engine packed `loaded`'s experts (they compute on the CPU kernel only)."""
    return any(m.packed for m in loaded.model.modules() if isinstance(m, FusedExperts))
