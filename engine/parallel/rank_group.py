"""The process group of one engine instance spanning several ranks (one process per device).

Two groups over the same ranks: `data` carries the MoE all-to-all and large all-reduces (NCCL on CUDA, gloo
on CPU) and `control` what does not fit the shared-memory channel (always gloo: object collectives over NCCL
would round-trip every command through device memory). The ranks share a host, so the leader's rounds, the
ranks' replies and the small all-reduces of CPU tensors go through shared memory (engine/parallel/
shared_memory.py).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.engine.parallel.shared_memory import SharedMemoryChannel
from batchgen.kernels.expert_parallel import ProcessGroupExchange

# A collective that waits longer than this means a rank died: fail instead of hanging the job.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# The start-up gathers wait for every rank's checkpoint load (a large model's shards from object storage, loads
# that end minutes apart): a rank that dies meanwhile fails them at once (its sockets close), a hung one at this.
LOAD_TIMEOUT = timedelta(hours=1)
JOIN_POLL_S = 0.05  # rank 0 looks for the ranks that joined (and for those that died) this often


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    data: dist.ProcessGroup
    control: dist.ProcessGroup
    channel: SharedMemoryChannel
    start: dist.ProcessGroup  # gloo, LOAD_TIMEOUT: the gathers around the ranks' loads (rank_worker.py)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the ranks ("sum" or "max"): through shared memory when it fits, else the data group
        (every rank decides alike: the ranks reduce tensors of the same shape)."""
        if self.channel.fits(tensor):
            return self.channel.all_reduce(tensor, op)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.data)
        return tensor

    # the MoE dispatch's exchanges (kernels/expert_parallel.py ProcessGroupExchange's calls)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.channel.fits(tensor):
            return self.channel.all_gather(tensor)
        return ProcessGroupExchange(self.data).all_gather(tensor)

    def all_to_all(self, send: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        if self.channel.fits_exchange(send, splits):
            return self.channel.all_to_all(send, splits)
        return ProcessGroupExchange(self.data).all_to_all(send, splits)


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0 listens for the others to join."""

    host: str
    port: int


def free_address() -> GroupAddress:
    """A port free on this machine now (the ranks of one engine share a node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return GroupAddress("127.0.0.1", sock.getsockname()[1])


class GroupStartError(RuntimeError):
    """One or more ranks failed to start (each rank's reason in the message)."""


def join_rank_group(address: GroupAddress, rank: int, size: int, device: torch.device,
                    departed: Callable[[], str | None] | None = None) -> RankGroup:
    """Join (rank 0: open) the engine's process group; every rank of the engine calls this. Rank 0 waits for the
    others to reach the group's store first, asking `departed` (which rank process has exited, if any) as it waits:
    a rank that died before joining (an import error, a device it cannot use) would otherwise leave it waiting out
    the whole COLLECTIVE_TIMEOUT, then failing with a store timeout that does not say why."""
    use_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore(address.host, address.port, size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    store.set(f"batchgen-joined-{rank}", "1")
    if rank == 0:
        _await_ranks(store, size, departed)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    control = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    start = dist.new_group(backend="gloo", timeout=LOAD_TIMEOUT)
    # the segment is named by the group's port (unique while the group lives) and unlinked once all mapped it
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(shm_dir, f"batchgen-engine-{address.port}")
    if rank == 0 and os.path.exists(path):  # left by a crashed group that had this port
        os.unlink(path)
    channel = SharedMemoryChannel(path, rank, size, create=True, group=control) if rank == 0 else None
    try:
        dist.barrier(group=control)
        channel = channel or SharedMemoryChannel(path, rank, size, create=False, group=control)
        dist.barrier(group=control)
    finally:  # also when a rank failed before mapping it: the segment does not outlive the group's start
        if rank == 0 and os.path.exists(path):
            os.unlink(path)
    return RankGroup(rank, size, world, control, channel, start)


def _await_ranks(store: dist.TCPStore, size: int, departed: Callable[[], str | None] | None) -> None:
    keys = [f"batchgen-joined-{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        reason = departed() if departed is not None else None
        if reason is not None:
            raise GroupStartError(reason)
        if time.monotonic() > deadline:
            raise GroupStartError(f"engine ranks did not join within {COLLECTIVE_TIMEOUT}")
        time.sleep(JOIN_POLL_S)


def leave_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def use_device(device: torch.device) -> None:
    """Make a rank's own GPU its process's current device: Triton launches its kernels, NCCL builds its
    communicator, DeepEP its buffers and torch.cuda.current_stream() answers on the current device, which
    is otherwise GPU 0 for every rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_of_rank(device: torch.device, rank: int) -> torch.device:
    """Rank r computes on the r-th CUDA device from the engine's own (cuda:2 with two ranks: cuda:2 and cuda:3; a
    CPU rank on the CPU)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def check_rank_devices(device: torch.device, size: int) -> None:
    """Refuse an engine of `size` ranks on CUDA devices this process cannot see, before any rank starts: a rank on a
    device past the last fails at once, and the others would wait for it to join until the group's timeout."""
    if device.type != "cuda":
        return
    first, visible = device.index or 0, torch.cuda.device_count()
    if first + size > visible:
        raise GroupStartError(f"an engine of {size} ranks on {device} needs CUDA devices {first}..{first + size - 1}; "
                         f"this process sees {visible} (CUDA_VISIBLE_DEVICES, or the GPUs Ray gave the actor: "
                         f"engine_num_gpus is per rank)")
