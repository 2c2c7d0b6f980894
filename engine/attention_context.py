"""AttentionContext implementations over the paged pools (see engine/models/context.py).

Three ways a micro-batch meets its KV:
- prefill: the new tokens' K/V are written to their pages (device pages, or host pages layer by layer
  when the prompt is offloaded right away: engine/prefill_offload.py) and attention runs over the
  batch's own new tokens, or, when a chunk continues a prompt prefilled in earlier steps, over each
  sequence's whole prefix read back from its pages;
- resident decode: one new token per sequence against its device pages (or, for host-resident sequences, against
  their host pages in place: a CPU's own memory, a GPU's view of the pinned pages);
- staged decode (offloaded COMBINE, stream_host_kv): the sequence's KV lives in the host store; for each
  layer its pages are copied into a one-layer staging pool, attention runs there, and the new token's
  K/V is written back to the host pages (on a GPU that addresses them, both by kernels on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.kv_pool import KVPool, PoolView
from batchgen.engine.prefill_offload import PrefillOffload
from batchgen.kernels import ops


@dataclass
class PrefillContext:
    positions: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [B + 1] int32, of the new tokens
    slots: torch.Tensor  # [T] int64 slots in `pool`
    pool: KVPool
    # chunked prefill: every sequence's keys are its whole prefix so far, read back from its pages
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32 over the prefixes (None: = cu_seqlens)
    context_slots: torch.Tensor | None = None  # [sum of prefixes] int64 slots in `pool`
    # prompts prefilled into host pages: each layer's K/V leaves for them as soon as the layer has attended
    offload: PrefillOffload | None = None
    offload_runs: list[tuple[int, int, int]] | None = None  # slot_runs of `slots`

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        if self.offload is None:
            ops.write_kv(k, v, k_cache, v_cache, self.slots)
        else:
            self.offload.write(layer, k, v, self.offload_runs)
        if self.context_slots is None:
            return ops.prefill_attention(q, k, v, self.cu_seqlens, self.cu_seqlens, scale)
        if self.offload is not None:
            self.offload.flush()  # the prefix read back includes this layer's new tokens
        keys = k_cache.flatten(0, 1)[self.context_slots].to(q.device)
        values = v_cache.flatten(0, 1)[self.context_slots].to(q.device)
        return ops.prefill_attention(q, keys, values, self.cu_seqlens, self.cu_seqlens_k, scale)


@dataclass
class DecodeContext:
    positions: torch.Tensor  # [B] position of the new token (= tokens already cached)
    slots: torch.Tensor  # [B] slot of the new token in `pool`
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, including the new token
    pool: KVPool | PoolView  # host pages a GPU attends on in place are a view of them

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        ops.write_kv(k, v, k_cache, v_cache, self.slots)
        return ops.paged_decode_attention(q, k_cache, v_cache, self.page_table, self.seq_lens, scale)


@dataclass
class StagedDecodeContext:
    positions: torch.Tensor  # [B]
    host: KVPool | PoolView  # as the device addresses it (KVManager.host_for_kernels)
    host_pages: torch.Tensor  # [N] host pages of the batch, in order (where `host` is)
    host_slots: torch.Tensor  # [B] host slot of each new token
    stage: KVPool  # one-layer pool on the device
    stage_pages: torch.Tensor  # [N] staging pages receiving host_pages
    stage_slots: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, max_pages] into the staging pool
    seq_lens: torch.Tensor  # [B]

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        # on a GPU that addresses the host pages (a view of them) the gather and the write-back below are kernels of
        # its own stream: no copy through the host, nothing waited on; otherwise copies both ways
        device, host_device = self.stage.device, self.host.k.device
        non_blocking = host_device.type != device.type
        self.stage.k[0, self.stage_pages] = self.host.k[layer, self.host_pages].to(device, non_blocking=non_blocking)
        self.stage.v[0, self.stage_pages] = self.host.v[layer, self.host_pages].to(device, non_blocking=non_blocking)
        ops.write_kv(k, v, self.stage.k[0], self.stage.v[0], self.stage_slots)
        out = ops.paged_decode_attention(q, self.stage.k[0], self.stage.v[0], self.page_table, self.seq_lens, scale)
        ops.write_kv(k.to(host_device), v.to(host_device), self.host.k[layer], self.host.v[layer], self.host_slots)
        return out
