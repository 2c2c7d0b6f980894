"""Memory-constrained mode: the model's weights live in host memory, and what the device budget cannot keep
resident streams through rings of device slots just before it computes.

Module units (attention, dense or shared MLPs, the LM head; whole feed-forward blocks in "layer" streaming)
are bound to a slot by forward hooks: the parameters point at the slot while the module runs and back at the
host copy after, so the model's code does not change. Routed experts stream one by one: a MoE call fetches
only the experts its COMBINE-d batch routes tokens to, a window of slots at a time, and runs the fused MoE
kernel on the window with the routing remapped to slots, so a large batch pays one fetch per expert per layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from batchgen.engine.offload.offload_plan import OffloadPlan
from batchgen.engine.offload.phase_switch import PhaseSwitch
from batchgen.engine.offload.slot_copies import SlotCopies
from batchgen.engine.offload.weight_units import ExpertLayer, ModuleUnit, WeightUnits, aligned_bytes
from batchgen.kernels import registry
from batchgen.kernels.moe_torch import accumulate_moe


class ModuleRing:
    """Streamed module units and the slots they take turns in (least recently used slot reloaded)."""

    def __init__(self, units: list[ModuleUnit], slots: int, slot_bytes: int, device: torch.device):
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.holds: list[str | None] = [None] * slots
        self.last_used = [0] * slots
        self.clock = 0
        self.copies = SlotCopies(device, slots)
        order = sorted(units, key=_program_order)
        self.next = {a.name: b for a, b in zip(order, order[1:])}
        self._bound: dict[str, int] = {}
        self._slot_views: dict[tuple[str, int], list[torch.Tensor]] = {}  # made once per unit and slot
        for unit in units:
            unit.module.register_forward_pre_hook(functools.partial(self._bind, unit))
            unit.module.register_forward_hook(functools.partial(self._unbind, unit))

    def _bind(self, unit: ModuleUnit, module: nn.Module, args) -> None:
        slot = self._fetch(unit)
        self.copies.wait(slot)
        for param, view in zip(unit.module.parameters(), self._views(unit, slot)):
            param.data = view
        self._bound[unit.name] = slot
        following = self.next.get(unit.name)
        if following is not None and len(self.buffers) > 1 and following.name not in self.holds:
            self._fetch(following, avoid=slot)  # on CUDA it loads while this unit computes

    def _unbind(self, unit: ModuleUnit, module: nn.Module, args, output) -> None:
        for param, host in zip(unit.module.parameters(), unit.host):
            param.data = host
        self.copies.release(self._bound.pop(unit.name))

    def _fetch(self, unit: ModuleUnit, avoid: int = -1) -> int:
        self.clock += 1
        if unit.name in self.holds:
            slot = self.holds.index(unit.name)
        else:
            slot = min((s for s in range(len(self.buffers)) if s != avoid), key=self.last_used.__getitem__)
            self.holds[slot] = unit.name
            self.copies.load(slot, list(zip(self._views(unit, slot), unit.host)))
        self.last_used[slot] = self.clock
        return slot

    def _views(self, unit: ModuleUnit, slot: int) -> list[torch.Tensor]:
        key = (unit.name, slot)
        if key not in self._slot_views:
            buffer, offset, views = self.buffers[slot], 0, []
            for host in unit.host:
                nbytes = host.numel() * host.element_size()
                views.append(buffer[offset : offset + nbytes].view(host.dtype).view(host.shape))
                offset += aligned_bytes(nbytes)
            self._slot_views[key] = views
        return self._slot_views[key]


class ExpertRing:
    """Expert slots shaped like one expert's weights; a MoE call streams its routed experts through them in
    windows: on CUDA the slots are two halves, the next window loading into one while the other computes.
    A slot still holding the expert it needs (the same layer's previous call: a step's feed-forward batches
    of up to B_moe tokens each route to much the same experts) is not loaded again, and a window its slots
    already hold goes first."""

    def __init__(self, layers: list[ExpertLayer], slots: int, device: torch.device):
        first = layers[0].experts
        self.gate_up = first.gate_up_proj.new_empty((slots, *first.gate_up_proj.shape[1:]), device=device)
        self.down = first.down_proj.new_empty((slots, *first.down_proj.shape[1:]), device=device)
        self.copies = SlotCopies(device, slots)
        self.halves = 2 if device.type == "cuda" and slots > 1 else 1
        self.window = slots // self.halves
        self.holds: list[tuple[int, int] | None] = [None] * slots  # (layer, expert) in each slot
        self.reused = 0  # expert loads saved: the slot already held that expert
        # the torch backend sums in float32 and rounds once: its windows' sums are added before that rounding (each
        # window rounded apart, a bf16 model's output differed from the resident model's even with top-2 routing)
        backend = registry.resolve("fused_moe", device.type, first.gate_up_proj.dtype)[0]
        self.accumulate = accumulate_moe if backend == "torch" and not first.packed else None

    def run(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' op (ops.fused_moe, or fused_moe_packed on packed experts) over the layer's experts, each routed
        expert fetched at most once. Each window holds consecutive experts in expert order and the windows' results are
        summed (before the rounding to the model's dtype where the backend sums in float32: torch's). When a call's
        routed experts fit one window, or with the torch backend and top-2 routing (in any window order), that is the
        resident computation exactly; with more experts per token in another window the partial sums associate
        differently, and the CPU kernel fuses each expert's multiply-add into its sum, so its windows' sums differ from
        one call's in the last bit."""
        experts = layer.experts
        routed = torch.unique(topk_ids[topk_ids >= 0]).tolist()
        windows = [routed[i : i + self.window] for i in range(0, len(routed), self.window)]
        if not windows:
            return torch.zeros_like(x)
        plan = self._place(layer.layer, windows)
        slot_of = torch.full((experts.num_local_experts,), -1, dtype=topk_ids.dtype, device=topk_ids.device)
        self._load(layer, *plan[0])
        out = None if self.accumulate is None else torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for i, (window, start) in enumerate(plan):
            if self.halves == 2 and i + 1 < len(plan):
                self._load(layer, *plan[i + 1])
            end = start + len(window)
            for slot in range(start, end):
                self.copies.wait(slot)
            slot_of.fill_(-1)
            slot_of[window] = torch.arange(len(window), dtype=topk_ids.dtype, device=topk_ids.device)
            ids = torch.where(topk_ids >= 0, slot_of[topk_ids.clamp(min=0)], topk_ids)
            if self.accumulate is not None:
                self.accumulate(out, x, self.gate_up[start:end], self.down[start:end], topk_weights, ids)
            else:
                part = experts.moe(x, self.gate_up[start:end], self.down[start:end], topk_weights, ids)
                out = part if out is None else out + part
            for slot in range(start, end):
                self.copies.release(slot)
            if self.halves == 1 and i + 1 < len(plan):
                self._load(layer, *plan[i + 1])
        return out if self.accumulate is None else out.to(x.dtype)

    def _place(self, layer: int, windows: list[list[int]]) -> list[tuple[list[int], int]]:
        """(window, first slot) in run order: a window some half of the slots holds entirely runs first, there;
        the others alternate between the halves (never the half the previous window computes in)."""
        starts = [h * self.window for h in range(self.halves)]

        def holder(window: list[int]) -> int | None:
            return next((s for s in starts if self.holds[s : s + len(window)] == [(layer, e) for e in window]), None)

        holders = [holder(w) for w in windows]
        plan = [(w, h) for w, h in zip(windows, holders) if h is not None]
        previous = plan[-1][1] if plan else None
        for window, held in zip(windows, holders):
            if held is None:
                start = next(s for s in starts if s != previous or self.halves == 1)
                plan.append((window, start))
                previous = start
        return plan

    def _load(self, layer: ExpertLayer, window: list[int], start: int) -> None:
        experts = layer.experts
        for offset, expert in enumerate(window):
            slot = start + offset
            if self.holds[slot] == (layer.layer, expert):
                self.reused += 1
                continue
            self.holds[slot] = (layer.layer, expert)
            self.copies.load(slot, [(self.gate_up[slot], experts.gate_up_proj[expert]),
                                    (self.down[slot], experts.down_proj[expert])])


