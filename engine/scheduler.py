"""Per-step decisions: refill (prefill), restore, evict, and how decode is cut into micro-batches.

A step holds a prefill part, a decode part, or both: refilled prompts are prefilled in the same
forward as the resident sequences decode (COMBINE-d into one MoE batch), at most
`max_prefill_tokens` prompt tokens per step; a longer prompt is prefilled in chunks over several
steps (its pages are allocated at its first chunk), so one long prompt never stalls decoding.

Two policies share the same queues and KV manager:
- coroutine: over-subscribed. Sequences that do not fit in device pages are YIELDed to the host
  store (the most progressed first) and keep decoding through the staging pool, so the MoE
  batch holds every resident sequence. Prompts are refilled when the decode population falls
  under a threshold.
- lockstep: vLLM-style continuous batching. Only device-resident sequences run; on page
  shortage the newest sequence is preempted (swapped to host) until pages free up.

When the host pool has no room either (for a YIELD, or for a host-resident sequence's next token), the
newest sequence of the pool that is short is preempted by recompute, as vLLM does: its KV is dropped and it
waits first in line to be prefilled again over its prompt and generated tokens; no prompt is admitted until
a sequence leaves, so the freed pages go to the sequences already running.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.page_cache import PageKey
from batchgen.engine.sampling_params import InvalidRequestError
from batchgen.engine.sequence import KVLocation, Phase, Sequence

PREFIX_WINDOW = 32  # how far into the waiting queue admission looks for prompts with a cached prefix


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, end) of `seq`'s prefill (Sequence.prefill_ids: `length` tokens) to compute this step
    (start > 0: earlier chunks' KV is in its pages)."""

    seq: Sequence
    start: int
    end: int
    length: int  # fixed when planned: the tokens a prefill draws grow prefill_ids of a recomputed sequence

    @property
    def completes(self) -> bool:
        return self.end == self.length


@dataclass
class PrefillPlan:
    chunks: list[PrefillChunk]
    location: KVLocation

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]

    @property
    def completed(self) -> list[Sequence]:
        """The sequences whose whole prompt is prefilled after this step: they take a first token."""
        return [c.seq for c in self.chunks if c.completes]


