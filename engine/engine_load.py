"""An engine's outstanding work, as the job's balancer compares engines (no torch: the balancer's
process does not load it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    requests: int  # requests in the engine, waiting or decoding
    tokens: int  # output tokens they may still generate (each unfinished sample's max_tokens left)
    busy_s: float  # time spent in steps so far
    refill_below: int = 0  # the engine takes more prompts while it holds fewer requests than this
    batch: int = 0  # requests the engine runs at once (max_num_seqs)
