"""Every step a configuration would run, without running the model: the engine's own scheduler and KV
manager replayed over page pools without storage ("meta" tensors), each sequence generating exactly its
planned output length."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_manager import KVBudget, KVManager
from batchgen.engine.models.context import KVSpec
from batchgen.engine.planner.step_model import StepShape
from batchgen.engine.planner.workload import WorkloadShape
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.scheduler import DecodePlan, Scheduler
from batchgen.engine.sequence import KVLocation, Sequence

META = torch.device("meta")


class ReplayError(RuntimeError):
    """The configuration cannot run the workload (a sequence that never fits, no end in sight)."""


def replay_schedule(config: EngineConfig, budget: KVBudget, spec: KVSpec, dtype: torch.dtype,
                    workload: WorkloadShape, stream_host: bool, device_type: str,
                    max_steps: int = 1_000_000) -> list[StepShape]:
    """The shape of every step the engine would take to run `workload` from an empty start on a `device_type`
    device.

    Prompts are distinct (no shared prefix), so the replay runs without the page cache: admission order
    and every placement are then the same as the engine's with it."""
    config = dataclasses.replace(config, prefix_caching=False)
    kv = KVManager(spec, config.page_size, dtype, budget, META, stream_host, prefix_caching=False, host_device=META)
    scheduler = Scheduler(config, kv)
    targets: dict[int, int] = {}
    ids = itertools.count()  # sequence ids and arrivals, as the engine numbers them: prompts, then forks
    for i, (prompt, output, n) in enumerate(zip(workload.prompt_lens, workload.output_lens, workload.sample_counts)):
        seq = Sequence(seq_id=next(ids), request_id=str(i), sample_index=0, prompt_ids=[0] * prompt,
                       sampling=SamplingParams(max_tokens=output, ignore_eos=True, n=n), eos_token_ids=frozenset(),
                       arrival=i)
        try:
            scheduler.check_fits(prompt + output, prompt, samples=n)
        except ValueError as exc:
            raise ReplayError(str(exc)) from None
        targets[seq.seq_id] = output
        scheduler.admit(seq)
    steps: list[StepShape] = []
    while scheduler.has_work():
        if len(steps) >= max_steps:
            raise ReplayError(f"no end after {max_steps} steps")
        moved = kv.bytes_moved
        try:
            plan = scheduler.schedule()
        except RuntimeError as exc:
            raise ReplayError(str(exc)) from None
        if plan is None:
            raise ReplayError("the scheduler found nothing to run while sequences wait: the KV budget is too "
                              "small for this workload")
        chunks = plan.prefill.chunks if plan.prefill else []
        decode = plan.decode
        # as the model runner cuts it: host-resident sequences join the resident micro-batches only where host pages
        # are the device's own memory (a CPU's; the replay's pools are both "meta")
        attended = decode.attended(kv.one_storage and device_type == "cpu") if decode else DecodePlan([])
        steps.append(StepShape(
            prefill=tuple((c.start, c.end) for c in chunks),
            resident=tuple(s.kv_len + 1 for s in attended.resident),
            staged=tuple(tuple(s.kv_len + 1 for s in group) for group in attended.staged_groups),
            completed=sum(c.completes for c in chunks),
            migrated_bytes=kv.bytes_moved - moved,
            streams_host=stream_host,
        ))
        completed = []
        for c in chunks:
            c.seq.kv_len = c.end
            if c.completes:
                completed.append(c.seq)
        for seq in _forked(scheduler, kv, completed, plan.prefill.location if plan.prefill else None, ids, targets):
            _accept(scheduler, seq, targets, decoding=False)
        for seq in decode.seqs if decode else ():
            seq.kv_len += 1
            _accept(scheduler, seq, targets, decoding=True)
    return steps


def _forked(scheduler: Scheduler, kv: KVManager, completed: list[Sequence], location, ids: Iterator[int],
            targets: dict[int, int]) -> list[Sequence]:
    """The prefilled sequences with the samples forked from each completed prompt, in the order the engine takes
    their first tokens (Engine._first_tokens): a fork that finds no pages is prefilled again."""
    out = []
    for parent in completed:
        out.append(parent)
        if parent.recomputing:
            continue
        for index in range(1, parent.sampling.n):
            sid = next(ids)
            child = Sequence(seq_id=sid, request_id=parent.request_id, sample_index=index,
                             prompt_ids=parent.prompt_ids, sampling=parent.sampling, eos_token_ids=frozenset(),
                             arrival=sid)
            where = scheduler.fork_location(parent, location)
            if where is not None:
                kv.fork(parent, child, where)
            targets[child.seq_id] = targets[parent.seq_id]
            out.append(child)
    return out


def _accept(scheduler: Scheduler, seq: Sequence, targets: dict[int, int], decoding: bool) -> None:
    """One more generated token; the sequence leaves when it has all of them (as Engine._accept_token)."""
    seq.generated.append(0)
    if len(seq.generated) < targets[seq.seq_id]:
        if decoding:
            return
        if seq.kv_location is KVLocation.NONE:  # a fork that found no pages
            scheduler.recompute(seq)
        else:
            scheduler.place_decoding(seq)
        return
    if decoding:
        scheduler.remove(seq)
    else:
        scheduler.leave_after_prefill(seq)
