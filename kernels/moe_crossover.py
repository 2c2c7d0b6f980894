"""Up to how many rows per expert the MoE C kernel's dot-product path runs before its blocked path, on this CPU.

The blocked path (kernels/moe_cpu.py) puts an expert's rows a vector's floats to a vector (sixteen with AVX-512), so
9-15 rows pay for a padded block there; the dot-product path loads each weight element once per four or eight rows and
pays horizontal sums instead. Which is faster depends on the CPU and the expert's shape: on a Zen 5 the blocked path won
from 9 rows at 512 x 1024; on a Zen 4 a crossover of 12 made decode-sized calls of those experts 2-7 % faster than 8,
and of experts with 4096-long rows (4096 x 14336, timed on a slice of its columns) 14-16 made them 12-17 % faster; on an
Intel Xeon (family 6 model 207) the dot-product path won at every row count up to the kernel's limit, the decode steps'
MoE 4 % faster in the engine at a crossover of 24 or 64 than at 16.
So it is measured: once per CPU, thread count, expert shape and kernel source, on synthetic layers of experts
twice the last-level cache in all under random routings, the candidates alternated; the result is kept under
$BATCHGEN_CACHE/calibration for every process of the machine. With BATCHGEN_PLAN=0 nothing is measured and the
default applies."""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time

import torch

from batchgen.kernels.calibration import cache_root, disk_cached, measuring
from batchgen.kernels.cpu_identity import last_level_cache_bytes, this_cpu

DEFAULT_DOT_ROWS = 8  # half a block of AVX-512's sixteen rows to a vector (the blocked path would pad it), AVX2's whole
CANDIDATES = (8, 10, 12, 16, 24, 32, 64)  # the crossovers tried; 64 (moe_cpu.SMALL_ROWS): every expert on the dot path
MEAN_ROWS = (8, 12, 16, 24, 32)  # rows per expert on average in the routings they are timed on: a decode step's range
LAYER_BYTES = 64 << 20  # weights of one synthetic layer of experts
# layers of them: twice the last-level cache in all, so each call reads its weights from memory as an engine's steps
# do (an Intel Xeon's 300 MiB cache held one 64 MiB layer: the two paths timed level there, while the dot-product
# path ran a model's decode steps 3 % faster than a crossover of 24, cold)
MAX_LAYERS = 8
MAX_EXPERT_BYTES = 16 << 20  # a larger expert is measured with fewer intermediate columns (the same row length)
ROUNDS = 5
TOLERANCE = 0.02


def choose_dot_rows(seconds: dict[int, float]) -> int:
    """The largest crossover whose calls took at most TOLERANCE more than the fastest (`seconds` maps a crossover
    to its time): a difference inside a shared machine's noise keeps more experts on the dot-product path, which
    reads two weight rows at a time in order, as the memory's prefetchers follow (on an Intel Xeon the calibration
    timed crossovers of 16-64 level, while bench-moe's engine ran 3 % faster at 64 than at 24, in 3 of 4 rounds of
    an in-process A/B)."""
    fastest = min(seconds.values())
    return max(crossover for crossover, time in seconds.items() if time <= fastest * (1 + TOLERANCE))


def measure(dim: int, inter: int) -> dict[int, float]:
    """Median seconds, over ROUNDS rounds, of the kernel's calls on random top-2 routings of MEAN_ROWS rows per
    expert on average (each routing through every synthetic layer), for each candidate crossover: the candidates
    alternate within a round, so a slow moment of a shared machine hits them alike. Real routings matter: an expert's
    rows past its last whole block take the dot-product path while its weights are in cache, which experts of exactly
    N rows would not show."""
    from batchgen.kernels.moe_cpu import grouped_experts

    inter = min(inter, max(8, MAX_EXPERT_BYTES // (12 * dim) // 8 * 8))
    experts = max(4, min(16, LAYER_BYTES // (12 * dim * inter)))
    layers = max(1, min(MAX_LAYERS, -(-2 * last_level_cache_bytes() // (12 * dim * inter * experts))))
    g = torch.Generator().manual_seed(0)
    weights_of = [(torch.randn(experts, 2 * inter, dim, generator=g) / dim**0.5,
                   torch.randn(experts, dim, inter, generator=g) / inter**0.5) for _ in range(layers)]
    routings = []
    for mean in MEAN_ROWS:
        tokens = experts * mean // 2
        weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(2)
        routings.append((torch.randn(tokens, dim, generator=g), weights, ids))

    def call(crossover: int) -> float:
        start = time.perf_counter()
        for x, weights, ids in routings:
            for w_gate_up, w_down in weights_of:
                grouped_experts(x, w_gate_up, w_down, weights, ids, crossover)
        return time.perf_counter() - start

    call(DEFAULT_DOT_ROWS)  # warm-up
    seconds: dict[int, list[float]] = {crossover: [] for crossover in CANDIDATES}
    for _ in range(ROUNDS):
        for crossover in CANDIDATES:
            seconds[crossover].append(call(crossover))
    return {crossover: statistics.median(times) for crossover, times in seconds.items()}


@functools.lru_cache(maxsize=64)
def dot_rows(dim: int, inter: int) -> int:
    """The crossover for experts of `dim` x `inter` on this CPU at torch's thread count: measured once per machine,
    DEFAULT_DOT_ROWS with BATCHGEN_PLAN=0."""
    if not measuring():
        return DEFAULT_DOT_ROWS
    from batchgen.kernels import moe_cpu

    threads = torch.get_num_threads()
    key = json.dumps([this_cpu(), threads, dim, inter, CANDIDATES, MEAN_ROWS, LAYER_BYTES, MAX_LAYERS,
                      moe_cpu.SOURCE_DIGEST])
    path = cache_root() / "calibration" / f"moe-dot-rows-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def calibrate() -> dict:
        seconds = measure(dim, inter)
        return {"dot_rows": choose_dot_rows(seconds), "cpu": this_cpu(), "threads": threads, "dim": dim,
                "inter": inter, "seconds": seconds}

    return disk_cached(path, calibrate, _load, json.dumps)["dot_rows"]


def _load(text: str) -> dict:
    record = json.loads(text)
    int(record["dot_rows"])  # a file without it (another layout) raises here and is measured again
    return record
