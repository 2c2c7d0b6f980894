"""Which CPU this is, for caches of what depends on it (compiled kernels, the planner's measured cost curves).

A model name alone does not tell: the dev boxes' Zen 4 and Zen 5 both say "AMD EPYC" while their fp32 GEMM peaks
differ 2x and `-march=native` builds different code for them; `platform.processor()` is empty on Linux.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path


def first_processor(cpuinfo: str) -> dict[str, str]:
    """The fields of /proc/cpuinfo's first processor."""
    first = cpuinfo.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def cpu_identity(cpuinfo: str) -> str:
    """From /proc/cpuinfo's text, its first processor: vendor, family, model, stepping, model name and a digest of
    its feature flags."""
    fields = first_processor(cpuinfo)
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:8]
    return " ".join([*(fields.get(k, "") for k in ("vendor_id", "cpu family", "model", "stepping", "model name")),
                     f"flags={flags}"])


def cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: what the platform module knows
        return f"model name: {platform.processor()}"


@functools.cache
def this_cpu() -> str:
    return f"{platform.machine()} {cpu_identity(cpuinfo())}"


@functools.cache
def this_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...; empty where /proc/cpuinfo names none)."""
    return first_processor(cpuinfo()).get("vendor_id", "")


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (Linux sysfs), or 512 MiB where none can be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=512 << 20)