class WeightStreamer:
    """Places a loaded model for `plan`: fixed and resident weights on `device`, the rest in host memory (pinned
    on CUDA) behind the rings. Counts the bytes and seconds the streaming costs."""

    def __init__(self, units: WeightUnits, plan: OffloadPlan, device: torch.device, activation_bytes_per_token: int):
        self.plan = plan
        self.device = device
        self.activation_bytes_per_token = activation_bytes_per_token
        self._cuda_base = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self._cuda_base = torch.cuda.memory_allocated(device)
        for param in units.fixed:
            _place(param, device)
        streamed_modules = []
        for unit in units.modules:
            if unit.name in plan.resident_modules:
                for param in unit.module.parameters():
                    _place(param, device)
            else:
                for param in unit.module.parameters():
                    _host(param, device)
                streamed_modules.append(ModuleUnit(unit.name, unit.module, unit.nbytes,
                                                   tuple(p.data for p in unit.module.parameters())))
        streamed_experts = []
        for layer in units.expert_layers:
            for param in layer.experts.parameters():
                (_place if layer.layer in plan.resident_expert_layers else _host)(param, device)
            if layer.layer not in plan.resident_expert_layers:
                streamed_experts.append(layer)
        if units.embedding.device != device:  # not the table of a resident tied LM head
            _host(units.embedding, device)
        self.modules = (ModuleRing(streamed_modules, plan.module_slots, plan.module_slot_bytes, device)
                        if streamed_modules else None)
        self.experts = ExpertRing(streamed_experts, plan.expert_slots, device) if streamed_experts else None
        for layer in streamed_experts:
            layer.experts.streamed = functools.partial(self.experts.run, layer)

    def forget(self) -> None:
        """Let go of what every slot holds, so each streamed unit's next use loads it again: as a step meets it, the
        slots having held other units since (what a profile of the placed model must time)."""
        for ring in (self.modules, self.experts):
            if ring is not None:
                ring.holds = [None] * len(ring.holds)

    def memory(self, kv, max_ffn_tokens: int, phases: PhaseSwitch | None = None) -> dict:
        """Device bytes by use, and their peak: the allocator's statistics on CUDA, this accounting elsewhere
        (weights and slots, the device KV pool as allocated, and the most any step held of staging pages and
        feed-forward activations together: with phase switching a prefill step's larger batch uses the staging
        pool's bytes)."""
        plan = self.plan
        pages, staging = kv.device.nbytes(kv.device.num_pages), kv.stage.nbytes(kv.stage.num_pages)
        kv_bytes = pages + staging
        activations = max_ffn_tokens * self.activation_bytes_per_token
        step_bytes = staging + activations if phases is None else phases.peak_bytes
        peak = plan.weight_bytes + pages + step_bytes
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        rings = [r.copies for r in (self.modules, self.experts) if r is not None]
        seconds = [c.seconds() for c in rings]
        return {"budget_bytes": plan.budget_bytes, "peak_bytes": peak,
                "resident_weight_bytes": plan.fixed_bytes + plan.resident_bytes, "slot_bytes": plan.ring_bytes,
                "kv_bytes": kv_bytes, "activation_bytes": activations,
                "weight_bytes_streamed": sum(c.bytes for c in rings),
                "weight_copies": sum(c.copies for c in rings),
                "expert_loads_reused": self.experts.reused if self.experts is not None else 0,
                # copying, and of that the time the computation waited for a copy (all of it on CPU; on CUDA the
                # rest was hidden behind compute)
                "weight_stream_seconds": sum(copy for copy, _ in seconds),
                "weight_stream_exposed_seconds": sum(stall for _, stall in seconds),
                "phase_switches": phases.switches if phases is not None else 0,
                "prefill_b_moe": phases.prefill_b_moe if phases is not None else plan.b_moe}


def _program_order(unit: ModuleUnit) -> tuple[float, int]:
    """Where a unit runs in a forward: by layer, attention before the feed-forward, the LM head last."""
    parts = unit.name.split(".")
    if parts[0] != "layers":
        return (float("inf"), 0)
    return (int(parts[1]), 0 if parts[2] == "attn" else 1)


def _place(param: nn.Parameter, device: torch.device) -> None:
    if param.device != device:
        param.data = param.data.to(device)


def _host(param: nn.Parameter, device: torch.device) -> None:
    """Keep `param` in host memory, pinned when it streams to a CUDA device (asynchronous copies need it)."""
    if param.device.type != "cpu":
        param.data = param.data.cpu()
    if device.type == "cuda" and not param.data.is_pinned():
        param.data = param.data.pin_memory()
