"""The WorkBalancer's decisions (balancing, PARTITION, failures, checkpoints) and the recovery cost
model, on the class itself: no Ray runtime."""

from __future__ import annotations

import asyncio
import re

import pytest

from batchgen.engine import EngineLoad, Result
from batchgen.engine.metrics import EngineMetrics
from batchgen.operators import work_balancer
from batchgen.operators.recovery_cost import Checkpoint, RecoveryCosts, measured_costs, restore_is_faster
from batchgen.operators.work_balancer import WorkBalancer


def load(requests: int, tokens: int) -> EngineLoad:
    return EngineLoad(requests, tokens, 1.0)


def report(balancer: WorkBalancer, worker: str, requests: int, tokens: int, serving: bool = True):
    return balancer.report(worker, (f"actor-{worker}", 0), load(requests, tokens), serving)


def test_the_busiest_actor_gives_half_the_token_difference_to_the_least_loaded_hungry_one():
    balancer = WorkBalancer(low_water=4, partition_below=0, min_share=0.2)
    assert report(balancer, "idle", 1, 10) == (0, None)  # nobody to take from yet
    assert report(balancer, "mid", 6, 110) == (50, "idle")  # (110 - 10) / 2
    assert report(balancer, "busy", 30, 3000) == (1495, "idle")
    assert report(balancer, "mid", 6, 110) == (0, None)  # not the busiest: only the busiest gives
    balancer.send("busy", "idle", [("r1", ["ref1"]), ("r2", ["ref2"]), ("r3", ["ref3"])], kv_bytes=300, tokens=1500)
    assert report(balancer, "busy", 27, 1500) == (0, None)  # "idle" has 1 + 3 requests coming: not hungry
    assert balancer.take("idle") == [("r1", ["ref1"]), ("r2", ["ref2"]), ("r3", ["ref3"])]
    balancer.deliver("idle", [Result("r1", [1])])
    assert balancer.collect("busy") == ([Result("r1", [1])], {})
    assert balancer.collect("busy", ["r1"]) == ([], {})  # said to have arrived: not handed again
    assert (balancer.stats.migrations, balancer.stats.kv_bytes_moved) == (3, 300)


def test_close_loads_and_single_requests_are_left_alone():
    balancer = WorkBalancer(low_water=100, partition_below=0, min_share=0.2)
    report(balancer, "a", 10, 1000)
    assert report(balancer, "b", 10, 1300) == (0, None)  # half the difference is 150 <= 20 % of 1300
    assert report(balancer, "b", 10, 2000) == (500, "a")
    assert report(balancer, "b", 1, 5000) == (0, None)  # one request cannot be split


def test_the_tail_is_partitioned_over_every_serving_actor_hungry_or_not():
    balancer = WorkBalancer(low_water=1, partition_below=16)
    report(balancer, "a", 2, 100)  # not hungry (low water 1), but the job's tail is spread regardless
    report(balancer, "b", 3, 300)
    report(balancer, "c", 0, 0, serving=False)  # between calls: Ray Data may kill it, it takes nothing
    assert report(balancer, "busy", 8, 800) == (350, "a")
    balancer.send("busy", "a", [(f"r{i}", [i]) for i in range(3)], 0, 300)
    assert report(balancer, "busy", 5, 500) == (100, "b")  # now b is the least loaded
    balancer.send("busy", "b", [("s", ["ref"])], 0, 100)
    assert balancer.stats.partition_events == 2
    big = WorkBalancer(low_water=1, partition_below=4)  # the same loads outside the tail: nobody is hungry
    for name, requests, tokens in (("a", 2, 100), ("b", 3, 300), ("busy", 8, 800)):
        assert report(big, name, requests, tokens) == (0, None)


def test_only_an_actor_serving_a_call_takes_work_and_finished_calls_stay_while_work_can_move():
    balancer = WorkBalancer(low_water=4, partition_below=0, min_share=0.2)
    report(balancer, "between-calls", 0, 0, serving=False)
    assert report(balancer, "busy", 20, 2000) == (0, None)
    assert balancer.has_surplus("between-calls")  # a finished call of it would stay open
    report(balancer, "between-calls", 0, 0)
    assert report(balancer, "busy", 20, 2000) == (1000, "between-calls")
    balancer.send("busy", "between-calls", [("r", ["ref"])], 0, 1000)
    report(balancer, "busy", 10, 1000)
    assert balancer.has_surplus("between-calls")  # requests are on their way to it
    balancer.take("between-calls")
    assert balancer.has_surplus("between-calls")  # it holds them
    balancer.deliver("between-calls", [Result("r", [1])])
    report(balancer, "between-calls", 0, 0)
    report(balancer, "busy", 1, 1000)
    assert not balancer.has_surplus("between-calls")  # one request left: nothing to spread


