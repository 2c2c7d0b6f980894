"""The shared-memory channel of an engine group (two processes on this host, tests/shm_ranks.py): all-reduces
equal torch's sum and max on every rank, tensors and messages too large for a slot take the process group and
still arrive, rounds sent back to back reach a slow follower in order, a rank waiting on a dead one fails
at once instead of spinning, and the start-up gathers wait out a rank's long checkpoint load."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch
from shm_ranks import BIG, REDUCED, SHORT_TIMEOUT, part

from batchgen.engine.parallel.rank_group import free_address

RANKS = Path(__file__).with_name("shm_ranks.py")


def run_ranks(case: str, tmp_path) -> list[dict | None]:
    """What each rank saw (None: it left no record)."""
    port = free_address().port
    outs = [tmp_path / f"rank{r}.pkl" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(RANKS), case, str(r), str(port), str(outs[r])]) for r in (0, 1)]
    for proc in procs:
        proc.wait(timeout=120)
    return [pickle.loads(out.read_bytes()) if out.exists() else None for out in outs]


def test_all_reduces_broadcasts_and_gathers_whatever_their_size(tmp_path):
    seen = run_ranks("collectives", tmp_path)
    for key, value in seen[0].items():
        if key[0] not in REDUCED:
            continue
        parts = [part(REDUCED[key[0]][0], r) for r in (0, 1)]
        expected = (parts[0] + parts[1] if key[1] == "sum" else torch.maximum(*parts)).tolist()
        assert value == expected and seen[1][key] == expected, key
    for rank in (0, 1):
        assert [v for k, v in seen[rank].items() if k[0] == "round"] == [{"round": 1}, b"x" * BIG, None]
    assert seen[0]["replies"] == [b"r" * 3, b"r" * BIG] and seen[1]["replies"] is None


def test_a_rank_waiting_on_a_dead_rank_fails_at_once(tmp_path):
    leader, gone = run_ranks("wait_on_the_dead", tmp_path)
    assert gone is None
    assert leader["error"].startswith("engine rank 1 (pid ") and leader["error"].endswith("is gone")
    assert leader["waited_s"] < 5


def test_the_start_up_gathers_wait_out_a_load_longer_than_the_collectives_timeout(tmp_path):
    """A rank whose shards loaded later than the others' by more than the collectives' timeout (a large checkpoint
    from object storage) failed the engine's start."""
    leader, slow = run_ranks("slow_load", tmp_path)
    assert leader is not None and slow is not None
    assert leader["waited_s"] > SHORT_TIMEOUT.total_seconds()
