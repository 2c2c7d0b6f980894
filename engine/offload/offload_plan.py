"""How a device-memory budget is spent when the model does not fit: a pure function of the units and sizes.

The budget (`EngineConfig.device_memory_bytes`) holds, in this order of need: the always-resident small
weights, the activations of one feed-forward batch (which sets B_moe), the slot rings weights stream through
(a few expert slots, and slots as large as the largest streamed module), the KV of one longest sequence.
What is left is shared: up to RESIDENT_SHARE of it goes to more expert slots (wider MoE windows), then keeps
modules resident (attention first: every token of every step reads it; then dense / shared MLPs, the LM head,
then whole layers of experts); the rest is KV pages, which is what lets the coroutines batch. An explicit KV
budget is taken as given instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.engine.offload.weight_units import WeightUnits, tensor_bytes

RESIDENT_SHARE = 0.5
ACTIVATION_SHARE = 0.1  # of the budget, for the feed-forward batch when B_moe is not given
MAX_B_MOE = 8192
EXPERT_SLOTS = 8  # at most, when the budget has room: a MoE call runs a window of this many experts at once
# fewest slots per ring: on CUDA one loads the next module or window while the other computes; one elsewhere
MIN_SLOTS = {"cuda": 2}


@dataclass(frozen=True)
class OffloadPlan:
    budget_bytes: int
    resident_modules: frozenset[str]  # ModuleUnit names kept on the device
    resident_expert_layers: frozenset[int]
    fixed_bytes: int
    resident_bytes: int  # resident modules and expert layers (fixed weights apart)
    module_slots: int
    module_slot_bytes: int
    expert_slots: int
    expert_slot_bytes: int
    activation_bytes: int
    kv_bytes: int
    b_moe: int

    @property
    def ring_bytes(self) -> int:
        return self.module_slots * self.module_slot_bytes + self.expert_slots * self.expert_slot_bytes

    @property
    def weight_bytes(self) -> int:
        """Weights on the device at any moment: fixed, resident and the slots they stream through."""
        return self.fixed_bytes + self.resident_bytes + self.ring_bytes


def plan_offload(units: WeightUnits, budget: int, device_type: str, activation_bytes_per_token: int,
                 min_kv_bytes: int, b_moe: int | None = None, kv_bytes: int | None = None) -> OffloadPlan:
    """Split `budget` bytes of device memory; ValueError naming the minimum when it cannot hold the fixed
    weights, the fewest slots of each ring, one feed-forward token's activations and `min_kv_bytes`."""
    fixed = sum(tensor_bytes(p) for p in units.fixed)
    module_slots = MIN_SLOTS.get(device_type, 1)
    local_experts = max((e.experts.num_local_experts for e in units.expert_layers), default=0)
    expert_slot = max((e.expert_bytes for e in units.expert_layers), default=0)

    def rings(p: _Placement) -> int:
        streamed = [u.nbytes for u in units.modules if u.name not in p.modules]
        experts_streamed = len(p.expert_layers) < len(units.expert_layers)
        return module_slots * max(streamed, default=0) + (p.expert_slots * expert_slot if experts_streamed else 0)

    sizes = {u.name: u.nbytes for u in units.modules} | {e.layer: e.nbytes for e in units.expert_layers}

    def weights(p: _Placement) -> int:
        """Resident weights and slots (the fixed weights apart)."""
        return sum(sizes[k] for k in p.modules | p.expert_layers) + rings(p)

    # the lightest start: with two slots a ring (CUDA), keeping the largest modules resident (an LM head of a large
    # vocabulary) can take less than their slots would; what the minimum and an explicit KV budget are checked
    # against. Of equally light ones, the one that streams the least.
    largest_first = sorted(units.modules, key=lambda u: -u.nbytes)
    starts = [_Placement(frozenset(u.name for u in largest_first[:k]), frozenset(), min(module_slots, local_experts))
              for k in range(len(largest_first) + 1)]
    state = min(starts, key=lambda p: (weights(p), -len(p.modules)))

    floor = fixed + weights(state) + min_kv_bytes
    if b_moe is None:  # a share of the budget, or what is left above the minimum if that is less
        share = min(int(budget * ACTIVATION_SHARE), budget - floor)
        b_moe = max(1, min(MAX_B_MOE, share // activation_bytes_per_token))
    activation = b_moe * activation_bytes_per_token
    if budget < floor + activation:
        detail = (f"fixed weights {_mb(fixed)}, weight slots {_mb(rings(state))}, KV of one longest sequence "
                  f"{_mb(min_kv_bytes)}, activations {_mb(activation_bytes_per_token)} per token")
        minimum = floor + activation_bytes_per_token
        if budget < minimum:
            raise ValueError(f"device_memory_bytes {budget} ({_mb(budget)}) is below this model's minimum of "
                             f"{minimum} ({_mb(minimum)}): {detail}")
        raise ValueError(f"device_memory_bytes {budget} ({_mb(budget)}) cannot hold b_moe {b_moe} tokens' "
                         f"activations ({_mb(activation)}) beside {detail}")
    if kv_bytes is not None and budget < fixed + weights(state) + activation + kv_bytes:
        raise ValueError(f"kv_budget_bytes {kv_bytes} does not fit in device_memory_bytes {budget} beside "
                         f"{_mb(fixed + weights(state) + activation)} of weights, slots and activations")
    # what resident weights and extra slots may take beyond the minimum's
    if kv_bytes is None:
        allowance = weights(state) + int((budget - floor - activation) * RESIDENT_SHARE)
    else:
        allowance = budget - fixed - activation - kv_bytes
    # each step grows the placement, taken when it fits: wider expert windows (a ring's fewest slots at a time: on
    # CUDA one half of the slots computes while the other loads, so an odd slot would never be used), then modules
    # in priority order, then whole expert layers
    steps = [lambda p, n=n: dataclasses.replace(p, expert_slots=n)
             for n in range(state.expert_slots + module_slots, min(EXPERT_SLOTS, local_experts) + 1, module_slots)]
    steps += [lambda p, name=u.name: dataclasses.replace(p, modules=p.modules | {name}) for u in units.modules]
    steps += [lambda p, layer=e.layer: dataclasses.replace(p, expert_layers=p.expert_layers | {layer})
              for e in units.expert_layers]
    peak = weights(state)  # the heaviest placement the walk passes through
    for step in steps:
        trial = step(state)
        if weights(trial) <= allowance:
            state = trial
            peak = max(peak, weights(trial))
    experts_streamed = len(state.expert_layers) < len(units.expert_layers)
    streamed_modules = [u.nbytes for u in units.modules if u.name not in state.modules]
    resident = weights(state) - rings(state)
    return OffloadPlan(
        budget_bytes=budget,
        resident_modules=state.modules,
        resident_expert_layers=state.expert_layers,
        fixed_bytes=fixed,
        resident_bytes=resident,
        module_slots=module_slots if streamed_modules else 0,
        module_slot_bytes=max(streamed_modules, default=0),
        expert_slots=state.expert_slots if experts_streamed else 0,
        expert_slot_bytes=expert_slot if experts_streamed else 0,
        activation_bytes=activation,
        # the KV what is left beside the walk's heaviest placement, not its last: a walk can pass through a heavier
        # one (the last streamed module made resident frees its slots), and the plan's own KV budget given back
        # (every engine actor of a job gets it) must let the same walk through to the same placement
        kv_bytes=budget - fixed - activation - peak if kv_bytes is None else kv_bytes,
        b_moe=b_moe,
    )


@dataclass(frozen=True)
class _Placement:
    modules: frozenset[str]
    expert_layers: frozenset[int]
    expert_slots: int


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
