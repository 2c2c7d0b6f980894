"""Python's cyclic collector against an engine process's heap.

torch, transformers and Ray leave ~200k container objects behind at import, and every collection of the oldest
generation walks them all (~50 ms on the dev box): in an engine process it lands in the middle of a step (one
such pause was a quarter of the host time of 512 sequences' 0.4 s run in bench/host_overhead.py). gc.freeze()
moves what exists now into a permanent generation the collector skips. For a process that holds one engine for
its life (an engine actor), called once the imports are in. Frozen objects are still freed by reference
counting; only cycles among them are never collected, so a process that builds and drops engines (tests) should
not call it.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then move every surviving object into the permanent generation; returns how many it holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
