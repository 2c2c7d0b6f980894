"""Turns scheduled sequences into coroutine micro-batches and runs them through the model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from batchgen.engine.attention_context import DecodeContext, PrefillContext, StagedDecodeContext
from batchgen.engine.batch_index import index_tensor, new_token_slots, page_table, span_positions, token_slots
from batchgen.engine.coroutine import CoroutineGroup, ProgramPoint, run_idle_layers, run_layers
from batchgen.engine.decode_graphs import DecodeGraphs
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.kv_pool import KVPool, PoolView
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.offload.phase_switch import PhaseSwitch
from batchgen.engine.prefill_offload import PrefillOffload, slot_runs
from batchgen.engine.scheduler import DecodePlan, PrefillChunk
from batchgen.engine.sequence import Sequence


@dataclass(frozen=True)
class MicroBatchLimits:
    """How one forward is cut: attention micro-batches of at most `b_attn` sequences,
    feed-forward (MoE) batches of at most `b_moe` tokens."""

    b_attn: int
    b_moe: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVManager, device: torch.device, limits: MicroBatchLimits,
                 stats: EngineMetrics, agree_ffn_calls: Callable[[int], int] | None = None,
                 phases: PhaseSwitch | None = None, graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv = kv
        self.device = device
        self.limits = limits
        self.stats = stats  # told every feed-forward batch size and the time spent in the forward itself
        # expert parallelism: this rank's feed-forward calls per layer -> the most any rank of the engine makes
        self.agree_ffn_calls = agree_ffn_calls
        self.prefill_offload = PrefillOffload(kv.host, device)
        self.phases = phases  # memory-constrained mode: the staging pool lent to prefill steps' MoE batches
        self.graphs = graphs  # pure decode steps of one resident micro-batch replayed from recordings

    def step(self, chunks: list[PrefillChunk], decode: DecodePlan | None) -> torch.Tensor:
        """One forward over prefill chunks (pages allocated) and decoding sequences (resident ones read
        device pages, staged ones host pages; both in the same micro-batches where the tiers are one storage),
        all COMBINE-d into the same MoE batches. Returns logits [C + D, V]: the last position of each chunk that
        completes its prompt, then one row per decoding sequence (resident, then staged)."""
        micro = [self._prefill_micro_batch(chunks[i : i + self.limits.b_attn])
                 for i in range(0, len(chunks), self.limits.b_attn)]
        plan = decode.attended(self.kv.one_storage) if decode else DecodePlan([])
        resident, staged_groups = plan.resident, plan.staged_groups
        decoding = [self._decode_micro_batch(resident[i : i + self.limits.b_attn], self.kv.device)
                    for i in range(0, len(resident), self.limits.b_attn)]
        decoding += [self._staged_micro_batch(group) for group in staged_groups]
        self.stats.decode_micro_batches += len(decoding)
        micro += decoding
        ends = _cumsum([c.end - c.start for c in chunks])
        decoding_seqs = plan.seqs
        decoded = len(decoding_seqs)
        rows = None
        if chunks:  # pure decode reads every row
            prefill_tokens = ends[-1]
            rows = index_tensor([end - 1 for c, end in zip(chunks, ends) if c.completes]
                                + list(range(prefill_tokens, prefill_tokens + decoded)), self.device)
        tokens = (ends[-1] if chunks else 0) + decoded
        b_moe = self.limits.b_moe
        if self.phases is not None:
            b_moe = self.phases.enter(bool(chunks), bool(staged_groups), tokens)
        start = time.perf_counter()
        if self.graphs is not None and not chunks and len(decoding) == 1 and not staged_groups:
            logits = self.graphs.forward(
                decoding[0], lambda batch: self._forward([batch], None, batch.num_tokens, b_moe), max_rows=b_moe)
        else:
            logits = self._forward(micro, rows, tokens, b_moe)
        self.stats.forward_seconds += time.perf_counter() - start
        for c in chunks:
            c.seq.kv_len = c.end
        for s in decoding_seqs:
            s.kv_len += 1
        return logits

    def idle(self) -> None:
        """A step with nothing to run here: under expert parallelism this rank's experts still serve the other
        ranks' MoE calls."""
        if self.agree_ffn_calls is None:
            return
        calls = self.agree_ffn_calls(0)
        if calls:
            self.stats.expert_only_steps += 1
            embedding = self.model.embed_tokens.weight
            run_idle_layers(self.model, calls, embedding.new_empty(0, embedding.shape[1]))

    def _forward(self, micro: list[CoroutineGroup], rows: torch.Tensor | None, tokens: int,
                 b_moe: int) -> torch.Tensor:
        """The model forward proper: every layer over the micro-batches (feed-forward batches of at most `b_moe`
        tokens), then the LM head on `rows`."""
        calls = 0
        if self.agree_ffn_calls is not None:
            calls = self.agree_ffn_calls(-(-tokens // b_moe))
        hidden = run_layers(self.model, micro, b_moe, self.stats.record_ffn_batch, calls)
        self.prefill_offload.flush()
        return self.model.head(hidden if rows is None else hidden[rows])

    def _token_ids(self, token_ids: list[int]) -> torch.Tensor:
        """A micro-batch's input rows, embedded inside the forward (run_layers: one lookup for the whole step)."""
        return index_tensor(token_ids, self.device)

    def _prefill_micro_batch(self, chunks: list[PrefillChunk]) -> CoroutineGroup:
        pool = self.kv.pool(chunks[0].seq.kv_location)
        page_size = self.kv.page_size
        lengths = [c.end - c.start for c in chunks]
        tokens = list(chain.from_iterable(c.seq.prefill_ids[c.start : c.end] for c in chunks))
        table = page_table([self.kv.pages_of(c.seq) for c in chunks], pool.device)
        rows, positions = span_positions([c.start for c in chunks], lengths, pool.device)
        slots = token_slots(table, rows, positions, page_size)
        cu_seqlens = cu_seqlens_k = index_tensor([0, *_cumsum(lengths)], self.device, torch.int32)
        context_slots = None
        if any(c.start for c in chunks):  # a continued chunk: every chunk attends over its whole prefix in pages
            ends = [c.end for c in chunks]
            cu_seqlens_k = index_tensor([0, *_cumsum(ends)], self.device, torch.int32)
            context_slots = token_slots(table, *span_positions([0] * len(chunks), ends, pool.device), page_size)
        offloaded = pool is self.kv.host
        ctx = PrefillContext(
            positions=positions.to(self.device),
            cu_seqlens=cu_seqlens,
            slots=slots,
            pool=pool,
            cu_seqlens_k=cu_seqlens_k,
            context_slots=context_slots,
            offload=self.prefill_offload if offloaded else None,
            offload_runs=slot_runs(slots.tolist()) if offloaded else None,
        )
        return CoroutineGroup([c.seq for c in chunks], self._token_ids(tokens), ProgramPoint(0, "embed"), ctx)

    def _decode_micro_batch(self, seqs: list[Sequence], pool: KVPool | PoolView) -> CoroutineGroup:
        """Sequences attending over their pages in `pool`'s storage in place (device pages, host pages where the
        host pool is in the device's own memory, or both where the two are one storage)."""
        kv_lens = index_tensor([s.kv_len for s in seqs], self.device)
        table = page_table([self.kv.pages_of(s) for s in seqs], self.device)
        ctx = DecodeContext(
            positions=kv_lens,
            slots=new_token_slots(table, kv_lens, self.kv.page_size),
            page_table=table,
            seq_lens=(kv_lens + 1).to(torch.int32),
            pool=pool,
        )
        return CoroutineGroup(seqs, self._token_ids([s.last_token for s in seqs]), ProgramPoint(0, "embed"), ctx)

    def _staged_micro_batch(self, seqs: list[Sequence]) -> CoroutineGroup:
        """Host-resident sequences: streamed layer by layer through the staging pool, or attending on the
        host pages in place (a CPU's own memory, or a GPU's view of the pinned pages: engine/host_view.py)."""
        if not self.kv.stream_host:
            return self._decode_micro_batch(seqs, self.kv.host_for_kernels)
        page_size = self.kv.page_size
        counts = [self.kv.pages_needed(s.kv_len + 1) for s in seqs]
        stage_pages = list(range(sum(counts)))
        tables, offset = [], 0
        for n in counts:
            tables.append(stage_pages[offset : offset + n])
            offset += n
        kv_lens = index_tensor([s.kv_len for s in seqs], self.device)
        table = page_table(tables, self.device)
        host = self.kv.host_for_kernels.k.device  # the GPU itself where it addresses the host pages
        ctx = StagedDecodeContext(
            positions=kv_lens,
            host=self.kv.host_for_kernels,
            host_pages=index_tensor([p for s, n in zip(seqs, counts) for p in s.host_pages[:n]], host),
            host_slots=new_token_slots(page_table([self.kv.pages_of(s) for s in seqs], host), kv_lens.to(host),
                                       page_size),
            stage=self.kv.stage,
            stage_pages=index_tensor(stage_pages, self.device),
            stage_slots=new_token_slots(table, kv_lens, page_size),
            page_table=table,
            seq_lens=(kv_lens + 1).to(torch.int32),
        )
        return CoroutineGroup(seqs, self._token_ids([s.last_token for s in seqs]), ProgramPoint(0, "embed"), ctx)


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out

