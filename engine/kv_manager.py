"""Where each sequence's KV lives, and the MIGRATE primitive between device pages and host store.

The device pool is bounded by the user's KV budget; the host pool is the overflow where
YIELDed sequences keep their KV. In coroutine mode a slice of the device budget becomes a
one-layer staging pool through which host-resident sequences keep decoding (offloaded COMBINE).

With prefix caching, both pools index the whole pages of prompt tokens they hold (engine/page_cache.py):
a new prompt starts from the pages of its longest cached prefix, a MIGRATE shares the pages the
target pool already caches instead of copying them, and an n > 1 fork shares its parent's full pages
and copies only the last, partly filled one (copy on write: every write lands past the shared pages).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

import torch

from batchgen.engine.host_view import host_pages_in_place
from batchgen.engine.kv_pool import KVPool, PoolGeometry, PoolView, copy_pages, slot_mapping, tiers_in_one_storage
from batchgen.engine.models.context import KVSpec
from batchgen.engine.page_cache import ROOT, PageKey
from batchgen.engine.sequence import KVLocation, Sequence

CPU = torch.device("cpu")


@dataclass
class KVBudget:
    device_bytes: int
    host_bytes: int
    staging_bytes: int  # part of device_bytes, 0 when host sequences do not decode (lockstep)


class KVManager:
    def __init__(self, spec: KVSpec, page_size: int, dtype: torch.dtype, budget: KVBudget,
                 device: torch.device, stream_host: bool, prefix_caching: bool, reserve_pages: int = 2,
                 host_device: torch.device = CPU):
        """`host_device`: where host pages live; the planner replays schedules on "meta" pools (no storage)."""
        self.geometry = PoolGeometry(spec, page_size, dtype)
        self.page_size = page_size
        self.reserve_pages = reserve_pages
        resident_pages = self.geometry.pages_in_budget(budget.device_bytes - budget.staging_bytes)
        host_pages = self.geometry.pages_in_budget(budget.host_bytes)
        # host pages attended in place in the device's own memory: the tiers are page ranges of one storage
        self.one_storage = not stream_host and host_device == device
        if self.one_storage:
            self.device, self.host = tiers_in_one_storage(self.geometry, resident_pages, host_pages, device,
                                                          prefix_caching)
        else:
            self.device = KVPool(self.geometry, resident_pages, device, cache=prefix_caching)
            self.host = KVPool(self.geometry, host_pages, host_device, pin=True, cache=prefix_caching)
        stage_geometry = PoolGeometry(KVSpec(1, spec.num_kv_heads, spec.k_dim, spec.v_dim), page_size, dtype)
        self.stage = KVPool(stage_geometry, stage_geometry.pages_in_budget(budget.staging_bytes), device)
        self.stream_host = stream_host  # host-resident KV decodes through `stage` (else on host pages in place)
        # the host pool as the device's kernels address it: on a GPU that can, a view of its pinned pages (host groups
        # attend on it in place, or the staging pool gathers from it and the new tokens' KV is written to it, all on
        # the device); else the pool itself (a CPU's own memory; a GPU that cannot copies through the host)
        self.host_for_kernels: KVPool | PoolView = (
            self.host.viewed_from(device) if host_pages_in_place(device) is None else self.host)
        self.bytes_moved = 0
        self.migrations = {"to_host": 0, "to_device": 0}
        self.prefix_query_tokens = 0  # prompt tokens of the prompts looked up in a prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens whose KV came from cached pages (prefill saved)

    @property
    def host_decode_pages(self) -> int:
        """Most pages host-resident sequences can decode over in one micro-batch."""
        return self.stage.num_pages if self.stream_host else self.host.num_pages

    def pool(self, location: KVLocation) -> KVPool:
        return self.device if location is KVLocation.DEVICE else self.host

    def pages_needed(self, num_tokens: int) -> int:
        return self.geometry.pages_for(num_tokens)

    def prompt_pages(self, num_tokens: int, samples: int = 1) -> int:
        """Pages a prompt of `num_tokens` and its first token take in one tier with its other `samples` - 1 samples
        forked beside it (fork): its own, and one per other sample (its copy of the partly filled last page, or the
        page its next token opens); the whole pages are shared."""
        return self.pages_needed(num_tokens + 1) + samples - 1

    def fork_pages(self, parent: Sequence, location: KVLocation) -> int:
        """Pages a fork of `parent` into `location` takes with its next token: beside the parent, all but the
        whole pages it shares; in the other tier, a copy of each."""
        shared = parent.kv_len // self.page_size if location is parent.kv_location else 0
        return self.pages_needed(parent.kv_len + 1) - shared

    def fits(self, location: KVLocation, num_tokens: int, reserve: bool = True, samples: int = 1) -> bool:
        """Whether `samples` sequences of `num_tokens` each fit `location`'s free pages (on the device beside
        the running sequences' reserve for their next tokens, unless `reserve` is off)."""
        return self.has_room(location, self.pages_needed(num_tokens) * samples, reserve)

    def has_room(self, location: KVLocation, pages: int, reserve: bool = True) -> bool:
        """Whether `pages` fit `location`'s free pages (on the device beside the reserve, as `fits`)."""
        extra = self.reserve_pages if reserve and location is KVLocation.DEVICE else 0
        return self.pool(location).free_pages >= pages + extra

    def allocate(self, seq: Sequence, location: KVLocation, num_tokens: int) -> None:
        pages = self.pool(location).allocate(self.pages_needed(num_tokens))
        seq.kv_location = location
        self._set_pages(seq, location, pages)

    def allocate_prompt(self, seq: Sequence, location: KVLocation) -> int:
        """Pages for a prefill (Sequence.prefill_ids: a new prompt, or a recompute's prompt and generated tokens) and
        the token it draws: its longest cached prefix shared, the rest allocated. Returns the number of tokens
        whose KV is already there (`seq.kv_len`). At least the last token is left to compute: its logits give the
        next one."""
        pool = self.pool(location)
        cached = []
        if pool.cache is not None:
            prompt = seq.prefill_ids
            cached = pool.cache.match(prompt, self.page_size, (len(prompt) - 1) // self.page_size)
            if not seq.recomputing:  # the hit rate is the prompts'
                self.prefix_query_tokens += len(prompt)
                self.prefix_hit_tokens += len(cached) * self.page_size
        self._place(seq, location, cached, self.pages_needed(len(seq.prefill_ids) + 1))
        seq.kv_len = len(cached) * self.page_size
        return seq.kv_len

    @property
    def caches_prefixes(self) -> bool:
        return self.device.cache is not None

    def caches_pages(self, location: KVLocation) -> bool:
        """Whether the pool at `location` holds any cached prefix page now."""
        cache = self.pool(location).cache
        return cache is not None and len(cache) > 0

    def prefix_state(self, seq: Sequence, location: KVLocation) -> tuple[int, PageKey | None]:
        """(how many of the prompt's pages the pool at `location` caches, the cache key of its first reusable
        page not cached yet, None if none): two prompts with the same key would compute the same page."""
        pool = self.pool(location)
        if pool.cache is None:
            return 0, None
        prompt, size = seq.prefill_ids, self.page_size
        reusable = (len(prompt) - 1) // size
        cached = pool.cache.match(prompt, size, reusable)
        if len(cached) == reusable:
            return len(cached), None
        start = len(cached) * size
        return len(cached), (cached[-1] if cached else ROOT, tuple(prompt[start : start + size]))

    def cache_prompt(self, seq: Sequence, num_tokens: int, prefilled: list[int] | None = None) -> None:
        """Index the whole pages of prefilled tokens (`prefilled`, else the sequence's prefill_ids) among the first
        `num_tokens` of the sequence's KV (just written)."""
        pool = self.pool(seq.kv_location)
        if pool.cache is not None:
            size, prompt = self.page_size, seq.prefill_ids if prefilled is None else prefilled
            whole = min(num_tokens, len(prompt)) // size
            _register(pool, self.pages_of(seq), [prompt[i * size : (i + 1) * size] for i in range(whole)])

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` KV entries, taking up to `reserve_pages` ahead on the device."""
        pages = self.pages_of(seq)
        missing = self.pages_needed(num_tokens) - len(pages)
        if missing <= 0:
            return True
        pool = self.pool(seq.kv_location)
        if pool.free_pages < missing:
            return False
        ahead = self.reserve_pages if seq.kv_location is KVLocation.DEVICE else 1
        pages.extend(pool.allocate(min(pool.free_pages, max(missing, ahead))))
        return True

    def free(self, seq: Sequence) -> None:
        if seq.kv_location is not KVLocation.NONE:
            self.pool(seq.kv_location).release(self.pages_of(seq))
        seq.device_pages, seq.host_pages = [], []
        seq.kv_location = KVLocation.NONE

    def migrate(self, seq: Sequence, to: KVLocation) -> int:
        """MIGRATE a sequence's KV between tiers (YIELD checkpoints to host, COMBINE restores)."""
        src_loc = seq.kv_location
        if src_loc is to:
            return 0
        count = self.pages_needed(seq.kv_len)
        src_pages = self.pages_of(seq)
        src, dst = self.pool(src_loc), self.pool(to)
        shared = _cached_in(dst, src, src_pages[:count])  # the prefix the target pool already holds
        self._set_pages(seq, src_loc, [])
        dst_pages = self._place(seq, to, shared, max(count, 1))
        moved = copy_pages(src, src_pages[len(shared) : count], dst, dst_pages[len(shared) : count])
        if dst.cache is not None:
            _register(dst, dst_pages, _cached_tokens(src, src_pages[:count]))
        src.release(src_pages)
        self.bytes_moved += moved
        self.migrations["to_host" if to is KVLocation.HOST else "to_device"] += 1
        return moved

    def fork(self, parent: Sequence, child: Sequence, location: KVLocation) -> None:
        """An n > 1 sample's prompt KV. Beside its parent it shares the parent's whole pages and gets a copy
        of the last, partly filled one, where both write next; in the other tier, a copy of every page."""
        count = self.pages_needed(parent.kv_len)
        src, dst = self.pool(parent.kv_location), self.pool(location)
        parent_pages = self.pages_of(parent)[:count]
        shared = parent_pages[: parent.kv_len // self.page_size] if location is parent.kv_location else []
        pages = self._place(child, location, shared, count)
        child.kv_len = parent.kv_len
        self.bytes_moved += copy_pages(src, parent_pages[len(shared):], dst, pages[len(shared):])

    def slots(self, seq: Sequence, start: int, count: int) -> list[int]:
        return slot_mapping(self.pages_of(seq), start, count, self.page_size)

    def export(self, seq: Sequence, packed: torch.Tensor, start: int = 0) -> None:
        """Write the KV of the sequence's tokens [start, kv_len) into `packed` (a uint8 host buffer of
        geometry.packed_nbytes(kv_len - start) bytes) for the prefill/decode split: one gather from the
        pages, the hand-off's one host copy."""
        pool = self.pool(seq.kv_location)
        slots = torch.tensor(self.slots(seq, start, seq.kv_len - start), dtype=torch.long, device=pool.device)
        for pages, out in zip((pool.k, pool.v), self.geometry.packed_views(packed, seq.kv_len - start)):
            flat = pages.view(pages.shape[0], -1, *pages.shape[3:])
            if flat.device == out.device:
                torch.index_select(flat, 1, slots, out=out)
            else:
                out.copy_(flat.index_select(1, slots))

    def load(self, seq: Sequence, location: KVLocation, packed: torch.Tensor, num_tokens: int,
             start: int = 0) -> bool:
        """Inverse of `export`: place the packed KV of tokens [start, num_tokens) into pages, the tokens
        before `start` coming from whole prompt pages the pool caches. With prefix caching, every cached
        prompt page is shared instead of written, and the new ones are indexed. False, with nothing
        changed, when the pool does not cache the pages before `start`."""
        pool = self.pool(location)
        cached = []
        if pool.cache is not None:
            whole = min(num_tokens, len(seq.prompt_ids)) // self.page_size
            cached = pool.cache.match(seq.prompt_ids, self.page_size, whole)
        written = len(cached) * self.page_size  # the first token to write
        if written < start:
            return False
        k, v = self.geometry.packed_views(packed, num_tokens - start)
        self._place(seq, location, cached, self.pages_needed(num_tokens))
        seq.kv_len = num_tokens
        slots = torch.tensor(self.slots(seq, written, num_tokens - written), dtype=torch.long, device=pool.device)
        flat_k = pool.k.view(pool.k.shape[0], -1, *pool.k.shape[3:])
        flat_v = pool.v.view(pool.v.shape[0], -1, *pool.v.shape[3:])
        flat_k[:, slots] = k[:, written - start :].to(pool.device)
        flat_v[:, slots] = v[:, written - start :].to(pool.device)
        self.bytes_moved += self.geometry.packed_nbytes(num_tokens - written)
        # the prompt's pages only: a moved sample's generated tokens were decoded, and a later prompt that shares
        # them computes their KV itself, as it would had the sample not moved
        self.cache_prompt(seq, num_tokens, seq.prompt_ids)
        return True

    def _place(self, seq: Sequence, location: KVLocation, shared: list[int], count: int) -> list[int]:
        """Give `seq` `count` pages at `location`: `shared` (pages of that pool it holds with others) first,
        freshly allocated ones after them. Returns its page list."""
        pool = self.pool(location)
        pool.share(shared)
        pages = shared + pool.allocate(count - len(shared))
        seq.kv_location = location
        self._set_pages(seq, location, pages)
        return pages

    def pages_of(self, seq: Sequence) -> list[int]:
        """The page ids of the tier the sequence's KV is in."""
        return seq.device_pages if seq.kv_location is KVLocation.DEVICE else seq.host_pages

    @staticmethod
    def _set_pages(seq: Sequence, location: KVLocation, pages: list[int]) -> None:
        if location is KVLocation.DEVICE:
            seq.device_pages = pages
        elif location is KVLocation.HOST:
            seq.host_pages = pages


def _cached_tokens(pool: KVPool, pages: list[int]) -> list[tuple[int, ...]]:
    """The tokens of the leading `pages` that `pool` caches (a sequence's cached prompt pages come first)."""
    out = []
    for page in pages:
        tokens = pool.cache.tokens_of(page) if pool.cache is not None else None
        if tokens is None:
            break
        out.append(tokens)
    return out


def _cached_in(dst: KVPool, src: KVPool, pages: list[int]) -> list[int]:
    """The pages of `dst` that already hold the cached prefix `pages` of `src` holds (its longest part)."""
    found: list[int] = []
    if dst.cache is None:
        return found
    parent = ROOT
    for tokens in _cached_tokens(src, pages):
        page = dst.cache.lookup(parent, tokens)
        if page is None:
            break
        found.append(page)
        parent = page
    return found


def _register(pool: KVPool, pages: list[int], page_tokens: list[SequenceT[int]]) -> None:
    """Index pages[i] as holding page_tokens[i] under pages[i - 1], in order; stops at the first prefix
    another page already caches (a page under an unindexed parent would be unreachable)."""
    parent = ROOT
    for page, tokens in zip(pages, page_tokens):
        if pool.cache.lookup(parent, tokens) != page and not pool.cache.insert(page, parent, tokens):
            return
        parent = page
