"""Recording a forward's kernel calls and torch ops once, then replaying them without the Python around them: the
CPU counterpart of a CUDA graph.

A decode step of a few sequences spends a quarter of its time in Python between its C kernels (module calls, input
checks, backend dispatch, wrappers building ctypes arguments: bench/RESULTS.md). None of it depends on the values in
the tensors, only on their shapes, so a step whose shapes repeat can run the same sequence of calls again on new
values: `record` runs a function once, noting every C kernel call (kernels/c_library.py: the function and its
arguments, pointers included) and every torch op that computes (through a TorchDispatchMode), in program order;
`Recording.replay` makes the same calls again. Every tensor the recording touched is kept alive, so the pointers
stay valid, and new inputs are copied into the recorded input tensors before a replay.

What a recording cannot hold refuses it (CaptureRefused) while recording: a value read back to the host (`.item()`,
a data-dependent shape, `read_back`'s lists), whose Python decisions would be replayed frozen, and a kernel backend
that runs outside both (Triton, flash-attn: kernels/registry.py asks `recording()`). A replayed C kernel that returns
another status than it did when recorded (an error code) raises ReplayDiverged: the caller runs the step eagerly.
Side effects a replay must repeat (engine counters) go through `effect`. A replay on fewer real rows than were recorded
(the rest pad the inputs to the recorded shape) marks which rows pad in `padding()`, so the recorded function can
spare them its costliest work.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchgen.kernels import c_library

aten = torch.ops.aten
_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                          aten.new_empty.default, aten.new_empty_strided.default})
# ops whose output shape depends on the values in their input: a replay would need another shape (and on a GPU the
# host waits for the device to size the output)
_DATA_SHAPED = frozenset({aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
                          aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                          aten.repeat_interleave.Tensor})
_RESHAPING = frozenset({aten.resize_.default, aten.set_.source_Storage})  # a tensor given another storage or shape

_state = threading.local()  # `capture`: the capture in progress on this thread (_Recorder or _EffectsCollector)


class CaptureRefused(RuntimeError):
    """The recorded function did something a replay cannot repeat; the message says what."""


class ReplayDiverged(RuntimeError):
    """A replayed kernel reported another status than when it was recorded (an error on the new inputs)."""


@dataclass
class Recording:
    """The calls of one recorded run, in order, and every tensor they touched (kept alive for their pointers)."""

    calls: list[Callable[[], object]] = field(default_factory=list)
    effects: list[tuple[Callable[..., object], tuple]] = field(default_factory=list)  # host side effects, after them
    tensors: list = field(default_factory=list)
    kernel_calls: int = 0  # C kernel calls among `calls`
    torch_ops: int = 0  # torch ops among `calls`
    rows: int | None = None  # the rows the recorded run computed (`record(rows=...)`), for replays on fewer
    nbytes: int = 0  # memory the recording holds of its own: the tensors its ops allocated or computed
    padding: torch.Tensor | None = None  # [rows, 1] bool, True on the padding rows (`padding()`), or None

    def replay(self, rows: int | None = None) -> None:
        """The recorded calls again, then the effects. `rows`: only the first `rows` of the recorded rows are real
        (the others pad the inputs to the recorded shape), so the effects see only those (see `effect`), and
        `padding()` marks the others."""
        mark_padding(self.padding, rows)
        for call in self.calls:
            call()
        self.run_effects(rows)

    def run_effects(self, rows: int | None = None) -> None:
        for fn, args in self.effects:
            fn(*(_effect_argument(a, self.rows, rows) for a in args))


def recording() -> bool:
    """Whether a capture is in progress on this thread: `record`'s, or a CUDA graph's (`collect_effects`)."""
    return getattr(_state, "capture", None) is not None


def recording_calls() -> bool:
    """Whether `record` is in progress on this thread: a replay repeats only the torch ops and C kernels it saw."""
    return isinstance(getattr(_state, "capture", None), _Recorder)


def refuse_if_recording(reason: str) -> None:
    if recording():
        raise CaptureRefused(reason)


def padding() -> torch.Tensor | None:
    """While recording rows of which a replay may pad some (`record(rows=...)`, `collect_effects(rows=...)`): a
    [rows, 1] bool tensor, True on the padding rows of the run in progress and of every replay after it. A recorded
    function masks with it what the padding rows would cost (their experts); None when nothing is recorded."""
    capture = getattr(_state, "capture", None)
    return None if capture is None else capture.recording.padding


def padding_mask(rows: int | None, real_rows: int | None, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The `padding()` tensor of a recording of `rows` rows, `real_rows` of them real in the recorded run. Made
    before the capture starts: made inside it, its fill would be replayed too."""
    if rows is None:
        return None
    mask = torch.empty(rows, 1, dtype=torch.bool, device=device)
    mark_padding(mask, real_rows)
    return mask


