"""Up to how many rows per expert the MoE C kernel's dot-product path beats its blocked path, on this CPU.

The blocked path (kernels/moe_cpu.py) puts an expert's rows sixteen to a vector, so 9-15 rows pay for a padded block;
the dot-product path loads each weight element once per eight rows and pays horizontal sums instead. Which wins
between 9 and 16 rows depends on the CPU: on a Zen 5 the blocked path won from 9 rows, on a Zen 4 the dot path up to
12 (a decode step's MoE at 12 rows per expert 10-20 % faster with it). So it is measured: once per CPU, thread
count, expert shape and kernel source, on synthetic experts larger than the last-level cache, the two paths
alternated; the result is kept under $BATCHGEN_CACHE/calibration for every process of the machine. With
BATCHGEN_PLAN=0 nothing is measured and the default applies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time

import torch

from batchgen.kernels.calibration import cache_root, disk_cached, measuring
from batchgen.kernels.cpu_identity import this_cpu

DEFAULT_DOT_ROWS = 8  # up to a half block the dot path won on every CPU measured
CANDIDATES = (10, 12, 14, 16)  # rows per expert at which the paths are compared
SAMPLE_BYTES = 64 << 20  # weights of the synthetic experts: past the last-level cache, as a model's layers are
MAX_EXPERT_BYTES = 16 << 20  # a larger expert is measured with fewer intermediate columns (the same row length)
ROUNDS = 5


def choose_dot_rows(seconds: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which the dot-product path was never the slower one; `seconds` maps a row count
    to (dot-product path, blocked path) seconds."""
    best = DEFAULT_DOT_ROWS
    for rows in sorted(seconds):
        dot, blocked = seconds[rows]
        if dot > blocked:
            break
        best = rows
    return best


def measure(dim: int, inter: int) -> dict[int, tuple[float, float]]:
    """Median seconds of the two paths over experts of each candidate row count, rounds alternated so a slow moment
    of a shared machine hits both alike."""
    from batchgen.kernels.moe_cpu import small_experts
    from batchgen.kernels.moe_torch import route_rows

    inter = min(inter, max(8, MAX_EXPERT_BYTES // (12 * dim) // 8 * 8))
    experts = max(2, min(16, SAMPLE_BYTES // (12 * dim * inter)))
    g = torch.Generator().manual_seed(0)
    w_gate_up = torch.randn(experts, 2 * inter, dim, generator=g) / dim**0.5
    w_down = torch.randn(experts, dim, inter, generator=g) / inter**0.5
    routed = {}
    for rows in CANDIDATES:
        tokens = experts * rows
        ids = (torch.arange(tokens) % experts).unsqueeze(1)
        routed[rows] = route_rows(torch.randn(tokens, dim, generator=g), torch.ones(tokens, 1), ids, experts)
    every = list(range(experts))
    small_experts(torch.zeros(experts * CANDIDATES[0], dim), routed[CANDIDATES[0]], every, w_gate_up, w_down,
                  CANDIDATES[0])  # warm-up
    seconds: dict[int, tuple[list[float], list[float]]] = {rows: ([], []) for rows in CANDIDATES}
    for _ in range(ROUNDS):
        for rows in CANDIDATES:
            # dot_rows = rows: every expert on the dot-product path; rows - 1: every expert blocked
            for timings, dot_rows in zip(seconds[rows], (rows, rows - 1)):
                out = torch.zeros(experts * rows, dim)
                start = time.perf_counter()
                small_experts(out, routed[rows], every, w_gate_up, w_down, dot_rows)
                timings.append(time.perf_counter() - start)
    return {rows: (statistics.median(dot), statistics.median(blocked)) for rows, (dot, blocked) in seconds.items()}


@functools.lru_cache(maxsize=64)
def dot_rows(dim: int, inter: int) -> int:
    """The crossover for experts of `dim` x `inter` on this CPU at torch's thread count: measured once per machine,
    DEFAULT_DOT_ROWS with BATCHGEN_PLAN=0."""
    if not measuring():
        return DEFAULT_DOT_ROWS
    from batchgen.kernels import moe_cpu

    threads = torch.get_num_threads()
    key = json.dumps([this_cpu(), threads, dim, inter, CANDIDATES, moe_cpu.SOURCE_DIGEST])
    path = cache_root() / "calibration" / f"moe-dot-rows-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def calibrate() -> dict:
        seconds = measure(dim, inter)
        return {"dot_rows": choose_dot_rows(seconds), "cpu": this_cpu(), "threads": threads, "dim": dim,
                "inter": inter, "seconds": {rows: list(pair) for rows, pair in seconds.items()}}

    return disk_cached(path, calibrate, _load, json.dumps)["dot_rows"]


def _load(text: str) -> dict:
    record = json.loads(text)
    int(record["dot_rows"])  # a file without it (another layout) raises here and is measured again
    return record
