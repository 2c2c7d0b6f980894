"""The job-wide coordinator of MIGRATE between engine actors: a Ray actor that only records loads and
passes object references (the engines stay Ray-free behind EngineLoop; operators/balancing.py is each
engine actor's side).

Every engine actor reports its load (EngineLoad) every REPORT_S, never per token, and is told what to
export and to whom:
- balancing: an actor serving a call with fewer than `low_water` requests, counting those on their way
  to it, is hungry; the busiest actor (by output tokens still to generate) gives the least loaded
  hungry one requests worth about half the difference, oldest first. Loads within `min_share` of the
  busier one are left alone.
- PARTITION: once the whole job holds fewer than `partition_below` requests, its tail is spread evenly
  the same way over every actor serving a call, hungry or not.
Only an actor serving a call takes work: Ray Data keeps such an actor, while it may kill one without a
task at any time once the input is exhausted.

A moved request has one holder at a time, so no two live actors decode it. Its Result comes back
here and on to the actor that exported it (its owner), whose task returns it, exactly once.

Failures. An actor that has not reported for STALE_S is looked up in Ray's actor table: unless it is
alive and still the incarnation that reported (Ray restarts a dead actor under the same id), it is
dead: the requests it held go back to their owners, each with its latest checkpoint. Results
addressed to a dead owner are dropped: Ray Data reruns the owner's tasks, and the rerun recovers each
request (`recover`).

Checkpoints. Engine actors hand over snapshots of their requests suspended in host pages, which this
actor stores as objects it owns so that they outlive the engine actor; the latest per request id is
kept until the request is done. `recover` decides per request between its checkpoint and recomputing
it from the prompt, by the costs the engine actors measured (operators/recovery_cost.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray._private import state as ray_state

from batchgen.engine.engine_load import EngineLoad
from batchgen.operators.recovery_cost import Checkpoint, RecoveryCosts, restore_is_faster

log = logging.getLogger(__name__)

REPORT_S = 0.25  # how often an engine actor reports and exchanges moved requests and their Results
STALE_S = 2.0  # an actor silent this long is checked for life
CHECKPOINT_S = 2.0  # how often an engine actor checkpoints its suspended requests, by default (WorkBalancer)
MIN_SHARE = 0.05  # a move of half the difference below this share of the busier load is left undone (loads within
# 10 % of each other stay put: a move costs KV copies)


@dataclass
class _Worker:
    actor: tuple[str, int]  # its actor id and restart count (`incarnation`), to tell whether it is alive
    load: EngineLoad = field(default_factory=lambda: EngineLoad(0, 0, 0.0))
    serving: bool = False  # a call of its UDF is running: Ray Data keeps it, it can take work
    seen: float = 0.0
    incoming: list[tuple[str, str, Any]] = field(default_factory=list)  # (owner, request id, ref) to take
    incoming_requests: int = 0  # sent to it since its last report (taken or not): not in its load yet
    incoming_tokens: int = 0
    holding: dict[str, str] = field(default_factory=dict)  # request id -> owner, for requests it took
    # handed to it by `take` or `collect`, kept (and handed again) until it says they arrived: a reply can be lost
    # on its way (a passing network failure: Ray's ActorUnavailableError, the call may or may not have run)
    taking: dict[str, Any] = field(default_factory=dict)  # request id -> ref
    results: list[Any] = field(default_factory=list)  # Results of its own requests, finished elsewhere
    lost: list[str] = field(default_factory=list)  # its own requests whose holder died
    recovering: dict[str, list | None] = field(default_factory=dict)  # lost ones, as `recover` answered once

    @property
    def requests(self) -> int:
        return self.load.requests + self.incoming_requests

    @property
    def tokens(self) -> int:
        return self.load.tokens + self.incoming_tokens


@dataclass
class BalancerStats:
    migrations: int = 0  # requests moved between engine actors
    kv_bytes_moved: int = 0
    partition_events: int = 0  # moves made while the job's tail is spread (PARTITION)
    lost: int = 0  # moved requests whose holder died (returned to their owners)
    restored: int = 0  # requests recovered from a checkpoint
    recomputed: int = 0  # requests recovered from their prompt
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    held_checkpoints: int = 0  # kept now: requests not yet done (or never told done: a leak)
    busy_s: dict[str, float] = field(default_factory=dict)  # engine actor -> time in engine steps


class WorkBalancer:
    def __init__(self, low_water: int | None = None, partition_below: int | None = None,
                 min_share: float = MIN_SHARE, checkpoint_s: float = CHECKPOINT_S) -> None:
        """`low_water` / `partition_below`: None takes each engine's own, as it reports them in its load (its
        refill threshold in requests; the largest batch of any engine). `checkpoint_s`: how often each engine
        actor hands over checkpoints of its suspended requests (more often: less rerun after a crash, more copies)."""
        check_checkpoint_period(checkpoint_s)
        self.low_water, self.partition_below, self.min_share = low_water, partition_below, min_share
        self.checkpoint_s = checkpoint_s
        self._workers: dict[str, _Worker] = {}
        self._checkpoints: dict[str, Checkpoint] = {}
        self._costs: RecoveryCosts | None = None
        self.stats = BalancerStats()

    def checkpoint_period(self) -> float:
        """Seconds between an engine actor's checkpoints (its agent asks once)."""
        return self.checkpoint_s

    # ------------------------------------------------------------ loads and moves
    def report(self, worker: str, actor: tuple[str, int], load: EngineLoad, serving: bool,
               costs: RecoveryCosts | None = None) -> tuple[int, str | None]:
        """Record `worker`'s load and whether it is serving a call (`actor`: its actor id and restart
        count); returns (output tokens' worth of requests it should export now, to whom)."""
        me = self._workers.setdefault(worker, _Worker(actor))
        me.load, me.serving, me.seen = load, serving, time.monotonic()
        me.incoming_requests = me.incoming_tokens = 0
        self.stats.busy_s[worker] = load.busy_s
        if costs is not None:
            self._costs = costs
        return self._plan(worker)

    def _plan(self, worker: str) -> tuple[int, str | None]:
        """The busiest actor (by output tokens still to generate) gives the least loaded actor serving a
        call half the difference; outside the job's tail only to an actor short of requests."""
        me = self._workers[worker]
        takers = {name: w for name, w in self._workers.items() if name != worker and w.serving}
        if not takers or me.load.requests < 2 or max(self._workers.values(), key=lambda w: w.tokens) is not me:
            return 0, None
        if not self._in_tail():
            takers = {name: w for name, w in takers.items()
                      if w.requests < (w.load.refill_below if self.low_water is None else self.low_water)}
        if not takers:
            return 0, None
        target = min(takers, key=lambda name: takers[name].tokens)
        surplus = int(self._surplus(me.tokens, takers[target].tokens))
        return (surplus, target) if surplus else (0, None)

    def _in_tail(self) -> bool:
        below = self.partition_below
        if below is None:
            below = max(w.load.batch for w in self._workers.values())
        return sum(w.requests for w in self._workers.values()) < below

    def _surplus(self, busy: int, idle: int) -> float:
        """Tokens to move from a `busy` load to an `idle` one: half the difference, 0 while that is within
        `min_share` of the busy load (a move would cost more than it evens out)."""
        half = (busy - idle) / 2
        return half if half > self.min_share * busy else 0.0

    def has_surplus(self, worker: str) -> bool:
        """Whether `worker` should keep a finished call open: requests were sent to it or it holds some, or
        another actor has enough more work that some of it would move to it."""
        me = self._workers.get(worker)
        if me is None:
            return False
        if me.incoming or me.holding:
            return True
        return any(other.load.requests > 1 and self._surplus(other.tokens, me.tokens)
                   for name, other in self._workers.items() if name != worker)

    def send(self, owner: str, target: str, items: list[tuple[str, list]], kv_bytes: int, tokens: int) -> None:
        """`owner` exported these (request id, [ref]) for `target`, carrying `kv_bytes` of KV and `tokens`
        output tokens still to generate, in all."""
        destination = self._workers.get(target)
        if destination is None:  # died since: the owner runs them itself
            self._return_to_owner(owner, [rid for rid, _ in items])
            return
        destination.incoming.extend((owner, rid, wrapped[0]) for rid, wrapped in items)
        destination.incoming_requests += len(items)
        destination.incoming_tokens += tokens
        if owner in self._workers:  # until its next report says so itself
            self._workers[owner].incoming_requests -= len(items)
            self._workers[owner].incoming_tokens -= tokens
        self.stats.partition_events += self._in_tail()
        self.stats.migrations += len(items)
        self.stats.kv_bytes_moved += kv_bytes

    def take(self, worker: str, received: Iterable[str] = ()) -> list[tuple[str, list]]:
        """The moved requests waiting for `worker`: (request id, [ref]), the ref wrapped in a list (so it stays a
        ref); those of an earlier call are handed again until `received` (what its last answer brought) names
        them."""
        me = self._workers.get(worker)
        if me is None:
            return []
        for rid in received:
            me.taking.pop(rid, None)
        items, me.incoming = me.incoming, []
        me.holding.update((rid, owner) for owner, rid, _ in items)
        me.taking.update((rid, ref) for _, rid, ref in items)
        return [(rid, [ref]) for rid, ref in me.taking.items()]

    def unreachable(self, worker: str, request_ids: list[str]) -> None:
        """`worker` took these but could not fetch them: it does not hold them, so they keep none of its calls open.
        Their owner died, most likely, and its objects with it (Ray Data reruns the owner's tasks, which recover
        them); an owner still here (the fetch failed otherwise) gets them back to run itself."""
        me = self._workers.get(worker)
        if me is not None:
            for rid in request_ids:
                owner = me.holding.pop(rid, None)
                if owner is not None:
                    self._return_to_owner(owner, [rid])

    def deliver(self, worker: str, results: list[Any]) -> None:
        """Results of requests `worker` took, for their owners (their checkpoints are of no use any more: a holder's
        checkpoint stored after the owner said `done` was kept to the job's end)."""
        me = self._workers.get(worker)
        for result in results:
            self._checkpoints.pop(result.request_id, None)
            owner = me.holding.pop(result.request_id, None) if me is not None else None
            if owner in self._workers:
                self._workers[owner].results.append(result)

    def collect(self, worker: str, received: Iterable[str] = ()) -> tuple[list[Any], dict[str, list | None]]:
        """(Results of `worker`'s own requests finished elsewhere, {request id: [checkpoint ref] or None}
        for its requests lost with their holder); handed again until `received` (the request ids its last answer
        brought) names them."""
        me = self._workers.get(worker)
        if me is None:
            return [], {}
        received = set(received)
        me.results = [result for result in me.results if result.request_id not in received]
        for rid in received:
            me.recovering.pop(rid, None)
        lost, me.lost = me.lost, []
        me.recovering.update(self.recover(lost))
        return list(me.results), dict(me.recovering)

    # ------------------------------------------------------------ checkpoints and recovery
    def checkpoint(self, items: list[tuple[Checkpoint, bytes]]) -> None:
        """Keep each request's latest snapshot (pickled MigratedRequest) as an object this actor owns."""
        for info, blob in items:
            self._checkpoints[info.request_id] = info.with_ref(ray.put(blob))
            self.stats.checkpoints += 1
            self.stats.checkpoint_bytes += info.kv_bytes

    def report_costs(self, costs: RecoveryCosts | None) -> None:
        """Recovery costs as an engine actor measured them (its checkpoint copies included)."""
        if costs is not None:
            self._costs = costs

    def checkpointed(self, request_ids: list[str]) -> dict[str, int]:
        """{request id: generated tokens at its checkpoint} for those of `request_ids` that have one."""
        return {rid: self._checkpoints[rid].generated for rid in request_ids if rid in self._checkpoints}

    def done(self, request_ids: list[str]) -> None:
        """These requests finished: their checkpoints are dropped."""
        for rid in request_ids:
            self._checkpoints.pop(rid, None)

    def recover(self, request_ids: list[str]) -> dict[str, list | None]:
        """For requests that must run again: {request id: [checkpoint ref]} where restoring it is faster
        than recomputing (measured costs), None where it is not or there is no checkpoint."""
        out: dict[str, list | None] = {}
        for rid in request_ids:
            point = self._checkpoints.get(rid)
            restore = point is not None and self._costs is not None and restore_is_faster(point, self._costs)
            out[rid] = [point.ref] if restore else None
            if restore:
                self.stats.restored += 1
            elif point is not None:
                self.stats.recomputed += 1
        return out

    def recovered(self, request_ids: list[str]) -> dict[str, list]:
        """`recover` for the rows of a rerun task: only the requests to restore from a checkpoint."""
        known = [rid for rid in request_ids if rid in self._checkpoints]
        return {rid: ref for rid, ref in self.recover(known).items() if ref is not None}

    def summary(self) -> BalancerStats:
        return dataclasses.replace(self.stats, held_checkpoints=len(self._checkpoints))

    # ------------------------------------------------------------ failures
    async def watch_workers(self) -> None:
        """Runs for the actor's life (started by start_work_balancer): reaps dead engine actors."""
        while True:
            await asyncio.sleep(STALE_S / 2)
            now = time.monotonic()
            for name, worker in list(self._workers.items()):
                if now - worker.seen <= STALE_S:
                    continue
                try:
                    alive = incarnation(worker.actor[0]) == ("ALIVE", worker.actor[1])
                except Exception:  # noqa: BLE001 - one failed lookup must not end the reaping for the job
                    log.exception("work balancer: looking up engine actor %s failed", name)
                    continue
                if not alive:
                    self._reap(name)

    def _reap(self, name: str) -> None:
        worker = self._workers.pop(name, None)
        if worker is None:
            return
        orphans = [(owner, rid) for rid, owner in worker.holding.items()]
        orphans += [(owner, rid) for owner, rid, _ in worker.incoming]
        for owner, rid in orphans:
            self._return_to_owner(owner, [rid])
            self.stats.lost += 1

    def _return_to_owner(self, owner: str, request_ids: list[str]) -> None:
        if owner in self._workers:
            self._workers[owner].lost.extend(request_ids)


