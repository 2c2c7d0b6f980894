"""A prefilled prompt on its way from a prefill engine to a decode engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.request import Request, TokenLogprob


@dataclass
class PrefillOutput:
    """The prompt's KV and each sample's first token: all a decode engine needs to continue it."""

    request: Request  # prompt_token_ids set, sampling resolved
    k: torch.Tensor  # [L, T, Hkv, Dk]
    v: torch.Tensor  # [L, T, Hkv, Dv]
    first_token_ids: list[int]  # one per sample
    first_logprobs: list[TokenLogprob | None]
    submitted_at: float
    prefilled_at: float

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]
