"""The units in which a model's weights stream from the host store to the device (memory-constrained mode).

A module unit is a module whose parameters move as one block: an attention module, a dense MLP, a shared
expert, the LM head, and in "layer" streaming (the FlexGen-style baseline) a whole feed-forward block with
all its experts. In "expert" streaming each routed expert is its own unit, fetched only when the step's
COMBINE-d MoE batch routes a token to it. Every parameter outside the units (norms, routers, gates) is
small and always on the device; the embedding table never needs the device (rows are looked up on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.engine.config import WEIGHT_STREAMING
from batchgen.engine.models.layers import FusedExperts, SparseMoE

ALIGN = 64  # bytes: each tensor of a unit starts at this alignment in its slot


@dataclass(frozen=True)
class ModuleUnit:
    name: str  # "layers.3.attn", "layers.3.mlp", "layers.3.shared_expert", "lm_head"
    module: nn.Module
    nbytes: int  # its parameters laid out in a slot, each aligned
    host: tuple[torch.Tensor, ...] = ()  # the host copies of its parameters, once it streams


@dataclass(frozen=True)
class ExpertLayer:
    """A MoE layer's routed experts, each streamed alone (or all resident)."""

    layer: int
    experts: FusedExperts
    expert_bytes: int  # one expert's gate_up and down rows

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.experts.num_local_experts


@dataclass(frozen=True)
class WeightUnits:
    modules: tuple[ModuleUnit, ...]  # in residency priority: attention, dense / shared MLPs, LM head
    expert_layers: tuple[ExpertLayer, ...]  # empty in "layer" streaming (the experts are in module units)
    fixed: tuple[nn.Parameter, ...]  # always on the device
    embedding: nn.Parameter  # looked up in host memory unless the LM head shares it and is resident
    total_bytes: int  # every distinct weight of the model


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def aligned_bytes(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def module_bytes(module: nn.Module) -> int:
    return sum(aligned_bytes(tensor_bytes(p)) for p in module.parameters())


def weight_units(model: nn.Module, granularity: str) -> WeightUnits:
    """Cut `model` (a DecoderLM) into streaming units."""
    if granularity not in WEIGHT_STREAMING:
        raise ValueError(f"weight streaming must be one of {WEIGHT_STREAMING}, got {granularity!r}")
    attention, mlps, expert_layers = [], [], []
    for index, layer in enumerate(model.layers):
        attention.append(ModuleUnit(f"layers.{index}.attn", layer.attn.self_attn,
                                    module_bytes(layer.attn.self_attn)))
        mlp = layer.ffn.mlp
        if granularity == "layer" or not isinstance(mlp, SparseMoE):
            mlps.append(ModuleUnit(f"layers.{index}.mlp", mlp, module_bytes(mlp)))
            continue
        experts = mlp.experts
        per_expert = (tensor_bytes(experts.gate_up_proj) + tensor_bytes(experts.down_proj)) // experts.num_local_experts
        expert_layers.append(ExpertLayer(index, experts, per_expert))
        if mlp.shared_expert is not None:
            mlps.append(ModuleUnit(f"layers.{index}.shared_expert", mlp.shared_expert,
                                   module_bytes(mlp.shared_expert)))
    head = ModuleUnit("lm_head", model.lm_head, module_bytes(model.lm_head))
    modules = (*attention, *mlps, head)
    in_units = {id(p) for unit in modules for p in unit.module.parameters()}
    in_units |= {id(p) for layer in expert_layers for p in layer.experts.parameters()}
    embedding = model.embed_tokens.weight
    in_units.add(id(embedding))
    distinct = {id(p): p for p in model.parameters()}
    fixed = tuple(p for key, p in distinct.items() if key not in in_units)
    return WeightUnits(modules, tuple(expert_layers), fixed, embedding,
                       sum(tensor_bytes(p) for p in distinct.values()))
