"""Roofline lower bound of a generation workload on this machine.

No engine can run a decode step faster than max(FLOPs / peak FLOP/s, bytes read / memory bandwidth).
The bound schedules the workload as well as any engine could: every prompt prefilled in one pass, then
every unfinished sequence decoded in one batch per step (so weights are read once per step for the
whole population), over as many steps as the longest output needs. A decode step reads the weights of
the experts its tokens hit, taken as the expected count under uniform routing. Peaks are measured here, in
the same process as the benchmark: a large fp32 GEMM (the faster of BLAS and oneDNN on CPU) and a large tensor
reduction (on CPU the faster of torch's sum and a C loop that only streams: torch's read 10-20 % below it on the
dev box, which priced every bound that much too low).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, fields

import torch

from batchgen.engine.host_arena import host_arena
from batchgen.kernels import gemm_onednn
from batchgen.kernels.c_library import VECTOR_SOURCE, CFunction

_READ_SOURCE = r"""
#include <stdint.h>
#include <string.h>
VECTOR
/* the sum of x[0, n) over `threads` threads of the OpenMP team, every element read once: four independent vector
   sums per thread, so the loads and not the adds' latency set the pace */
float read_sum_f32(const float *x, int64_t n, int threads) {
    int64_t blocks = n / (4 * LANES);
    float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const float *p = x + b * 4 * LANES;
            s0 += load(p);
            s1 += load(p + LANES);
            s2 += load(p + 2 * LANES);
            s3 += load(p + 3 * LANES);
        }
        vec s = (s0 + s1) + (s2 + s3);
        for (int i = 0; i < LANES; i++) total += s[i];
    }
    for (int64_t i = blocks * 4 * LANES; i < n; i++) total += x[i];
    return total;
}
""".replace("VECTOR", VECTOR_SOURCE)
_READ_SUM = CFunction("roofline_read", _READ_SOURCE, "read_sum_f32", (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int),
                      ctypes.c_float)


@dataclass(frozen=True)
class MachinePeaks:
    matmul_flops: float  # FLOP/s of a large square GEMM
    read_bandwidth: float  # bytes/s streaming a large tensor (sum; see read_sum)
    copy_bandwidth: float  # bytes/s read + written by a large tensor copy


def best_peaks(samples: list[MachinePeaks]) -> MachinePeaks:
    """Each peak at its best over samples taken at different times of one run: a shared machine's speed drifts by
    minutes (on the AVX2 dev box the same GEMM read 117 GFLOP/s at a bench's start and 160-180 GFLOP/s a few
    minutes later), and a peak read in a slow moment prices every bound too high (a prefill "faster than its bound")."""
    return MachinePeaks(**{peak.name: max(getattr(s, peak.name) for s in samples) for peak in fields(MachinePeaks)})


@dataclass(frozen=True)
class MoEShape:
    """What the bound needs of a Mixtral-style model (q/k/v/o attention, top-k routed SwiGLU experts)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    intermediate: int
    dtype_bytes: int

    @classmethod
    def from_hf_config(cls, config: dict, dtype_bytes: int = 4) -> MoEShape:
        needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_local_experts", "num_experts_per_tok", "intermediate_size")
        missing = [k for k in needed if k not in config]
        if missing:
            raise ValueError(f"config.json of model_type {config.get('model_type')!r} lacks {missing}: "
                             "the roofline bound needs a Mixtral-style MoE config")
        heads = config["num_attention_heads"]
        return cls(vocab=config["vocab_size"], hidden=config["hidden_size"],
                   layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                   intermediate=config["intermediate_size"], dtype_bytes=dtype_bytes)

    @property
    def dense_params_per_layer(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + self.hidden * self.experts + 2 * self.hidden  # + router + two norms

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class RooflineBound:
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    compute_bound_steps: int
    flops: float
    bytes_read: float


CPU_GEMM_SIZE = 2048
GPU_GEMM_SIZE = 8192
GPU_CALLS = 10  # back-to-back calls a timing on a GPU: one launch and synchronisation cost tens of us


def _best_seconds(fn, repeats: int, device: torch.device, calls: int = 1) -> float:
    """The best of `repeats` timings of `calls` back-to-back calls of fn, per call."""
    def timed() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / calls

    timed()  # warm-up: allocator, thread pool, kernel selection
    return min(timed() for _ in range(repeats))


def measure_peaks(device: torch.device | None = None, gemm_size: int | None = None, stream_mib: int = 512,
                  repeats: int = 5, dtype: torch.dtype = torch.float32) -> MachinePeaks:
    """Best-of-`repeats` GEMM FLOP/s in `dtype` (the systems' own: bfloat16 runs on a GPU's tensor cores, several
    times float32's rate) and streaming bandwidth, with torch's default thread count. On CPU the float32 GEMM is the
    faster of torch.mm (BLAS) and the engine's own (oneDNN: 2.3x MKL on the dev box's AMD cores). On a GPU the GEMM
    is GPU_GEMM_SIZE square, and each timing GPU_CALLS calls: a 2048-cube bfloat16 GEMM takes ~25 us on an H100's tensor
    cores, about what one launch and synchronisation cost, and would measure half the peak (a bound half as tight)."""
    device = device or torch.device("cpu")
    gpu = device.type == "cuda"
    gemm_size = gemm_size or (GPU_GEMM_SIZE if gpu else CPU_GEMM_SIZE)
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    b = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    calls = GPU_CALLS if gpu else 1
    gemm = _best_seconds(lambda: torch.mm(a, b), repeats, device, calls)
    if device.type == "cpu" and dtype == torch.float32:
        gemm = min(gemm, _best_seconds(lambda: gemm_onednn.linear(a, b), repeats, device))
    x, y = _stream_buffer(stream_mib, device), _stream_buffer(stream_mib, device)
    copy = _best_seconds(lambda: y.copy_(x), repeats, device, calls)
    nbytes = x.numel() * x.element_size()
    return MachinePeaks(matmul_flops=2 * gemm_size**3 / gemm, read_bandwidth=_read_rate(x, repeats, device),
                        copy_bandwidth=2 * nbytes / copy)


def read_bandwidth(device: torch.device, threads: int | None = None, stream_mib: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` bytes/s of summing a `stream_mib` buffer on `threads` torch threads (default: as set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _read_rate(_stream_buffer(stream_mib, device), repeats, device)
    finally:
        torch.set_num_threads(before)


def read_sum(x: torch.Tensor) -> float:
    """The sum of a dense float32 CPU tensor by the C streaming loop, on torch's thread count."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"read_sum streams a dense float32 CPU tensor, got {x.dtype} on {x.device}"
                         f"{'' if x.is_contiguous() else ', not contiguous'}")
    return _READ_SUM(x.data_ptr(), x.numel(), torch.get_num_threads())


def _stream_buffer(stream_mib: int, device: torch.device) -> torch.Tensor:
    """`stream_mib` MiB of float32 ones; on CPU in a host arena, the huge pages a CPU engine's weights and KV live in
    (4 KiB pages read 20-25 % slower on the dev box's VM: a bound measured on them would not bound the engine)."""
    count = stream_mib * 2**20 // 4
    if device.type != "cpu":
        return torch.ones(count, device=device)
    return host_arena(count * 4).view(torch.float32).fill_(1.0)


def _read_rate(x: torch.Tensor, repeats: int, device: torch.device) -> float:
    seconds = _best_seconds(lambda: x.sum(), repeats, device, GPU_CALLS if device.type == "cuda" else 1)
    if device.type == "cpu" and _READ_SUM.unavailable() is None:
        seconds = min(seconds, _best_seconds(lambda: read_sum(x), repeats, device))
    return x.numel() * x.element_size() / seconds


def _experts_touched(shape: MoEShape, tokens: int) -> float:
    """Expected distinct experts hit per layer when `tokens` tokens route uniformly at random."""
    return shape.experts * (1 - (1 - shape.top_k / shape.experts) ** tokens)


@dataclass(frozen=True)
class StepShape:
    """The work of one forward: prompt tokens (their (query, key) pairs, cached prefix tokens read back, prompts
    whose last token gets logits) and decoded sequences (cached tokens they attend over, the new one included)."""

    prompt_tokens: int = 0
    prompt_attended: int = 0
    prompt_kv_read: int = 0
    prompts_completed: int = 0
    decoded: int = 0
    decode_kv: int = 0


def step_cost(shape: MoEShape, step: StepShape) -> tuple[float, float]:
    """(FLOPs, bytes read) of one forward. Its tokens hit the expected count of distinct experts under uniform
    routing, each hit expert's weights read once for all of them."""
    tokens = step.prompt_tokens + step.decoded
    per_token = shape.layers * (shape.dense_params_per_layer + shape.top_k * shape.expert_params)
    attended = step.prompt_attended + step.decode_kv
    flops = 2 * tokens * per_token + shape.layers * 4 * shape.heads * shape.head_dim * attended
    logit_rows = step.prompts_completed + step.decoded
    flops += 2 * shape.vocab * shape.hidden * logit_rows
    weights = shape.layers * (shape.dense_params_per_layer + _experts_touched(shape, tokens) * shape.expert_params)
    weights += tokens * shape.hidden  # embedding rows
    if logit_rows:  # a step of prompt chunks that complete none never runs the LM head
        weights += shape.vocab * shape.hidden
    kv_read = step.prompt_kv_read + step.decode_kv
    return flops, weights * shape.dtype_bytes + kv_read * shape.kv_bytes_per_token


def step_seconds(shape: MoEShape, step: StepShape, peaks: MachinePeaks) -> tuple[float, bool]:
    """Least time of one forward, and whether compute (not the memory read) bounds it."""
    return _roofline(*step_cost(shape, step), peaks)


def _roofline(flops: float, nbytes: float, peaks: MachinePeaks) -> tuple[float, bool]:
    compute, memory = flops / peaks.matmul_flops, nbytes / peaks.read_bandwidth
    return max(compute, memory), compute >= memory


def schedule_bound(shape: MoEShape, steps: list[StepShape], peaks: MachinePeaks) -> float:
    """Least time of a given schedule (an engine's steps as it ran them): each step at its own roofline."""
    return sum(step_seconds(shape, step, peaks)[0] for step in steps)


def workload_bound(shape: MoEShape, prompt_lens: list[int], output_lens: list[int], peaks: MachinePeaks
                   ) -> RooflineBound:
    """Least time for prompts `prompt_lens` generating `output_lens` tokens each (the first from prefill)."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError(f"need one output length per prompt, got {len(prompt_lens)} prompts "
                         f"and {len(output_lens)} output lengths")
    prefill_step = StepShape(prompt_tokens=sum(prompt_lens), prompt_attended=sum(n * (n + 1) // 2 for n in prompt_lens),
                             prompts_completed=len(prompt_lens))
    steps = [prefill_step]
    for step in range(1, max(output_lens)):
        contexts = [p + step for p, o in zip(prompt_lens, output_lens) if o > step]
        steps.append(StepShape(decoded=len(contexts), decode_kv=sum(contexts)))
    costs = [step_cost(shape, step) for step in steps]
    timed = [_roofline(flops, nbytes, peaks) for flops, nbytes in costs]
    prefill = timed[0][0]
    decode = sum(seconds for seconds, _ in timed[1:])
    return RooflineBound(seconds=prefill + decode, prefill_seconds=prefill, decode_seconds=decode,
                         decode_steps=len(steps) - 1, compute_bound_steps=sum(bound for _, bound in timed[1:]),
                         flops=sum(f for f, _ in costs), bytes_read=sum(b for _, b in costs))
