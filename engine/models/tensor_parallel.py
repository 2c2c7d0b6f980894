"""Tensor parallelism: one rank's slice of a model's attention heads and MLP columns.

`keep_tensor_shard` turns a model built on the meta device into rank r of N's share before its weights load:
attention keeps heads [r*H/N, (r+1)*H/N) (GQA: its KV heads too, so its KV cache holds only those; MLA: the
query heads, the latent stays whole), dense MLPs, shared experts and every routed expert keep 1/N of their
intermediate columns. The projections that consume a split (o_proj, down_proj) then produce partial sums:
each attention and feed-forward block adds them up over the ranks (`sum_over_ranks`, an all-reduce) before the
residual. Norms, routers, embeddings and the LM head stay whole (every rank computes the same routing and
logits from the same reduced hidden states). Returns, per parameter, how to cut its checkpoint tensors.

The same cut applies to a model whose weights are loaded (engine/parallel/partition.py: a rank of an
expert-parallel group borrows its own weights as a tensor-parallel share to decode a straggler): each
parameter is then replaced by its slice, a view where the slice is contiguous.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from batchgen.engine.models.layers import FusedExperts, GatedMLP, GQAAttention


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor a rank keeps: along `dim` (of the parameter), rank `rank`'s 1/`ranks`
    of each of `parts` equal blocks (a fused gate_up projection is two blocks); `dim` None: the whole tensor
    on rank 0 and zeros elsewhere (the bias of a projection whose outputs are summed over the ranks)."""

    dim: int | None
    rank: int
    ranks: int
    parts: int = 1

    def rows(self, size: int) -> list[slice]:
        """The index ranges along the cut dimension of a tensor `size` long there."""
        block = size // self.parts
        share = block // self.ranks
        return [slice(p * block + self.rank * share, p * block + (self.rank + 1) * share) for p in range(self.parts)]


def keep_tensor_shard(model: nn.Module, rank: int, ranks: int, experts: bool = True,
                      dense: bool = True) -> dict[str, TensorSlice]:
    """Cut `model` (on the meta device, or loaded) to rank `rank` of `ranks`; {parameter name: TensorSlice}
    for the loader. `experts` False leaves the routed experts as they are (an expert-parallel rank's own);
    `dense` False leaves everything but the routed experts (a rank's columns of every expert alone)."""
    from batchgen.engine.models.deepseek_v3 import MLAAttention  # its module imports the registry: not at top

    cuts: dict[str, TensorSlice] = {}

    def cut(module: nn.Module, prefix: str, attr: str, dim: int | None, parts: int = 1) -> None:
        param = getattr(module, attr)
        piece = TensorSlice(dim, rank, ranks, parts)
        if dim is not None and param.shape[dim] % (ranks * parts):
            raise ValueError(f"tensor parallel: {prefix}{attr} has {param.shape[dim]} rows along dim {dim}, "
                             f"which do not split over {ranks} ranks")
        if param.is_meta and dim is not None:
            shape = list(param.shape)
            shape[dim] //= ranks
            setattr(module, attr, nn.Parameter(param.new_empty(shape), requires_grad=False))
        elif not param.is_meta:
            share = read_slice(lambda _, index: param[index], prefix + attr, piece, 0, tuple(param.shape))
            setattr(module, attr, nn.Parameter(share.contiguous(), requires_grad=False))
        cuts[prefix + attr] = piece

    def column(linear: nn.Linear, prefix: str) -> None:  # output features split
        cut(linear, prefix, "weight", 0)
        if linear.bias is not None:
            cut(linear, prefix, "bias", 0)

    def row(linear: nn.Linear, prefix: str) -> None:  # input features split: partial sums
        cut(linear, prefix, "weight", 1)
        if linear.bias is not None:
            cut(linear, prefix, "bias", None)

    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if not dense and not isinstance(module, FusedExperts):
            continue
        if isinstance(module, GQAAttention):
            _check_heads(name, "attention heads", module.num_heads, ranks)
            _check_heads(name, "KV heads", module.num_kv_heads, ranks)
            for proj in ("q_proj", "k_proj", "v_proj"):
                column(getattr(module, proj), f"{prefix}{proj}.")
            row(module.o_proj, f"{prefix}o_proj.")
            module.num_heads //= ranks
            module.num_kv_heads //= ranks
        elif isinstance(module, MLAAttention):
            _check_heads(name, "attention heads", module.num_heads, ranks)
            query = "q_proj" if hasattr(module, "q_proj") else "q_b_proj"
            column(getattr(module, query), f"{prefix}{query}.")
            column(module.kv_b_proj, f"{prefix}kv_b_proj.")
            row(module.o_proj, f"{prefix}o_proj.")
            module.num_heads //= ranks
        elif isinstance(module, GatedMLP):
            column(module.gate_proj, f"{prefix}gate_proj.")
            column(module.up_proj, f"{prefix}up_proj.")
            row(module.down_proj, f"{prefix}down_proj.")
        elif isinstance(module, FusedExperts) and experts:
            cut(module, prefix, "gate_up_proj", 1, parts=2)  # [E, 2I, D]: the gate rows' share, the up rows'
            cut(module, prefix, "down_proj", 2)  # [E, D, I]
    spec = model.kv_spec()
    if dense and any(isinstance(m, GQAAttention) for m in model.modules()):  # MLA's latent cache stays whole
        model._kv_spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // ranks)
    return cuts


def _check_heads(name: str, what: str, count: int, ranks: int) -> None:
    if count % ranks:
        raise ValueError(f"tensor parallel: {name} has {count} {what}, which do not split over {ranks} ranks")


def read_slice(get_rows, name: str, piece: TensorSlice, shift: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The rank's part of checkpoint tensor `name` (full shape `shape`): `get_rows(name, index)` reads rows by
    index; `shift`: how many leading parameter dims the checkpoint tensor lacks (a per-expert tensor fills one
    expert's slice of a fused parameter)."""
    if piece.dim is None:
        whole = get_rows(name, slice(None))
        return whole if piece.rank == 0 else torch.zeros_like(whole)
    dim = piece.dim - shift
    blocks = [get_rows(name, (slice(None),) * dim + (rows,)) for rows in piece.rows(shape[dim])]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=dim)
