"""Which implementation runs each kernel op, per device type and dtype, and which one ran last.

Order of precedence: `set_backend(op, name)` > the BATCHGEN_KERNELS environment variable
(e.g. "fused_moe=torch,paged_decode_attention=triton", or a bare "torch" for every op) > automatic
choice (first backend in BACKENDS that runs natively on the device and dtype and whose modules import).
Implementations are imported on first use, so a missing flash-attn or Triton costs nothing unless chosen;
forcing a backend that cannot run raises BackendUnavailableError saying what is missing.
"""

import contextlib
import contextvars
import importlib
import importlib.util
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from batchgen.kernels import activation_cpu, capture

logger = logging.getLogger(__name__)

ENV_VAR = "BATCHGEN_KERNELS"
OPS = ("fused_moe", "fused_moe_packed", "prefill_attention", "paged_decode_attention", "write_kv", "linear", "rms_norm",
       "rotary", "argmax", "router_topk")
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
# Backends whose work a recorded forward replays (kernels/capture.py): torch ops and the C kernels.
REPLAYABLE = frozenset({"torch", "cpu_c"})
# Distribution names to tell the user, keyed by the module that must import.
PACKAGE_NAMES = {"triton": "triton", "flash_attn": "flash-attn"}


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run here; the message names the missing package, device or dtype."""


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    target: str  # "module:function", imported on first use
    devices: frozenset[str]  # device types it runs on natively
    requires: tuple[str, ...] = ()  # modules that must import
    dtypes: frozenset[torch.dtype] | None = None  # None: any floating dtype
    interpretable: bool = False  # runs on CPU tensors under TRITON_INTERPRET=1 (only when forced)
    probe: str | None = None  # "module:function" returning why it cannot run here (None: it can)

    def missing(self, device_type: str, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on (device_type, dtype), or None if it can."""
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{PACKAGE_NAMES.get(module, module)} is not installed"
        interpreted = self.interpretable and os.environ.get("TRITON_INTERPRET") == "1"
        if device_type not in self.devices and not interpreted:
            hint = " (or TRITON_INTERPRET=1)" if self.interpretable else ""
            return f"it needs a {'/'.join(sorted(self.devices))} tensor{hint}, got {device_type}"
        if self.dtypes is not None and dtype not in self.dtypes:
            supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"it supports {supported}, got {str(dtype).removeprefix('torch.')}"
        if self.probe is not None:
            module, function = self.probe.split(":")
            return getattr(importlib.import_module(module), function)()
        return None

    def load(self) -> Callable:
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


_CUDA = frozenset({"cuda"})
_ANY = frozenset({"cpu", "cuda", "mps", "xpu"})
_PKG = "batchgen.kernels"


def _c_kernel(op: str, module: str, function: str) -> Backend:
    """A C kernel for float32 CPU tensors, `module:function` of this package; the module's `unavailable()` says
    why it cannot run here (no C compiler, or a build error)."""
    return Backend(op, "cpu_c", f"{_PKG}.{module}:{function}", frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                   probe=f"{_PKG}.{module}:unavailable")