def incarnation(actor_id: str) -> tuple[str, int]:
    """(state, restarts) of an actor, from Ray's actor table (GCS): a restarted actor keeps its id but
    counts one more restart, so ("ALIVE", n) tells whether the incarnation that reported is still up."""
    info = ray_state.actors(actor_id)  # {} for an actor the table does not know (any more): not alive
    return info.get("State", "UNKNOWN"), info.get("NumRestarts", -1)


def check_checkpoint_period(checkpoint_s: Any) -> None:
    """ValueError unless `checkpoint_s` is a finite, positive number of seconds (not a bool)."""
    if isinstance(checkpoint_s, bool) or not isinstance(checkpoint_s, (int, float)) \
            or not 0 < checkpoint_s < math.inf:
        raise ValueError(f"checkpoint_s must be a positive number of seconds, got {checkpoint_s!r}")


def start_work_balancer(low_water: int | None = None, partition_below: int | None = None,
                        checkpoint_s: float = CHECKPOINT_S) -> Any:
    """The job's WorkBalancer actor (no CPU of its own: it records loads and passes references); thresholds
    and checkpoint period as WorkBalancer takes them, the period checked here (an actor's constructor error
    would surface only once the engine actors first call it)."""
    check_checkpoint_period(checkpoint_s)
    balancer = ray.remote(num_cpus=0, max_concurrency=1000)(WorkBalancer).remote(
        low_water, partition_below, checkpoint_s=checkpoint_s)
    balancer.watch_workers.remote()
    return balancer
