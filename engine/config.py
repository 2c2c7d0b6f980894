"""Engine configuration: one dataclass, every knob with a default that runs on a laptop CPU.

Values are checked when the config is built, so a bad option fails where the job is planned (the
driver, the CLI), not later inside a Ray actor.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("coroutine", "lockstep")
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
WEIGHT_STREAMING = ("expert", "layer")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "coroutine"  # "coroutine" (BatchGen) or "lockstep" (continuous-batching baseline)
    dtype: str = "float32"  # weights and KV, when the engine is built from a checkpoint URI
    device: str = "auto"  # "auto" picks cuda when present
    page_size: int = 64
    # Fields left None are planned when the engine is built (engine/planner): the configuration with the
    # shortest predicted batch completion time under the memory available; a value given here always wins.
    kv_budget_bytes: int | None = None  # device page pool (resident pages + staging pool)
    host_kv_budget_bytes: int | None = None  # host page pool
    staging_fraction: float | None = None  # coroutine mode: share of the device budget kept for streaming
    # coroutine mode, how host-resident sequences decode: True streams their KV layer by layer through a
    # staging pool in device memory; False attends on the host pages in place (a CPU's own memory, a GPU's
    # view of the pinned pages: engine/host_view.py); None (auto) in place wherever the device can
    stream_host_kv: bool | None = None
    b_attn: int | None = None  # max sequences per attention micro-batch
    b_moe: int | None = None  # max tokens per MoE (feed-forward) batch
    max_num_seqs: int | None = None  # sequences resident in the engine (over-subscription bound)
    max_prefill_tokens: int = 4096  # prompt tokens per step; a longer prompt is prefilled in chunks
    # prefill micro-batches join the same step's decode micro-batches in one MoE batch (COMBINE), so a
    # refill never stalls decoding; False runs prefill steps apart from decode steps
    mixed_steps: bool = True
    # prompts sharing whole pages of a prefix reuse those pages' KV instead of prefilling them again
    prefix_caching: bool = True
    # refill prompts when decoding sequences fall under this share of max_num_seqs (0: once none decodes)
    refill_threshold: float | None = None
    max_model_len: int | None = None  # None = the checkpoint's context length
    # ranks (one process per device) of one engine: each attends over its own sequences (data parallel) and
    # holds 1/ep_size of every MoE layer's experts (expert parallel); the experts must split evenly
    ep_size: int = 1
    # or ranks that all run every sequence, each with 1/tp_size of the attention heads and MLP / expert columns
    # (tensor parallel); heads, KV heads and intermediate sizes must split evenly. One of the two, not both.
    tp_size: int = 1
    # expert parallel: when one request is left in the whole engine, every rank decodes it with tensor
    # parallelism (its KV split by heads) instead of one rank alone while the others idle (PARTITION)
    partition_stragglers: bool = True
    # memory-constrained mode (engine/offload): the device bytes the engine may use for weights, KV and activations
    # together. The weights stay in host memory; what the budget cannot keep resident streams through device
    # slots as it computes. None: every weight on the device
    device_memory_bytes: int | None = None
    # how streamed weights move: "expert" (each routed expert alone, when the step's MoE batch routes a token to
    # it) or "layer" (each attention block and whole feed-forward block: the FlexGen-style offloading baseline)
    weight_streaming: str = "expert"
    # a pure decode step whose shape repeats the previous step's replays a recording of its forward instead of
    # running the Python around its kernels: the kernel calls on a CPU, a CUDA graph on a GPU
    # (engine/decode_graphs.py); False runs every step eagerly
    decode_graphs: bool = True
    # every row's logits the same bits whatever else its step computes (batch size, chunking, other sequences):
    # kernels that pick a path by row count keep the one whose sums run in a fixed order per row (slower prefill).
    # CPU float32 engines of one process (the C kernels); vLLM's and SGLang's batch-invariant / deterministic modes
    batch_invariant: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"engine mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"engine dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"engine device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("page_size", "max_prefill_tokens", "ep_size", "tp_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("b_attn", "b_moe", "max_num_seqs", "kv_budget_bytes", "host_kv_budget_bytes", "max_model_len",
                     "device_memory_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError(f"engine options ep_size ({self.ep_size}) and tp_size ({self.tp_size}): one engine is "
                             "either expert parallel or tensor parallel, not both")
        for name in ("mixed_steps", "prefix_caching", "partition_stragglers", "decode_graphs", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"engine option {name} must be true or false, got {getattr(self, name)!r}")
        if self.weight_streaming not in WEIGHT_STREAMING:
            raise ValueError(f"engine option weight_streaming must be one of {WEIGHT_STREAMING}, "
                             f"got {self.weight_streaming!r}")
        if self.device_memory_bytes is not None and self.ranks > 1:
            raise ValueError("engine option device_memory_bytes runs one engine on one device; it cannot be combined "
                             f"with ep_size ({self.ep_size}) or tp_size ({self.tp_size})")
        if self.device_memory_bytes is not None and self.stream_host_kv is False:
            raise ValueError("engine option device_memory_bytes streams host-resident KV through device staging "
                             "pages; stream_host_kv false (attending on host pages in place) cannot be combined")
        if self.batch_invariant and (self.ranks > 1 or self.device_memory_bytes is not None):
            raise ValueError("engine option batch_invariant runs one engine's kernels in one process on its own "
                             "weights: it cannot be combined with ep_size, tp_size or device_memory_bytes")
        if self.weight_streaming == "layer" and self.device_memory_bytes is None:
            raise ValueError("engine option weight_streaming 'layer' streams weights within device_memory_bytes; "
                             "without it every weight stays on the device and nothing would stream")
        if self.stream_host_kv is not None and not isinstance(self.stream_host_kv, bool):  # (0 == False)
            raise ValueError(f"engine option stream_host_kv must be true, false or null, got {self.stream_host_kv!r}")
        for name in ("staging_fraction", "refill_threshold"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"engine option {name} must be a number in [0, 1], got {value!r}")

    @property
    def ranks(self) -> int:
        """Processes (devices) the engine spans."""
        return self.ep_size * self.tp_size

    def torch_device(self) -> torch.device:
        """The device to load onto: "auto" is cuda when present, else cpu."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def load_device(self) -> torch.device:
        """Where the checkpoint is loaded: host memory in memory-constrained mode (the engine then places what is
        resident on its device), else the device itself."""
        return torch.device("cpu") if self.device_memory_bytes is not None else self.torch_device()

    @property
    def shares_host_weights(self) -> bool:
        """Memory-constrained engines stream from host weights that every process of the node shares (one file
        mapping: connectors/host_memory.py), so a node's engine actors hold one copy, not one per device."""
        return self.device_memory_bytes is not None

    @classmethod
    def from_kwargs(cls, base: EngineConfig | None = None, **overrides: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(base or cls(), **overrides)


INT64_MAX = 2**63 - 1  # sizes and the seed reach C and torch as 64-bit integers


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT64_MAX:
        raise ValueError(f"engine option {name} must be an integer in [{minimum}, 2^63 - 1], got {value!r}")
