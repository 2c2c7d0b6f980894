"""What is measured once per machine and kept on disk under $BATCHGEN_CACHE (default ~/.cache/batchgen): the
kernels' crossovers on this CPU, the planner's cost curves and plans. BATCHGEN_PLAN=0 in the environment turns
every such measurement an engine would make for itself off: fixed settings and defaults, as the tests and
reproducible runs want (a plan asked for by name, `batchgen plan` or `batchgen run --engine-actors`, still runs)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

PLAN_ENV = "BATCHGEN_PLAN"
T = TypeVar("T")


def measuring() -> bool:
    """False with BATCHGEN_PLAN=0: nothing is profiled or calibrated, the defaults apply."""
    return os.environ.get(PLAN_ENV, "1") != "0"


def cache_root() -> Path:
    return Path(os.environ.get("BATCHGEN_CACHE", Path.home() / ".cache" / "batchgen"))


def disk_cached(path: Path, compute: Callable[[], T], load: Callable[[str], T], dump: Callable[[T], str]) -> T:
    """`load` of the file at `path`, else `compute()` saved there. Processes of one machine asking for the same file
    take turns (a file lock): the first computes, the others read (the Ray actors of one job)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                return load(path.read_text())
            except (ValueError, KeyError, TypeError):
                pass  # a file of an older layout: compute again
        value = compute()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(dump(value))
        tmp.replace(path)
        return value
