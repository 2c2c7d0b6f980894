"""The contract between a model's attention and whoever owns the KV cache.

Models see a flat batch of T new tokens from any number of sequences (no padding). Attention
modules compute q/k/v for those tokens and hand them to an `AttentionContext`, which stores k/v
in its cache and returns attention over each token's own sequence prefix. The reference runner
implements it over contiguous per-sequence tensors, the engine over device pages; models never
know which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVSpec:
    """Per-layer cache geometry a model asks for (MLA caches one latent 'head')."""

    num_layers: int
    num_kv_heads: int
    k_dim: int
    v_dim: int


class AttentionContext(Protocol):
    positions: torch.Tensor  # [T] int64: position of each new token inside its sequence

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T,H,Dk], k [T,Hkv,Dk], v [T,Hkv,Dv] -> [T,H,Dv], causal within each sequence."""
        ...
