"""Shared-prefix caching: the page index, held pages, copy on write, MIGRATE between caching pools, and
greedy outputs equal to the engine without it under evictions, staged decode, n > 1 and the split."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_scheduling import PAGE, manager, sequence
from tiny_models import kv_bytes_per_token, scheduler_config

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, PrefillExporter, Request, SamplingParams
from batchgen.engine.kv_pool import OutOfPagesError
from batchgen.engine.page_cache import ROOT, PageCache
from batchgen.engine.scheduler import PREFIX_WINDOW, Scheduler
from batchgen.engine.sequence import KVLocation


def test_index_matches_whole_pages_of_the_exact_prefix():
    cache = PageCache()
    assert cache.insert(7, ROOT, (1, 2)) and cache.insert(3, 7, (3, 4)) and cache.insert(5, 7, (3, 9))
    assert not cache.insert(8, ROOT, (1, 2))  # that prefix is cached already, in page 7
    assert not cache.insert(7, 3, (0, 0))  # page 7 caches something else already
    assert cache.match([1, 2, 3, 4, 5], 2, 3) == [7, 3]
    assert cache.match([1, 2, 3, 9], 2, 2) == [7, 5]
    assert cache.match([1, 2, 3, 4], 2, 1) == [7]
    assert cache.match([2, 2, 3, 4], 2, 2) == []


def test_evicting_a_page_drops_every_page_cached_under_it():
    cache = PageCache()
    for page, parent, tokens in [(0, ROOT, (1,)), (1, 0, (2,)), (2, 1, (3,)), (3, ROOT, (9,))]:
        cache.insert(page, parent, tokens)
    cache.idle.update({0: None, 2: None, 3: None})  # page 1 is still held by a sequence
    assert sorted(cache.evict()) == [0, 2]  # the held page leaves the index but is not freed
    assert cache.match([1, 2, 3], 1, 3) == [] and not cache.cached(1) and list(cache.idle) == [3]


def test_pool_frees_a_page_when_its_last_holder_lets_go_and_reuses_idle_cached_pages_last():
    kv = manager(device_pages=4, prefix_caching=True)
    pool = kv.device
    a, b = sequence(0, prompt_len=9), sequence(1, prompt_len=9)
    assert kv.allocate_prompt(a, KVLocation.DEVICE) == 0
    kv.cache_prompt(a, 9)  # two whole pages of 4 tokens
    assert kv.allocate_prompt(b, KVLocation.DEVICE) == 2 * PAGE  # shares them, computes the rest
    assert b.device_pages[:2] == a.device_pages[:2] and b.device_pages[2] != a.device_pages[2]
    assert [pool.holders[p] for p in a.device_pages] == [2, 2, 1] and pool.free_pages == 0
    kv.free(a)
    assert pool.free_pages == 1 and [pool.holders[p] for p in b.device_pages] == [2 - 1, 1, 1]
    kv.free(b)
    assert pool.free_pages == 4 and len(pool.cache.idle) == 2  # the cached pages stay readable
    c = sequence(2, prompt_len=3)
    c.prompt_ids = [2] * 3  # another prefix, one page: taken from the never-cached pages
    kv.allocate_prompt(c, KVLocation.DEVICE)
    assert len(pool.cache.idle) == 2
    d = sequence(3, prompt_len=9)
    assert kv.allocate_prompt(d, KVLocation.DEVICE) == 2 * PAGE  # the idle pages came back into use
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)


def test_allocation_takes_idle_pages_least_recently_used_first():
    kv = manager(device_pages=4, prefix_caching=True)
    first, second = sequence(0, prompt_len=5), sequence(1, prompt_len=5)
    second.prompt_ids = [2] * 5
    for seq in (first, second):
        kv.allocate_prompt(seq, KVLocation.DEVICE)
        kv.cache_prompt(seq, 5)
        kv.free(seq)
    assert len(kv.device.cache.idle) == 2
    kv.device.allocate(3)  # two free pages, then the oldest idle one: the first prompt's
    assert kv.prefix_state(sequence(2, prompt_len=5), KVLocation.DEVICE) == (0, (ROOT, (1, 1, 1, 1)))
    assert kv.prefix_state(second, KVLocation.DEVICE) == (1, None)  # still cached


def test_fork_shares_whole_pages_and_copies_the_page_both_write_next():
    kv = manager(device_pages=8)
    parent, child = sequence(0, prompt_len=6), sequence(1, prompt_len=6)
    kv.allocate(parent, KVLocation.DEVICE, 7)
    parent.kv_len = 6
    kv.device.k[:, parent.device_pages] = torch.randn_like(kv.device.k[:, parent.device_pages])
    kv.fork(parent, child, KVLocation.DEVICE)
    assert child.device_pages[0] == parent.device_pages[0] and child.device_pages[1] != parent.device_pages[1]
    assert torch.equal(kv.device.k[:, child.device_pages[1]], kv.device.k[:, parent.device_pages[1]])
    assert kv.device.holders[parent.device_pages[0]] == 2
    kv.device.k[:, parent.device_pages[1], 2] = 7.0  # the parent's next token: not in the child's page
    assert not bool((kv.device.k[:, child.device_pages[1], 2] == 7.0).any())
    kv.free(parent)
    assert kv.device.holders[child.device_pages[0]] == 1


def test_yield_and_restore_share_what_the_other_pool_caches_and_keep_kv_exact():
    kv = manager(device_pages=8, host_pages=8, prefix_caching=True)
    a, b = sequence(0, prompt_len=10), sequence(1, prompt_len=10)
    kv.allocate_prompt(a, KVLocation.DEVICE)
    kv.device.k[:, a.device_pages] = torch.randn_like(kv.device.k[:, a.device_pages])
    a.kv_len = 10
    kv.cache_prompt(a, 10)
    kv.allocate_prompt(b, KVLocation.DEVICE)
    b.kv_len = 10
    before = kv.device.k[:, a.device_pages].clone()
    full = kv.migrate(a, KVLocation.HOST)
    assert full == 3 * kv.device.nbytes(1) and kv.host.cache.match(a.prompt_ids, PAGE, 2) == a.host_pages[:2]
    shared = kv.migrate(b, KVLocation.HOST)  # its two cached prompt pages are on the host already
    assert shared == kv.device.nbytes(1) and b.host_pages[:2] == a.host_pages[:2]
    kv.migrate(a, KVLocation.DEVICE)
    assert torch.equal(kv.device.k[:, a.device_pages], before)


@pytest.fixture(scope="module")
def demo():
    return load_model("tiny-moe")


def shared_prefix_requests(vocab: int, count: int = 18, prefix_len: int = 70, seed: int = 0) -> list[Request]:
    """Prompts of two shared prefixes (and a few loners) with unique tails; n = 2 on every fourth."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(8, vocab) for _ in range(prefix_len)] for _ in range(2)]
    out = []
    for i in range(count):
        head = prefixes[i % 2] if i % 6 != 5 else [rng.randrange(8, vocab) for _ in range(9)]
        tail = [rng.randrange(8, vocab) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2 if i % 4 == 0 else 1)
        out.append(Request(str(i), head + tail, sampling=params))
    return out


