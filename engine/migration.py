"""A request on its way from one engine to another (MIGRATE between workers): everything the target needs
to continue it exactly where the source left it.

A decoding sample is its generated tokens, logprobs and the packed KV of every token but the last (whose
KV the next decode step writes). Nothing else travels: penalties, bad words and stop strings read the
generated tokens, a structured-output matcher is rebuilt by feeding it those tokens again, and a seeded
sample's noise is counter-based (`Sequence.rng_seed`), so it draws the same tokens on the new engine. A
request still waiting for its prefill travels as its prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.request import Request, TokenLogprob


@dataclass
class MigratedSample:
    index: int
    generated: list[int]
    logprobs: list[TokenLogprob] | None
    kv: torch.Tensor | None  # uint8, PoolGeometry.packed_views of its first `kv_len` tokens; None once finished
    # or while waiting to be prefilled again (its KV dropped by a recompute preemption: `kv_len` 0)
    kv_len: int
    finish_reason: str | None = None  # set for a sample that finished before the move
    stop_text_end: int | None = None
    finished_at: float | None = None  # wall clock, as every stamp here (engine/wall_clock.py)


@dataclass
class MigratedRequest:
    request: Request  # prompt_token_ids set, sampling resolved
    samples: list[MigratedSample]  # empty: the prompt was not prefilled yet
    submitted_at: float
    first_scheduled_at: float | None
    error: str | None = None  # why a finished sample failed: the request's Result is that error
    kv_layout: str = ""  # the source engine's PoolGeometry.layout ("": unknown, the sizes alone are checked)

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv.numel() for s in self.samples if s.kv is not None)

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still generate (as Engine.load counts them)."""
        limit = self.request.sampling.max_tokens
        if not self.samples:
            return limit * self.request.sampling.n
        return sum(limit - len(s.generated) for s in self.samples if s.finish_reason is None)

    @property
    def generated_tokens(self) -> int:
        """Tokens decoded so far, over its samples: what recomputing it would decode again."""
        return max((len(s.generated) for s in self.samples), default=0)

