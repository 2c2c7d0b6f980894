"""The public engine: requests in, results out, one scheduling round per `step()`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from batchgen.engine.config import EngineConfig, available_memory_bytes
from batchgen.engine.kv_manager import KVBudget, KVManager
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.model_runner import BatchShape, ModelRunner
from batchgen.engine.request import Completion, Request, Result, TokenLogprob
from batchgen.engine.sampler import sample_next_tokens
from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.engine.scheduler import DecodePlan, PrefillPlan, PromptTooLargeError, Scheduler, SchedulerConfig
from batchgen.engine.sequence import KVLocation, Phase, Sequence
from batchgen.engine.stop_checker import finish_reason, output_text


@dataclass
class PrefillOutput:
    """A prefilled prompt travelling from a prefill stage to a decode stage (CPU tensors)."""

    request: Request
    k: torch.Tensor  # [L, T, Hkv, Dk]
    v: torch.Tensor  # [L, T, Hkv, Dv]
    first_token_ids: list[int]  # one per sample
    first_logprobs: list[TokenLogprob | None]
    submitted_at: float
    prefilled_at: float

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class _RequestState:
    request: Request
    samples: list[Sequence] = field(default_factory=list)
    pending: int = 0


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, storage_options: dict | None = None,
                 **overrides):
        from batchgen.connectors.checkpoint import load_model

        self.config = EngineConfig.from_kwargs(config, **overrides)
        device = self.config.device
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)
        loaded = model if hasattr(model, "model") else load_model(
            model, dtype=self.config.dtype, device=str(self.device), storage_options=storage_options)
        self.loaded = loaded
        self.model = loaded.model.eval()
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = min(self.config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.kv = KVManager(self.model.kv_spec(), self.config.page_size, next(self.model.parameters()).dtype,
                            self._budget(), self.device)
        self.scheduler = Scheduler(SchedulerConfig(
            mode=self.config.mode, max_num_seqs=self.config.max_num_seqs,
            max_prefill_tokens=self.config.max_prefill_tokens,
            refill_threshold=self.config.refill_threshold, b_attn=self.config.b_attn), self.kv)
        b_moe = self.config.b_moe if self.config.mode == "coroutine" else 1 << 62
        b_attn = self.config.b_attn if self.config.mode == "coroutine" else 1 << 62
        self.runner = ModelRunner(self.model, self.kv, self.device, BatchShape(b_attn, b_moe))
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.stats = EngineMetrics()
        self._observe_routing()
        self._requests: dict[str, _RequestState] = {}
        self._ready: list[Result] = []
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    # ----------------------------------------------------------------- public API
    def add_request(self, request: Request) -> None:
        """Queue a request; a bad one comes back from the next `step()` as a Result with `error`."""
        self.stats.mark_start()
        submitted = time.perf_counter()
        try:
            prompt_ids = self._validate(request)
        except (InvalidRequestError, PromptTooLargeError, ValueError, TypeError) as exc:
            self._fail(request, [], str(exc), submitted)
            return
        state = _RequestState(request)
        self._requests[request.request_id] = state
        parent = self._new_sequence(request, 0, prompt_ids, submitted)
        state.samples.append(parent)
        state.pending = request.sampling.n
        self.scheduler.admit(parent)

    @torch.inference_mode()
    def step(self) -> list[Result]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if isinstance(plan, PrefillPlan):
            self._run_prefill(plan)
        elif isinstance(plan, DecodePlan):
            self._run_decode(plan)
        self.stats.step_seconds += time.perf_counter() - start
        self.stats.yields, self.stats.restores = self.scheduler.yields, self.scheduler.restores
        self.stats.timeline.append((time.perf_counter(), len(self.scheduler.running),
                                    len(self.scheduler.suspended), self.stats.finished_requests))
        done, self._ready = self._ready, []
        return done

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, decoding, suspended) and free its KV; no result follows."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.samples:
            if seq.phase is not Phase.FINISHED:
                self.scheduler.remove(seq)
                seq.phase = Phase.FINISHED
                seq.finish_reason = "abort"
        self.stats.aborted_requests += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self.scheduler.has_work()

    def generate(self, requests: Iterable[Request]) -> list[Result]:
        requests = list(requests)
        by_id = {r.request_id: r for r in self.stream(requests)}
        return [by_id[r.request_id] for r in requests]

    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()

    def metrics(self) -> dict:
        return self.stats.summary(self.kv.bytes_moved)

    # ------------------------------------------------- prefill / decode disaggregation
    @torch.inference_mode()
    def prefill(self, requests: Iterable[Request]) -> list[PrefillOutput | Result]:
        """Prefill only: each prompt's KV and first token(s), for a separate decode stage."""
        requests = list(requests)
        for request in requests:
            self.add_request(request)
        out: dict[str, PrefillOutput | Result] = {r.request_id: r for r in self._ready}
        self._ready = []
        while self.scheduler.waiting:
            plan = self.scheduler.schedule()
            if not isinstance(plan, PrefillPlan):
                raise RuntimeError("the prefill engine ran out of KV room; give it a larger kv budget")
            for prefilled in self._run_prefill(plan, export=True):
                out[prefilled.request.request_id] = prefilled
        return [out[r.request_id] for r in requests]

    @torch.inference_mode()
    def add_prefilled(self, prefilled: PrefillOutput) -> None:
        """Adopt a sequence prefilled elsewhere: place its KV, then decode it like any other."""
        self.stats.mark_start()
        request = prefilled.request
        state = _RequestState(request, pending=request.sampling.n)
        self._requests[request.request_id] = state
        num_tokens = prefilled.k.shape[1]
        for index, logprob in enumerate(prefilled.first_logprobs):
            seq = self._new_sequence(request, index, list(request.prompt_token_ids), prefilled.submitted_at)
            seq.first_scheduled_at = time.perf_counter()
            seq.logprobs = None if logprob is None else [logprob]
            on_device = self.kv.fits(KVLocation.DEVICE, num_tokens + 1)
            self.kv.load(seq, KVLocation.DEVICE if on_device else KVLocation.HOST, prefilled.k, prefilled.v)
            state.samples.append(seq)
        for seq in list(state.samples):
            self._accept_token(seq, prefilled.first_token_ids[seq.sample_index])
            if seq.phase is not Phase.FINISHED:
                self.scheduler.place_decoding(seq)

    # ------------------------------------------------------------------ internals
    def _budget(self) -> KVBudget:
        """Explicit budgets win; otherwise what `max_num_seqs` full contexts need, capped by free memory."""
        cfg = self.config
        spec = self.model.kv_spec()
        token_bytes = spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * self.loaded.dtype.itemsize
        wanted = token_bytes * cfg.max_num_seqs * self.max_model_len
        # several engine actors may share one node: take a modest share of what is free
        share = 0.5 if self.device.type == "cuda" else 0.05
        device_bytes = cfg.kv_budget_bytes or min(wanted, int(available_memory_bytes(self.device.type) * share))
        host_bytes = cfg.host_kv_budget_bytes or min(wanted, int(available_memory_bytes("cpu") * 0.05))
        staging = int(device_bytes * cfg.staging_fraction) if cfg.kv_budget_bytes and cfg.mode == "coroutine" else 0
        if cfg.mode == "coroutine" and not staging:
            staging = min(int(device_bytes * 0.05), token_bytes * self.max_model_len * cfg.b_attn)
        return KVBudget(device_bytes, host_bytes, staging)

    def _observe_routing(self) -> None:
        for module in self.model.modules():
            if hasattr(module, "on_route"):
                experts = module.num_experts
                module.on_route = lambda ids, e=experts: self.stats.record_route(ids, e)

    def _validate(self, request: Request) -> list[int]:
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {request.request_id!r}")
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            vocab = self.model.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt_token_ids: token {bad[0]!r} is outside the vocabulary [0, {vocab})")
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise InvalidRequestError(f"prompt: expected text or prompt_token_ids, got {type(request.prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        params = request.sampling
        limit = min(self.max_model_len, params.max_prompt_tokens or self.max_model_len)
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, over the limit of {limit - 1} (context length {self.max_model_len})")
        self.scheduler.check_fits(min(len(ids) + params.max_tokens, self.max_model_len))
        return ids

    def _new_sequence(self, request: Request, index: int, prompt_ids: list[int], submitted: float) -> Sequence:
        return Sequence(seq_id=next(self._seq_ids), request_id=request.request_id, sample_index=index,
                        prompt_ids=prompt_ids, sampling=request.sampling, eos_token_ids=self.eos_token_ids,
                        arrival=next(self._arrivals), submitted_at=submitted)

    def _run_prefill(self, plan: PrefillPlan, export: bool = False) -> list[PrefillOutput]:
        now = time.perf_counter()
        for seq in plan.seqs:
            seq.phase = Phase.PREFILL
            seq.first_scheduled_at = now
            self.stats.prompt_tokens += len(seq.prompt_ids)
        logits = self._timed(self.runner.prefill, plan.seqs)
        self.stats.prefill_steps += 1
        rows, seqs = [], []
        for row, parent in enumerate(plan.seqs):
            state = self._requests[parent.request_id]
            for index in range(1, 1 if export else parent.sampling.n):
                child = self._new_sequence(state.request, index, parent.prompt_ids, parent.submitted_at)
                child.first_scheduled_at = now
                location = plan.location if self.kv.fits(plan.location, parent.kv_len + 1) else KVLocation.HOST
                self.kv.fork(parent, child, location)
                state.samples.append(child)
            # forks share the parent's logits row; an exported prompt samples its first tokens here too
            samples = state.samples if not export else [
                self._new_sequence(state.request, i, parent.prompt_ids, parent.submitted_at)
                for i in range(parent.sampling.n)]
            rows.extend([row] * len(samples))
            seqs.extend(samples)
        tokens = sample_next_tokens(logits[rows], seqs, self.generator)
        if export:
            return self._export(plan.seqs, seqs, tokens)
        for seq, token in zip(seqs, tokens):
            self._accept_token(seq, token)
            if seq.phase is not Phase.FINISHED:
                self.scheduler.place_decoding(seq)
        return []

    def _export(self, parents: list[Sequence], samples: list[Sequence], tokens: list[int]) -> list[PrefillOutput]:
        out, cursor = [], 0
        for parent in parents:
            n = parent.sampling.n
            state = self._requests.pop(parent.request_id)
            k, v = self.kv.export(parent)
            chosen = samples[cursor : cursor + n]
            out.append(PrefillOutput(
                request=Request(parent.request_id, parent.prompt_ids, None, state.request.sampling),
                k=k, v=v, first_token_ids=tokens[cursor : cursor + n],
                first_logprobs=[s.logprobs[0] if s.logprobs else None for s in chosen],
                submitted_at=parent.submitted_at, prefilled_at=time.perf_counter()))
            self.kv.free(parent)
            cursor += n
        return out

    def _run_decode(self, plan: DecodePlan) -> None:
        seqs = plan.resident + [s for group in plan.staged_groups for s in group]
        self.stats.decoding = True
        logits = self._timed(self.runner.decode, plan.resident, plan.staged_groups)
        self.stats.decoding = False
        self.stats.decode_steps += 1
        tokens = sample_next_tokens(logits, seqs, self.generator)
        for seq, token in zip(seqs, tokens):
            self._accept_token(seq, token)
            if seq.phase is Phase.FINISHED:
                self.scheduler.remove(seq)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.stats.model_seconds += time.perf_counter() - start
        return out

    def _accept_token(self, seq: Sequence, token: int) -> None:
        seq.generated.append(token)
        self.stats.generated_tokens += 1
        reason = finish_reason(seq, self.tokenizer, self.max_model_len)
        if reason is not None:
            seq.finish_reason = reason
            seq.phase = Phase.FINISHED
            seq.finished_at = time.perf_counter()
            if seq.kv_location is not KVLocation.NONE and seq not in self.scheduler.running \
                    and seq not in self.scheduler.suspended:
                self.kv.free(seq)
            self._sample_finished(seq)

    def _sample_finished(self, seq: Sequence) -> None:
        state = self._requests[seq.request_id]
        state.pending -= 1
        if state.pending:
            return
        del self._requests[seq.request_id]
        samples = sorted(state.samples, key=lambda s: s.sample_index)
        outputs = [Completion(index=s.sample_index, token_ids=list(s.generated), text=output_text(s, self.tokenizer),
                              finish_reason=s.finish_reason, logprobs=s.logprobs) for s in samples]
        finished = max(s.finished_at for s in samples)
        self._ready.append(Result(request_id=seq.request_id, prompt_token_ids=samples[0].prompt_ids, outputs=outputs,
                                  submitted_at=samples[0].submitted_at,
                                  first_scheduled_at=min(s.first_scheduled_at or finished for s in samples),
                                  finished_at=finished))
        self.stats.finished_requests += 1
        self.stats.last_finished_at = finished
        self.stats.completion_times.append(finished - samples[0].submitted_at)

    def _fail(self, request: Request, prompt_ids: list[int], error: str, submitted: float) -> None:
        now = time.perf_counter()
        self._ready.append(Result(request_id=request.request_id, prompt_token_ids=prompt_ids, error=error,
                                  submitted_at=submitted, finished_at=now))
        self.stats.failed_requests += 1