# Automatic choice walks this list in order, per op.
BACKENDS = (
    Backend(
        "fused_moe", "triton", f"{_PKG}.moe_triton:fused_moe_triton", _CUDA, ("triton",), interpretable=True
    ),
    _c_kernel("fused_moe", "moe_cpu", "fused_moe_cpu"),
    Backend("fused_moe", "torch", f"{_PKG}.moe_torch:fused_moe_torch", _ANY),
    # fused_moe on expert weights the engine packed for it (kernels/moe_packed_cpu.py): a model packed when
    # fused_moe ran on cpu_c runs this whatever fused_moe is later forced to
    _c_kernel("fused_moe_packed", "moe_packed_cpu", "fused_moe_packed_cpu"),
    Backend(
        "prefill_attention",
        "flash_attn",
        f"{_PKG}.attention_flash:prefill_attention_flash",
        _CUDA,
        ("flash_attn",),
        dtypes=HALF_DTYPES,
    ),
    _c_kernel("prefill_attention", "prefill_cpu", "prefill_attention_cpu"),
    Backend("prefill_attention", "torch", f"{_PKG}.attention_torch:prefill_attention_torch", _ANY),
    Backend(
        "paged_decode_attention",
        "triton",
        f"{_PKG}.decode_triton:paged_decode_attention_triton",
        _CUDA,
        ("triton",),
        interpretable=True,
    ),
    _c_kernel("paged_decode_attention", "attention_cpu", "paged_decode_attention_cpu"),
    Backend("paged_decode_attention", "torch", f"{_PKG}.attention_torch:paged_decode_attention_torch", _ANY),
    Backend(
        "write_kv",
        "triton",
        f"{_PKG}.write_kv_triton:write_kv_triton",
        _CUDA,
        ("triton",),
        interpretable=True,
    ),
    _c_kernel("write_kv", "write_kv_cpu", "write_kv_cpu"),
    Backend("write_kv", "torch", f"{_PKG}.attention_torch:write_kv_torch", _ANY),
    _c_kernel("linear", "linear_cpu", "linear_cpu"),
    Backend("linear", "torch", "torch.nn.functional:linear", _ANY),
    _c_kernel("rms_norm", "norm_cpu", "rms_norm_cpu"),
    Backend("rms_norm", "torch", f"{_PKG}.norm_torch:rms_norm_torch", _ANY),
    _c_kernel("rotary", "rotary_cpu", "rotary_cpu"),
    Backend("rotary", "torch", f"{_PKG}.rotary_torch:rotary_torch", _ANY),
    _c_kernel("argmax", "argmax_cpu", "argmax_cpu"),
    Backend("argmax", "torch", f"{_PKG}.argmax_torch:argmax_torch", _ANY),
    _c_kernel("router_topk", "router_cpu", "router_topk_cpu"),
    Backend("router_topk", "torch", f"{_PKG}.router_torch:router_topk_torch", _ANY),
)


@dataclass
class _State:
    forced: dict[str, str]
    resolved: dict[tuple, tuple[str, Callable]]
    last: dict[str, str]
    counts: Counter
    generation: int = 0  # set_backend calls so far


_state = _State(forced={}, resolved={}, last={}, counts=Counter())


def backends_for(op: str) -> list[Backend]:
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; known ops: {', '.join(OPS)}")
    return [b for b in BACKENDS if b.op == op]


def _backend(op: str, name: str, source: str) -> Backend:
    for backend in backends_for(op):
        if backend.name == name:
            return backend
    known = ", ".join(b.name for b in backends_for(op))
    raise ValueError(f"{source}: unknown backend {name!r} for {op}; known: {known}")


def parse_overrides(spec: str) -> dict[str, str]:
    """'fused_moe=torch,write_kv=triton' -> {op: name}; a bare name applies to every op that has it."""
    overrides: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if "=" in item:
            op, name = (s.strip() for s in item.split("=", 1))
            overrides[op] = _backend(op, name, ENV_VAR).name
            continue
        ops = [op for op in OPS if any(b.name == item for b in backends_for(op))]
        if not ops:
            raise ValueError(f"{ENV_VAR}: unknown backend {item!r}")
        overrides.update(dict.fromkeys(ops, item))
    return overrides


def set_backend(op: str, name: str | None) -> None:
    """Force `op` to backend `name` in this process (None: back to env/automatic choice)."""
    if name is None:
        _state.forced.pop(op, None)
        backends_for(op)
    else:
        _state.forced[op] = _backend(op, name, "set_backend").name
    _state.resolved.clear()
    _state.generation += 1


def configuration() -> tuple[int, str, bool]:
    """What decides the backends and their paths besides the tensors (the forced ones, the environment, batch
    invariance): recorded forwards made under another configuration call other kernels than it would now."""
    return _state.generation, os.environ.get(ENV_VAR, ""), batch_invariant()


