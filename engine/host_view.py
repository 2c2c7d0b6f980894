"""Host pages a GPU reads and writes in place: pinned host memory seen as a CUDA tensor.

Page-locked host memory that CUDA allocated (torch's pinned memory) lives in the one virtual address space a 64-bit
process shares with its GPUs (unified virtual addressing): a kernel given its address reads and writes it over the
host link, with no copy in between. The engine's host KV pool is pinned on a CUDA engine, so host-resident sequences
can decode on their host pages in place, as on a CPU, instead of copying each layer's pages into a device staging
pool (a host gather, a copy and a write-back per layer, each a synchronisation): the attention kernel reads the same
bytes over the same link, nothing waits on the host, and the step is the same kernels as a resident one. Where the
KV does stream through the staging pool (stream_host_kv, memory-constrained mode), the gather into it and the
write-back of the new tokens' KV are kernels on the view too, instead of copies through the host.
"""

from __future__ import annotations

import functools

import torch

from batchgen.kernels import ops


class _HostMemory:
    """The bytes of a pinned host tensor as a CUDA array interface: torch.as_tensor makes a CUDA tensor of them
    without a copy (and keeps this object, so the host tensor, alive as long as that tensor)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 3}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on CUDA `device` over the memory of `host` (pinned, contiguous): the same bytes, no copy. Through
    bytes: the array interface has no bfloat16."""
    if device.type != "cuda":
        raise ValueError(f"a device view of host memory is for a CUDA device, not {device}")
    if host.numel() == 0:  # (an empty tensor never reports pinned: there is no memory to view either way)
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    if not host.is_pinned():
        raise ValueError("a device view needs pinned host memory (a GPU addresses only page-locked host memory); "
                         f"this {tuple(host.shape)} {host.dtype} tensor is pageable")
    if not host.is_contiguous():
        raise ValueError(f"a device view needs contiguous host memory, got strides {host.stride()}")
    flat = torch.as_tensor(_HostMemory(host), device=device)
    return flat.view(host.dtype).view(host.shape)


@functools.cache
def _refusal(device: torch.device) -> str | None:
    """Why kernels on `device` cannot use host pages in place, None if they can: a view is made and both directions
    checked once - a kernel reads what the host wrote, and the engine's own KV write (the backend it runs on this
    device: Triton's launcher checks every pointer) writes what the host then reads."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no device view of host memory on {device.type}"
    try:
        pages = torch.zeros(2, 4, 1, 8).pin_memory()  # [pages, page size, KV heads, head dim]
        view = device_view(pages, device)
        read = (view + 2).sum().item()
        token = torch.arange(8.0, device=device).view(1, 1, 8)
        ops.write_kv(token, token + 1, view, view, torch.tensor([5], device=device))
        torch.cuda.synchronize(device)
    except (RuntimeError, ValueError) as exc:
        return f"pinned host memory is not addressable from {device}: {exc}"
    if read != 2 * pages.numel() or not torch.equal(pages.view(8, 8)[5], torch.arange(8.0) + 1):
        return f"a device view of pinned host memory on {device} did not read and write the host's bytes"
    return None


def host_pages_in_place(device: torch.device) -> str | None:
    """None when kernels on `device` can attend on host KV pages in place (a CPU: the same memory; a GPU: pinned
    host memory in its address space), else the reason they cannot."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _refusal(device)


def streams_host_kv(setting: bool | None, device_type: str) -> bool:
    """Whether host-resident sequences decode through a device staging pool: `setting` (EngineConfig.stream_host_kv)
    when given, else only where the device cannot attend on host pages in place. A plan made for a CUDA device on a
    machine without one assumes it can (every 64-bit CUDA host maps pinned memory)."""
    if setting is not None:
        return setting
    if device_type == "cuda" and torch.cuda.is_available():
        return host_pages_in_place(torch.device("cuda")) is not None
    return device_type not in ("cpu", "cuda")
