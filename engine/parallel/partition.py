"""PARTITION: the last request of an expert-parallel engine decodes on every rank at once.

Expert parallel, a rank attends only over its own sequences, so when one request is left the other ranks
only serve their experts while one rank reads every attention weight and the LM head alone. A partition
lends that request every rank: each builds (once) a tensor-parallel view of its own model, its 1/N of the
attention heads, dense MLP columns and LM head rows (slices of the weights it already holds, views where they
are contiguous) and, of the experts, its 1/N of every expert's columns where the rank loads them beside its own
experts (CPU groups: host memory is what every rank draws on), else its own experts whole; every feed-forward
block sums the ranks' shares (one all-reduce; nothing is dispatched, every rank holds the same token; the
head's logits are gathered). Split by columns, every rank reads 1/N of each token's expert bytes; whole, the
rank holding more of a token's experts sets the pace (with top-2 of 16 over 2 ranks, 1.47 of the 2 on
average). The request moves in with its KV split by heads (GQA: each rank keeps its KV heads; MLA: the latent
is replicated) into a small engine of its own on every rank, sized for that request; it moves back with the
heads joined when other work arrives (or ends there when it finishes).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from batchgen.engine.engine import Engine
from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.kv_pool import PoolGeometry
from batchgen.engine.migration import MigratedRequest, MigratedSample
from batchgen.engine.models.layers import FusedExperts
from batchgen.engine.models.tensor_parallel import keep_tensor_shard
from batchgen.engine.parallel.rank_group import RankGroup
from batchgen.engine.quantile_sketch import QuantileSketch
from batchgen.kernels.expert_parallel import ExpertShareDispatcher, LocalDispatcher


def partition_pages(length_pages: int, samples: int, reserve: int) -> int:
    """Device pages of the engine a straggler partitions into: each sample's whole length and a page ahead, and the
    `reserve` an import keeps free beside them (KVManager.reserve_pages), so its KV lands on the device however far
    it had decoded (without the reserve, a straggler in its last page went to the one host page and failed every
    rank)."""
    return (length_pages + 1) * samples + reserve


def module_view(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the same tensors (nothing is copied), so
    the copy can be re-sliced and re-wired without touching the original."""
    view = copy.copy(module)
    view._parameters = dict(module._parameters)
    view._buffers = dict(module._buffers)
    view._modules = {name: module_view(child) for name, child in module._modules.items()}
    return view


def partition_model(model: nn.Module, group: RankGroup,
                    expert_columns: Callable[[], nn.Module] | None = None) -> nn.Module:
    """This rank's tensor-parallel share of its expert-parallel `model` (heads, columns: sliced; the LM head: its
    rows of the vocabulary when they split evenly, the ranks' logits gathered). Experts: its columns of every
    expert, from the model `expert_columns()` loads (only its FusedExperts hold weights), else its own experts,
    each token's routes to them only. Raises ValueError when the heads or expert columns do not split over the
    ranks."""
    rank, ranks = group.rank, group.size
    view = module_view(model)
    keep_tensor_shard(view, rank, ranks, experts=False)
    experts = [m for m in view.modules() if isinstance(m, FusedExperts)]
    if expert_columns is None:  # experts stay on their ranks: each computes the routes to its own
        for module in experts:
            module.dispatcher = ExpertShareDispatcher(module.num_experts, rank, ranks)
    else:  # each rank computes its columns of every routed expert
        columns = [m for m in expert_columns().modules() if isinstance(m, FusedExperts)]
        for module, share in zip(experts, columns, strict=True):
            module.gate_up_proj, module.down_proj = share.gate_up_proj, share.down_proj
            module.first_expert, module.dispatcher = 0, LocalDispatcher(module.num_experts)
    head = view.lm_head.weight
    if head.shape[0] % ranks == 0:
        rows = head.shape[0] // ranks
        view.lm_head.weight = nn.Parameter(head[rank * rows:(rank + 1) * rows], requires_grad=False)
        view.gather_vocab = lambda logits: torch.cat(list(group.all_gather(logits)), dim=-1)
    return view


def split_heads(migrated: MigratedRequest, whole: PoolGeometry, part: PoolGeometry, rank: int) -> MigratedRequest:
    """The request with only rank `rank`'s KV heads (the whole KV when the heads are not split: MLA)."""
    heads = part.spec.num_kv_heads
    if whole.spec.num_kv_heads == heads:
        return migrated
    mine = slice(rank * heads, (rank + 1) * heads)
    return _with_kv(migrated, lambda s: _packed([t[:, :, mine] for t in whole.packed_views(s.kv, s.kv_len)]),
                    part.layout)


