"""Host memory for a model's weights: one region for all of them, in either of two kinds.

- A private anonymous mapping (`host_arena`, engine/host_arena.py): an engine's own copy, written once at load.
- A file mapping shared by every process of the node (`SharedHostWeights`): the host store memory-constrained
  engines stream from (engine/offload). The first process to load a checkpoint writes its weights, in the
  engine's layout and dtype, to a file under $BATCHGEN_CACHE/host-weights and every process maps that file, so the
  engine actors of a node's devices read one copy in the page cache instead of holding one each, and a later
  actor's load is a mapping, not a read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.engine.host_arena import host_arena

STORE_FORMAT = 1  # bump when the layout of a shared host-weights file changes
_MAPS_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def place_in_arena(module: torch.nn.Module, allocate: Callable[[int], torch.Tensor] = host_arena
                   ) -> torch.Tensor | None:
    """Give every parameter of `module` (built on the meta device, in the dtypes it will hold) storage in one
    host region from `allocate(nbytes)` (uint8), each 64-byte aligned; a parameter registered under several names
    (tied) stays one. Buffers get plain host memory. Returns the region (None for a model without parameters)."""
    unique = {id(p): p for p in module.parameters()}
    offsets, total = {}, 0
    for key, param in unique.items():
        offsets[key] = total
        total += -(-param.numel() * param.element_size() // 64) * 64
    if not total:
        return None
    arena = allocate(total)
    placed = {key: torch.nn.Parameter(arena[offsets[key] : offsets[key] + p.numel() * p.element_size()]
                                      .view(p.dtype).view(p.shape), requires_grad=False)
              for key, p in unique.items()}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                sub._parameters[name] = placed[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = torch.empty_like(buf, device="cpu")
    return arena


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file the mapping holding `tensor` maps (Linux; None for anonymous memory or where there is no
    /proc/self/maps)."""
    address = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                bounds = _MAPS_RANGE.match(line)
                if bounds and int(bounds[1], 16) <= address < int(bounds[2], 16):
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    return path if path.startswith("/") else None
    except OSError:
        pass
    return None


class SharedHostWeights:
    """The node-shared file for one checkpoint loaded in one layout: `allocate` maps it, `complete` says whether it
    already held the weights, `commit` publishes a new one. The engine actors of a node start together: the first
    to allocate holds a file lock while it writes (into a temporary file renamed into place), and the others wait
    for it, then map the file it wrote, so the node never holds two copies."""

    def __init__(self, cache_dir: Path, identity: dict):
        key = hashlib.sha256(json.dumps({**identity, "format": STORE_FORMAT, "torch": torch.__version__},
                                        sort_keys=True).encode()).hexdigest()[:24]
        self.path = cache_dir / f"{key}.bin"
        self.complete = False
        self._writing: Path | None = None
        self._lock = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_writes(self.path.parent)
        self._lock = open(self.path.with_suffix(".lock"), "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        if self.path.exists() and self.path.stat().st_size == nbytes:
            self._unlock()
            self.complete = True  # private: read from the page cache like the others, a stray write stays ours
            return torch.from_file(str(self.path), shared=False, size=nbytes, dtype=torch.uint8)
        self._writing = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp")
        self._writing.unlink(missing_ok=True)
        return torch.from_file(str(self._writing), shared=True, size=nbytes, dtype=torch.uint8)

    def commit(self) -> None:
        """The weights are written: later loads map the file (ours keeps mapping the same inode)."""
        if self._writing is not None:
            os.replace(self._writing, self.path)
            self._writing = None
        self._unlock()

    def abandon(self) -> None:
        if self._writing is not None:
            self._writing.unlink(missing_ok=True)
            self._writing = None
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None


def remove_abandoned_writes(folder: Path) -> None:
    """Delete the temporary files of writers that died (a killed actor, an OOM kill mid-load: no Python cleanup
    ran), each up to a model's size: a temporary file whose key's lock nobody holds has no writer."""
    for leftover in sorted(folder.glob("*.tmp")):
        with open(folder / f"{leftover.name.split('.', 1)[0]}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its writer is alive
                continue
            leftover.unlink(missing_ok=True)