# Batch-invariant kernels (EngineConfig.batch_invariant): each row's result the same bits whatever else the call
# holds. Set around an engine's forwards, on the thread that runs them.
_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar("batchgen_batch_invariant", default=False)
# the ops whose other backends give a row other bits by what else the call holds (a path by row count, BLAS): the
# backends that keep every row's sums in one order (the others' kernels compute each row, or each sequence, on its own)
INVARIANT_OPS = {"linear": "cpu_c", "fused_moe": "cpu_c", "router_topk": "cpu_c"}


def batch_invariant() -> bool:
    """Whether the kernels now run must give each row the same result whatever the rest of the batch."""
    return _INVARIANT.get()


def invariance_refusal(device_type: str, dtype: torch.dtype) -> str | None:
    """Why an engine on (device_type, dtype) cannot run batch-invariant here, or None."""
    for op, needed in INVARIANT_OPS.items():
        try:
            name, _ = resolve(op, device_type, dtype)
        except BackendUnavailableError as exc:
            return str(exc)
        if name != needed:
            return (f"batch-invariant kernels are the {needed} backend's for {op} (float32 CPU tensors); "
                    f"{name} runs it here")
    return activation_cpu.unavailable()  # the models' silu and sigmoid in this mode


@contextlib.contextmanager
def invariant_batches(on: bool) -> Iterator[None]:
    """Run the kernels batch-invariant (`on`) inside the block."""
    token = _INVARIANT.set(on)
    try:
        yield
    finally:
        _INVARIANT.reset(token)


@contextlib.contextmanager
def use_backend(op: str, name: str) -> Iterator[None]:
    """Temporarily force a backend (tests, benchmarks)."""
    previous = _state.forced.get(op)
    set_backend(op, name)
    try:
        yield
    finally:
        set_backend(op, previous)


def _choose(op: str, device_type: str, dtype: torch.dtype, env: str) -> tuple[str, Callable]:
    forced = _state.forced.get(op) or parse_overrides(env).get(op)
    if forced is not None:
        backend = _backend(op, forced, "set_backend")
        reason = backend.missing(device_type, dtype)
        if reason is not None:
            raise BackendUnavailableError(f"{op}: backend {forced!r} was forced but cannot run: {reason}")
        try:
            return forced, backend.load()
        except ImportError as exc:
            raise BackendUnavailableError(
                f"{op}: backend {forced!r} was forced but failed to import: {exc}"
            ) from exc
    for backend in backends_for(op):
        if device_type not in backend.devices or backend.missing(device_type, dtype) is not None:
            continue
        try:
            return backend.name, backend.load()
        except ImportError as exc:
            logger.warning("%s: skipping backend %r, import failed: %s", op, backend.name, exc)
    raise BackendUnavailableError(f"{op}: no backend runs on {device_type} with {dtype}")


def resolve(op: str, device_type: str, dtype: torch.dtype) -> tuple[str, Callable]:
    """(backend name, implementation) for op on this device type and dtype, without recording use."""
    env = os.environ.get(ENV_VAR, "")
    key = (op, device_type, dtype, env)
    choice = _state.resolved.get(key)
    if choice is None:
        choice = _state.resolved[key] = _choose(op, device_type, dtype, env)
    return choice


def dispatch(op: str, tensor: torch.Tensor) -> Callable:
    """Implementation of op for the tensor's device and dtype; records it as the last one used."""
    name, fn = resolve(op, tensor.device.type, tensor.dtype)
    if name not in REPLAYABLE and capture.recording_calls():
        raise capture.CaptureRefused(f"{op} runs on the {name} backend, whose work a recording does not see")
    _state.last[op] = name
    _state.counts[(op, name)] += 1
    return fn


def last_used(op: str) -> str | None:
    """Name of the backend that ran `op` most recently in this process."""
    backends_for(op)
    return _state.last.get(op)


def usage_counts() -> dict[tuple[str, str], int]:
    """{(op, backend): calls} since start or reset_usage()."""
    return dict(_state.counts)


def reset_usage() -> None:
    _state.last.clear()
    _state.counts.clear()
