"""Expert-parallel token dispatch and combine behind one interface.

Rank r owns the contiguous experts [r * E_local, (r + 1) * E_local). A MoE layer does

    sent = dispatcher.dispatch(x, topk_ids, topk_weights, decode=...)
    y = fused_moe(sent.x, w_gate_up_local, w_down_local, sent.topk_weights, sent.topk_ids)
    out = dispatcher.combine(y, sent)

`sent.topk_ids` are local expert ids, -1 where the expert lives on another rank (fused_moe skips those),
so each token travels at most once per rank and `combine` only sums the per-rank partial results.

Backends: "local" (one rank), "all_to_all" (torch.distributed all_to_all_single with uneven splits; runs
on gloo and NCCL), "deep_ep" (DeepEP: normal kernels for prefill, low-latency kernels for decode). DeepEP is
imported only when chosen; "auto" picks it on CUDA when it imports and the group has several ranks.
"""

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from batchgen.kernels.registry import BackendUnavailableError

EP_BACKENDS = ("local", "all_to_all", "deep_ep")


@dataclass
class Dispatched:
    x: torch.Tensor  # [N, D] rows this rank computes
    topk_ids: torch.Tensor  # [N, K] local expert ids, -1 = expert on another rank
    topk_weights: torch.Tensor  # [N, K] float32 routing weights (applied by fused_moe)
    handle: Any  # backend state that combine needs


class LocalDispatcher:
    """Single rank: every expert is local, dispatch and combine are identities."""

    name = "local"

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.rank, self.world_size = 0, 1
        self.num_local_experts = num_experts

    def dispatch(self, x, topk_ids, topk_weights, decode: bool = False) -> Dispatched:
        return Dispatched(x, topk_ids, topk_weights, None)

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        return y


class ExpertShareDispatcher:
    """Every rank holds the same tokens (a straggler PARTITIONed over an expert-parallel group): each computes
    the routes to its own experts only, nothing travels, and the feed-forward block's all-reduce sums the
    ranks' shares."""

    name = "expert_share"

    def __init__(self, num_experts: int, rank: int, world_size: int):
        self.num_experts = num_experts
        self.rank, self.world_size = rank, world_size
        self.num_local_experts = num_experts // world_size

    def dispatch(self, x, topk_ids, topk_weights, decode: bool = False) -> Dispatched:
        local = topk_ids - self.rank * self.num_local_experts
        mine = (topk_ids >= 0) & (local >= 0) & (local < self.num_local_experts)
        return Dispatched(x, torch.where(mine, local, -1), topk_weights, None)

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        return y


def _group_shape(group, num_experts: int) -> tuple[int, int, int]:
    """(rank, world_size, experts per rank), checking that the experts split evenly."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if num_experts % world_size:
        raise ValueError(
            f"expert parallel: {num_experts} experts do not split evenly over {world_size} ranks"
        )
    return rank, world_size, num_experts // world_size


class ProcessGroupExchange:
    """Row exchanges over a torch.distributed group: what AllToAllDispatcher needs of its ranks (an engine
    group's RankGroup offers the same two calls through shared memory)."""

    def __init__(self, group=None):
        self.group = group

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)

    def all_to_all(self, send: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        """`splits[i][j]`: rows rank i sends rank j; this rank's rows for rank 0, then rank 1, ... in `send`."""
        rank = dist.get_rank(self.group)
        recv_splits = [row[rank] for row in splits]
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, splits[rank], group=self.group)
        return recv


@dataclass
class _AllToAllHandle:
    token_of_row: torch.Tensor  # [rows sent] source token of each sent row (rows grouped by destination)
    splits: list[list[int]]  # [i][j]: rows rank i sent rank j
    num_tokens: int


