"""An engine actor's side of MIGRATE: reports its load to the job's WorkBalancer, moves requests, and
checkpoints the requests it holds suspended in host pages.

Runs on a thread of its own from the actor's construction (an actor Ray Data has given no batch yet
is the idlest, and must be able to take work), every REPORT_S: report the load the engine loop
published after its last step (never waiting for a step); export what the balancer asks for and send
it on; adopt what was sent here (both between two engine steps); send the Results of
adopted requests back towards their owners; complete this actor's own moved requests with the
Results that came back, and rerun those whose holder died (from a checkpoint where that is faster).
Every checkpoint period (the balancer's `checkpoint_s`) it hands the balancer snapshots of its suspended
requests that have decoded CHECKPOINT_TOKENS more tokens since their last checkpoint; the balancer stores
them as its own objects, so that they outlive this actor.

Ray Data does not know about moved requests: it scales an actor pool down by killing actors that have
no task once the input is exhausted, which is exactly when the tail is left to balance. So an actor
takes work only while one of its calls is running (`serving`), and a call whose own rows are done
stays (`linger`) while this actor holds moved requests or another actor has work to spare: the idle
actor keeps its last task open, Ray Data keeps the actor, and the tail is shared.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from batchgen.engine import Engine, EngineLoad, EngineLoop, InvalidRequestError, MigratedRequest, Result
from batchgen.operators.recovery_cost import Checkpoint, RecoveryCosts, measured_costs
from batchgen.operators.work_balancer import REPORT_S, incarnation

log = logging.getLogger(__name__)

LINGER_GRACE_S = 4 * REPORT_S  # a finished call waits this long for fresh loads before asking to stay
CHECKPOINT_TOKENS = 16  # a request is checkpointed again once it decoded this many more tokens


async def run_requests(loop: EngineLoop, agent: BalancingAgent | None, request_ids: list[str],
                       add: Callable[[Engine, int], None]) -> list[Result]:
    """A UDF call's requests through its actor's engine (`add(engine, i)` adds the i-th), balanced with
    the other engine actors when the actor has an agent."""
    if agent is not None:
        return await agent.run(request_ids, add)
    return await loop.run(request_ids, add)


class BalancingAgent:
    def __init__(self, balancer: Any, loop: EngineLoop) -> None:
        self.balancer, self.loop = balancer, loop
        self.name = uuid.uuid4().hex[:12]
        actor_id = ray.get_runtime_context().get_actor_id()
        self.actor = (actor_id, incarnation(actor_id)[1])  # how the balancer tells this incarnation is alive
        self._finished: list[Result] = []  # Results of adopted requests, filled on the engine thread
        self._holding: set[str] = set()  # adopted requests whose Result has not been sent back yet (a request moved
        # here again, its owner's task rerun elsewhere, is one request: the loop runs it once)
        self._serving = 0  # calls of this actor's UDF in progress
        self._checkpointed: dict[str, int] = {}  # request id -> generated tokens at its last checkpoint
        self._done: list[str] = []  # this actor's requests finished since the last exchange
        # request ids the last `take` and `collect` answers brought, told to the balancer with the next call of each
        # (it hands them again until then)
        self._taken: list[str] = []
        self._collected: list[str] = []
        self._copied_bytes, self._copy_s = 0, 0.0
        self._last_checkpoint = time.monotonic()
        self._checkpoint_s: float | None = None  # the balancer's period, asked at the first exchange
        self._lock = threading.Lock()
        threading.Thread(target=asyncio.run, args=(self._cycle(),), name="batchgen-balancing", daemon=True).start()

    # ------------------------------------------------------------ the UDF's side
    async def run(self, request_ids: list[str], add: Callable[[Engine, int], None]) -> list[Result]:
        """EngineLoop.run for a UDF call's requests (`add(engine, i)` adds the i-th), each restored from its
        checkpoint instead where the task runs again after an actor died and that is faster. Meanwhile the
        actor may be given work (it is serving); the call stays while this actor holds moved requests or
        another has work to spare."""
        restored = await self._recovered(request_ids)

        def restore_or_add(engine: Engine, i: int) -> None:
            if request_ids[i] in restored:
                try:
                    engine.import_request(restored[request_ids[i]])
                    return
                except InvalidRequestError:
                    pass  # recomputed instead
            add(engine, i)

        with self._lock:
            self._serving += 1
        try:
            results = await self.loop.run(request_ids, restore_or_add)
            with self._lock:  # told by the exchange, after any checkpoint of them it is storing
                self._done.extend(request_ids)
            await self._linger()
        finally:
            with self._lock:
                self._serving -= 1
        return results

    async def _recovered(self, request_ids: list[str]) -> dict[str, MigratedRequest]:
        """Checkpoints to continue from, for the requests of a task Ray Data runs again after an actor died
        (those worth restoring; the others run from their prompts)."""
        refs = await self.balancer.recovered.remote(request_ids)
        blobs = await asyncio.gather(*(wrapped[0] for wrapped in refs.values()))
        return {rid: pickle.loads(blob) for rid, blob in zip(refs, blobs)}

    async def _linger(self) -> None:
        """Only the actor's last call in progress stays: any other keeps the actor serving. It first waits
        LINGER_GRACE_S for fresh loads (this actor's and the others'), then stays while it should."""
        waited = 0.0
        while True:
            with self._lock:
                holding, others = bool(self._holding), self._serving > 1
            if others:
                return
            if waited >= LINGER_GRACE_S and not holding and not await self.balancer.has_surplus.remote(self.name):
                return
            await asyncio.sleep(REPORT_S)
            waited += REPORT_S

    # ------------------------------------------------------------ the agent's thread
    async def _cycle(self) -> None:
        while True:
            try:
                await self._exchange()
            except ray.exceptions.ActorDiedError:
                return  # the balancer is gone: the job ended
            except ray.exceptions.ActorUnavailableError:  # a passing network failure: the next exchange tries again
                log.warning("engine actor %s: the work balancer is unreachable for now", self.name, exc_info=True)
            except Exception:  # noqa: BLE001 - one failed exchange must not end balancing for the job
                log.exception("engine actor %s: a balancing exchange failed", self.name)
            await asyncio.sleep(REPORT_S)

    async def _exchange(self) -> None:
        with self._lock:
            serving = self._serving > 0
        load = self.loop.load
        if self.loop.failure is not None:  # a failed engine takes no work, and holds none for others to wait on
            serving, load = False, EngineLoad(0, 0, load.busy_s)
        give, target = await self.balancer.report.remote(self.name, self.actor, load, serving, self._costs())
        if give:
            moved = await asyncio.wrap_future(self.loop.export(give))
            try:
                if moved:  # objects owned by this actor: lost with it, when its tasks run again anyway
                    items = [(m.request.request_id, [ray.put(m)]) for m in moved]
                    await self.balancer.send.remote(self.name, target, items, sum(m.kv_bytes for m in moved),
                                                    sum(m.remaining_tokens for m in moved))
            except Exception:  # not sent: they continue here (only this actor held them)
                self.loop.rerun({m.request.request_id: m for m in moved})
                raise
        incoming = await self.balancer.take.remote(self.name, self._taken)
        if incoming:
            # a request whose owner died before it got here is gone with its owner's objects: nobody waits
            # for it (Ray Data reruns the owner's tasks), and this actor does not hold it
            fetched = await asyncio.gather(*(wrapped[0] for _, wrapped in incoming), return_exceptions=True)
            adopted = [m for m in fetched if not isinstance(m, Exception)]
            unreachable = [rid for (rid, _), m in zip(incoming, fetched) if isinstance(m, Exception)]
            if unreachable:
                await self.balancer.unreachable.remote(self.name, unreachable)
            with self._lock:
                self._holding.update(m.request.request_id for m in adopted)
            await asyncio.wrap_future(self.loop.adopt(adopted, self._adopted_done))
        self._taken = [rid for rid, _ in incoming]
        with self._lock:
            done, self._finished = self._finished, []
        if done:
            try:
                await self.balancer.deliver.remote(self.name, done)
            except Exception:  # delivered again next time (the balancer passes a Result on once)
                with self._lock:
                    self._finished[:0] = done
                raise
            with self._lock:
                self._holding.difference_update(result.request_id for result in done)
            for result in done:  # adopted requests this actor checkpointed: finished
                self._checkpointed.pop(result.request_id, None)
        results, lost = await self.balancer.collect.remote(self.name, self._collected)
        if results:
            self.loop.resolve(results)
        if lost:  # (handed over once: a checkpoint that cannot be fetched means running from the prompt)
            points = {}
            for rid, wrapped in lost.items():
                if wrapped is not None:
                    try:
                        points[rid] = pickle.loads(await wrapped[0])
                    except Exception:  # noqa: BLE001
                        log.warning("engine actor %s: the checkpoint of %s is gone; it runs again from its prompt",
                                    self.name, rid, exc_info=True)
            self.loop.rerun({rid: points.get(rid) for rid in lost})
        self._collected = [result.request_id for result in results] + list(lost)
        if self._checkpoint_s is None:
            self._checkpoint_s = await self.balancer.checkpoint_period.remote()
        if time.monotonic() - self._last_checkpoint > self._checkpoint_s:
            self._last_checkpoint = time.monotonic()
            await self._store_checkpoints(await asyncio.wrap_future(self.loop.snapshot(self._checkpoint_is_recent)))
        with self._lock:
            finished, self._done = self._done, []
        if finished:  # after their last checkpoints: one stored after `done` was kept by the balancer for good
            for rid in finished:
                self._checkpointed.pop(rid, None)
            await self.balancer.done.remote(finished)

    def _checkpoint_is_recent(self, request_id: str, generated: int) -> bool:
        last = self._checkpointed.get(request_id)
        return last is not None and generated - last < CHECKPOINT_TOKENS

    async def _store_checkpoints(self, snapshots: list[MigratedRequest]) -> None:
        """Each snapshot to the balancer, which stores it as an object of its own (so it outlives this
        actor), pickled here so the balancer's process needs no torch. The time it takes is the copy
        bandwidth a restore is costed at."""
        if not snapshots:
            return
        started = time.perf_counter()
        items = [(Checkpoint(m.request.request_id, m.kv_bytes, len(m.request.prompt_token_ids), m.generated_tokens),
                  pickle.dumps(m, protocol=5)) for m in snapshots]
        await self.balancer.checkpoint.remote(items)
        self._copy_s += time.perf_counter() - started
        self._copied_bytes += sum(info.kv_bytes for info, _ in items)
        self._checkpointed.update((info.request_id, info.generated) for info, _ in items)
        await self.balancer.report_costs.remote(self._costs())

    def _costs(self) -> RecoveryCosts | None:
        return measured_costs(self.loop.engine.stats, self._copied_bytes, self._copy_s)

    def _adopted_done(self, result: Result) -> None:
        with self._lock:
            self._finished.append(result)
