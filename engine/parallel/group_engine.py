"""One logical engine over several ranks: expert parallel (ep_size) or tensor parallel (tp_size).

The leader (rank 0, the caller's process) starts ranks 1..N-1 as processes of their own, one per device.
Each rank holds its own Engine. Every step all ranks step together (a round: engine/parallel/rank_round.py).

- Expert parallel: each rank has its own sequences, scheduler and KV pools (data-parallel attention) and 1/N
  of every MoE layer's experts; a step's MoE batch is dispatched to the experts' ranks by all-to-all and
  combined back, and a rank with no sequences of its own still serves its experts. The leader places each new
  request on the rank with the least work left, and a rank that runs out takes requests from the busiest
  (Engine's MIGRATE export / import between ranks).
- PARTITION (expert parallel, `partition_stragglers`): when one request is left in the whole engine, every
  rank takes its share of it (engine/parallel/partition.py) and decodes it with tensor parallelism; it moves
  back to one rank when other work arrives, and the partition ends when it finishes.
- Tensor parallel: every rank runs every request (the same calls in the same order, so the same schedule),
  each with 1/N of the heads and columns and its own heads' KV; the blocks all-reduce their partial sums, so
  every rank samples the same tokens, and the leader answers with its own results. Its requests do not
  MIGRATE (their KV is split by heads over the ranks).

The leader answers the same calls as an Engine, so EngineLoop, the Ray operators and the Batch API drive it
unchanged.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from typing import Any

from batchgen.engine.engine_load import EngineLoad
from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.generation import Generates
from batchgen.engine.metrics import completion_quantiles
from batchgen.engine.migration import MigratedRequest
from batchgen.engine.parallel.partition import RankEngines, join_heads
from batchgen.engine.parallel.prefix_placement import PrefixPlacement
from batchgen.engine.parallel.rank_group import RankGroup, check_rank_devices, free_address, leave_rank_group
from batchgen.engine.parallel.rank_round import RankCall, RankReply, Round, broadcast_round, gather_replies, run_round
from batchgen.engine.parallel.rank_worker import RankSpec, build_rank_engine
from batchgen.engine.prefill_output import PrefillOutput
from batchgen.engine.quantile_sketch import QuantileSketch
from batchgen.engine.request import Request, Result

STOP_TIMEOUT_S = 30.0
# metrics that add up over ranks (the rest are the leader's)
SUMMED_METRICS = (
    "generated_tokens", "prompt_tokens", "recomputed_tokens", "finished_requests", "failed_requests",
    "aborted_requests", "prefill_steps", "decode_steps", "mixed_steps", "chunked_prefills", "handoff_prefills",
    "migrated_out", "migrated_in", "staged_decode_batches", "yields", "restores", "recomputes", "bytes_moved",
    "prefill_tokens_saved", "prefix_query_tokens", "expert_only_steps", "partitioned_steps",
    "decode_micro_batches", "decode_graph_captures", "decode_graph_replays", "decode_graph_refusals",
    # each rank's own sequences: the sum of the ranks' peaks (at most what the group held at once)
    "peak_active", "peak_suspended",
)
# the ranks step together, and every MoE call of a step serves all of them: the group's calls are the most any
# rank made (one without tokens for a call still makes it)
MAXED_METRICS = ("max_ffn_tokens", "prefill_step_seconds", "decode_step_seconds", "moe_calls", "decode_moe_calls")


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """An expert-parallel group's metrics from its ranks' (each attends its own sequences; every MoE call of a
    step serves all ranks' tokens): counts summed, peaks and step times per rank at their largest, the expert
    batch of a call the ranks' tokens together, rates recomputed from the summed counts. Keys not merged here
    (the scheduler and host shares) are rank 0's."""
    merged = dict(per_rank[0])
    for key in SUMMED_METRICS:
        merged[key] = sum(m[key] for m in per_rank)
    for key in MAXED_METRICS:
        merged[key] = max(m[key] for m in per_rank)
    for mean, calls in (("mean_expert_batch", "moe_calls"), ("mean_decode_expert_batch", "decode_moe_calls")):
        tokens = sum(m[mean] * m[calls] for m in per_rank)  # tokens per expert, over every call of every rank
        merged[mean] = tokens / merged[calls] if merged[calls] else 0.0
    merged["prefix_hit_rate"] = (merged["prefill_tokens_saved"] / merged["prefix_query_tokens"]
                                 if merged["prefix_query_tokens"] else 0.0)
    histograms = [m["expert_histogram"] for m in per_rank]
    width = max(map(len, histograms))
    merged["expert_histogram"] = [sum(h[e] for h in histograms if e < len(h)) for e in range(width)]
    return merged


def start_engine_group(spec: RankSpec) -> GroupEngine:
    """Start ranks 1..N-1 and build rank 0 here; raises GroupStartError naming any rank that failed."""
    check_rank_devices(spec.config.torch_device(), spec.size)
    workers = []
    for rank in range(1, spec.size):
        worker = subprocess.Popen([sys.executable, "-m", "batchgen.engine.parallel.rank_worker"],
                                  stdin=subprocess.PIPE)
        worker.stdin.write(pickle.dumps((rank, spec)))
        worker.stdin.close()
        workers.append(worker)

    def departed() -> str | None:
        return next((f"engine rank {rank} exited with code {worker.returncode} before joining the group"
                     for rank, worker in enumerate(workers, 1) if worker.poll() is not None), None)

    try:
        engines, group = build_rank_engine(spec, 0, departed)
    except BaseException:
        _stop(workers)
        raise
    try:
        return GroupEngine(engines, group, workers)
    except BaseException:  # its first rounds failed: the ranks would wait for the next one forever
        _kill(workers)
        leave_rank_group()
        raise


def rank_spec(load, config, threads: int) -> RankSpec:
    """The spec of a group of `config.ranks` ranks on this machine. Expert-parallel CPU ranks that may PARTITION a
    straggler also hold 1/N of every expert's columns (twice an expert rank's expert bytes: as much as one engine
    holding every expert, over N ranks), so a partition splits each routed expert's columns evenly instead of
    waiting on the rank holding more of the token's experts; ranks on devices of their own keep to their experts."""
    columns = config.ep_size > 1 and config.partition_stragglers and config.torch_device().type == "cpu"
    return RankSpec(free_address(), config.ranks, config, load, threads, expert_columns=columns)


class GroupEngine(Generates):
    def __init__(self, engines: RankEngines, group: RankGroup, workers: list[subprocess.Popen]):
        self.rank_engines = engines  # the leader's own rank
        self.engine = engines.engine
        self.group = group
        self._workers = workers
        self._calls: list[list[RankCall]] = [[] for _ in range(group.size)]
        self._queued_tokens = [0] * group.size  # output tokens placed on each rank since its last reply
        self._replies = [RankReply() for _ in range(group.size)]
        self._where: dict[str, int] = {}  # request id -> the rank holding it
        self._failed: list[Result] = []  # queued calls a rank refused
        self._broken = False
        self.replicated = self.engine.config.tp_size > 1  # tensor parallel: every rank runs every request
        self._partitioned: str | None = None  # the request every rank decodes now (PARTITION)
        self._prefixes = PrefixPlacement(self.engine.kv.page_size)  # where prefilled rows' shared prefixes went
        self.partitions = 0  # partitions formed
        self._round(step=False)  # every rank's load
        # PARTITION needs every rank's share of the heads (its own engine's check, asked once)
        errors = self._ask({rank: [RankCall("partition_error", ())] for rank in range(self.ranks)})
        self.partition_error = next((e[0] for e in errors.values() if e[0] is not None), None)

    # what callers read of an engine: the leader's (every rank runs the same model and options)
    @property
    def config(self):
        return self.engine.config

    @property
    def normalizer(self):
        return self.engine.normalizer

    @property
    def stats(self):
        return self.engine.stats

    @property
    def ranks(self) -> int:
        return self.group.size

    # ------------------------------------------------------------ the Engine interface
    def add_request(self, request: Request) -> None:
        """As Engine.add_request: a bad request (a duplicate id in any rank included) comes back from a step."""
        self._end_partition()
        if request.request_id in self._where:
            self._failed.append(Result(request.request_id, [], error=f"duplicate request_id {request.request_id!r}"))
            return
        self._place(request.request_id, request.sampling, "add_request", request)

    def add_prefilled(self, prefilled: PrefillOutput) -> None:
        self.check_prefilled(prefilled)
        self._end_partition()
        # its KV alone: a view of the hand-off batch's buffer pickles the whole buffer into the round, for each row
        prefilled = dataclasses.replace(prefilled, kv=prefilled.kv.clone())
        prompt = prefilled.request.prompt_token_ids
        rank = self._prefixes.rank_of(prompt, prefilled.kv_start) if prefilled.kv_start else None
        self._place(prefilled.request.request_id, prefilled.request.sampling, "add_prefilled", prefilled, rank)
        if not self.replicated:
            self._prefixes.placed(prompt, self._where[prefilled.request.request_id])

    def check_prefilled(self, prefilled: PrefillOutput) -> None:
        self._check_movable_in("a prefilled request")
        if prefilled.request.request_id in self._where:
            raise InvalidRequestError(f"duplicate request_id {prefilled.request.request_id!r}")
        self.engine.check_prefilled(prefilled)

    def import_request(self, migrated: MigratedRequest) -> None:
        self._check_movable_in("a migrated request")
        rid = migrated.request.request_id
        if rid in self._where:
            raise InvalidRequestError(f"duplicate request_id {rid!r}")
        self._end_partition()
        rank = self._least_loaded()
        self._call_now(rank, "import_request", migrated)
        self._where[rid] = rank

    def step(self) -> list[Result]:
        replies = self._round(step=True)
        results = [r for reply in (replies[:1] if self._one_answers else replies) for r in reply.results]
        for result in results:
            self._where.pop(result.request_id, None)
        if self._partitioned is not None and self._partitioned not in self._where:  # it finished
            self._end_partition()
        if not self.replicated and self._partitioned is None:
            self._rebalance()
            self._partition_straggler()
        failed, self._failed = self._failed, []
        return failed + results

    def abort(self, request_id: str) -> bool:
        if request_id == self._partitioned:
            self._end_partition()
        rank = self._where.pop(request_id, None)
        if rank is None:
            return False
        for holder in range(self.ranks) if self.replicated else (rank,):
            self._calls[holder].append(RankCall("abort", (request_id,)))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._failed) or any(self._calls) or any(r.unfinished for r in self._replies)

    def load(self) -> EngineLoad:
        loads = [r.load for r in (self._replies[:1] if self._one_answers else self._replies)]
        return EngineLoad(sum(x.requests for x in loads), sum(x.tokens for x in loads) + sum(self._queued_tokens),
                          self.engine.stats.step_seconds, sum(x.refill_below for x in loads),
                          sum(x.batch for x in loads))

    def metrics(self) -> dict:
        answers = self._ask({rank: [RankCall("metrics", ()), RankCall("completion_times", ())]
                             for rank in range(self.ranks)})
        per_rank = [answers[rank][0] for rank in range(self.ranks)]
        merged = dict(per_rank[0])
        if self.replicated:  # every rank ran every request
            return {**merged, "ranks": per_rank}
        merged = merge_rank_metrics(per_rank)
        merged["partitions"] = self.partitions
        times = QuantileSketch()
        for rank in range(self.ranks):  # each rank finished its own requests
            times.merge(answers[rank][1])
        merged.update(completion_quantiles(times))
        merged["bct_s"] = max(m["bct_s"] for m in per_rank)
        merged["tokens_per_s"] = merged["generated_tokens"] / merged["bct_s"] if merged["bct_s"] else 0.0
        merged["ranks"] = per_rank
        return merged

    def movable_requests(self, tokens: int, keep=()) -> list[str]:
        """Taken from the rank with the most work left that can give some (a request moves with its rank's KV; a
        rank keeps its last request, so the busiest holding one long request gives none while another may); none
        under tensor parallelism, nor a partitioned straggler (it has every rank already)."""
        if self.replicated or self._partitioned is not None:
            return []
        for rank in sorted(range(self.ranks), key=lambda r: -self._replies[r].load.tokens):
            movable = self._call_now(rank, "movable_requests", tokens, set(keep))
            if movable:
                return movable
        return []

    def export_request(self, request_id: str) -> MigratedRequest | None:
        if request_id == self._partitioned:
            self._end_partition()
        rank = self._where.get(request_id)
        if rank is None or self.replicated:
            return None
        migrated = self._call_now(rank, "export_request", request_id)
        if migrated is not None:
            del self._where[request_id]
        return migrated

    def snapshot_request(self, request_id: str) -> MigratedRequest | None:
        if request_id == self._partitioned:
            self._end_partition()
        rank = self._where.get(request_id)
        return None if rank is None or self.replicated else self._call_now(rank, "snapshot_request", request_id)

    def suspended_requests(self) -> dict[str, int]:
        if self.replicated:
            return {}
        out = {}
        for (suspended,) in self._ask({rank: [RankCall("suspended_requests", ())]
                                       for rank in range(self.ranks)}).values():
            out.update(suspended)
        return out

    def close(self) -> None:
        """Stop every rank and leave the group (a broken group's ranks are killed)."""
        if self._workers is None:
            return
        workers, self._workers = self._workers, None
        try:
            if not self._broken:
                broadcast_round(self.group, None)
                _stop(workers)
        finally:
            _kill(workers)
            leave_rank_group()

    # ------------------------------------------------------------------ internals
    def _place(self, request_id: str, sampling, method: str, payload: Any, rank: int | None = None) -> None:
        """Queue the request on `rank`, else the rank with the least work left (every rank under tensor
        parallelism); it reaches the ranks with the next round."""
        if self.replicated:
            rank = 0
        elif rank is None:
            rank = self._least_loaded()
        for holder in range(self.ranks) if self.replicated else (rank,):
            self._calls[holder].append(RankCall(method, (payload,), request_id))
        self._queued_tokens[rank] += sampling.max_tokens * sampling.n
        self._where[request_id] = rank

    def _check_movable_in(self, what: str) -> None:
        if self.replicated:
            raise InvalidRequestError(f"{what} cannot join a tensor-parallel engine (its KV would have to be split "
                                      "by heads over the ranks)")

    def _rebalance(self) -> None:
        """A rank left with no request takes about half of the busiest rank's remaining output tokens (waiting
        prompts first, then suspended and decoding requests with their KV: Engine.movable_requests), so it
        attends again instead of only serving its experts. Never the busiest rank's last request."""
        loads = [reply.load for reply in self._replies]
        idle = [r for r in range(self.ranks) if loads[r].requests == 0 and not self._calls[r]]
        donor = max(range(self.ranks), key=lambda r: loads[r].tokens)
        if not idle or loads[donor].requests < 2:
            return
        receiver = idle[0]
        moving = self._call_now(donor, "movable_requests", loads[donor].tokens // 2, set())
        exported = self._ask({donor: [RankCall("export_request", (rid,)) for rid in moving]})[donor]
        for rid, migrated in zip(moving, exported):
            if migrated is not None:
                self._calls[receiver].append(RankCall("import_request", (migrated,), rid))
                self._where[rid] = receiver

    @property
    def _one_answers(self) -> bool:
        """Every rank runs the same requests (tensor parallel, or a partitioned straggler): the leader's
        results and load stand for all."""
        return self.replicated or self._partitioned is not None

    def _partition_straggler(self) -> None:
        """When one request is left in the engine and nothing is queued, every rank takes its share of it."""
        if self.partition_error is not None or len(self._where) != 1 or any(self._calls) or self._failed:
            return
        (rid, rank), = self._where.items()
        if self._replies[rank].load.requests != 1:  # placed but not yet there, or not in the engine any more
            return
        migrated = self._call_now(rank, "export_straggler", rid)
        if migrated is None:  # waiting for or part-way through a prefill (a sample's recompute too): not yet
            return
        self._ask({r: [RankCall("start_partition", (migrated,))] for r in range(self.ranks)})
        self._partitioned = rid
        self.partitions += 1

    def _end_partition(self) -> None:
        """Every rank drops its share of the partitioned straggler; one still running moves back to one rank,
        its KV heads joined."""
        rid, self._partitioned = self._partitioned, None
        if rid is None:
            return
        shares = self._ask({r: [RankCall("end_partition", (rid,))] for r in range(self.ranks)})
        parts = [shares[r][0] for r in range(self.ranks)]
        if parts[0] is None:  # it finished (or was aborted) there
            self._where.pop(rid, None)
            return
        migrated = join_heads(parts, self.engine.kv.geometry, self.rank_engines.part_geometry)
        rank = self._least_loaded()
        self._calls[rank].append(RankCall("import_request", (migrated,), rid))
        sampling = migrated.request.sampling  # counted as queued work: the request that ended the partition goes
        self._queued_tokens[rank] += sampling.max_tokens * sampling.n  # to the other rank, not beside it
        self._where[rid] = rank

    def _least_loaded(self) -> int:
        return min(range(self.ranks), key=lambda r: self._replies[r].load.tokens + self._queued_tokens[r])

    def _call_now(self, rank: int, method: str, *args: Any) -> Any:
        """Run one call on `rank` now (with whatever is queued), returning its value or raising its error."""
        return self._ask({rank: [RankCall(method, args)]})[rank][0]

    def _ask(self, calls: dict[int, list[RankCall]]) -> dict[int, list[Any]]:
        """Run these calls now, all in one round (with whatever is queued): each rank's values in call order;
        a refused call raises its error."""
        for rank, own in calls.items():
            self._calls[rank].extend(own)
        replies = self._round(step=False)
        out = {}
        for rank, own in calls.items():
            answered = replies[rank].values[len(replies[rank].values) - len(own):]
            for ok, value in answered:
                if not ok:
                    raise value
            out[rank] = [value for _, value in answered]
        return out

    def _round(self, step: bool) -> list[RankReply]:
        if self._broken:
            raise RuntimeError("the engine group is broken: a rank failed in an earlier round")
        calls, self._calls = self._calls, [[] for _ in range(self.ranks)]
        self._broken = True  # until every rank has replied: a failure part-way leaves the ranks out of step
        broadcast_round(self.group, Round(calls, step))
        replies = gather_replies(self.group, run_round(self.rank_engines, calls[0], step))
        self._broken = False
        for reply, sent in zip(replies, calls):
            for call, (ok, value) in zip(sent, reply.values):
                if not ok and call.request_id is not None:  # a queued request the rank refused
                    self._where.pop(call.request_id, None)
                    self._failed.append(Result(call.request_id, [], error=str(value)))
        self._replies = replies
        self._queued_tokens = [0] * self.ranks
        return replies


def _kill(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _stop(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        try:
            worker.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
