"""Prefill-only use of an engine, for a disaggregated prefill stage.

Each prompt is prefilled in the engine's pages, its samples' first tokens are drawn from the last
position's logits, and its KV is gathered from the pages straight into the batch's one host buffer
(its slice becomes the `PrefillOutput`'s `kv`) and freed: nothing decodes here. With prefix caching,
the whole prompt pages an earlier prompt of the batch already carries are left out of a prompt's
slice (`kv_start`): the decode engine finds them in its own page cache, having adopted that earlier
prompt first.
The engine's scheduler still plans the prefill batches (token budget, KV room).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from batchgen.engine.engine import Engine
from batchgen.engine.prefill_output import PrefillBatch, PrefillOutput
from batchgen.engine.request import Request, Result
from batchgen.engine.sampler import sample_next_tokens
from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.engine.scheduler import PrefillPlan
from batchgen.engine.wall_clock import to_wall


class PrefillExporter:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @torch.inference_mode()
    def prefill(self, requests: Iterable[Request], before_step: Callable[[], object] | None = None) -> PrefillBatch:
        """One PrefillOutput per request, or a Result with `error` for a request the engine rejects.
        `before_step()` runs before each prefill step (an engine actor recounts its threads there)."""
        engine, scheduler = self.engine, self.engine.scheduler
        engine.stats.mark_start()
        requests = list(requests)
        out: list[PrefillOutput | Result | None] = [None] * len(requests)
        position: dict[str, int] = {}  # admitted request id -> its place
        admitted = []
        for i, request in enumerate(requests):
            submitted = time.perf_counter()
            try:
                if request.request_id in position:  # (the outputs are matched to requests by id)
                    raise InvalidRequestError(f"duplicate request_id {request.request_id!r}")
                ids = engine.admissible_prompt(request)
            except InvalidRequestError as exc:
                out[i] = Result(request.request_id, [], error=str(exc), submitted_at=submitted,
                                finished_at=time.perf_counter())
                continue
            position[request.request_id] = i
            admitted.append(engine.new_sequence(request, 0, ids, submitted))
        geometry = engine.kv.geometry
        starts = _carried_prefixes([s.prompt_ids for s in admitted], engine.kv.page_size,
                                   engine.kv.caches_prefixes)
        sizes = [geometry.packed_nbytes(len(s.prompt_ids) - start) for s, start in zip(admitted, starts)]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        slices, offset = {}, 0
        for seq, start, size in zip(admitted, starts, sizes):  # request order, as the batch's KV leaves
            slices[seq.request_id] = (start, buffer[offset : offset + size])
            offset += size
            scheduler.admit(seq)
        by_id = {requests[i].request_id: requests[i] for i in position.values()}
        while scheduler.waiting or scheduler.prefilling:
            if before_step is not None:
                before_step()
            plan = scheduler.schedule()  # nothing decodes here, so a plan is prefill alone
            if plan is None or plan.prefill is None:
                raise RuntimeError("the prefill engine ran out of KV room; give it a larger kv budget")
            for prefilled in self._export(plan.prefill, by_id, slices):
                out[position[prefilled.request.request_id]] = prefilled
        return PrefillBatch(out, buffer)

    def _export(self, plan: PrefillPlan, by_id: dict[str, Request],
                slices: dict[str, tuple[int, torch.Tensor]]) -> list[PrefillOutput]:
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
            start, packed = slices[prompt.request_id]
            engine.kv.export(prompt, packed, start)
            engine.scheduler.remove(prompt)
            drawn = samples[cursor : cursor + n]
            out.append(PrefillOutput(
                request=Request(prompt.request_id, prompt.prompt_ids, sampling=prompt.sampling),
                kv=packed, first_token_ids=tokens[cursor : cursor + n],
                first_logprobs=[s.logprobs[0] if s.logprobs else None for s in drawn],
                submitted_at=to_wall(prompt.submitted_at), kv_start=start, kv_layout=engine.kv.geometry.layout))
            cursor += n
        return out


def _carried_prefixes(prompts: list[list[int]], page_size: int, enabled: bool) -> list[int]:
    """Per prompt, how many leading tokens an earlier prompt of the list carries: its longest run of whole
    pages equal to an earlier prompt's (0 for all when `enabled` is false)."""
    seen: set[tuple[int, ...]] = set()  # every whole-page prefix of the prompts so far
    starts = []
    for prompt in prompts:
        whole = len(prompt) // page_size if enabled else 0
        shared = 0
        while shared < whole and tuple(prompt[: (shared + 1) * page_size]) in seen:
            shared += 1
        starts.append(shared * page_size)
        seen.update(tuple(prompt[: (i + 1) * page_size]) for i in range(shared, whole))
    return starts