class AllToAllDispatcher:
    """torch.distributed all-to-all with uneven splits: each token goes once to every rank it needs."""

    name = "all_to_all"

    def __init__(self, num_experts: int, group=None, exchange=None):
        self.num_experts = num_experts
        self.group = group
        self.exchange = exchange or ProcessGroupExchange(group)
        self.rank, self.world_size, self.num_local_experts = _group_shape(group, num_experts)

    def dispatch(self, x, topk_ids, topk_weights, decode: bool = False) -> Dispatched:
        num_tokens = x.shape[0]
        owner = torch.where(topk_ids >= 0, topk_ids // self.num_local_experts, self.world_size)
        needs = torch.zeros(num_tokens, self.world_size + 1, dtype=torch.bool, device=x.device)
        needs.scatter_(1, owner, True)
        dest, token_of_row = needs[:, : self.world_size].t().nonzero(as_tuple=True)
        send_counts = torch.bincount(dest, minlength=self.world_size).to(torch.int64)
        splits = self.exchange.all_gather(send_counts).tolist()

        row_ids = topk_ids[token_of_row]
        local_ids = row_ids - (dest * self.num_local_experts)[:, None]
        local_ids = torch.where(
            (row_ids >= 0) & (local_ids >= 0) & (local_ids < self.num_local_experts), local_ids, -1
        )
        # one exchange for the rows, their local expert ids and their weights: each row's bytes side by side
        parts = (x[token_of_row], local_ids.to(torch.int64), topk_weights[token_of_row].to(torch.float32))
        packed = torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)
        recv = self.exchange.all_to_all(packed, splits)
        widths = [p.shape[1] * p.element_size() for p in parts]
        recv_x, recv_ids, recv_weights = (  # copied out: a view of bytes as wider types needs aligned rows
            torch.empty_like(chunk, memory_format=torch.contiguous_format).copy_(chunk).view(p.dtype)
            for chunk, p in zip(torch.split(recv, widths, dim=1), parts)
        )
        handle = _AllToAllHandle(token_of_row, splits, num_tokens)
        return Dispatched(recv_x, recv_ids, recv_weights, handle)

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        handle: _AllToAllHandle = sent.handle
        back = [list(column) for column in zip(*handle.splits)]  # rows go back the way they came
        partial = self.exchange.all_to_all(y, back)
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, handle.token_of_row, partial.to(torch.float32))
        return out.to(y.dtype)


def _import_deep_ep():
    if importlib.util.find_spec("deep_ep") is None:
        raise BackendUnavailableError(
            "expert parallel backend 'deep_ep': deep_ep is not installed (DeepEP has no PyPI wheel; build it "
            "from source with NVSHMEM on a CUDA host)"
        )
    return importlib.import_module("deep_ep")


@dataclass
class _DeepEPHandle:
    low_latency: bool
    inner: Any  # DeepEP's own handle
    topk_ids: torch.Tensor | None = None  # low-latency combine needs the original routing
    topk_weights: torch.Tensor | None = None
    recv_shape: tuple[int, ...] | None = None


