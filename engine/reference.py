"""Greedy generation with a plain contiguous KV cache per sequence: the ground truth the engine is checked
against. Deliberately simple: every step is one flat forward over all unfinished sequences, each layer's
cache is a growing [L, Hkv, D] tensor per sequence, attention is kernels.ops.prefill_attention over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.kernels import ops


@dataclass
class SequenceKV:
    keys: list[torch.Tensor]  # per layer [L, Hkv, Dk]
    values: list[torch.Tensor]  # per layer [L, Hkv, Dv]
    length: int = 0


@dataclass
class ContiguousKVContext:
    """AttentionContext of one forward: `new_lens[b]` new tokens of sequence `caches[b]`, in that order."""

    caches: list[SequenceKV]
    new_lens: list[int]
    positions: torch.Tensor = field(init=False)

    def __post_init__(self):
        device = self.caches[0].keys[0].device
        spans = zip(self.caches, self.new_lens)
        self.positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in spans]).to(device)
        self._cu_q = _cumsum(self.new_lens, device)
        self._cu_k = _cumsum([c.length + n for c, n in zip(self.caches, self.new_lens)], device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        start = 0
        for cache, n in zip(self.caches, self.new_lens):
            cache.keys[layer] = torch.cat([cache.keys[layer], k[start:start + n]])
            cache.values[layer] = torch.cat([cache.values[layer], v[start:start + n]])
            start += n
        keys = torch.cat([c.keys[layer] for c in self.caches])
        values = torch.cat([c.values[layer] for c in self.caches])
        return ops.prefill_attention(q, keys, values, self._cu_q, self._cu_k, scale)

    def commit(self) -> None:
        """Call after the forward: the new tokens are now part of each sequence's prefix."""
        for cache, n in zip(self.caches, self.new_lens):
            cache.length += n


class ReferenceRunner:
    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device

    @torch.inference_mode()
    def prefill_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits [T, V] for every position of one prompt."""
        self._check_prompts([prompt])
        return self._step([prompt], [self._empty_cache()])

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_ids=()) -> list[list[int]]:
        """Greedy continuation of each prompt: max_new_tokens tokens, or fewer ending with an eos token."""
        self._check_prompts(prompts)
        eos = set(eos_token_ids)
        caches = [self._empty_cache() for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        feed = [list(p) for p in prompts]
        active = list(range(len(prompts))) if max_new_tokens > 0 else []
        while active:
            logits = self._step([feed[i] for i in active], [caches[i] for i in active])
            last = torch.tensor([len(feed[i]) for i in active], device=self.device).cumsum(0) - 1
            still_active = []
            for i, token in zip(active, logits[last].argmax(dim=-1).tolist()):
                outputs[i].append(token)
                feed[i] = [token]
                if token not in eos and len(outputs[i]) < max_new_tokens:
                    still_active.append(i)
            active = still_active
        return outputs

    def _step(self, tokens: list[list[int]], caches: list[SequenceKV]) -> torch.Tensor:
        ctx = ContiguousKVContext(caches, [len(t) for t in tokens])
        input_ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=self.device)
        logits = self.model(input_ids, ctx)
        ctx.commit()
        return logits

    def _empty_cache(self) -> SequenceKV:
        spec = self.model.kv_spec()
        empty = lambda dim: torch.empty(0, spec.num_kv_heads, dim, dtype=self.dtype, device=self.device)
        return SequenceKV([empty(spec.k_dim) for _ in range(spec.num_layers)],
                          [empty(spec.v_dim) for _ in range(spec.num_layers)])

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        vocab = self.model.vocab_size
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {index}: token {bad[0]} is outside the vocabulary [0, {vocab})")


def _cumsum(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *values], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
