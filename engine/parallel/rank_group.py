"""The process group of one engine instance spanning several ranks (one process per device).

Two groups over the same ranks: `data` carries the MoE all-to-all (NCCL on CUDA, gloo on CPU) and
`control` carries the leader's commands and the ranks' replies as pickled objects (always gloo: object
collectives over NCCL would round-trip every command through device memory).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits longer than this means a rank died: fail instead of hanging the job.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0 listens for the others to join."""

    host: str
    port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def free_address() -> GroupAddress:
    """A port free on this machine now (the ranks of one engine share a node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return GroupAddress("127.0.0.1", sock.getsockname()[1])


def join_rank_group(address: GroupAddress, rank: int, size: int, device: torch.device) -> RankGroup:
    """Join (rank 0: open) the engine's process group; every rank of the engine calls this."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address.init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    control = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return RankGroup(rank, size, world, control)


def leave_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def device_of_rank(device: torch.device, rank: int) -> torch.device:
    """Rank r computes on the r-th CUDA device it can see (a CPU rank on the CPU)."""
    return torch.device("cuda", rank) if device.type == "cuda" else device
