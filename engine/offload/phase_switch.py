"""Local phase switching: the staging part of the device KV is re-split between decoding and prefilling.

Host-resident sequences decode through the staging pool (one layer of their pages at a time, engine/
kv_manager.py); a step without them does not need it. In memory-constrained mode a step that prefills without
staged decode runs in the prefill layout: the staging pool's storage is released and its bytes go to a larger
feed-forward batch, so a prompt-heavy step runs fewer MoE batches and fetches each streamed expert fewer times
(prompts placed in host pages keep at most two layers of their KV on the device meanwhile: engine/
prefill_offload.py). The next step with staged decode switches back: the staging pool is allocated again (its
contents are per-layer scratch, nothing to restore) and B_moe returns to the plan's. On CUDA the released
storage goes back to the caching allocator, which hands it to the larger batch's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.kv_pool import KVPool


@dataclass
class PhaseSwitch:
    stage: KVPool
    b_moe: int  # the plan's: activations of one feed-forward batch beside an allocated staging pool
    activation_bytes_per_token: int
    prefill_layout: bool = False
    switches: int = 0
    peak_bytes: int = 0  # staging storage and feed-forward activations together, the most any step held

    @property
    def prefill_b_moe(self) -> int:
        """B_moe with the staging pool's bytes turned into activations."""
        return self.b_moe + self.stage.nbytes(self.stage.num_pages) // self.activation_bytes_per_token

    def enter(self, prefill: bool, staged: bool, tokens: int) -> int:
        """Lay the device out for a step (prefill: it has prompt tokens; staged: host-resident sequences decode
        in it; tokens: all its tokens) and return the step's B_moe. A step that needs neither keeps the layout."""
        if staged and self.prefill_layout:
            self.stage.restore_storage()
            self.prefill_layout = False
            self.switches += 1
        elif prefill and not staged and not self.prefill_layout:
            self.stage.release_storage()
            self.prefill_layout = True
            self.switches += 1
        b_moe = self.prefill_b_moe if self.prefill_layout else self.b_moe
        staging = 0 if self.prefill_layout else self.stage.nbytes(self.stage.num_pages)
        self.peak_bytes = max(self.peak_bytes, staging + min(tokens, b_moe) * self.activation_bytes_per_token)
        return b_moe
