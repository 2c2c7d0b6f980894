"""Price a replayed schedule for many (b_attn, b_moe) pairs at once.

Per step, the layer DAG of step_model is a chain on the compute stream, plus, when host-resident groups
stream their KV through the staging pool, a chain of copies on the copy stream (attended in place on a GPU's view of
the host pages, a group's attention takes at least the read of its KV over the host link). A chain's critical path
is the sum of its nodes, and every curve is linear in its features, so all micro-batches of one kind
price as one term with a call count. With copies, the g-th staged attention starts when both the compute
before it and the first g copies are done: a recurrence over the group index, run for all steps at once.
Whole schedules become a few vector operations; a test holds them equal to the DAG's critical path.
"""

from __future__ import annotations

import torch

from batchgen.engine.planner.cost_curves import CostCurves
from batchgen.engine.planner.step_model import StepShape


class SchedulePricer:
    def __init__(self, steps: list[StepShape], curves: CostCurves):
        def column(values) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.float64)

        self.steps, self.curves = steps, curves
        self.prefill_chunks = column(len(s.prefill) for s in steps)
        self.prefill_tokens = column(sum(e - b for b, e in s.prefill) for s in steps)
        self.pairs = column(sum((e - b) * (b + e + 1) / 2 for b, e in s.prefill) for s in steps)
        self.resident = column(len(s.resident) for s in steps)
        self.groups = column(len(s.staged) for s in steps)
        self.decoding = column(s.decoding for s in steps)
        self.kv_tokens = column(sum(s.resident) + sum(map(sum, s.staged)) for s in steps)
        self.rows = column(s.completed + s.decoding for s in steps)
        self.migrated = column(s.migrated_bytes for s in steps)
        self.tokens = self.prefill_tokens + self.decoding
        # host-resident groups of steps that stream them, [steps, most groups] zero-padded: whether there is one,
        # its attention's seconds, its copy's seconds (none of which depends on b_attn or b_moe)
        self.streamed = _groups([s.staged if s.streams_host else () for s in steps], curves)
        # and of steps that attend on them in place over a GPU's host link (on a CPU they are its own memory)
        over_link = curves.device_type != "cpu"
        self.linked = _groups([s.staged if over_link and not s.streams_host else () for s in steps], curves)

    def step_seconds(self, b_attn: int, b_moe: int) -> torch.Tensor:
        c = self.curves
        pa, da, hd, hs = (x.coefficients for x in (c.prefill_attention, c.decode_attention, c.head, c.host))
        prefill_calls, decode_calls = self._attention_calls(b_attn)
        decode = decode_calls * da[0] + self.decoding * da[1] + self.kv_tokens * da[2]
        prefill = prefill_calls * pa[0] + self.prefill_chunks * pa[1] + self.prefill_tokens * pa[2] + self.pairs * pa[3]
        attention = prefill + decode
        present, group_attention, group_copy = self.streamed
        if present.shape[1]:  # streamed groups: their attention waits for their copies
            copies = torch.cumsum(group_copy, dim=1)
            done = attention - group_attention.sum(dim=1)  # compute before the first streamed group
            for g in range(present.shape[1]):
                done = torch.where(present[:, g], torch.maximum(done, copies[:, g]) + group_attention[:, g], done)
            attention = done
        _, linked_attention, linked_read = self.linked  # in place over the host link: at least the group's read
        attention = attention + torch.clamp(linked_read - linked_attention, min=0).sum(dim=1)
        full, rest = torch.div(self.tokens, b_moe, rounding_mode="floor"), torch.remainder(self.tokens, b_moe)
        ffn = full * c.ffn_seconds(b_moe) + (rest > 0) * c.ffn_seconds(rest)
        head = (self.rows > 0) * (hd[0] + self.rows * hd[1])
        features = self.host_features(b_attn)
        host = sum(coef * features[name] for name, coef in zip(c.host.features, hs))
        return c.num_layers * (attention + ffn) + head + host + self.migrated / c.copy_bytes_per_s

    def execution(self, b_attn: int, b_moe: int) -> tuple:
        """What the engine computes for this schedule cut by (b_attn, b_moe): equal for two pairs exactly when
        they run the same steps in the same micro-batches and feed-forward calls (a limit above every step's
        count cuts nothing, so its value does not matter). Such configurations differ only in the noise of a
        measurement."""
        widest = int(torch.maximum(self.prefill_chunks, self.resident).max().item()) if self.steps else 0
        most_tokens = int(self.tokens.max().item()) if self.steps else 0
        return tuple(self.steps), min(b_attn, max(1, widest)), min(b_moe, max(1, most_tokens))

    def host_features(self, b_attn: int) -> dict[str, torch.Tensor]:
        """Each step's host-cost features (cost_curves.HOST, in order): one step, its sequences, its attention
        micro-batches, no admissions (priced once per prompt, apart)."""
        prefill_calls, decode_calls = self._attention_calls(b_attn)
        return {"calls": torch.ones_like(self.decoding), "seqs": self.decoding + self.prefill_chunks,
                "micro_batches": prefill_calls + decode_calls,
                "prompts": torch.zeros_like(self.decoding)}

    def _attention_calls(self, b_attn: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill and decode attention micro-batches per step, cut as the model runner cuts them."""
        return torch.ceil(self.prefill_chunks / b_attn), torch.ceil(self.resident / b_attn) + self.groups


def _groups(staged: list[tuple[tuple[int, ...], ...]], curves: CostCurves
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each step's host-resident groups as [steps, most groups] tensors, zero-padded: whether a group is there, its
    decode attention's seconds, and the seconds its KV takes over the host link (per layer)."""
    width = max(map(len, staged), default=0)
    kv = torch.tensor([[sum(g) for g in groups] + [0] * (width - len(groups)) for groups in staged],
                      dtype=torch.float64).view(len(staged), width)
    seqs = torch.tensor([[len(g) for g in groups] + [0] * (width - len(groups)) for groups in staged],
                        dtype=torch.float64).view(len(staged), width)
    da = curves.decode_attention.coefficients
    present = seqs > 0
    attention = present * (da[0] + seqs * da[1] + kv * da[2])
    return present, attention, kv * (curves.kv_bytes_per_token / curves.num_layers / curves.copy_bytes_per_s)