def join_heads(parts: list[MigratedRequest], whole: PoolGeometry, part: PoolGeometry) -> MigratedRequest:
    """The request with every rank's KV heads side by side again (`parts` in rank order)."""
    if whole.spec.num_kv_heads == part.spec.num_kv_heads:
        return parts[0]
    by_index = [{s.index: s for s in p.samples} for p in parts]

    def joined(sample: MigratedSample) -> torch.Tensor:
        views = [part.packed_views(p[sample.index].kv, sample.kv_len) for p in by_index]
        return _packed([torch.cat([v[i] for v in views], dim=2) for i in (0, 1)])

    return _with_kv(parts[0], joined, whole.layout)


def _with_kv(migrated: MigratedRequest, kv_of, layout: str) -> MigratedRequest:
    """`migrated` with each unfinished sample's KV replaced by kv_of(sample), laid out as `layout`."""
    samples = [s if s.kv is None else dataclasses.replace(s, kv=kv_of(s)) for s in migrated.samples]
    return dataclasses.replace(migrated, samples=samples, kv_layout=layout)


def _packed(kv: list[torch.Tensor]) -> torch.Tensor:
    """k then v, as PoolGeometry.packed_views reads them."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in kv])


class RankEngines:
    """A rank's engines: its own (expert parallel) and, while a straggler is partitioned, its share of the
    straggler's tensor-parallel one."""

    def __init__(self, engine: Engine, group: RankGroup, expert_columns: Callable[[], nn.Module] | None = None):
        """`expert_columns`: loads this rank's columns of every expert (see partition_model), or None."""
        self.engine = engine
        self.group = group
        self.partition: Engine | None = None
        self.model: nn.Module | None = None
        self._unable: str | None = None  # why this model cannot be partitioned, if it cannot
        config = engine.config
        if config.ep_size > 1 and config.partition_stragglers:
            try:
                self.model = partition_model(engine.model, group, expert_columns)
            except ValueError as exc:
                self._unable = str(exc)
        else:
            self._unable = "partition_stragglers is off" if config.ep_size > 1 else "not expert parallel"

    def partition_error(self) -> str | None:
        """Why this rank cannot take a share of a straggler (None: it can)."""
        return self._unable

    @property
    def active(self) -> Engine:
        """The engine a round's step runs: the partition's while there is one."""
        return self.partition or self.engine

    @property
    def part_geometry(self) -> PoolGeometry:
        whole = self.engine.kv.geometry
        return dataclasses.replace(whole, spec=self.model.kv_spec())

    def start_partition(self, migrated: MigratedRequest) -> None:
        """Take this rank's share of `migrated` (every rank is given the same request) into an engine sized
        for it."""
        if self.model is None:
            raise InvalidRequestError(f"this engine cannot partition a request: {self._unable}")
        part = self.part_geometry
        request = migrated.request
        length = min(len(request.prompt_token_ids) + request.sampling.max_tokens, self.engine.max_model_len)
        pages = partition_pages(part.pages_for(length), request.sampling.n, self.engine.kv.reserve_pages)
        config = dataclasses.replace(self.engine.config, ep_size=1, tp_size=self.group.size,
                                     kv_budget_bytes=pages * part.page_bytes, host_kv_budget_bytes=part.page_bytes,
                                     stream_host_kv=False, prefix_caching=False)
        loaded = dataclasses.replace(self.engine.loaded, model=self.model)
        engine = Engine(loaded, config, group=self.group)
        engine.import_request(split_heads(migrated, self.engine.kv.geometry, part, self.group.rank))
        self.partition = engine

    def metrics(self) -> dict:
        """The rank's engine's metrics, a running partition's steps and tokens counted in on the leader."""
        if self.partition is None or not self.group.is_leader:
            return self.engine.metrics()
        stats = copy.deepcopy(self.engine.stats)
        stats.absorb_partition(self.partition.stats)
        return stats.summary(self.engine.kv)

    def completion_times(self) -> QuantileSketch:
        """The rank's completion-time sketch, a running partition's counted in on the leader (as in `metrics`)."""
        times = copy.deepcopy(self.engine.stats.completion_times)
        if self.partition is not None and self.group.is_leader:
            times.merge(self.partition.stats.completion_times)
        return times

    def end_partition(self, request_id: str) -> MigratedRequest | None:
        """Drop the partition's engine: its request (this rank's heads) if it is still there, else None.
        The leader's rank counts the partition's steps and tokens as its own."""
        partition, self.partition = self.partition, None
        if partition is None:
            return None
        migrated = partition.export_request(request_id)
        if self.group.is_leader:
            self.engine.stats.absorb_partition(partition.stats)
        return migrated

