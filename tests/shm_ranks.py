"""A rank of tests/test_shared_memory_channel.py: `python shm_ranks.py <case> <rank> <port> <out>` joins a
two-rank group on this host, runs the case and pickles what it saw to <out> (a process of its own: nothing
of the test process, a Ray runtime included, is inherited)."""

from __future__ import annotations

import os
import pickle
import sys
import time
from datetime import timedelta

import torch

from batchgen.engine.parallel import rank_group, shared_memory
from batchgen.engine.parallel.rank_group import GroupAddress, join_rank_group, leave_rank_group
from batchgen.engine.parallel.rank_round import broadcast_round, gather_replies
from batchgen.engine.parallel.rank_worker import _raise_failures

SHORT_TIMEOUT = timedelta(seconds=6)  # slow_load's collective timeout
SLOW_LOAD_S = 8.0  # slow_load's rank 1 loads this long: past SHORT_TIMEOUT

BIG = shared_memory.MESSAGE_BYTES + 1
# name -> (shape, dtype); "large" does not fit a slot and takes the process group
REDUCED = {"small": ((3, 5), torch.float32), "bf16": ((4,), torch.bfloat16),
           "large": ((shared_memory.REDUCE_BYTES // 4 + 1,), torch.float32)}


def part(shape, rank: int) -> torch.Tensor:
    """Rank `rank`'s input: different on each rank, and each rank is larger somewhere."""
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return x * (rank + 1) - 3 * rank


def collectives(group) -> dict:
    got = {}
    for name, (shape, dtype) in REDUCED.items():
        for op in ("sum", "max"):
            got[name, op] = group.all_reduce(part(shape, rank=group.rank).to(dtype), op).float().tolist()
    if group.rank == 1:
        time.sleep(0.5)  # a slow follower: the leader must not overwrite a round it has not read yet
    for message in ({"round": 1}, b"x" * BIG, None):  # small, through the process group, the stop message
        got["round", len(repr(message))] = broadcast_round(group, message if group.rank == 0 else None)
    got["replies"] = gather_replies(group, b"r" * (BIG if group.rank == 1 else 3))
    leave_rank_group()
    return got


def wait_on_the_dead(group) -> dict:
    if group.rank == 1:
        os._exit(0)  # gone without a word
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except shared_memory.RankDied as exc:
        return {"error": str(exc), "waited_s": time.monotonic() - started}
    return {}


def slow_load(group) -> dict:
    """Rank 1's checkpoint load outlasts the collectives' timeout; the start-up gather waits for it."""
    if group.rank == 1:
        time.sleep(SLOW_LOAD_S)
    started = time.monotonic()
    _raise_failures(None, group)
    leave_rank_group()
    return {"waited_s": time.monotonic() - started}


if __name__ == "__main__":
    case, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if case == "slow_load":
        rank_group.COLLECTIVE_TIMEOUT = SHORT_TIMEOUT
    group = join_rank_group(GroupAddress("127.0.0.1", port), rank, 2, torch.device("cpu"))
    seen = {"collectives": collectives, "wait_on_the_dead": wait_on_the_dead, "slow_load": slow_load}[case](group)
    with open(out, "wb") as f:
        pickle.dump(seen, f)
