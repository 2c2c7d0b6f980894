"""The prefill -> decode KV hand-off store that joins the two stages of the disaggregated pipeline.

(Not the engine's host page pool: that one lives inside each engine, see engine/kv_manager.py.)
A prefill worker `put`s each prompt's hand-off payload (a dict of its KV tensors and first tokens)
and passes the returned ref, a short string, downstream inside the dataset row; a decode worker
`get`s it and `delete`s it once its result is safe. `get` answers None for a ref whose KV is gone
(a crashed owner, a store restart): the decode stage then recomputes the prefill instead of
failing the row.

Default backend: the Ray object store. Who owns each object is the crux. An object belongs to the
process that called `ray.put`, and dies with it; Ray Data kills a stage's actors as soon as that
stage has consumed its input, while the decode stage may still be working through a backlog of
refs, and Ray 2.56 removed `ray.put(_owner=...)`. So prefill workers do not own the KV: they hand
it to a `HandoffOwner` actor (zero CPUs, one per node, living as long as the store handle's creator)
which `ray.put`s it and keeps the ObjectRef under its key (one extra copy of the KV, on the same
node: the price of outliving the prefill actors). The bytes sit in that node's shared
object store (spilled to disk under pressure, fetched across nodes by Ray); only keys travel in
the dataset, so nothing depends on serialising ObjectRefs out of band (which would pin them for
the owner's lifetime with no way to free them). A decode worker asks the owner for the refs, then
pulls the objects directly from the object store.
"""

from __future__ import annotations

import uuid
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import ray
import torch

Payload = dict[str, Any]  # field name -> value; torch tensors travel as raw bytes


class HandoffStore(ABC):
    """put_many(keys, payloads) -> refs; get_many(refs) -> payloads (None where gone); delete_many(refs)."""

    @abstractmethod
    def put_many(self, keys: list[str], values: list[Payload]) -> list[str]: ...

    @abstractmethod
    def get_many(self, refs: list[str]) -> list[Payload | None]: ...

    @abstractmethod
    def delete_many(self, refs: list[str]) -> None: ...


@ray.remote(num_cpus=0, max_restarts=-1)
class HandoffOwner:
    """Owns the KV objects of one node; keeps their ObjectRefs alive until deleted."""

    def __init__(self) -> None:
        self._refs: dict[str, ray.ObjectRef] = {}

    def put(self, keys: list[str], values: list[dict]) -> None:
        for key, value in zip(keys, values):
            self._refs[key] = ray.put(value)

    def lookup(self, keys: list[str]) -> list[list[ray.ObjectRef] | None]:
        # a ref inside a list travels as a ref, it is not resolved to its value
        return [[self._refs[k]] if k in self._refs else None for k in keys]

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._refs.pop(key, None)

    def size(self) -> int:
        return len(self._refs)


class RayHandoffStore(HandoffStore):
    """Payloads in the Ray object store, owned by one HandoffOwner per node. A ref is '<node id>/<key>'."""

    def __init__(self, owners: dict[str, ray.actor.ActorHandle]) -> None:
        self.owners = owners

    @classmethod
    def create(cls) -> RayHandoffStore:
        """Start one owner on every alive node; call it on the driver before the pipeline runs."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        run = uuid.uuid4().hex[:8]
        owners = {}
        for node in ray.nodes():
            if node["Alive"]:
                node_id = node["NodeID"]
                owners[node_id] = HandoffOwner.options(
                    name=f"batchgen-kv-{run}-{node_id[:12]}",
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True)).remote()
        ray.get([o.size.remote() for o in owners.values()])
        return cls(owners)

    def put_many(self, keys: list[str], values: list[Payload]) -> list[str]:
        if any("/" in k for k in keys):
            raise ValueError("hand-off store keys must not contain '/'")
        node = ray.get_runtime_context().get_node_id()
        node = node if node in self.owners else next(iter(self.owners))
        ray.get(self.owners[node].put.remote(keys, [_to_numpy(v) for v in values]))
        return [f"{node}/{k}" for k in keys]

    def get_many(self, refs: list[str]) -> list[Payload | None]:
        out: list[Payload | None] = [None] * len(refs)
        for node, positions, keys in self._by_owner(refs):
            try:
                found = ray.get(self.owners[node].lookup.remote(keys))
                values = ray.get([f[0] for f in found if f is not None])
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                continue  # the owner died with its objects: the caller recomputes these
            it = iter(values)
            for pos, f in zip(positions, found):
                out[pos] = None if f is None else _from_numpy(next(it))
        return out

    def delete_many(self, refs: list[str]) -> None:
        pending = []
        for node, _, keys in self._by_owner(refs):
            pending.append(self.owners[node].delete.remote(keys))
        try:
            ray.get(pending)
        except ray.exceptions.RayActorError:
            pass  # a dead owner has freed its objects already

    def _by_owner(self, refs: list[str]) -> list[tuple[str, list[int], list[str]]]:
        groups: dict[str, tuple[list[int], list[str]]] = {}
        for pos, ref in enumerate(refs):
            node, _, key = ref.partition("/")
            if node not in self.owners or not key:
                raise ValueError(f"KV ref {ref!r} does not belong to this store")
            positions, keys = groups.setdefault(node, ([], []))
            positions.append(pos)
            keys.append(key)
        return [(node, p, k) for node, (p, k) in groups.items()]


@dataclass(frozen=True)
class _RawTensor:
    """A tensor as raw bytes in a numpy array: it comes back from the object store without a copy,
    and a byte view carries any dtype (numpy has no bfloat16)."""

    data: Any  # numpy uint8 array
    dtype: torch.dtype
    shape: tuple[int, ...]


def _to_numpy(payload: Payload) -> Payload:
    out = dict(payload)
    for name, value in payload.items():
        if isinstance(value, torch.Tensor):
            tensor = value.contiguous()
            out[name] = _RawTensor(tensor.view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))
    return out


def _from_numpy(payload: Payload) -> Payload:
    out = dict(payload)
    for name, value in payload.items():
        if isinstance(value, _RawTensor):
            with warnings.catch_warnings():  # read-only store buffer; the decode engine copies it into its pages
                warnings.simplefilter("ignore", UserWarning)
                out[name] = torch.from_numpy(value.data).view(value.dtype).reshape(value.shape)
    return out