def mark_padding(mask: torch.Tensor | None, real_rows: int | None) -> None:
    """Mark the rows of `mask` past the first `real_rows` (all real when None) as padding."""
    if mask is not None:
        real = mask.shape[0] if real_rows is None else real_rows
        mask[:real] = False
        mask[real:] = True


def read_back(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`: values read back to the host, where Python decides on them; refused while recording (a
    replay would repeat the decisions these values made)."""
    refuse_if_recording(f"a tensor of shape {list(tensor.shape)} is read back to the host")
    return tensor.tolist()


def effect(fn: Callable[..., object], *args) -> None:
    """fn(*args), a host side effect (a counter) that a replay must repeat. While recording it runs when the recording
    completes (a refused one leaves no effect behind: its caller runs the work again), and at the end of every
    replay, after the kernels: with copies of its tensor arguments, which the next replay overwrites, as they are at
    the end of the recorded function. (Between the kernels, the few Python calls of a counter took 10-40 us each on the
    dev box: a decode step's expert weights streamed through the caches evict the interpreter's own memory.)
    Effects count rows: a replay on the first n of a recording's N rows (`record(rows=N)`, `replay(rows=n)`) gives
    fn the first n rows of each tensor argument of N rows and n for an int argument equal to N."""
    capture = getattr(_state, "capture", None)
    if capture is None:
        fn(*args)
        return
    capture.recording.effects.append((fn, args))


@contextmanager
def record(rows: int | None = None, real_rows: int | None = None) -> Iterator[Recording]:
    """Record what runs inside the block (on this thread) into the Recording yielded; CaptureRefused leaves it.
    `rows`: the rows the block computes, where a replay may pad fewer real ones to them (Recording.replay);
    `real_rows`: how many of them are real in the recorded run itself (the effects run when it completes)."""
    recorder = _Recorder()
    recorder.recording.rows = rows
    recorder.recording.padding = padding_mask(rows, real_rows)
    with _capturing(recorder), recorder, c_library.observe_calls(recorder.kernel_call):
        yield recorder.recording
    recorder.recording.run_effects(real_rows)


@contextmanager
def collect_effects(rows: int | None = None, padding: torch.Tensor | None = None) -> Iterator[Recording]:
    """Keep the effects of the block in the Recording yielded (its `effects` only) instead of running them: what a
    CUDA graph's capture needs (kernels/cuda_graph.py), whose kernels compute nothing until a replay. Values read back
    to the host refuse it as they refuse `record` (a capture cannot wait for the device). `rows` as for `record`;
    `padding`: the `padding()` tensor (`padding_mask`, on the capture's device)."""
    collector = _EffectsCollector(Recording(rows=rows, padding=padding))
    with _capturing(collector), collector:
        yield collector.recording


@contextmanager
def _capturing(capture) -> Iterator[None]:
    if recording():
        raise CaptureRefused("a capture is already in progress on this thread")
    _state.capture = capture
    try:
        yield
    finally:
        _state.capture = None


class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch would wrap __torch_dispatch__ to keep torch.compile out of it, and that wrapper's first call
        imports torch._dynamo (1.6-1.7 s on the dev box, once a process: an engine actor's first recorded step).
        Nothing here runs under torch.compile."""
        return False


class _EffectsCollector(_Mode):
    """Refuses the torch ops that read a value back to the host (on a GPU: wait for the device, which a capture
    cannot), with their name; runs every op as it is."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _refuse_data_shaped(func, args)
        if func is aten._local_scalar_dense.default:  # `.item()`: refused before it waits on a capturing stream
            raise CaptureRefused(f"{func} reads a value back to the host")
        out = func(*args, **(kwargs or {}))
        if isinstance(out, (bool, int, float, complex)):
            raise CaptureRefused(f"{func} returns {type(out).__name__}: a value read back to the host")
        return out


class _Recorder(_Mode):
    def __init__(self) -> None:
        super().__init__()
        self.recording = Recording()
        self._held: set[int] = set()  # storages counted in recording.nbytes

    def kernel_call(self, fn: Callable, args: tuple, result: object) -> None:
        self.recording.kernel_calls += 1
        if result is None:
            self.recording.calls.append(functools.partial(fn, *args))
            return

        def checked() -> None:
            status = fn(*args)
            if status != result:
                raise ReplayDiverged(f"kernel {getattr(fn, '__name__', fn)} returned {status}, recorded {result}")

        self.recording.calls.append(checked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_data_shaped(func, args)
        if func in _RESHAPING:
            raise CaptureRefused(f"{func} gives a tensor another storage or shape, which a replay would not")
        out = func(*args, **kwargs)
        self.recording.tensors.append((args, kwargs, out))
        if func in _ALLOCATIONS:
            self._hold(out)
            return out
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            self._append(functools.partial(func, *args, **kwargs))  # in place: the same call again
            return out
        outputs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else None
        if outputs is None or not all(isinstance(t, torch.Tensor) for t in outputs):
            raise CaptureRefused(f"{func} returns {type(out).__name__}: a value read back to the host")
        aliased = [_aliases(t, args) for t in outputs]
        if all(aliased):  # a view of its input: it follows whatever is written there
            return out
        if any(aliased):
            raise CaptureRefused(f"{func} returns views and new tensors together")
        for t in outputs:
            self._hold(t)
        self._append(_computed(func, args, kwargs, out))
        return out

    def _append(self, call: Callable[[], object]) -> None:
        self.recording.calls.append(call)
        self.recording.torch_ops += 1

    def _hold(self, tensor: torch.Tensor) -> None:
        """Count a new tensor's storage (once) in the memory the recording keeps alive."""
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._held:
            self._held.add(storage.data_ptr())
            self.recording.nbytes += storage.nbytes()


def _refuse_data_shaped(func, args: tuple) -> None:
    if func in _DATA_SHAPED or (func is aten.index.Tensor and _boolean_index(args)):
        raise CaptureRefused(f"{func} gives an output whose shape depends on the input's values")


def _computed(func, args: tuple, kwargs: dict, out) -> Callable[[], object]:
    """A replay of an op that returns new tensors: into the recorded outputs (its out= overload where it has one
    taking the same arguments, else computed anew and copied)."""
    out_op = _out_overload(func) if isinstance(out, torch.Tensor) else None
    if out_op is not None:
        return functools.partial(out_op, *args, **kwargs, out=out)

    def copied() -> None:
        result = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            out.copy_(result)
        else:
            for target, value in zip(out, result):
                target.copy_(value)

    return copied


@functools.cache
def _out_overload(func):
    names = [a.name for a in func._schema.arguments]
    for overload in func.overloadpacket.overloads():
        candidate = getattr(func.overloadpacket, overload)
        arguments = candidate._schema.arguments
        if [a.name for a in arguments] == [*names, "out"] and arguments[-1].alias_info is not None:
            return candidate
    return None


def _effect_argument(value, recorded: int | None, rows: int | None):
    """An effect's argument on a replay of `rows` real rows of the `recorded` ones: a tensor copied (the next replay
    overwrites it), its real rows only; a row count of the recording, the real one."""
    narrowed = rows is not None and rows != recorded
    if isinstance(value, torch.Tensor):
        return (value[:rows] if narrowed and value.dim() and value.shape[0] == recorded else value).clone()
    if narrowed and type(value) is int and value == recorded:
        return rows
    return value


def _tensors_in(args) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _aliases(tensor: torch.Tensor, args: tuple) -> bool:
    storage = tensor.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in _tensors_in(args))


def _boolean_index(args: tuple) -> bool:
    return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors_in(args[1:]))
