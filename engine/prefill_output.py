"""A prefilled prompt on its way from a prefill engine to a decode engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.request import Request, Result, TokenLogprob


@dataclass
class PrefillOutput:
    """The prompt's KV and each sample's first token: all a decode engine needs to continue it."""

    request: Request  # prompt_token_ids set, sampling resolved
    kv: torch.Tensor  # uint8, packed as PoolGeometry.packed_views lays it out, in the engines' KV dtype
    first_token_ids: list[int]  # one per sample
    first_logprobs: list[TokenLogprob | None]
    submitted_at: float  # wall clock (engine/wall_clock.py): the decode engine may run on another machine
    # `kv` holds prompt tokens [kv_start, num_tokens): the earlier ones are whole prefix pages an earlier
    # output of the same batch carries, so a shared prefix crosses to the decode engine once per batch
    kv_start: int = 0
    kv_layout: str = ""  # the prefill engine's PoolGeometry.layout ("": unknown, the sizes alone are checked)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


@dataclass
class PrefillBatch:
    """What PrefillExporter.prefill returns: per request a PrefillOutput, or a Result with its `error`;
    every PrefillOutput's `kv` is a slice of `kv_buffer`, back to back in request order, so the whole
    batch's KV can leave as one buffer without another copy."""

    outputs: list[PrefillOutput | Result]
    kv_buffer: torch.Tensor  # uint8, on the host
