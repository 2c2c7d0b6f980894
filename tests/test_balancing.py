"""MIGRATE between real engine actors on a local Ray runtime (fractional CPUs): an idle actor takes work
from a busy one, outputs unchanged, greedy and seeded; an actor killed while it holds moved requests
loses and repeats nothing; an actor killed after checkpointing restores those requests from their KV
and recomputes the others."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
import ray
from crash_injection import crashing_agent, read_marker
from pipeline_helpers import ENGINE, engine_outputs, workload

from batchgen.connectors.indexed_parquet import ROW_INDEX
from batchgen.operators import BatchGen
from batchgen.operators.work_balancer import start_work_balancer

pytestmark = pytest.mark.slow  # end to end on a Ray runtime

LONG = {"temperature": 0.0, "max_tokens": 384, "ignore_eos": True}  # long enough that the idle actor,
# after its linger grace, finds work left even when it lent the busy one its thread (operators/thread_lending.py)
SEEDED = {"temperature": 0.9, "seed": 7, "max_tokens": 384, "ignore_eos": True}
SHORT = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}  # long enough to see the other's load


def skewed_blocks(prompts: list[str]) -> tuple[list[pa.Table], list[list[int]]]:
    """Two numbered blocks: the first all long outputs (greedy and seeded), the second all short; and
    what the engine alone generates for each row."""
    half = len(prompts) // 2
    quarter = half // 2
    params = [LONG] * quarter + [SEEDED] * (half - quarter) + [SHORT] * half
    blocks = [pa.table({ROW_INDEX: list(range(i, i + half)), "prompt": prompts[i : i + half],
                        "sampling_params": params[i : i + half]}) for i in (0, half)]
    return blocks, [tokens for start, stop, p in ((0, quarter, LONG), (quarter, half, SEEDED), (half, 2 * half, SHORT))
                    for tokens in engine_outputs(ENGINE_MODEL[0], prompts[start:stop], p)]


ENGINE_MODEL: list[str] = []  # the tiny-moe directory, set by the fixture of each test


def run_two_actors(stage: type, blocks: list[pa.Table], balancer, engine: dict) -> list[dict]:
    """A block per actor (one task in flight each, both actors started before the first task: else the
    first one ready may take both blocks in turn), every row's output sorted by row index."""
    context = ray.data.DataContext.get_current()
    wait = context.wait_for_min_actors_s
    context.wait_for_min_actors_s = 120
    try:
        ds = ray.data.from_arrow(blocks).map_batches(
            stage, batch_size=blocks[0].num_rows, batch_format="pyarrow", num_cpus=0.5,
            compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1),
            fn_constructor_kwargs={"model": ENGINE_MODEL[0], "balancer": balancer, **engine})
        return sorted(ds.take_all(), key=lambda r: r[ROW_INDEX])
    finally:
        context.wait_for_min_actors_s = wait


def test_an_idle_actor_takes_work_from_a_busy_one_and_outputs_do_not_change(ray_cluster, tiny_moe_dir):
    """The actor done with its short rows keeps its call open, takes part of the other's long rows (and
    their KV) and sends the Results back to the owner's task: nothing is rerun."""
    ENGINE_MODEL[:] = [tiny_moe_dir]
    blocks, expected = skewed_blocks(workload(24))
    balancer = start_work_balancer(low_water=64, partition_below=0)
    rows = run_two_actors(BatchGen, blocks, balancer, ENGINE)
    assert [r[ROW_INDEX] for r in rows] == list(range(24))
    assert [list(r["generated_token_ids"]) for r in rows] == expected
    assert all(r["error"] is None for r in rows)
    stats = ray.get(balancer.summary.remote())
    assert stats.migrations > 0 and stats.lost == 0, stats
    assert len(stats.busy_s) == 2 and all(s > 0 for s in stats.busy_s.values())
    ray.kill(balancer)


def test_an_actor_killed_holding_moved_requests_loses_and_repeats_nothing(ray_cluster, tiny_moe_dir, tmp_path):
    """The idle actor dies right after adopting the busy one's requests: the balancer finds it dead,
    the requests go back to their owner, which runs them again; Ray Data reruns the dead actor's task."""
    ENGINE_MODEL[:] = [tiny_moe_dir]
    blocks, expected = skewed_blocks(workload(24))
    balancer = start_work_balancer(low_water=64, partition_below=0)
    marker = tmp_path / "crashed"
    rows = run_two_actors(crashing_agent(BatchGen, marker=marker, moment="adopted"), blocks, balancer, ENGINE)
    assert read_marker(marker)["moment"] == "adopted"
    assert [r[ROW_INDEX] for r in rows] == list(range(24))  # every row once
    assert [list(r["generated_token_ids"]) for r in rows] == expected
    stats = ray.get(balancer.summary.remote())
    assert stats.lost > 0, stats
    ray.kill(balancer)


def test_a_dead_actors_checkpointed_requests_restore_from_kv_and_the_others_are_recomputed(
        ray_cluster, tiny_moe_dir, tmp_path):
    """A device KV pool of a few sequences: most long requests wait in host pages, and are checkpointed.
    The actor dies right after its third store of checkpoints (the first alone prices a restore at one small
    copy's bandwidth, a call's fixed cost mostly, and on a fast enough box every recompute looked cheaper: none was
    restored in one of four runs on the AVX2 dev box); Ray Data runs its task again on the restarted actor,
    which restores the checkpointed requests (their KV is cheaper to copy than to recompute) and runs
    the others from their prompts. Every row's tokens are those of the engine alone."""
    ENGINE_MODEL[:] = [tiny_moe_dir]
    prompts = workload(12)
    # 384 tokens each, checkpoints every 0.25 s: the job outlasts the first ones on any box
    blocks = [pa.table({ROW_INDEX: list(range(12)), "prompt": prompts, "sampling_params": [SEEDED] * 6 + [LONG] * 6})]
    expected = engine_outputs(tiny_moe_dir, prompts[:6], SEEDED) + engine_outputs(tiny_moe_dir, prompts[6:], LONG)
    balancer = start_work_balancer(low_water=1, partition_below=0, checkpoint_s=0.25)
    marker = tmp_path / "crashed"
    tight = {**ENGINE, "kv_budget_bytes": 1 << 20, "page_size": 4, "b_attn": 2}  # 512 tokens: about 2 requests
    ds = ray.data.from_arrow(blocks).map_batches(
        crashing_agent(BatchGen, marker=marker, moment="checkpointed", stores=3), batch_size=12, batch_format="pyarrow",
        num_cpus=0.5, compute=ray.data.ActorPoolStrategy(size=1),
        fn_constructor_kwargs={"model": tiny_moe_dir, "balancer": balancer, **tight})
    rows = sorted(ds.take_all(), key=lambda r: r[ROW_INDEX])
    assert int(read_marker(marker)["requests"]) > 0
    assert [list(r["generated_token_ids"]) for r in rows] == expected
    stats = ray.get(balancer.summary.remote())
    assert stats.checkpoints > 0 and stats.restored > 0, stats
    assert stats.restored < 12  # the requests on the device when it died had no checkpoint: recomputed
    deadline = time.monotonic() + 10  # the restarted actor's agent tells `done` at its next exchange
    while stats.held_checkpoints and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = ray.get(balancer.summary.remote())
    assert stats.held_checkpoints == 0, stats  # every request done, none of its checkpoints kept
    ray.kill(balancer)