def test_requests_a_taker_could_not_fetch_keep_none_of_its_calls_open():
    balancer = WorkBalancer(low_water=4, partition_below=0, min_share=0.2)
    report(balancer, "owner", 10, 1000)
    report(balancer, "taker", 0, 0)
    balancer.send("owner", "taker", [("a", ["ref-a"]), ("b", ["ref-b"])], 0, 200)
    assert [rid for rid, _ in balancer.take("taker")] == ["a", "b"]
    report(balancer, "owner", 1, 800)
    balancer.unreachable("taker", ["a"])  # its owner's object could not be fetched: the taker never adopted it
    assert balancer.has_surplus("taker")  # it still holds "b"
    balancer.deliver("taker", [Result("b", [1])])
    assert not balancer.has_surplus("taker")  # before the fix "a" stayed held and kept its last call open forever
    # an owner still here gets "a" back to run itself (it waited for its Result for good)
    assert balancer.collect("owner") == ([Result("b", [1])], {"a": None})


def test_a_failed_actor_lookup_does_not_end_the_reaping(monkeypatch):
    balancer = WorkBalancer(low_water=4, partition_below=0)
    for name in ("flaky", "gone", "owner"):
        report(balancer, name, 0, 0)
    balancer.send("owner", "gone", [("r", ["ref"])], 0, 10)
    lookups = []

    def lookup(actor_id: str):
        lookups.append(actor_id)
        if actor_id == "actor-flaky":
            raise ConnectionError("GCS unavailable")
        return {"actor-owner": ("ALIVE", 0)}.get(actor_id, ("UNKNOWN", -1))

    monkeypatch.setattr(work_balancer, "incarnation", lookup)
    monkeypatch.setattr(work_balancer, "STALE_S", 0.0)
    asyncio.run(_one_watch(balancer))  # STALE_S 0: round after round
    assert lookups.count("actor-flaky") >= 2  # the loop went on after the failed lookup
    assert balancer.collect("owner") == ([], {"r": None})  # and reaped "gone"


def test_an_actor_the_table_does_not_know_is_not_alive(monkeypatch):
    monkeypatch.setattr(work_balancer.ray_state, "actors", lambda actor_id: {})
    assert work_balancer.incarnation("actor-x") != ("ALIVE", 0)


def test_requests_held_by_a_dead_actor_go_back_to_their_owner_with_their_checkpoints(monkeypatch):
    balancer = WorkBalancer(low_water=4, partition_below=0)
    report(balancer, "owner", 10, 1000)
    report(balancer, "holder", 0, 0)
    balancer.send("owner", "holder", [("a", ["ref-a"]), ("b", ["ref-b"])], 0, 200)
    balancer.take("holder")
    balancer.send("owner", "holder", [("c", ["ref-c"])], 0, 100)  # sent, not taken yet
    monkeypatch.setattr(work_balancer.ray, "put", stored)
    balancer.checkpoint([(Checkpoint("a", kv_bytes=1000, prompt_tokens=50, generated=40), b"a"),
                         (Checkpoint("b", kv_bytes=10**12, prompt_tokens=5, generated=1), b"b")])
    balancer.report_costs(RecoveryCosts(copy_bytes_per_s=1e9, prefill_s_per_token=1e-3, decode_step_s=1e-2))

    # the actor table: the owner runs as it reported, the holder's actor was restarted (a new incarnation)
    table = {"actor-owner": ("ALIVE", 0), "actor-holder": ("ALIVE", 1)}
    monkeypatch.setattr(work_balancer, "incarnation", table.get)
    monkeypatch.setattr(work_balancer, "STALE_S", 0.0)
    asyncio.run(_one_watch(balancer))
    results, lost = balancer.collect("owner")
    # "a": 1 us to copy its KV against 0.45 s to recompute; "b": 1,000 s against 15 ms; "c": no checkpoint
    assert results == [] and lost == {"a": ["ckpt-a"], "b": None, "c": None}
    assert (balancer.stats.lost, balancer.stats.restored, balancer.stats.recomputed) == (3, 1, 1)
    balancer.send("owner", "holder", [("d", ["ref-d"])], 0, 100)  # named before it died: the owner keeps it
    assert balancer.collect("owner", ["a", "b", "c"]) == ([], {"d": None})
    balancer.deliver("holder", [Result("a", [1])])  # a late Result from the dead holder goes nowhere
    assert balancer.collect("owner", ["d"]) == ([], {})


