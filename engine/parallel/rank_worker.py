"""A rank process of an engine group: `python -m batchgen.engine.parallel.rank_worker`, its RankSpec pickled
on stdin. It builds its share of the engine, then serves the leader's rounds until told to stop. It exits
when its parent (the leader's process) is gone, so a killed engine actor leaves no rank behind.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.parallel.partition import RankEngines
from batchgen.engine.parallel.rank_group import (
    GroupAddress,
    GroupStartError,
    RankGroup,
    device_of_rank,
    join_rank_group,
    leave_rank_group,
)
from batchgen.engine.parallel.rank_round import broadcast_round, gather_replies, run_round
from batchgen.engine.planner import resolve_config
from batchgen.engine.process_heap import freeze_heap, keep_freed_memory

PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its share of one engine."""

    address: GroupAddress
    size: int
    config: EngineConfig
    # (device, expert_shard= or tensor_shard=(rank, ranks)) -> that rank's model: picklable (a partial of the loader)
    load: Callable[..., LoadedModel]
    threads: int  # torch threads per rank
    # expert parallel: each rank also holds 1/N of every expert's columns, so a PARTITION splits each routed
    # expert's columns over the ranks (CPU groups: host memory is what all ranks draw on)
    expert_columns: bool = False


def build_rank_engine(spec: RankSpec, rank: int,
                      departed: Callable[[], str | None] | None = None) -> tuple[RankEngines, RankGroup]:
    """Join the group, load this rank's shard and build its Engine; every rank learns whether all succeeded
    (so a bad checkpoint fails the leader with the rank's own error instead of hanging the others). The ranks
    size their KV pools alike: each reads its own free memory, and ranks whose pools differed would schedule
    apart (tensor parallel: every rank runs every request)."""
    torch.set_num_threads(spec.threads)
    device = device_of_rank(spec.config.torch_device(), rank)
    group = join_rank_group(spec.address, rank, spec.size, device, departed)
    loaded, config, error = None, None, None
    try:
        share = "expert_shard" if spec.config.ep_size > 1 else "tensor_shard"
        loaded = spec.load(device=device, **{share: (rank, spec.size)})
        config = resolve_config(loaded, spec.config, plan=False)
    except Exception as exc:  # noqa: BLE001 - gathered below, raised on every rank
        error = f"{type(exc).__name__}: {exc}"
    _raise_failures(error, group)
    budgets = [None] * spec.size
    dist.all_gather_object(budgets, (config.kv_budget_bytes, config.host_kv_budget_bytes), group=group.start)
    config = common_budgets(config, budgets)
    engine, error = None, None
    try:
        # the columns load when the partition's build knows the heads split
        columns = functools.partial(expert_columns, spec, rank, device) if spec.expert_columns else None
        engine = RankEngines(Engine(loaded, config, group=group), group, columns)
    except Exception as exc:  # noqa: BLE001 - gathered below, raised on every rank
        error = f"{type(exc).__name__}: {exc}"
    _raise_failures(error, group)
    return engine, group


def common_budgets(config: EngineConfig, budgets: list[tuple[int, int]]) -> EngineConfig:
    """`config` with the KV budgets every rank can hold: the least of the ranks' (device, host) budgets."""
    return dataclasses.replace(config, kv_budget_bytes=min(b[0] for b in budgets),
                               host_kv_budget_bytes=min(b[1] for b in budgets))


def _raise_failures(error: str | None, group: RankGroup) -> None:
    """Every rank's `error` gathered; GroupStartError on every rank if any failed."""
    errors = [None] * group.size
    dist.all_gather_object(errors, error, group=group.start)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        leave_rank_group()
        raise GroupStartError("; ".join(f"engine rank {r}: {e}" for r, e in failed))


def expert_columns(spec: RankSpec, rank: int, device: torch.device) -> torch.nn.Module:
    """The model with only this rank's 1/N of every expert's columns loaded."""
    return spec.load(device=device, tensor_shard=(rank, spec.size), experts_only=True).model


def serve(engines: RankEngines, group: RankGroup) -> None:
    """Run the leader's rounds until it sends None."""
    while (message := broadcast_round(group, None)) is not None:
        gather_replies(group, run_round(engines, message.calls[group.rank], message.step))


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="batchgen-rank-parent", daemon=True).start()


def main() -> None:
    rank, spec = pickle.load(sys.stdin.buffer)
    _exit_with_parent()
    keep_freed_memory()
    try:
        engines, group = build_rank_engine(spec, rank)
    except GroupStartError:
        sys.exit(1)
    freeze_heap()  # this process holds its engine for life: the collector's full passes would stall the group
    try:
        serve(engines, group)
    except BaseException:  # the group is broken: exit now, so the other ranks' collectives fail at once
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    leave_rank_group()


if __name__ == "__main__":
    main()