class DeepEPDispatcher:
    """DeepEP on CUDA (bf16 activations): normal kernels for prefill, low-latency kernels for decode.

    One buffer serves both modes (sized for the larger); it is cleaned when switching to low latency,
    as DeepEP requires. Low-latency dispatch returns per-expert padded rows; they are exposed as flat
    rows whose padding carries id -1, and the routing weights are applied by DeepEP's combine instead.
    """

    name = "deep_ep"

    def __init__(self, num_experts: int, group=None, max_decode_tokens: int = 256):
        self.deep_ep = _import_deep_ep()
        self.num_experts = num_experts
        self.group = group if group is not None else dist.group.WORLD
        self.max_decode_tokens = max_decode_tokens
        self.rank, self.world_size, self.num_local_experts = _group_shape(self.group, num_experts)
        self._buffer = None
        self._hidden = None
        self._last_low_latency = False

    def _buffer_for(self, hidden: int, low_latency: bool):
        buffer_cls = self.deep_ep.Buffer
        if self._buffer is None:
            hidden_bytes = hidden * 2
            nvl_bytes = rdma_bytes = 0
            for config in (
                buffer_cls.get_dispatch_config(self.world_size),
                buffer_cls.get_combine_config(self.world_size),
            ):
                nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, self.world_size))
                rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, self.world_size))
            rdma_bytes = max(
                rdma_bytes,
                buffer_cls.get_low_latency_rdma_size_hint(
                    self.max_decode_tokens, hidden, self.world_size, self.num_experts
                ),
            )
            self._buffer = buffer_cls(
                self.group,
                nvl_bytes,
                rdma_bytes,
                low_latency_mode=True,
                num_qps_per_rank=self.num_local_experts,
            )
            self._hidden = hidden
        elif hidden != self._hidden:
            raise ValueError(
                f"expert parallel (deep_ep): hidden size {hidden} differs from the buffer's {self._hidden}"
            )
        if low_latency and not self._last_low_latency:
            self._buffer.clean_low_latency_buffer(self.max_decode_tokens, hidden, self.num_experts)
        self._last_low_latency = low_latency
        return self._buffer

    def dispatch(self, x, topk_ids, topk_weights, decode: bool = False) -> Dispatched:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"expert parallel (deep_ep): x must be bfloat16, got {x.dtype}")
        ids = topk_ids.to(torch.int64)
        weights = topk_weights.to(torch.float32)
        buffer = self._buffer_for(x.shape[1], low_latency=decode)
        if decode:
            return self._dispatch_low_latency(buffer, x, ids, weights)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_weights, _, inner, _ = buffer.dispatch(
            x,
            topk_idx=ids,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        return Dispatched(recv_x, recv_ids, recv_weights, _DeepEPHandle(low_latency=False, inner=inner))

    def _dispatch_low_latency(self, buffer, x, ids, weights) -> Dispatched:
        if x.shape[0] > self.max_decode_tokens:
            raise ValueError(
                f"expert parallel (deep_ep): {x.shape[0]} decode tokens exceed max_decode_tokens "
                f"= {self.max_decode_tokens}"
            )
        recv, counts, inner, _, _ = buffer.low_latency_dispatch(
            x, ids, self.max_decode_tokens, self.num_experts, use_fp8=False
        )
        num_local, capacity, hidden = recv.shape
        slot = torch.arange(capacity, device=x.device)
        expert = torch.arange(num_local, device=x.device)[:, None].expand(num_local, capacity)
        local_ids = torch.where(slot[None, :] < counts[:, None], expert, -1).reshape(-1, 1)
        ones = torch.ones(num_local * capacity, 1, dtype=torch.float32, device=x.device)
        handle = _DeepEPHandle(True, inner, ids, weights, tuple(recv.shape))
        return Dispatched(recv.view(-1, hidden), local_ids, ones, handle)

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        handle: _DeepEPHandle = sent.handle
        if handle.low_latency:
            out, _, _ = self._buffer.low_latency_combine(
                y.view(handle.recv_shape), handle.topk_ids, handle.topk_weights, handle.inner
            )
            return out
        out, _, _ = self._buffer.combine(y, handle.inner)
        return out


def make_dispatcher(
    num_experts: int,
    backend: str = "auto",
    group=None,
    device: torch.device | str = "cpu",
    max_decode_tokens: int = 256,
    exchange=None,
):
    """The dispatcher for `backend`.

    "auto": local on one rank, else DeepEP on CUDA when it imports, else torch all_to_all (through
    `exchange` when given: ProcessGroupExchange's calls, e.g. over shared memory).
    """
    if backend not in ("auto", *EP_BACKENDS):
        raise ValueError(
            f"unknown expert parallel backend {backend!r}; known: auto, {', '.join(EP_BACKENDS)}"
        )
    distributed = dist.is_available() and dist.is_initialized()
    if backend == "auto":
        if not distributed or dist.get_world_size(group) == 1:
            backend = "local"
        elif torch.device(device).type == "cuda" and importlib.util.find_spec("deep_ep") is not None:
            backend = "deep_ep"
        else:
            backend = "all_to_all"
    if backend == "local":
        return LocalDispatcher(num_experts)
    if not distributed:
        raise BackendUnavailableError(
            f"expert parallel backend {backend!r}: torch.distributed is not initialized "
            "(call torch.distributed.init_process_group first)"
        )
    if backend == "all_to_all":
        return AllToAllDispatcher(num_experts, group, exchange)
    if torch.device(device).type != "cuda":
        raise BackendUnavailableError(f"expert parallel backend 'deep_ep' needs a CUDA device, got {device}")
    return DeepEPDispatcher(num_experts, group, max_decode_tokens)
