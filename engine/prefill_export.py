"""Prefill-only use of an engine, for a disaggregated prefill stage.

Each prompt is prefilled in the engine's pages, its samples' first tokens are drawn from the last
position's logits, and its KV is gathered from the pages straight into the batch's one host buffer
(its slice becomes the `PrefillOutput`'s `kv`) and freed: nothing decodes here.
The engine's scheduler still plans the prefill batches (token budget, KV room).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from batchgen.engine.engine import Engine
from batchgen.engine.prefill_output import PrefillBatch, PrefillOutput
from batchgen.engine.request import Request, Result
from batchgen.engine.sampler import sample_next_tokens
from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.engine.scheduler import PrefillPlan


class PrefillExporter:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @torch.inference_mode()
    def prefill(self, requests: Iterable[Request]) -> PrefillBatch:
        """One PrefillOutput per request, or a Result with `error` for a request the engine rejects."""
        engine, scheduler = self.engine, self.engine.scheduler
        engine.stats.mark_start()
        out: dict[str, PrefillOutput | Result] = {}
        requests = list(requests)
        admitted = []
        for request in requests:
            submitted = time.perf_counter()
            try:
                ids = engine.admissible_prompt(request)
            except InvalidRequestError as exc:
                out[request.request_id] = Result(request.request_id, [], error=str(exc), submitted_at=submitted,
                                                 finished_at=time.perf_counter())
                continue
            admitted.append(engine.new_sequence(request, 0, ids, submitted))
        geometry = engine.kv.geometry
        buffer = torch.empty(sum(geometry.packed_nbytes(len(s.prompt_ids)) for s in admitted), dtype=torch.uint8)
        slices, offset = {}, 0
        for seq in admitted:  # request order, as the batch's KV leaves
            size = geometry.packed_nbytes(len(seq.prompt_ids))
            slices[seq.request_id] = buffer[offset : offset + size]
            offset += size
            scheduler.admit(seq)
        by_id = {r.request_id: r for r in requests}
        while scheduler.waiting or scheduler.prefilling:
            plan = scheduler.schedule()  # nothing decodes here, so a plan is prefill alone
            if plan is None or plan.prefill is None:
                raise RuntimeError("the prefill engine ran out of KV room; give it a larger kv budget")
            for prefilled in self._export(plan.prefill, by_id, slices):
                out[prefilled.request.request_id] = prefilled
        return PrefillBatch([out[r.request_id] for r in requests], buffer)

    def _export(self, plan: PrefillPlan, by_id: dict[str, Request],
                slices: dict[str, torch.Tensor]) -> list[PrefillOutput]:
        engine = self.engine
        logits = engine.prefill_logits(plan)
        rows, samples = [], []
        for row, prompt in enumerate(plan.completed):  # each sample draws its first token from its prompt's row
            request = by_id[prompt.request_id]
            for index in range(prompt.sampling.n):
                samples.append(engine.new_sequence(request, index, prompt.prompt_ids, prompt.submitted_at))
                rows.append(row)
        tokens = sample_next_tokens(logits[rows], samples, engine.generator)
        out, cursor = [], 0
        for prompt in plan.completed:
            n = prompt.sampling.n
            engine.kv.export(prompt, slices[prompt.request_id])
            engine.scheduler.remove(prompt)
            drawn = samples[cursor : cursor + n]
            out.append(PrefillOutput(
                request=Request(prompt.request_id, prompt.prompt_ids, sampling=prompt.sampling),
                kv=slices[prompt.request_id], first_token_ids=tokens[cursor : cursor + n],
                first_logprobs=[s.logprobs[0] if s.logprobs else None for s in drawn],
                submitted_at=prompt.submitted_at))
            cursor += n
        return out