@dataclass
class DecodePlan:
    resident: list[Sequence]
    staged_groups: list[list[Sequence]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.resident + [s for group in self.staged_groups for s in group]

    def attended(self, one_storage: bool) -> DecodePlan:
        """The plan as the model runner attends it: where the KV tiers are one storage (kv_pool.tiers_in_one_storage)
        the host-resident sequences join the resident ones, in the same order."""
        return DecodePlan(self.seqs) if one_storage and self.staged_groups else self


@dataclass
class StepPlan:
    prefill: PrefillPlan | None
    decode: DecodePlan | None


class Scheduler:
    """Owns the three queues and every decision about where a sequence's KV lives.

    `running` and `suspended` are insertion-ordered dicts keyed by seq_id: FIFO like a deque, and a
    finished sequence leaves in O(1) whatever its position.
    """

    def __init__(self, config: EngineConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()  # prompts, FIFO
        self.running: dict[int, Sequence] = {}  # KV in device pages
        self.suspended: dict[int, Sequence] = {}  # KV in host pages, FIFO
        self.prefilling: Sequence | None = None  # a prompt part-way through chunked prefill
        self._refilling = True
        self._held = False  # a recompute preemption holds refills until a sequence leaves
        self._head = (-1, 0)  # (the waiting head's seq_id, how often a later prompt went before it)
        self.yields = 0
        self.restores = 0
        self.recomputes = 0

    @property
    def coroutine(self) -> bool:
        return self.config.mode == "coroutine"

    def num_decoding(self) -> int:
        return len(self.running) + len(self.suspended)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.suspended or self.prefilling)

    def check_fits(self, total_tokens: int, prompt_tokens: int, samples: int, imported: bool = False) -> None:
        """Reject a request that could never run, however long it waited: each sequence (prompt + max_tokens,
        `total_tokens`) must fit a pool it can decode from, and the prompt's pages with all `samples` one pool it
        can be prefilled into (kv.prompt_pages: forks share the whole pages) - host pages too in coroutine mode, or
        when its KV is `imported` (prefilled elsewhere: placed on the host when the device is full, or prefilled
        again here when no pool has room for a copy per sample)."""
        need = self.kv.pages_needed(total_tokens)
        device_ok = need <= self.kv.device.num_pages
        streamed_ok = self.coroutine and need <= min(self.kv.host_decode_pages, self.kv.host.num_pages)
        if not (device_ok or streamed_ok):
            raise InvalidRequestError(
                f"a sequence of up to {total_tokens} tokens (prompt + max_tokens) does not fit in the KV "
                f"budget ({self.kv.device.num_pages} device pages of {self.kv.page_size} tokens)")
        placed = self.kv.prompt_pages(prompt_tokens, samples)
        on_host = (self.coroutine or imported) and placed <= self.kv.host.num_pages
        if placed > self.kv.device.num_pages and not on_host:
            raise InvalidRequestError(
                f"a prompt of {prompt_tokens} tokens with n={samples} needs {placed} KV pages at once, more than "
                f"the KV budget holds ({self.kv.device.num_pages} device pages of {self.kv.page_size} tokens)")

    def schedule(self) -> StepPlan | None:
        self._restore()
        prefill = self._plan_prefill() if self.prefilling is not None or self._should_refill() else None
        decode = None
        if (self.running or self.suspended) and (prefill is None or self.config.mixed_steps):
            decode = self._plan_decode()
            if not decode.seqs:  # every decoding sequence was preempted by recompute
                decode = None
        return None if prefill is None and decode is None else StepPlan(prefill, decode)

    def _holding(self) -> bool:
        """Whether a recompute preemption holds refills: until a sequence leaves, while any decodes."""
        return self._held and bool(self.running or self.suspended)

    def _should_refill(self) -> bool:
        if not self.waiting or self._holding():
            return False
        if not self.coroutine:
            return True
        active = self.num_decoding()
        if active < self.config.refill_threshold * self.config.max_num_seqs or not active:  # (threshold 0: at none)
            self._refilling = True
        if active >= self.config.max_num_seqs:
            self._refilling = False
        return self._refilling

    def _plan_prefill(self) -> PrefillPlan | None:
        budget = self.config.max_prefill_tokens
        chunks: list[PrefillChunk] = []
        location = None
        room = self.config.max_num_seqs - self.num_decoding()
        if self.prefilling is not None:  # the chunked prompt goes on first; its pages are already there
            seq = self.prefilling
            length = len(seq.prefill_ids)
            chunks.append(PrefillChunk(seq, seq.kv_len, min(length, seq.kv_len + budget), length))
            location = seq.kv_location
            room -= seq.prefill_samples
            self.prefilling = None if chunks[0].completes else seq
        tokens = sum(c.end - c.start for c in chunks)
        samples_total = 0
        computing: set[PageKey] = set()  # the first prefix page each prompt of this step computes
        states: dict[tuple[int, KVLocation], tuple[int, PageKey | None]] = {}
        while self.waiting and self.prefilling is None and not self._holding():
            seq = self._next_prompt(computing, location or KVLocation.DEVICE, states)
            if seq is None:
                break  # every candidate's next prefix page is being computed: they start next step, cached
            samples = seq.prefill_samples
            if tokens >= budget or (chunks and samples > room):
                break
            if not chunks and samples > room and self.num_decoding() > 0:
                break
            pages = self.kv.prompt_pages(len(seq.prefill_ids), samples)
            where = self._prefill_location(pages, samples_total + samples)
            if where is None or (location is not None and where is not location):
                break
            _, next_page = states.get((seq.seq_id, where)) or self.kv.prefix_state(seq, where)
            if next_page in computing:
                break
            if next_page is not None:
                computing.add(next_page)
            self._take(seq)
            location = where
            start = self.kv.allocate_prompt(seq, where)  # past its cached prefix
            seq.phase = Phase.PREFILL
            length = len(seq.prefill_ids)
            chunks.append(PrefillChunk(seq, start, min(length, start + budget - tokens), length))
            tokens += chunks[-1].end - start
            samples_total += samples
            room -= samples
            if not chunks[-1].completes:
                self.prefilling = seq
        if not chunks:
            return None
        return PrefillPlan(chunks, location)

    def _next_prompt(self, computing: set[PageKey], location: KVLocation,
                     states: dict[tuple[int, KVLocation], tuple[int, PageKey | None]]) -> Sequence | None:
        """The waiting prompt to prefill next. FIFO without prefix caching; with it, of the first
        PREFIX_WINDOW prompts the one whose cached prefix is longest (the earliest on ties), so sharers run
        while their prefix is resident, skipping any whose next prefix page a prompt of this step
        computes. The head is passed over at most PREFIX_WINDOW times. None: every candidate waits.
        `states`: each prompt's kv.prefix_state, looked up once per step (an admission that evicts cached
        pages may leave one stale: it only orders prompts, allocate_prompt matches again)."""
        head = self.waiting[0]
        if not self.kv.caches_prefixes:
            return head

        def state(seq: Sequence) -> tuple[int, PageKey | None]:
            key = (seq.seq_id, location)
            if key not in states:
                states[key] = self.kv.prefix_state(seq, location)
            return states[key]

        if not self.kv.caches_pages(location) and state(head)[1] not in computing:
            return head  # nothing cached to reorder for
        if head.seq_id != self._head[0]:
            self._head = (head.seq_id, 0)
        best, best_pages = None, -1
        for seq in itertools.islice(self.waiting, PREFIX_WINDOW):
            cached_pages, next_page = state(seq)
            if next_page in computing:
                continue
            if seq is head and self._head[1] >= PREFIX_WINDOW:
                return head
            if cached_pages > best_pages:
                best, best_pages = seq, cached_pages
        if best is not None and best is not head:
            self._head = (head.seq_id, self._head[1] + 1)
        return best

    def _take(self, seq: Sequence) -> None:
        """Out of the waiting queue (near its front: the prompt came from `_next_prompt`'s window)."""
        if seq is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    def _prefill_location(self, pages: int, samples: int) -> KVLocation | None:
        """Where a prompt needing `pages` can go, if anywhere, beside the step's other prompts (already
        allocated; `samples` sequences in all, this one's included)."""
        reserve = self.kv.reserve_pages * samples if self.running else 0
        if pages + reserve <= self.kv.device.free_pages:
            return KVLocation.DEVICE
        # lockstep too for samples more than the whole device holds together: a prompt prefilled elsewhere, adopted
        # when no pool had room (check_fits admits it for the host), prefilled here again
        if (self.coroutine or pages > self.kv.device.num_pages) and pages <= self.kv.host.free_pages:
            return KVLocation.HOST
        return None

    def _restore(self) -> None:
        """Refill the device from the suspended pool in FIFO order (COMBINE restores KV)."""
        while self.suspended:
            seq = next(iter(self.suspended.values()))
            if not self.kv.fits(KVLocation.DEVICE, seq.kv_len + 1, reserve=bool(self.running)):
                return
            del self.suspended[seq.seq_id]
            self.kv.migrate(seq, KVLocation.DEVICE)
            seq.phase = Phase.DECODE
            self.running[seq.seq_id] = seq
            self.restores += 1

    def _plan_decode(self) -> DecodePlan:
        victims: list[Sequence] = []  # eviction order, sorted when needed (again when a short host pool took
        # the newest sequences in place of the popped ones, which still run)
        for seq in list(self.running.values()):
            while seq.seq_id in self.running and not self.kv.grow(seq, seq.kv_len + 1):
                if not victims:
                    victims = sorted(self.running.values(), key=self._victim_order)
                victim = victims.pop()
                if victim.seq_id not in self.running:
                    continue
                # room for its KV and its next token on the host (else it would be recomputed right after the copy)
                if self.kv.fits(KVLocation.HOST, victim.kv_len + 1):
                    self._yield(victim)
                    continue
                newest = _newest(self.running.values())  # (a scan only when the host pool is short)
                if self.kv.fits(KVLocation.HOST, newest.kv_len + 1):
                    self._yield(newest)
                else:  # no host room to keep it: the newest running sequence recomputes
                    self.recompute(newest)
        staged: list[list[Sequence]] = []
        if self.coroutine:
            for seq in list(self.suspended.values()):
                while seq.seq_id in self.suspended and not self.kv.grow(seq, seq.kv_len + 1):
                    self.recompute(_newest(self.suspended.values()))
            # a sequence larger than the staging pool waits in host pages for a device restore
            streamable = [s for s in self.suspended.values()
                          if self.kv.pages_needed(s.kv_len + 1) <= self.kv.host_decode_pages]
            staged = self._staging_groups(streamable)
        return DecodePlan(list(self.running.values()), staged)

    def _victim_order(self, seq: Sequence) -> tuple[int, ...]:
        """Sort key whose largest value is evicted first."""
        if self.coroutine:  # most progressed first: the most KV already written, the closest to done
            return (len(seq.generated), -seq.arrival)
        return (seq.arrival,)  # vLLM: preempt the newest

    def _yield(self, seq: Sequence) -> None:
        """YIELD a sequence off the device: checkpoint its KV to host pages (the caller checked they have room)."""
        del self.running[seq.seq_id]
        self.kv.migrate(seq, KVLocation.HOST)
        seq.phase = Phase.SUSPENDED
        self.suspended[seq.seq_id] = seq
        self.yields += 1

    def recompute(self, seq: Sequence) -> None:
        """Preempt by recompute: drop a sequence's KV (it has generated tokens); it waits first in line for a
        prefill over its prompt and generated tokens (Sequence.recomputing), which draws its next token as a
        decode step would."""
        if seq.phase is Phase.DECODE:
            del self.running[seq.seq_id]
        elif seq.phase is Phase.SUSPENDED:
            del self.suspended[seq.seq_id]
        self.kv.free(seq)
        seq.kv_len = 0
        seq.phase = Phase.WAITING
        self.waiting.appendleft(seq)
        self.recomputes += 1
        self._held = True

    def _staging_groups(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        groups: list[list[Sequence]] = []
        pages = 0
        for seq in seqs:
            need = self.kv.pages_needed(seq.kv_len + 1)
            if not groups or pages + need > self.kv.host_decode_pages or len(groups[-1]) >= self.config.b_attn:
                groups.append([])
                pages = 0
            groups[-1].append(seq)
            pages += need
        return groups

    def admit(self, seq: Sequence) -> None:
        seq.phase = Phase.WAITING
        self.waiting.append(seq)

    def fork_location(self, parent: Sequence, planned: KVLocation) -> KVLocation | None:
        """Where an n > 1 sample's copy of its parent's prompt KV goes: beside the parent when it fits, else host
        pages when they have room; None when neither has (the step's decode took the pages admission counted on:
        the sample is `recompute`d)."""
        for location in (planned, KVLocation.HOST):
            if self.kv.has_room(location, self.kv.fork_pages(parent, location)):
                return location
        return None

    def import_location(self, num_tokens: int, samples: int = 1) -> KVLocation | None:
        """Where KV prefilled elsewhere lands, for `samples` sequences together: device pages when they have room
        for all, else host pages when those have; None when neither has now (the caller prefills it again)."""
        for location in (KVLocation.DEVICE, KVLocation.HOST):
            if self.kv.fits(location, num_tokens + 1, samples=samples):
                return location
        return None

    def place_decoding(self, seq: Sequence) -> None:
        """A sequence whose KV was just written (prefill, fork, import) joins the decode pool."""
        if seq.kv_location is KVLocation.DEVICE:
            seq.phase = Phase.DECODE
            self.running[seq.seq_id] = seq
        else:
            seq.phase = Phase.SUSPENDED
            self.suspended[seq.seq_id] = seq

    def leave_after_prefill(self, seq: Sequence) -> None:
        """A sequence done at the token its prefill drew (in no queue): frees its KV."""
        self._held = False
        self.kv.free(seq)
        seq.phase = Phase.FINISHED

    def remove(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves whichever queue holds it (O(1) unless still waiting) and
        frees its KV."""
        self._held = False
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
        elif seq is self.prefilling:
            self.prefilling = None
        elif seq.phase is Phase.DECODE:
            del self.running[seq.seq_id]
        elif seq.phase is Phase.SUSPENDED:
            del self.suspended[seq.seq_id]
        self.kv.free(seq)
        seq.phase = Phase.FINISHED


def _newest(seqs) -> Sequence:
    """The sequence submitted last: the one a preemption takes first, as vLLM's."""
    return max(seqs, key=lambda s: s.arrival)
