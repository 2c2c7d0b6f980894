"""The ranks of one engine share a host: their small collectives go through one shared-memory segment.

A gloo collective over loopback TCP costs about a millisecond on a small VM (bench/RESULTS.md), and a tensor-
parallel decode step makes two per layer, plus the leader's round (a broadcast and a gather). Here a rank
writes its part into its slot of a segment every rank has mapped, raises its sequence counter, and waits for
the others' counters: a few microseconds when the ranks run. Waiting spins briefly, then yields its core, then
sleeps, and checks that the ranks it waits on are alive, so a dead rank fails its peers at once.

What does not fit a slot (a prefill's hidden states, a round carrying a request's KV) goes through the
process group instead: for a tensor the caller (RankGroup) decides from sizes every rank knows, a message is
announced in the segment and sent point to point.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

REDUCE_BYTES = 1 << 20  # largest all-reduce through a slot (a decode step's hidden states are a few KB)
MESSAGE_BYTES = 4 << 20  # largest round or reply through a slot
SPIN_S = 50e-6  # then yield the core
YIELD_S = 2e-3  # then sleep
SLEEP_S = 200e-6  # then, after IDLE_S, IDLE_SLEEP_S: an idle engine's ranks wait for minutes
IDLE_S = 0.1
IDLE_SLEEP_S = 1e-3
CHECK_ALIVE_S = 0.05
# header (int64 words): the leader's round counter and length, then per rank: reply counter and length,
# collective counter, pid, the last round it has read
_ROUND, _ROUND_LEN, _RANKS = 0, 1, 8
_REPLY, _REPLY_LEN, _COLLECTIVE, _PID, _ROUND_READ, _PER_RANK = 0, 1, 2, 3, 4, 5
_EXTERNAL = -1  # a length that means "sent through the process group"


class RankDied(RuntimeError):
    """A rank this one waits on is gone: the engine group is broken."""


class SharedMemoryChannel:
    """One engine's segment: rounds from the leader, replies to it, and collectives of small CPU tensors
    (all-reduce, all-gather, all-to-all: the MoE dispatch)."""

    def __init__(self, path: str, rank: int, size: int, create: bool, group: dist.ProcessGroup):
        self.rank, self.size, self.group = rank, size, group
        header = (_RANKS + _PER_RANK * size) * 8
        self._reduce_at = -(-header // 64) * 64
        self._round_at = self._reduce_at + 2 * size * REDUCE_BYTES
        self._reply_at = self._round_at + MESSAGE_BYTES
        nbytes = self._reply_at + size * MESSAGE_BYTES
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)  # sparse: only the pages written take memory
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._header = np.frombuffer(self._map, dtype=np.int64, count=header // 8)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._tensor = torch.from_numpy(self._bytes)  # the same bytes, sliced without a conversion per call
        # header words of the other ranks' collective counters: what every collective waits on
        self._others = [r for r in range(size) if r != rank]
        self._their_counters = [_RANKS + _PER_RANK * r + _COLLECTIVE for r in self._others]
        self._collectives = 0
        self._rounds = 0
        self._word(rank, _PID)[...] = os.getpid()

    def _word(self, rank: int, field: int) -> np.ndarray:
        return self._header[_RANKS + _PER_RANK * rank + field:][:1]

    # ----------------------------------------------------------------- tensor collectives
    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= REDUCE_BYTES

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, as dist.all_reduce: every rank gets the same result (summed in rank order)."""
        read = self._publish(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        parts = [read(rank, 0, nbytes).view(tensor.dtype).view(tensor.shape) for rank in range(self.size)]
        if op != "sum":
            return tensor.copy_(torch.stack(parts).amax(dim=0))
        tensor.copy_(parts[0])  # this rank's own part is in its slot too
        for part in parts[1:]:
            tensor += part
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[ranks, *shape]: every rank's `tensor` (same shape on every rank), in rank order."""
        read = self._publish(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        return torch.stack([read(rank, 0, nbytes).view(tensor.dtype).view(tensor.shape).clone()
                            for rank in range(self.size)])

    def fits_exchange(self, send: torch.Tensor, splits: list[list[int]]) -> bool:
        """Whether every rank's rows of this all_to_all fit its slot (every rank knows `splits`: all decide
        alike)."""
        return send.device.type == "cpu" and max(sum(row) for row in splits) * _row_bytes(send) <= REDUCE_BYTES

    def all_to_all(self, send: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        """As dist.all_to_all_single over rows (when `fits_exchange`): `send` [rows, ...] holds this rank's
        rows for rank 0, then rank 1, ...; `splits[i][j]`: rows rank i sends rank j."""
        row_bytes = _row_bytes(send)
        read = self._publish(send)
        parts = []
        for rank, row in enumerate(splits):
            start = sum(row[:self.rank]) * row_bytes
            chunk = read(rank, start, row[self.rank] * row_bytes)
            parts.append(chunk.view(send.dtype).view(row[self.rank], *send.shape[1:]))
        return torch.cat(parts)

    def _publish(self, tensor: torch.Tensor):
        """Write this rank's `tensor` into its slot, wait for every rank's, and return read(rank, start,
        nbytes) -> those bytes of that rank's slot. Two sets of slots by turn: a rank can be one collective
        ahead of another, never two (it waited for everyone's previous one)."""
        self._collectives += 1
        seq = self._collectives
        base = self._reduce_at + (seq % 2) * self.size * REDUCE_BYTES
        data = tensor.contiguous().view(-1).view(torch.uint8)
        mine = base + self.rank * REDUCE_BYTES
        self._tensor[mine:mine + data.numel()].copy_(data)
        header = self._header
        header[_RANKS + _PER_RANK * self.rank + _COLLECTIVE] = seq
        counters = self._their_counters
        if not all(header[i] >= seq for i in counters):  # else they are all there already: no wait at all
            self._wait(lambda: all(header[i] >= seq for i in counters), self._others)

        def read(rank: int, start: int, nbytes: int) -> torch.Tensor:
            at = base + rank * REDUCE_BYTES + start
            return self._tensor[at:at + nbytes]

        return read

    # ----------------------------------------------------------------- rounds
    def broadcast(self, message: Any) -> Any:
        """The leader's `message` to every rank (each rank returns what the leader sent). The leader writes a
        round only once every rank has read the one before, so rounds may follow each other without replies."""
        self._rounds += 1
        seq = self._rounds
        if self.rank == 0:
            followers = list(range(1, self.size))
            self._wait(lambda: all(self._word(r, _ROUND_READ)[0] >= seq - 1 for r in followers), followers)
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            external = len(payload) > MESSAGE_BYTES
            if not external:
                self._bytes[self._round_at:self._round_at + len(payload)] = np.frombuffer(payload, np.uint8)
            self._header[_ROUND_LEN] = _EXTERNAL if external else len(payload)
            self._header[_ROUND] = seq
            if external:
                for rank in range(1, self.size):
                    _send(payload, rank, self.group)
            return message
        self._wait(lambda: self._header[_ROUND] >= seq, [0])
        length = int(self._header[_ROUND_LEN])
        if length == _EXTERNAL:
            message = pickle.loads(_recv(0, self.group))
        else:
            message = pickle.loads(self._bytes[self._round_at:self._round_at + length].tobytes())
        self._word(self.rank, _ROUND_READ)[...] = seq
        return message

    def gather(self, reply: Any) -> list[Any] | None:
        """Every rank's `reply` at the leader, in rank order (None elsewhere); call after `broadcast`."""
        seq = self._rounds
        if self.rank != 0:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            external = len(payload) > MESSAGE_BYTES
            start = self._reply_at + self.rank * MESSAGE_BYTES
            if not external:
                self._bytes[start:start + len(payload)] = np.frombuffer(payload, np.uint8)
            self._word(self.rank, _REPLY_LEN)[...] = _EXTERNAL if external else len(payload)
            self._word(self.rank, _REPLY)[...] = seq
            if external:
                _send(payload, 0, self.group)
            return None
        out = [reply]
        for rank in range(1, self.size):
            self._wait(lambda r=rank: self._word(r, _REPLY)[0] >= seq, [rank])
            length = int(self._word(rank, _REPLY_LEN)[0])
            if length == _EXTERNAL:
                out.append(pickle.loads(_recv(rank, self.group)))
            else:
                start = self._reply_at + rank * MESSAGE_BYTES
                out.append(pickle.loads(self._bytes[start:start + length].tobytes()))
        return out

    # ----------------------------------------------------------------- waiting
    def _wait(self, ready, ranks: list[int]) -> None:
        started = time.perf_counter()
        checked = started
        while not ready():
            now = time.perf_counter()
            waited = now - started
            if waited < SPIN_S:
                continue
            if now - checked > CHECK_ALIVE_S:
                checked = now
                for rank in ranks:
                    pid = int(self._word(rank, _PID)[0])
                    if not _alive(pid):
                        raise RankDied(f"engine rank {rank} (pid {pid}) is gone")
            if waited < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S if waited < IDLE_S else IDLE_SLEEP_S)


def _row_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed rank its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _send(payload: bytes, dst: int, group: dist.ProcessGroup) -> None:
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group)
    dist.send(data, dst, group=group)


def _recv(src: int, group: dist.ProcessGroup) -> bytes:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return data.numpy().tobytes()
