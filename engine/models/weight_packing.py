"""A model's weights repacked for the CPU register-tile kernels where those kernels compute them: routed experts
for kernels/moe_packed_cpu.py, projections (attention, dense MLPs, the LM head) for kernels/linear_packed_cpu.py.

A resident engine packs its model once, in place, before profiling it: a float32 model on the CPU whose fused_moe
(linear) runs on the C kernels, with widths the packed blocks divide. Any engine on the same loaded model then finds
it packed; its experts (and the CPU slots a later memory-constrained engine streams them through) run on
kernels.ops.fused_moe_packed, its projections on kernels.ops.linear_packed. A memory-constrained engine does not
pack: its host weights may be a file the node's processes share (connectors/host_memory.py), whose pages a
repacking would write or copy."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.models.layers import FusedExperts, GatedMLP, GQAAttention, Linear
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.kernels import linear_packed_cpu, moe_packed_cpu, registry


def packing_refusal(loaded: LoadedModel) -> str | None:
    """Why `loaded`'s experts stay in the checkpoint layout, or None."""
    return _refusal(loaded, "fused_moe", moe_packed_cpu.unavailable)


def projection_refusal(loaded: LoadedModel) -> str | None:
    """Why `loaded`'s projections stay in the checkpoint layout, or None."""
    return _refusal(loaded, "linear", linear_packed_cpu.unavailable)


def _refusal(loaded: LoadedModel, op: str, kernel_unavailable) -> str | None:
    """Why `loaded`'s weights that `op` computes are not packed for its packed kernel (`kernel_unavailable()`: why
    that kernel cannot run here), or None."""
    if loaded.host_weights_shared:
        return "its weights are a file mapping the node's processes share"
    if loaded.weight_placement != "resident":
        return f"its weights are placed for streaming ({loaded.weight_placement})"
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return f"the packed kernels take float32 CPU tensors, the model is {loaded.dtype} on {loaded.device.type}"
    name = registry.resolve(op, "cpu", torch.float32)[0]
    if name != "cpu_c":
        return f"{op} runs on the {name} backend"
    return kernel_unavailable()


def pack_experts(loaded: LoadedModel) -> None:
    """Pack the routed-expert modules of `loaded` (in place), all of them or, when one's widths do not divide the
    kernel's blocks, none (the weight streamer's slots take one layout)."""
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    widths = [(m.down_proj.shape[1], m.down_proj.shape[2]) for m in experts if not m.packed]
    if packing_refusal(loaded) is None and all(moe_packed_cpu.packing_refusal(*w) is None for w in widths):
        for module in experts:
            module.pack_for_cpu()


def packable_projections(model: nn.Module) -> list[Linear]:
    """The projections of `model` only their own forward reads: attention's (GQA; MLA reads its kv_b_proj's weight
    itself), dense MLPs' and the LM head, unless its weight is also another parameter (tied embeddings); those whose
    output width the packed blocks divide."""
    owners = [m for m in model.modules() if isinstance(m, GQAAttention | GatedMLP)]
    linears = [c for m in owners for c in m.children() if type(c) is Linear]
    head = getattr(model, "lm_head", None)
    if type(head) is Linear and not any(p is head.weight for n, p in model.named_parameters(remove_duplicate=False)
                                        if not n.startswith("lm_head.")):
        linears.append(head)
    return [m for m in linears if m.packed or linear_packed_cpu.packing_refusal(m.weight) is None]


def pack_projections(loaded: LoadedModel) -> None:
    """Pack `loaded`'s packable projections (in place) for kernels.ops.linear_packed, where it runs."""
    if projection_refusal(loaded) is None:
        for module in packable_projections(loaded.model):
            module.pack_for_cpu()


def experts_packed(loaded: LoadedModel) -> bool:
    """Whether an engine packed `loaded`'s experts (they compute on the CPU kernel only)."""
    return any(m.packed for m in loaded.model.modules() if isinstance(m, FusedExperts))


def projections_packed(model: nn.Module) -> bool:
    """Whether an engine packed projections of `model` (they compute on the CPU kernel only)."""
    return any(m.packed for m in model.modules() if isinstance(m, Linear))