def test_what_take_and_collect_hand_out_is_handed_again_until_the_actor_says_it_arrived():
    """A reply lost on its way (a passing network failure: Ray's ActorUnavailableError, after the call ran) lost the
    moved requests it carried, or their Results: their owners waited for good."""
    balancer = WorkBalancer(low_water=4, partition_below=0, min_share=0.2)
    report(balancer, "owner", 10, 1000)
    report(balancer, "taker", 0, 0)
    balancer.send("owner", "taker", [("a", ["ref-a"])], 0, 100)
    assert balancer.take("taker") == [("a", ["ref-a"])]  # this answer was lost
    balancer.send("owner", "taker", [("b", ["ref-b"])], 0, 100)
    assert balancer.take("taker") == [("a", ["ref-a"]), ("b", ["ref-b"])]
    assert balancer.take("taker", ["a", "b"]) == []
    balancer.deliver("taker", [Result("a", [1])])
    balancer.deliver("taker", [Result("a", [1])])  # delivered again (its first answer lost): passed on once
    assert balancer.collect("owner") == ([Result("a", [1])], {})  # this answer was lost
    assert balancer.collect("owner") == ([Result("a", [1])], {})
    assert balancer.collect("owner", ["a"]) == ([], {})


async def _one_watch(balancer: WorkBalancer) -> None:
    task = asyncio.create_task(balancer.watch_workers())
    await asyncio.sleep(0.05)
    task.cancel()


def stored(blob: bytes) -> str:
    """Stands in for ray.put: the object the balancer keeps for a checkpoint."""
    return f"ckpt-{blob.decode()}"


def test_a_rerun_task_restores_only_the_requests_worth_restoring_and_finished_ones_are_forgotten(monkeypatch):
    balancer = WorkBalancer(low_water=4, partition_below=0)
    monkeypatch.setattr(work_balancer.ray, "put", stored)
    balancer.checkpoint([(Checkpoint("row-1", 1000, 50, 40), b"1"), (Checkpoint("row-2", 1000, 50, 40), b"2")])
    assert balancer.recovered(["row-1", "row-2", "row-3"]) == {}  # no costs measured yet: recompute
    balancer.report("w", ("actor-w", 0), load(1, 1), True, RecoveryCosts(1e9, 1e-3, 1e-2))
    balancer.done(["row-2"])
    assert balancer.checkpointed(["row-1", "row-2"]) == {"row-1": 40}
    assert balancer.recovered(["row-1", "row-2", "row-3"]) == {"row-1": ["ckpt-1"]}
    # a moved request's holder delivers its Result: its checkpoint goes too (one stored by the holder after the
    # owner's `done` was kept for good)
    report(balancer, "holder", 0, 0)
    balancer.checkpoint([(Checkpoint("row-4", 1000, 50, 40), b"4")])
    balancer.deliver("holder", [Result("row-4", [1])])
    assert balancer.checkpointed(["row-4"]) == {} and balancer.summary().held_checkpoints == 1  # row-1's


def test_recovery_cost_compares_the_copy_with_prefill_and_decode_again():
    costs = RecoveryCosts(copy_bytes_per_s=1e8, prefill_s_per_token=1e-3, decode_step_s=2e-2)
    # recompute: 100 * 1 ms + 10 * 20 ms = 0.3 s
    assert restore_is_faster(Checkpoint("r", kv_bytes=2 * 10**7, prompt_tokens=100, generated=10), costs)  # 0.2 s
    assert not restore_is_faster(Checkpoint("r", kv_bytes=4 * 10**7, prompt_tokens=100, generated=10), costs)


def test_the_prefill_rate_counts_the_tokens_recompute_preemptions_prefilled_in_the_same_steps():
    stats = EngineMetrics(prompt_tokens=300, recomputed_tokens=100, prefill_step_seconds=2.0, decode_steps=12,
                          mixed_steps=2, decode_step_seconds=0.5)
    costs = measured_costs(stats, copied_bytes=10**6, copy_s=0.01)
    assert costs == RecoveryCosts(copy_bytes_per_s=1e8, prefill_s_per_token=2.0 / 400, decode_step_s=0.05)


def test_the_checkpoint_period_is_the_balancers_and_must_be_positive():
    assert WorkBalancer().checkpoint_period() == work_balancer.CHECKPOINT_S
    assert WorkBalancer(checkpoint_s=0.25).checkpoint_period() == 0.25
    for bad in (0, -1.0, float("nan"), float("inf"), True, None, "2"):
        message = f"checkpoint_s must be a positive number of seconds, got {re.escape(repr(bad))}"
        with pytest.raises(ValueError, match=message):
            WorkBalancer(checkpoint_s=bad)
        with pytest.raises(ValueError, match=message):  # on the driver, before the actor (no Ray started here)
            work_balancer.start_work_balancer(checkpoint_s=bad)
