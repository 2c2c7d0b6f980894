"""The public engine: requests in, results out, one scheduling round per `step()`.

The engine takes a loaded model (connectors/checkpoint.py loads one from any URI) and wires the
pieces that each own one concern: the scheduler (queues and every KV placement decision), the KV
manager (pages and MIGRATE), the model runner (coroutine micro-batches through the model) and the
sampler. Prefill-only use for a separate decode stage is `PrefillExporter` (engine/prefill_export.py).
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field, replace

import torch

from batchgen.engine import route_counting
from batchgen.engine.config import EngineConfig
from batchgen.engine.decode_graphs import RECORDERS, DecodeGraphs
from batchgen.engine.engine_load import EngineLoad
from batchgen.engine.generation import Generates
from batchgen.engine.grammar import GrammarBackend
from batchgen.engine.host_view import host_pages_in_place, streams_host_kv
from batchgen.engine.kv_budget import plan_kv_budget
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.migration import MigratedRequest, MigratedSample
from batchgen.engine.model_runner import MicroBatchLimits, ModelRunner
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.offload.memory_constrained import place_as_engine
from batchgen.engine.offload.phase_switch import PhaseSwitch
from batchgen.engine.offload.weight_streamer import WeightStreamer
from batchgen.engine.parallel.group_model import FfnCallAgreement, attach_dispatchers, attach_partial_sums
from batchgen.engine.parallel.rank_group import RankGroup
from batchgen.engine.planner.planner import resolve_config
from batchgen.engine.prefill_output import PrefillOutput
from batchgen.engine.request import Completion, Request, Result
from batchgen.engine.request_normalizer import RequestNormalizer
from batchgen.engine.sampler import sample_next_tokens
from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.engine.scheduler import DecodePlan, PrefillPlan, Scheduler, StepPlan
from batchgen.engine.sequence import KVLocation, Phase, Sequence
from batchgen.engine.stop_checker import finish_reason, output_text
from batchgen.engine.wall_clock import from_wall, to_wall
from batchgen.kernels.registry import invariance_refusal, invariant_batches

_UNBOUNDED = 1 << 62


@dataclass
class _RequestState:
    request: Request
    samples: list[Sequence] = field(default_factory=list)
    pending: int = 0
    # an adopted prompt whose carried prefix was not in the page cache: prefilled here again, its samples
    # keep the first tokens the prefill engine drew
    prefilled: PrefillOutput | None = None
    error: str | None = None  # why a sample failed: the request's Result says so once every sample is done


def _check_room(kv: KVManager, config: EngineConfig) -> None:
    """ValueError when the KV budgets hold no page any sequence could run in (the device pool, or in coroutine mode
    host pages it decodes from): every request would fail as not fitting. How many it takes depends on each
    request, whose own error says."""
    if kv.device.num_pages or (config.mode == "coroutine" and min(kv.host_decode_pages, kv.host.num_pages)):
        return
    raise ValueError(f"the KV budgets (engine options kv_budget_bytes {config.kv_budget_bytes} and "
                     f"host_kv_budget_bytes {config.host_kv_budget_bytes}, given or planned) hold no page of "
                     f"{config.page_size} tokens ({kv.geometry.page_bytes} bytes) a sequence could run in")


class Engine(Generates):
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, group: RankGroup | None = None,
                 **overrides):
        """`group`: this engine is one rank of an engine spanning several (engine/parallel): `loaded` holds the
        rank's share of the experts (ep_size) or of the heads and columns (tp_size), and every step is taken
        together with the other ranks."""
        config = EngineConfig.from_kwargs(config, **overrides)
        loaded.context_length(config.max_model_len)  # before planning for it
        if config.batch_invariant:
            refusal = invariance_refusal(loaded.device.type, loaded.dtype)
            if refusal is not None:
                raise ValueError(f"engine option batch_invariant: {refusal}")
        # before planning: the profile then times packed experts, streamed weights
        self.streamer: WeightStreamer | None
        self.streamer, config = place_as_engine(loaded, config)
        self.config = resolve_config(loaded, config, plan=group is None)
        self.loaded = loaded
        self.model = loaded.model.eval()
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = loaded.context_length(self.config.max_model_len)
        self.normalizer = RequestNormalizer(self.tokenizer, self.model.vocab_size, self.max_model_len)
        spec = self.model.kv_spec()
        stream_host = streams_host_kv(self.config.stream_host_kv, self.device.type)
        refusal = None if stream_host else host_pages_in_place(self.device)
        if refusal is not None:
            raise ValueError(f"engine option stream_host_kv false attends on host KV pages in place: {refusal}")
        budget = plan_kv_budget(self.config, stream_host)
        try:
            self.kv = KVManager(spec, self.config.page_size, loaded.dtype, budget, self.device, stream_host,
                                self.config.prefix_caching)
        except (OSError, MemoryError, RuntimeError) as exc:  # mmap's ENOMEM, torch's out of memory
            raise MemoryError(f"the KV pools of engine options kv_budget_bytes ({self.config.kv_budget_bytes}) and "
                              f"host_kv_budget_bytes ({self.config.host_kv_budget_bytes}) could not be allocated: "
                              f"{exc}") from exc
        _check_room(self.kv, self.config)
        self.scheduler = Scheduler(self.config, self.kv)
        coroutine = self.config.mode == "coroutine"
        # lockstep runs one unbounded batch, except that a device-memory budget bounds its activations too
        bounded_moe = coroutine or self.streamer is not None
        limits = MicroBatchLimits(self.config.b_attn if coroutine else _UNBOUNDED,
                                  self.config.b_moe if bounded_moe else _UNBOUNDED)
        self.stats = EngineMetrics()
        agree = None
        if group is not None and self.config.ep_size > 1:
            agree = FfnCallAgreement(group)
            attach_dispatchers(self.model, group, self.device, loaded.dtype)
        elif group is not None:
            attach_partial_sums(self.model, group)
        phases = None
        if self.streamer is not None and self.kv.stage.num_pages:
            phases = PhaseSwitch(self.kv.stage, limits.b_moe, self.streamer.activation_bytes_per_token)
        # a recording (a CPU's, or a GPU's CUDA graph) replays one process's kernels: not a rank group's collectives,
        # not weights streamed in as they compute (this engine's, or a placement made before it: the planner's
        # profile runs engines of its own on a model placed for a budget)
        replayable = (group is None and self.device.type in RECORDERS and self.streamer is None
                      and loaded.weight_placement == "resident")
        graphs = DecodeGraphs(self.stats) if self.config.decode_graphs and replayable else None
        self.runner = ModelRunner(self.model, self.kv, self.device, limits, self.stats, agree, phases, graphs)
        self.model.observe_routing(route_counting.observe)  # each step's routing counts for the engine stepping
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._requests: dict[str, _RequestState] = {}
        self._ready: list[Result] = []
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._grammars: GrammarBackend | None = None
        self._bad_words: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        self._step_observers: list[Callable[[StepPlan], None]] = []

    # ----------------------------------------------------------------- public API
    def add_request(self, request: Request) -> None:
        """Queue a request; a bad one comes back from the next `step()` as a Result with `error`."""
        self.stats.mark_start()
        submitted = time.perf_counter()
        try:
            prompt_ids = self.admissible_prompt(request)
        except InvalidRequestError as exc:
            self._fail(request, str(exc), submitted)
            return
        self._admit(request, prompt_ids, submitted)
        self.stats.admission_seconds += time.perf_counter() - submitted

    @torch.inference_mode()
    def step(self) -> list[Result]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            self.runner.idle()
        else:
            with route_counting.counting_for(self.stats.record_route):
                logits = self._forward(plan.prefill, plan.decode)
            done = len(plan.prefill.completed) if plan.prefill else 0
            if plan.prefill:
                self._first_tokens(plan.prefill, logits[:done])
            if plan.decode:
                self._next_tokens(plan.decode, logits[done:])
        self.stats.record_step_time(plan, time.perf_counter() - start)
        self.stats.record_step(self.scheduler)
        if plan is not None:
            for observe in self._step_observers:
                observe(plan)
        done, self._ready = self._ready, []
        return done

    def observe_steps(self, observer: Callable[[StepPlan], None]) -> None:
        """Call `observer` with each step's plan once the step has run (its decoded sequences' kv_len then
        counts the token just written): a schedule's shape for profilers and benchmarks (bench/bct.py's
        roofline of a schedule), without a per-step record kept by the engine itself."""
        self._step_observers.append(observer)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, decoding, suspended) and free its KV; no result follows."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.samples:
            if seq.phase is not Phase.FINISHED:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        self.stats.aborted_requests += 1
        return True

    @property
    def ranks(self) -> int:
        """Processes this engine spans: one (engine/parallel's GroupEngine spans several)."""
        return 1

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self.scheduler.has_work()

    def metrics(self) -> dict:
        summary = self.stats.summary(self.kv)
        summary["prefill_offload"] = self.runner.prefill_offload.summary()
        summary["frozen_objects"] = gc.get_freeze_count()  # the process's heap left to the collector (process_heap)
        if self.streamer is not None:
            summary["device_memory"] = self.streamer.memory(self.kv, self.stats.max_ffn_tokens, self.runner.phases)
        return summary

    @torch.inference_mode()
    def check_prefilled(self, prefilled: PrefillOutput) -> None:
        """InvalidRequestError unless this engine can adopt `prefilled` (its KV packed for this model's
        layers, heads and KV dtype; an id not in use; a length it can run)."""
        if prefilled.request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {prefilled.request.request_id!r}")
        same = "prefill and decode engines must run the same model and KV dtype"
        self._check_layout(prefilled.kv_layout, "prefilled KV", "prefill and decode engines")
        self._check_packed(prefilled.kv, prefilled.num_tokens - prefilled.kv_start,
                           f"the prefilled KV does not fit this decode engine ({same})")
        sampling = prefilled.request.sampling
        if not len(prefilled.first_token_ids) == len(prefilled.first_logprobs) == sampling.n:  # else it never ends
            raise InvalidRequestError(f"the prefilled prompt carries {len(prefilled.first_token_ids)} first tokens "
                                      f"and {len(prefilled.first_logprobs)} logprobs for n = {sampling.n} samples")
        # ids the embedding table lacks failed the step (every request of the actor's engine) with an IndexError
        self.normalizer.prompt_ids(prompt_token_ids=prefilled.request.prompt_token_ids)
        self._check_in_vocabulary(prefilled.first_token_ids, "the prefilled prompt's first tokens")
        if sampling.logprobs is not None and None in prefilled.first_logprobs:  # its logprobs would be a token short
            raise InvalidRequestError("the request asks for logprobs; the prefilled prompt carries no first-token "
                                      "logprobs")
        self.normalizer.check_length(prefilled.num_tokens, sampling)  # (a prefill engine of a longer context)
        self.scheduler.check_fits(min(prefilled.num_tokens + sampling.max_tokens, self.max_model_len),
                                  prefilled.num_tokens, sampling.n, imported=True)
        self.normalizer.check_vocabulary(prefilled.request.sampling)
        self._check_structured(prefilled.request.sampling)
        self._bad_word_ids(prefilled.request.sampling.bad_words)

    def add_prefilled(self, prefilled: PrefillOutput) -> None:
        """Adopt a prompt prefilled elsewhere (checked with check_prefilled): place its KV, then decode its
        samples like any other. A prompt whose KV leaves out a prefix (`kv_start`) takes it from the page
        cache, where the batch's earlier prompt carrying it left it; if that prompt went elsewhere (a
        batch split between engines) or neither KV pool has room for it now, this engine prefills the prompt itself
        when its turn comes and keeps the first tokens."""
        self.check_prefilled(prefilled)
        self.stats.mark_start()
        request = prefilled.request
        state = _RequestState(request, pending=request.sampling.n)
        self._requests[request.request_id] = state
        location = self.scheduler.import_location(prefilled.num_tokens, samples=request.sampling.n)
        for index, logprob in enumerate(prefilled.first_logprobs):
            seq = self.new_sequence(request, index, list(request.prompt_token_ids), from_wall(prefilled.submitted_at))
            if location is None or not self.kv.load(seq, location, prefilled.kv, prefilled.num_tokens,
                                                    prefilled.kv_start):
                # only the first sample can miss (later ones find its pages); its first tokens are kept, not the KV
                # (a view of the whole hand-off batch's buffer: held until the request ends, it kept all of it)
                state.prefilled = replace(prefilled, kv=prefilled.kv[:0].clone())
                state.samples.append(seq)
                self.scheduler.admit(seq)
                self.stats.handoff_prefills += 1
                return
            seq.first_scheduled_at = time.perf_counter()
            seq.logprobs = None if logprob is None else [logprob]
            state.samples.append(seq)
        for seq in list(state.samples):
            self._continue_or_finish(seq, prefilled.first_token_ids[seq.sample_index])

    def load(self) -> EngineLoad:
        """What this engine still has to do, as a balancer compares engines (engine/engine_load.py)."""
        tokens = sum(map(self._remaining_tokens, self._requests.values()))
        config = self.config
        return EngineLoad(len(self._requests), tokens, self.stats.step_seconds,
                          refill_below=max(1, int(config.refill_threshold * config.max_num_seqs)),
                          batch=config.max_num_seqs)

    def movable_requests(self, tokens: int, keep: Container[str] = ()) -> list[str]:
        """Requests another engine could continue whose output tokens still to generate come closest to
        `tokens` in all, taken oldest first: prompts still waiting, then requests suspended in host pages,
        then decoding ones (moving those spreads the tail: PARTITION). Never every request, none in `keep`."""
        out: dict[str, None] = {}
        total, limit = 0, len(self._requests) - 1
        queues = (self.scheduler.waiting, self.scheduler.suspended.values(), self.scheduler.running.values())
        for seq in itertools.chain(*queues):
            if total >= tokens or len(out) >= limit:
                break
            rid = seq.request_id
            state = self._requests[rid]
            if rid in out or rid in keep or not self._movable(state):
                continue
            more = self._remaining_tokens(state)
            if total + more - tokens <= tokens - total:  # it brings the total closer to `tokens`
                out[rid] = None
                total += more
        return list(out)

    def _remaining_tokens(self, state: _RequestState) -> int:
        """Output tokens the request may still generate: each unfinished sample's max_tokens left."""
        sampling = state.request.sampling
        if len(state.samples) < sampling.n:  # not forked yet: nothing generated
            return sampling.max_tokens * sampling.n
        return sum(sampling.max_tokens - len(s.generated) for s in state.samples if s.phase is not Phase.FINISHED)

    def suspended_requests(self) -> dict[str, int]:
        """{request id: tokens generated} of the requests whose every unfinished sample sits in host pages:
        their snapshot is a checkpoint."""
        out = {}
        for rid in dict.fromkeys(s.request_id for s in self.scheduler.suspended.values()):
            samples = self._requests[rid].samples
            if all(s.phase in (Phase.SUSPENDED, Phase.FINISHED) for s in samples):
                out[rid] = max(len(s.generated) for s in samples)
        return out

    def snapshot_request(self, request_id: str) -> MigratedRequest | None:
        """A copy of what another engine needs to continue the request from where it is now, leaving it
        here (a checkpoint); None if there is no such request or it is part-way through a prefill."""
        state = self._requests.get(request_id)
        if state is None or not self._movable(state):
            return None
        first = state.samples[0]
        request = Request(request_id, list(first.prompt_ids), sampling=state.request.sampling)
        migrated = MigratedRequest(request, [], to_wall(first.submitted_at), to_wall(first.first_scheduled_at),
                                   state.error, kv_layout=self.kv.geometry.layout)
        for seq in state.samples:
            if seq.phase is Phase.WAITING and not seq.recomputing:
                continue
            kv = None
            if seq.phase is not Phase.FINISHED and seq.kv_len:  # (a sample waiting for a recompute has none)
                kv = torch.empty(self.kv.geometry.packed_nbytes(seq.kv_len), dtype=torch.uint8)
                self.kv.export(seq, kv)
            logprobs = None if seq.logprobs is None else list(seq.logprobs)  # a checkpoint is read as it decodes on
            migrated.samples.append(MigratedSample(seq.sample_index, list(seq.generated), logprobs, kv, seq.kv_len,
                                                   seq.finish_reason, seq.stop_text_end, to_wall(seq.finished_at)))
        return migrated

    def export_request(self, request_id: str) -> MigratedRequest | None:
        """MIGRATE out: remove a request that is waiting or decoding (its KV in device or host pages) and
        return what another engine needs to continue it (`import_request`); None as for `snapshot_request`."""
        migrated = self.snapshot_request(request_id)
        if migrated is None:
            return None
        for seq in self._requests.pop(request_id).samples:
            if seq.phase is not Phase.FINISHED:
                self.scheduler.remove(seq)
        self.stats.migrated_out += 1
        return migrated

    def export_straggler(self, request_id: str) -> MigratedRequest | None:
        """`export_request` for a PARTITION over an engine group's ranks: a request whose every unfinished sample is
        decoding, or None with nothing moved (the partition's engine would prefill the others, and a partition
        ended part-way through that prefill could not give the request back)."""
        state = self._requests.get(request_id)
        if state is None or len(state.samples) < state.request.sampling.n or any(
                s.phase not in (Phase.DECODE, Phase.SUSPENDED, Phase.FINISHED) for s in state.samples):
            return None
        return self.export_request(request_id)

    def _movable(self, state: _RequestState) -> bool:
        """Not adopted from a prefill engine and re-prefilling, and no sample in (or part-way through) a
        prefill: its KV is whole."""
        return state.prefilled is None and not any(
            s.phase is Phase.PREFILL or s is self.scheduler.prefilling for s in state.samples)

    def import_request(self, migrated: MigratedRequest) -> None:
        """MIGRATE in: continue a request exported by another engine of the same model and KV dtype. Raises
        InvalidRequestError (nothing changed) when this engine cannot run it."""
        request = migrated.request
        prompt_ids = self.admissible_prompt(request)
        self._check_layout(migrated.kv_layout, "migrated KV", "the two engines")
        for sample in migrated.samples:
            self._check_in_vocabulary(sample.generated, f"migrated sample {sample.index}'s generated tokens")
            if sample.kv is not None:
                self._check_packed(sample.kv, sample.kv_len, "the migrated KV does not fit this engine (both must "
                                   "run the same model and KV dtype)")
            if sample.finish_reason is not None:
                continue
            if len(sample.generated) >= request.sampling.max_tokens:  # it would run one token past
                raise InvalidRequestError(f"migrated sample {sample.index} is unfinished with {len(sample.generated)} "
                                          f"tokens, max_tokens {request.sampling.max_tokens}")
            if sample.kv is not None and sample.kv_len != len(prompt_ids) + len(sample.generated) - 1:
                raise InvalidRequestError(f"migrated sample {sample.index}'s KV holds {sample.kv_len} tokens, not its "
                                          f"prompt's {len(prompt_ids)} and generated tokens' {len(sample.generated)} "
                                          "but the last")
        self.stats.mark_start()
        self.stats.migrated_in += 1
        submitted = from_wall(migrated.submitted_at)
        if not migrated.samples:
            self._admit(request, prompt_ids, submitted)
            return
        unfinished = [s for s in migrated.samples if s.finish_reason is None]
        state = _RequestState(request, pending=len(unfinished), error=migrated.error)
        self._requests[request.request_id] = state
        for sample in migrated.samples:
            seq = self.new_sequence(request, sample.index, prompt_ids, submitted)
            seq.first_scheduled_at = from_wall(migrated.first_scheduled_at)
            seq.generated, seq.logprobs = list(sample.generated), sample.logprobs
            seq.finish_reason, seq.stop_text_end, seq.finished_at = (sample.finish_reason, sample.stop_text_end,
                                                                     from_wall(sample.finished_at))
            state.samples.append(seq)
            if seq.grammar is not None:
                for token in seq.generated:
                    seq.grammar.accept_token(token)
            if seq.finish_reason is not None:
                seq.phase = Phase.FINISHED
                continue
            location = None if sample.kv is None else self.scheduler.import_location(sample.kv_len)
            if location is None:  # KV dropped before the move, or no room for it here: prefilled again
                self.scheduler.admit(seq)
                continue
            self.kv.load(seq, location, sample.kv, sample.kv_len)
            self.scheduler.place_decoding(seq)

    # --------------------------------------------- shared with PrefillExporter
    def admissible_prompt(self, request: Request) -> list[int]:
        """The request's prompt ids, if this engine can ever run it; InvalidRequestError otherwise."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request_id {request.request_id!r}")
        ids = self.normalizer.prompt_ids(prompt_token_ids=request.prompt_token_ids, messages=request.messages,
                                         prompt=request.prompt, chat=request.chat_options)
        self.normalizer.check_length(len(ids), request.sampling)
        self.normalizer.check_vocabulary(request.sampling)
        self._check_structured(request.sampling)
        self._bad_word_ids(request.sampling.bad_words)
        if request.sampling.stop and self.tokenizer is None:  # matched on the detokenized text, which is empty here
            raise InvalidRequestError("stop strings need the model's tokenizer; this model has none (stop_token_ids "
                                      "take token ids)")
        self.scheduler.check_fits(min(len(ids) + request.sampling.max_tokens, self.max_model_len), len(ids),
                                  request.sampling.n)
        return ids

    def new_sequence(self, request: Request, index: int, prompt_ids: list[int], submitted: float) -> Sequence:
        spec = request.sampling.structured_outputs
        return Sequence(seq_id=next(self._seq_ids), request_id=request.request_id, sample_index=index,
                        prompt_ids=prompt_ids, sampling=request.sampling, eos_token_ids=self.eos_token_ids,
                        arrival=next(self._arrivals), submitted_at=submitted,
                        grammar=None if spec is None else self.grammars.matcher(spec),
                        bad_word_ids=self._bad_word_ids(request.sampling.bad_words))

    @property
    def grammars(self) -> GrammarBackend:
        """The structured-output grammars, set up on the first structured request."""
        if self._grammars is None:
            eos = self.eos_token_ids or ({self.tokenizer.eos_token_id} - {None} if self.tokenizer else set())
            self._grammars = GrammarBackend(self.tokenizer, self.model.vocab_size, sorted(eos))
        return self._grammars

    def prefill_logits(self, plan: PrefillPlan) -> torch.Tensor:
        """Run a planned prefill alone: last-position logits, one row per prompt it completes."""
        return self._forward(plan, None)

    # ------------------------------------------------------------------ internals
    def _forward(self, prefill: PrefillPlan | None, decode: DecodePlan | None) -> torch.Tensor:
        """One model forward over a step's prefill chunks and decoding sequences (runner.step's rows)."""
        chunks = prefill.chunks if prefill else []
        now = time.perf_counter()
        for chunk in chunks:
            if chunk.seq.first_scheduled_at is None:  # (a cached prefix starts its first chunk past 0)
                chunk.seq.first_scheduled_at = now
            if chunk.seq.recomputing:
                self.stats.recomputed_tokens += chunk.end - chunk.start
            else:
                self.stats.prompt_tokens += chunk.end - chunk.start
        self.stats.chunked_prefills += sum(1 for c in chunks if not c.completes)
        self.stats.decoding = decode is not None
        with invariant_batches(self.config.batch_invariant):
            logits = self._timed(self.runner.step, chunks, decode)
        for chunk in chunks:  # their pages now hold the KV: index the whole prompt pages for sharers
            self.kv.cache_prompt(chunk.seq, chunk.end)
        self.stats.decoding = False
        self.stats.prefill_steps += prefill is not None
        self.stats.decode_steps += decode is not None
        self.stats.mixed_steps += prefill is not None and decode is not None
        self.stats.sequence_steps += len(chunks) + (len(decode.seqs) if decode else 0)
        self.stats.staged_decode_batches += len(decode.staged_groups) if decode else 0
        return logits

    def _first_tokens(self, plan: PrefillPlan, logits: torch.Tensor) -> None:
        """Prompts whose prefill completed: fork n > 1 samples, draw each sample's first token (a recomputed
        sequence's next one)."""
        rows, seqs = [], []
        for row, parent in enumerate(plan.completed):
            if parent.recomputing:
                rows.append(row)
                seqs.append(parent)
                continue
            state = self._requests[parent.request_id]
            for index in range(1, parent.sampling.n):  # forks share the parent's logits row
                child = self.new_sequence(state.request, index, parent.prompt_ids, parent.submitted_at)
                child.first_scheduled_at = parent.first_scheduled_at
                location = self.scheduler.fork_location(parent, plan.location)
                if location is not None:  # else it takes its first token here and is prefilled again
                    self.kv.fork(parent, child, location)
                state.samples.append(child)
            if state.prefilled is not None:  # prefilled again here: the first tokens were drawn already
                prefilled, state.prefilled = state.prefilled, None  # its KV whole again: movable (MIGRATE) as any
                for seq in state.samples:
                    logprob = prefilled.first_logprobs[seq.sample_index]
                    seq.logprobs = None if logprob is None else [logprob]
                    self._continue_or_finish(seq, prefilled.first_token_ids[seq.sample_index])
                continue
            rows.extend([row] * len(state.samples))
            seqs.extend(state.samples)
        if rows != list(range(logits.shape[0])):  # forks repeat a row, prompts prefilled elsewhere drop theirs
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        tokens = sample_next_tokens(logits, seqs, self.generator) if seqs else []
        for seq, token in zip(seqs, tokens):
            self._continue_or_finish(seq, token)

    def _next_tokens(self, plan: DecodePlan, logits: torch.Tensor) -> None:
        seqs = plan.seqs
        tokens = sample_next_tokens(logits, seqs, self.generator)
        for seq, token in zip(seqs, tokens):
            if self._accept_token(seq, token):
                self.scheduler.remove(seq)

    def _continue_or_finish(self, seq: Sequence, token: int) -> None:
        """A sequence whose KV was just written takes its first token, then decodes or is done (a fork that found
        no pages waits to be prefilled again)."""
        if self._accept_token(seq, token):
            self.scheduler.leave_after_prefill(seq)
        elif seq.kv_location is KVLocation.NONE:
            self.scheduler.recompute(seq)
        else:
            self.scheduler.place_decoding(seq)

    def _admit(self, request: Request, prompt_ids: list[int], submitted: float) -> None:
        state = _RequestState(request, pending=request.sampling.n)
        self._requests[request.request_id] = state
        parent = self.new_sequence(request, 0, prompt_ids, submitted)
        state.samples.append(parent)
        self.scheduler.admit(parent)

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, leading spaces stripped, alone and after a space (as it appears mid-text):
        vLLM's spellings, but the spaced one also where it tokenizes to another length (vLLM then leaves it out, and
        " story" of one token is generated freely where "story" is banned). A spelling holding a token past the
        model's vocabulary (a tokenizer larger than the embedding table) can never be generated, so it needs no
        ban; banning its last token would index past the logits."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer; this model has none")
        if words not in self._bad_words:  # tokenized once per list: admission checks it, each sample uses it
            variants = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                        for word in words for text in (word.lstrip(), " " + word.lstrip())}
            vocab = self.model.vocab_size
            self._bad_words[words] = tuple(sorted(v for v in variants if v and max(v) < vocab))
        return self._bad_words[words]

    def _check_layout(self, layout: str, what: str, engines: str) -> None:
        """InvalidRequestError unless KV laid out as `layout` ("": unknown) is this engine's: another model's of as
        many bytes per token (other layers and heads) passed the size check and decoded garbage."""
        if layout and layout != self.kv.geometry.layout:
            raise InvalidRequestError(f"the {what} is {layout}, this engine's is {self.kv.geometry.layout} ({engines} "
                                      "must run the same model and KV dtype)")

    def _check_in_vocabulary(self, token_ids: list[int], what: str) -> None:
        """InvalidRequestError naming the first of `token_ids` (`what`) outside this model's vocabulary."""
        vocab = self.model.vocab_size
        outside = [t for t in token_ids if not 0 <= t < vocab]
        if outside:
            raise InvalidRequestError(f"{what}: token {outside[0]} is outside the vocabulary [0, {vocab})")

    def _check_packed(self, packed: torch.Tensor, num_tokens: int, problem: str) -> None:
        """InvalidRequestError (`problem`: the reason) unless `packed` holds `num_tokens` tokens of KV laid out
        for this engine."""
        try:
            self.kv.geometry.packed_views(packed, num_tokens)
        except ValueError as exc:
            raise InvalidRequestError(f"{problem}: {exc}") from None

    def _check_structured(self, sampling) -> None:
        """InvalidRequestError if the request's structured-output spec does not compile for this model."""
        if sampling.structured_outputs is not None:
            self.grammars.compile(sampling.structured_outputs)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.stats.model_seconds += time.perf_counter() - start
        return out

    def _accept_token(self, seq: Sequence, token: int) -> bool:
        """Append a token; True when it finished the sequence (the caller frees its KV)."""
        seq.generated.append(token)
        self.stats.generated_tokens += 1
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            # the grammar allows no token here, or bad_words banned every one it does: this request fails, the
            # engine goes on
            why = "bad_words banned every one" if seq.bad_word_ids else "the grammar allows none here"
            self._requests[seq.request_id].error = (
                f"structured_outputs: after {len(seq.generated) - 1} tokens no token the grammar allows was left to "
                f"sample ({why})")
            reason = "error"
        else:
            reason = finish_reason(seq, self.tokenizer, self.max_model_len)
        if reason is None:
            return False
        seq.finish_reason = reason
        seq.finished_at = time.perf_counter()
        self._sample_finished(seq)
        return True

    def _sample_finished(self, seq: Sequence) -> None:
        state = self._requests[seq.request_id]
        state.pending -= 1
        if state.pending:
            return
        del self._requests[seq.request_id]
        if state.error is not None:
            self._fail(state.request, state.error, seq.submitted_at)
            return
        samples = state.samples if len(state.samples) == 1 else sorted(state.samples, key=lambda s: s.sample_index)
        outputs = [Completion(index=s.sample_index, token_ids=list(s.generated), text=output_text(s, self.tokenizer),
                              finish_reason=s.finish_reason, logprobs=s.logprobs) for s in samples]
        finished = max(s.finished_at for s in samples)
        self._ready.append(Result(request_id=seq.request_id, prompt_token_ids=samples[0].prompt_ids, outputs=outputs,
                                  submitted_at=samples[0].submitted_at,
                                  first_scheduled_at=min(s.first_scheduled_at or finished for s in samples),
                                  finished_at=finished))
        self.stats.record_finished(finished, finished - samples[0].submitted_at)

    def _fail(self, request: Request, error: str, submitted: float) -> None:
        now = time.perf_counter()
        self._ready.append(Result(request_id=request.request_id, prompt_token_ids=[], error=error,
                                  submitted_at=submitted, finished_at=now))
        self.stats.failed_requests += 1
