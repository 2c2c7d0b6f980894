"""The memory an engine may use for KV and activations, and the KV tiers of a configuration.

Without explicit budgets the planner (engine/planner) sizes the tiers within these limits: half the
free memory of a GPU, a modest share of a CPU machine's available memory (several engine actors may share
one node, and host pages there are the same memory as device pages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_manager import KVBudget
from batchgen.engine.models.loaded_model import LoadedModel

GPU_KV_SHARE = 0.5
CPU_KV_SHARE = 0.05
ACTIVATION_SHARE = 0.05  # of the free device memory, for the feed-forward batch's activations


@dataclass(frozen=True)
class MemoryLimits:
    device_kv_bytes: int  # device pages (resident + staging)
    host_kv_bytes: int  # host pages
    activation_bytes: int  # one feed-forward batch's activations


def memory_limits(device_type: str, config: EngineConfig, free: int, host_free: int) -> MemoryLimits:
    """What the planner may give each tier, from the free device and host memory beside the loaded model:
    an explicit budget is the limit itself."""
    share = GPU_KV_SHARE if device_type == "cuda" else CPU_KV_SHARE
    return MemoryLimits(device_kv_bytes=config.kv_budget_bytes or int(free * share),
                        host_kv_bytes=config.host_kv_budget_bytes or int(host_free * CPU_KV_SHARE),
                        activation_bytes=int(free * ACTIVATION_SHARE))


def plan_kv_budget(config: EngineConfig, stream_host: bool) -> KVBudget:
    """The tiers of a configuration whose budgets are set: the staging pool is part of the device budget,
    and only exists where host-resident sequences decode by streaming through it."""
    if config.kv_budget_bytes is None or config.host_kv_budget_bytes is None:
        raise ValueError("KV budgets are planned before the tiers are laid out (engine/planner)")
    staging = 0
    if config.mode == "coroutine" and stream_host:
        staging = int(config.kv_budget_bytes * config.staging_fraction)
    return KVBudget(config.kv_budget_bytes, config.host_kv_budget_bytes, staging)


def activation_bytes_per_token(loaded: LoadedModel, top_k: int) -> int:
    """Bytes one token of a feed-forward batch holds at its peak: hidden rows in and out, and each routed
    expert's gate, up and product rows."""
    c = loaded.config
    inner = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return (4 * c.hidden_size + 3 * inner * max(1, top_k)) * loaded.dtype.itemsize


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory, within this process's share of the device (torch's per-process memory fraction: an
    engine actor granted a fraction of a GPU sets it); on the host what the machine has available, within what the
    memory limit of this process's cgroup (a container's) still leaves."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.6 and later
        return device_room_bytes(free, total, torch.cuda.memory_reserved(device),
                                 1.0 if fraction is None else fraction(device))
    try:
        with open("/proc/meminfo") as meminfo:
            available = meminfo_available_bytes(meminfo.read())
    except OSError:  # not Linux
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):  # macOS counts no available pages: half its memory, a guess left to the user
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    try:
        with open("/proc/self/cgroup") as cgroup:
            room = cgroup_room_bytes(cgroup.read(), Path("/sys/fs/cgroup"))
    except OSError:
        room = None
    return available if room is None else min(available, room)


def device_room_bytes(free: int, total: int, reserved: int, share: float) -> int:
    """What a process may still allocate on a device that has `free` bytes free: within its `share` of the
    device's `total` less what it holds (`reserved`). Two engines sharing a GPU both saw all its free memory: each
    sized its KV pool for it, their pools together for twice that."""
    return max(0, min(free, int(share * total) - reserved))


def cgroup_room_bytes(proc_cgroup: str, root: Path) -> int | None:
    """What the memory limits of a process's cgroup leave (`proc_cgroup`: its /proc/<pid>/cgroup; `root`: where
    the hierarchies are mounted): over the cgroup and each cgroup above it (a parent's limit binds its children
    too), the least of limit less working set (the usage less its inactive page cache, which the kernel reclaims
    first); None without a limit. A container without its own cgroup namespace sees the host's path in
    /proc/self/cgroup while its own cgroup is mounted at the hierarchy's root, which the walk up reaches. A pod
    limited to 8 GiB on a 512 GiB host otherwise sized its KV pools from the host's memory and was killed on its
    first run."""
    rooms = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # cgroup v2
            base, names = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            base, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for where in (base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)):
            room = _room(where, names)
            if room is not None:
                rooms.append(room)
    return min(rooms, default=None)


def _room(where: Path, names: tuple[str, str, str]) -> int | None:
    """One cgroup's limit less its working set, or None where it has no limit (or no files)."""
    try:
        limit = (where / names[0]).read_text().strip()
        usage = int((where / names[1]).read_text())
        stat = dict(entry.split() for entry in (where / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # none set ("max"; v1: a page-rounded 2^63)
        return None
    return max(0, int(limit) - (usage - int(stat.get(names[2], 0))))


def meminfo_available_bytes(meminfo: str) -> int | None:
    """MemAvailable of a /proc/meminfo text: the free pages and what the kernel reclaims without swapping (the page
    cache above all). The free pages alone undercount a machine that has read files: on the dev box 8 of 24 GB
    free, 24 GB available, and a planner cut to a share of the free pages chose a 32-expert model's b_moe 4x
    smaller in one run than in the next, as reading the model and the data filled the cache."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, *unit = value.split()
            return int(number) * (1024 if unit == ["kB"] else 1)
    return None
