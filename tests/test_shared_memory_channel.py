"""The shared-memory channel of an engine group (two processes on this host): all-reduces equal torch's sum
and max on every rank, tensors and messages too large for a slot take the process group and still arrive, and
a rank waiting on a dead one fails at once instead of spinning."""

from __future__ import annotations

import multiprocessing
import os
import time

import torch

from batchgen.engine.parallel import shared_memory
from batchgen.engine.parallel.rank_group import free_address, join_rank_group, leave_rank_group
from batchgen.engine.parallel.rank_round import broadcast_round, gather_replies

BIG = shared_memory.MESSAGE_BYTES + 1


# name -> (shape, dtype); "large" does not fit a slot and takes the process group
REDUCED = {"small": ((3, 5), torch.float32), "bf16": ((4,), torch.bfloat16),
           "large": ((shared_memory.REDUCE_BYTES // 4 + 1,), torch.float32)}


def _part(shape, rank: int) -> torch.Tensor:
    """Rank `rank`'s input: different on each rank, and each rank is larger somewhere."""
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return x * (rank + 1) - 3 * rank


def _rank(rank: int, address, out) -> None:
    group = join_rank_group(address, rank, 2, torch.device("cpu"))
    got = {}
    for name, (shape, dtype) in REDUCED.items():
        for op in ("sum", "max"):
            got[name, op] = group.all_reduce(_part(shape, rank).to(dtype), op).float().tolist()  # no tensor: its
            # storage would be shared with the parent through this process, gone by then
    for message in ({"round": 1}, b"x" * BIG, None):  # small, through the process group, the stop message
        got["round", len(repr(message))] = broadcast_round(group, message if rank == 0 else None)
    got["replies"] = gather_replies(group, b"r" * (BIG if rank == 1 else 3))
    out.put((rank, got))
    leave_rank_group()


def test_all_reduces_broadcasts_and_gathers_whatever_their_size():
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    address = free_address()
    procs = [context.Process(target=_rank, args=(r, address, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    for key, value in results[0].items():
        if key[0] not in REDUCED:
            continue
        parts = [_part(REDUCED[key[0]][0], r) for r in (0, 1)]
        expected = (parts[0] + parts[1] if key[1] == "sum" else torch.maximum(*parts)).tolist()
        assert value == expected and results[1][key] == expected, key
    for rank in (0, 1):
        rounds = [v for k, v in results[rank].items() if k[0] == "round"]
        assert rounds == [{"round": 1}, b"x" * BIG, None]
    assert results[0]["replies"] == [b"r" * 3, b"r" * BIG] and results[1]["replies"] is None


def _wait_forever(rank: int, address, out) -> None:
    group = join_rank_group(address, rank, 2, torch.device("cpu"))
    if rank == 1:
        os._exit(0)  # gone without a word
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except shared_memory.RankDied as exc:
        out.put((str(exc), time.monotonic() - started))


def test_a_rank_waiting_on_a_dead_rank_fails_at_once():
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    address = free_address()
    procs = [context.Process(target=_wait_forever, args=(r, address, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[1].join(timeout=120)  # reaped: the peer finds no process
    message, waited = out.get(timeout=120)
    procs[0].join(timeout=60)
    assert message.startswith("engine rank 1 (pid ") and message.endswith("is gone")
    assert waited < 5