def outputs(engine: Engine, requests: list[Request]) -> list[list[list[int]]]:
    results = engine.generate(requests)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [[o.token_ids for o in r.outputs] for r in results]


@pytest.mark.parametrize("options", [
    {"page_size": 16},
    {"page_size": 8, "budget_pages": 40, "stream_host_kv": True},  # YIELD/restore, staged decode
    {"page_size": 8, "budget_pages": 40, "stream_host_kv": False},
    {"page_size": 8, "budget_pages": 40, "mode": "lockstep"},
    {"page_size": 16, "max_prefill_tokens": 24},  # chunked prefill from a cached prefix
], ids=["roomy", "staged", "in-place", "lockstep", "chunked"])
def test_greedy_outputs_with_prefix_caching_equal_those_without(demo, options):
    options = dict(options)
    pages = options.pop("budget_pages", None)
    if pages:
        options["kv_budget_bytes"] = kv_bytes_per_token(demo) * options["page_size"] * pages
    batch = shared_prefix_requests(demo.model.vocab_size)
    expected = outputs(Engine(demo, prefix_caching=False, **options), batch)
    engine = Engine(demo, **options)
    assert outputs(engine, batch) == expected
    metrics = engine.metrics()
    assert metrics["prefill_tokens_saved"] > 0 and 0 < metrics["prefix_hit_rate"] < 1
    total = sum(len(r.prompt_token_ids) for r in batch)
    assert metrics["prompt_tokens"] == total - metrics["prefill_tokens_saved"]
    if pages and options.get("mode") != "lockstep":
        assert metrics["yields"] + metrics["staged_decode_batches"] > 0


def test_sharers_wait_one_step_for_a_prefix_being_prefilled(demo):
    """Prompts whose prefix another prompt of the same step computes start a step later, from the cache:
    the prefix is computed once, not once per prompt that arrives together."""
    batch = [r for r in shared_prefix_requests(demo.model.vocab_size, count=12) if int(r.request_id) % 6 != 5]
    engine = Engine(demo, page_size=16)
    outputs(engine, batch)
    cacheable = 70 // 16 * 16
    assert engine.metrics()["prefill_tokens_saved"] == cacheable * (len(batch) - 2)


