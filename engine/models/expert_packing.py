"""A model's routed experts repacked for the CPU MoE kernel (kernels/moe_packed_cpu.py) when that kernel computes them.

The engine packs its model once, in place, before placing or profiling it: a float32 model on the CPU whose
fused_moe runs on the C kernels, with expert widths the packed tiles divide. Any engine on the same loaded model then
finds it packed; its experts (and the slots memory-constrained mode streams them through) run on
kernels.ops.fused_moe_packed."""

from __future__ import annotations

import torch

from batchgen.engine.models.layers import FusedExperts
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.kernels import moe_packed_cpu, registry


def packing_refusal(loaded: LoadedModel) -> str | None:
    """Why `loaded`'s experts stay in the checkpoint layout, or None."""
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return f"the packed kernel takes float32 CPU tensors, the model is {loaded.dtype} on {loaded.device.type}"
    name = registry.resolve("fused_moe", "cpu", torch.float32)[0]
    if name != "cpu_c":
        return f"fused_moe runs on the {name} backend"
    return moe_packed_cpu.unavailable()


def pack_experts(loaded: LoadedModel) -> int:
    """Pack every routed-expert module of `loaded` the packed kernel can take (in place); returns how many are packed
    now."""
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    if packing_refusal(loaded) is None:
        for module in experts:
            if not module.packed and moe_packed_cpu.packing_refusal(module.down_proj.shape[1],
                                                                   module.down_proj.shape[2]) is None:
                module.pack_for_cpu()
    return sum(module.packed for module in experts)
