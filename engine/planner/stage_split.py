"""How many of N engine actors should prefill in the disaggregated pipeline: a discrete-event simulation
of prefill actors, the KV hand-off and decode actors, driven by the same cost curves as the planner.

Prefill actors take prompts in input order, up to the engine's prompt-token budget per step, and hand
each prompt's KV on after its step plus the hand-off copy. Decode actors each run an engine of at most
`max_num_seqs` sequences: every step decodes all of them at once (priced like any step), and an actor
takes handed-off prompts from the shared queue whenever it has room. The batch completes when the last
sequence does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.config import EngineConfig
from batchgen.engine.planner.cost_curves import CostCurves
from batchgen.engine.planner.step_model import StepShape, step_seconds
from batchgen.engine.planner.workload import WorkloadShape


@dataclass(frozen=True)
class StageSplit:
    prefill_actors: int
    decode_actors: int
    predicted_bct_s: float
    by_prefill_actors: dict[int, float]  # every split simulated: prefill actors -> predicted BCT


# up to this many splits every one is simulated; past it a grid of this many, then the same between the best grid
# point's neighbours, until few enough are left: each simulation's events grow with the actors, and trying every
# split of 64 actors took 23 s
SPLITS_AT_ONCE = 24


def plan_stage_split(engine_actors: int, workload: WorkloadShape, curves: CostCurves, config: EngineConfig,
                     handoff_bytes_per_s: float | None = None) -> StageSplit:
    """The split of `engine_actors` (at least 2) with the shortest simulated BCT; ties go to more decoders.
    Past SPLITS_AT_ONCE splits, the best of a narrowing grid (the BCT falls, then rises, with the prefill actors:
    flat near its minimum). `handoff_bytes_per_s`: the prefill -> decode KV copy rate (default: two host copies
    at the profiled copy bandwidth, the pages into the hand-off buffer and the buffer into the decode engine's
    pages)."""
    if engine_actors < 2:
        raise ValueError(f"a disaggregated pipeline needs at least 2 engine actors, got {engine_actors}")
    rate = handoff_bytes_per_s or curves.copy_bytes_per_s / 2
    results: dict[int, float] = {}

    def bct(prefill_actors: int) -> float:
        if prefill_actors not in results:
            results[prefill_actors] = simulate_disaggregated(workload, curves, config, prefill_actors,
                                                             engine_actors - prefill_actors, rate)
        return results[prefill_actors]

    low, high = 1, engine_actors - 1
    while high - low + 1 > SPLITS_AT_ONCE:
        grid = sorted({low + (high - low) * i // (SPLITS_AT_ONCE - 1) for i in range(SPLITS_AT_ONCE)})
        at = grid.index(min(grid, key=lambda p: (bct(p), p)))
        low, high = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
    for prefill_actors in range(low, high + 1):
        bct(prefill_actors)
    best = min(results, key=lambda p: (results[p], p))
    return StageSplit(best, engine_actors - best, results[best], dict(sorted(results.items())))


def simulate_disaggregated(workload: WorkloadShape, curves: CostCurves, config: EngineConfig, prefill_actors: int,
                           decode_actors: int, handoff_bytes_per_s: float) -> float:
    """Simulated seconds until every sequence of `workload` has all its tokens."""
    prompts = deque(range(len(workload.prompt_lens)))
    arrived: deque[int] = deque()  # prefilled prompts waiting for a decode actor
    decoders = [_Decoder() for _ in range(decode_actors)]
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, actor or prompt)
    order = itertools.count()
    now, finished, total = 0.0, 0, workload.sequences
    samples = workload.sample_counts

    def start_prefill(actor: int) -> None:
        batch, tokens = [], 0
        while prompts and (not batch or tokens + workload.prompt_lens[prompts[0]] <= config.max_prefill_tokens):
            batch.append(prompts.popleft())
            tokens += workload.prompt_lens[batch[-1]]
        if not batch:
            return
        shape = StepShape(prefill=tuple((0, workload.prompt_lens[i]) for i in batch), resident=(), staged=(),
                          completed=len(batch), migrated_bytes=0, streams_host=False)
        done = now + step_seconds(shape, curves, config.b_attn, config.b_moe)
        heapq.heappush(events, (done, next(order), "prefilled", actor))
        for i in batch:
            copy = workload.prompt_lens[i] * curves.kv_bytes_per_token / handoff_bytes_per_s
            heapq.heappush(events, (done + copy, next(order), "arrive", i))

    def start_decode(actor: int) -> None:
        d = decoders[actor]
        if d.busy:  # arrivals join at the next step
            return
        d.seqs = [s for s in d.seqs if s[1] > 0]
        # a prompt's samples decode together (the engine takes a request's n sequences in at once)
        while arrived and (not d.seqs or len(d.seqs) + samples[arrived[0]] <= config.max_num_seqs):
            i = arrived.popleft()
            for _ in range(samples[i]):  # the first token: prefill's
                d.seqs.append([workload.prompt_lens[i] + 1, workload.output_lens[i] - 1])
        if not d.seqs:
            return
        shape = StepShape(prefill=(), resident=tuple(s[0] for s in d.seqs), staged=(), completed=0,
                          migrated_bytes=0, streams_host=False)
        d.busy = True
        heapq.heappush(events, (now + step_seconds(shape, curves, config.b_attn, config.b_moe), next(order),
                                "decoded", actor))

    for actor in range(prefill_actors):
        start_prefill(actor)
    while events:
        now, _, kind, who = heapq.heappop(events)
        if kind == "prefilled":
            start_prefill(who)
        elif kind == "arrive":
            if workload.output_lens[who] <= 1:
                finished += samples[who]
            else:
                arrived.append(who)
        else:
            d = decoders[who]
            d.busy = False
            for s in d.seqs:
                s[0] += 1
                s[1] -= 1
            finished += sum(1 for s in d.seqs if s[1] == 0)
        for actor in range(decode_actors):
            start_decode(actor)
        if finished == total:
            return now
    raise RuntimeError(f"the simulation ended with {total - finished} of {total} sequences unfinished")


@dataclass
class _Decoder:
    seqs: list[list[int]] = field(default_factory=list)  # [KV tokens a step reads, tokens still to generate]
    busy: bool = False
