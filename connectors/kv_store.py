"""The host KV store that joins a prefill stage to a decode stage.

A prefill worker `put`s each sequence's PrefillOutput (KV + first tokens) and passes the returned
ref, a short string, downstream inside the dataset row; a decode worker `get`s it and `delete`s it
once its result is safe. `get` answers None for a ref whose KV is gone (a crashed owner, a store
restart): the decode stage then recomputes the prefill instead of failing the row.

Default backend: the Ray object store. Who owns each object is the crux. An object belongs to the
process that called `ray.put`, and dies with it; Ray Data kills a stage's actors as soon as that
stage has consumed its input, while the decode stage may still be working through a backlog of
refs, and Ray 2.56 removed `ray.put(_owner=...)`. So prefill workers do not own the KV: they hand
it to a `KVOwner` actor (zero CPUs, one per node, living as long as the store handle's creator)
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

import ray
import torch

from batchgen.engine import PrefillOutput


class KVStore(ABC):
    """put(key, PrefillOutput) -> ref; get(ref) -> PrefillOutput | None; delete(ref)."""

    @abstractmethod
    def put_many(self, keys: list[str], values: list[PrefillOutput]) -> list[str]: ...

    @abstractmethod
    def get_many(self, refs: list[str]) -> list[PrefillOutput | None]: ...

    @abstractmethod
    def delete_many(self, refs: list[str]) -> None: ...

    def put(self, key: str, value: PrefillOutput) -> str:
        return self.put_many([key], [value])[0]

    def get(self, ref: str) -> PrefillOutput | None:
        return self.get_many([ref])[0]

    def delete(self, ref: str) -> None:
        self.delete_many([ref])


@ray.remote(num_cpus=0, max_restarts=-1)
class KVOwner:
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


class RayKVStore(KVStore):
    """KV in the Ray object store, owned by one KVOwner per node. A ref is '<node id>/<key>'."""

    def __init__(self, owners: dict[str, ray.actor.ActorHandle]) -> None:
        self.owners = owners

    @classmethod
    def create(cls) -> RayKVStore:
        """Start one owner on every alive node; call it on the driver before the pipeline runs."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        run = uuid.uuid4().hex[:8]
        owners = {}
        for node in ray.nodes():
            if node["Alive"]:
                node_id = node["NodeID"]
                owners[node_id] = KVOwner.options(
                    name=f"batchgen-kv-{run}-{node_id[:12]}",
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True)).remote()
        ray.get([o.size.remote() for o in owners.values()])
        return cls(owners)

    def put_many(self, keys: list[str], values: list[PrefillOutput]) -> list[str]:
        if any("/" in k for k in keys):
            raise ValueError("KV store keys must not contain '/'")
        node = ray.get_runtime_context().get_node_id()
        node = node if node in self.owners else next(iter(self.owners))
        ray.get(self.owners[node].put.remote(keys, [_to_numpy(v) for v in values]))
        return [f"{node}/{k}" for k in keys]

    def get_many(self, refs: list[str]) -> list[PrefillOutput | None]:
        out: list[PrefillOutput | None] = [None] * len(refs)
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


def _to_numpy(value: PrefillOutput) -> dict:
    """KV as raw bytes in numpy arrays: they come back from the object store without a copy, and
    byte views carry any dtype (numpy has no bfloat16)."""
    fields = dict(vars(value))
    for name in ("k", "v"):
        tensor = fields[name].contiguous()
        fields[name] = (tensor.view(torch.uint8).numpy(), tensor.dtype)
    return fields


def _from_numpy(fields: dict) -> PrefillOutput:
    fields = dict(fields)
    for name in ("k", "v"):
        raw, dtype = fields[name]
        with warnings.catch_warnings():  # read-only store buffer; the decode engine copies it into its pages
            warnings.simplefilter("ignore", UserWarning)
            fields[name] = torch.from_numpy(raw).view(dtype)
    return PrefillOutput(**fields)
