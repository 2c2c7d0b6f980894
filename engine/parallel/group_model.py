"""What makes one rank's model part of an engine over several ranks. Expert parallel: its MoE layers dispatch
through the group, and its steps make as many MoE calls as every other rank's. Tensor parallel: its attention
and feed-forward blocks sum their partial outputs over the ranks."""

from __future__ import annotations

import torch

from batchgen.engine.models.layers import AttentionBlock, FeedForwardBlock, FusedExperts
from batchgen.engine.parallel.rank_group import RankGroup
from batchgen.kernels.expert_parallel import make_dispatcher


def attach_dispatchers(model: torch.nn.Module, group: RankGroup, device: torch.device, dtype: torch.dtype) -> None:
    """Route every MoE layer's tokens through the group (all-to-all; DeepEP on CUDA when installed and the model
    runs in bfloat16, the only activation type its kernels take). The model must hold this rank's share of the
    experts (connectors' load_model(expert_shard=(rank, ranks)))."""
    backend = "auto" if dtype == torch.bfloat16 else "all_to_all"
    dispatchers = {}  # one per expert count: DeepEP buffers are large, every layer shares one
    for name, module in model.named_modules():
        if not isinstance(module, FusedExperts):
            continue
        local = module.num_experts // group.size
        if module.num_local_experts * group.size != module.num_experts or module.first_expert != group.rank * local:
            raise ValueError(
                f"{name} holds experts {module.first_expert}..{module.first_expert + module.num_local_experts - 1} "
                f"of {module.num_experts}; rank {group.rank} of {group.size} needs {group.rank * local}.."
                f"{(group.rank + 1) * local - 1} (load the model with expert_shard=({group.rank}, {group.size}))"
            )
        if module.num_experts not in dispatchers:
            dispatchers[module.num_experts] = make_dispatcher(module.num_experts, backend, group.data, device,
                                                           exchange=group)
        module.dispatcher = dispatchers[module.num_experts]


class FfnCallAgreement:
    """Each step, every rank's feed-forward calls per layer -> the most any rank makes (one small all-reduce),
    so every rank makes that many, empty ones included, and the MoE collectives pair up."""

    def __init__(self, group: RankGroup):
        self.group = group

    def __call__(self, local_calls: int) -> int:
        return int(self.group.all_reduce(torch.tensor([local_calls], dtype=torch.int64), op="max").item())


def attach_partial_sums(model: torch.nn.Module, group: RankGroup) -> None:
    """Have every attention and feed-forward block all-reduce its output before the residual: the model holds
    this rank's heads and columns (load_model(tensor_shard=(rank, ranks)))."""
    for module in model.modules():
        if isinstance(module, (AttentionBlock, FeedForwardBlock)):
            module.sum_over_ranks = group.all_reduce