def test_a_prompt_starting_past_its_cached_prefix_records_when_it_was_first_scheduled(demo):
    """Its first chunk starts past 0: the time it was first scheduled was never set, so its result reported the
    time it finished."""
    batch = shared_prefix_requests(demo.model.vocab_size, count=3)
    engine = Engine(demo, page_size=16)
    first, second = (engine.generate([request])[0] for request in batch[::2])  # one prefix
    assert engine.metrics()["prefill_tokens_saved"] > 0
    for result in (first, second):
        assert result.submitted_at <= result.first_scheduled_at < result.finished_at


def decoded(decode: Engine, exported) -> dict[str, list[list[int]]]:
    for out in exported:
        decode.add_prefilled(out)
    got = {}
    while decode.has_unfinished():
        got.update({r.request_id: [o.token_ids for o in r.outputs] for r in decode.step()})
    return got


def test_split_stages_reuse_the_prefix_and_send_it_once_a_batch(demo):
    batch = shared_prefix_requests(demo.model.vocab_size)
    expected = outputs(Engine(demo, page_size=16, prefix_caching=False), batch)
    prefill = Engine(demo, page_size=16)
    exported = PrefillExporter(prefill).prefill(batch).outputs
    assert prefill.metrics()["prefill_tokens_saved"] > 0
    # the first prompt of each prefix carries it; its sharers carry only the pages after it
    assert [out.kv_start for out in exported[:4]] == [0, 0, 64, 64]
    assert exported[5].kv_start == 0  # a loner
    geometry = prefill.kv.geometry
    assert all(out.kv.numel() == geometry.packed_nbytes(out.num_tokens - out.kv_start) for out in exported)
    decode = Engine(demo, page_size=16)
    got = decoded(decode, exported)
    assert [got[r.request_id] for r in batch] == expected
    assert decode.metrics()["handoff_prefills"] == 0


@pytest.mark.parametrize("caching", [True, False], ids=["carrier-elsewhere", "decode-without-cache"])
def test_a_prompt_whose_carried_prefix_is_missing_is_prefilled_again_with_the_same_tokens(demo, caching):
    """The batch split between decode engines (the carrier adopted elsewhere), or a decode engine that
    caches nothing: the prompt is prefilled there and keeps the first tokens the prefill engine drew."""
    batch = shared_prefix_requests(demo.model.vocab_size, count=4)
    batch[2] = Request("2", batch[2].prompt_token_ids, sampling=SamplingParams(
        max_tokens=10, temperature=1.0, seed=5, n=2, logprobs=1))  # sampled: the first tokens must be kept
    exported = PrefillExporter(Engine(demo, page_size=16)).prefill(batch).outputs
    assert exported[2].kv_start == 64
    reference = Engine(demo, page_size=16)
    expected = decoded(reference, exported)
    decode = Engine(demo, page_size=16, prefix_caching=caching)
    got = decoded(decode, exported[1:])  # the carrier of "2", exported[0], went to another engine
    assert got == {k: v for k, v in expected.items() if k != "0"}
    assert decode.metrics()["handoff_prefills"] == (1 if caching else 2)


def test_admission_runs_sharers_of_a_resident_prefix_first_and_never_starves_the_head():
    kv = manager(device_pages=64, prefix_caching=True)
    scheduler = Scheduler(scheduler_config(max_num_seqs=100), kv)
    cached = sequence(0, prompt_len=9)
    kv.allocate_prompt(cached, KVLocation.DEVICE)
    kv.cache_prompt(cached, 9)
    head = sequence(1, prompt_len=9)
    head.prompt_ids = [2] * 9  # nothing of it cached
    sharers = [sequence(i, prompt_len=9) for i in range(2, 2 + PREFIX_WINDOW + 5)]
    for seq in [head, *sharers]:
        scheduler.admit(seq)
    chunks = scheduler.schedule().prefill.chunks  # admission order
    assert [c.seq for c in chunks] == [*sharers[:PREFIX_WINDOW], head, *sharers[PREFIX_WINDOW:]]
    assert [c.start for c in chunks] == [2 * PAGE] * PREFIX_WINDOW + [0] + [2 * PAGE] * 5  # sharers from the cache


def test_identical_prompts_of_whole_pages_send_their_kv_once(demo):
    """Prompts equal to a whole number of pages: the later copies carry no KV at all (kv_start is the
    prompt's length), their decode engine takes every page from its cache, and tokens do not change."""
    prompt = list(range(10, 42))  # two pages of 16
    batch = [Request(str(i), prompt, sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
             for i in range(3)]
    expected = outputs(Engine(demo, page_size=16, prefix_caching=False), batch)
    exported = PrefillExporter(Engine(demo, page_size=16)).prefill(batch).outputs
    assert [out.kv_start for out in exported] == [0, 32, 32] and [o.kv.numel() for o in exported[1:]] == [0, 0]
    decode = Engine(demo, page_size=16)
    got = decoded(decode, exported)
    assert [got[r.request_id] for r in batch] == expected and decode.metrics()["handoff_prefills"] == 0
