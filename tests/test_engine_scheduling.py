"""The primitives and the scheduling policy on hand-built sequences (no model needed)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import scheduler_config

from batchgen.engine.batch_index import index_tensor, new_token_slots, page_table, span_positions, token_slots
from batchgen.engine.coroutine import CoroutineGroup, ProgramPoint, combine, partition
from batchgen.engine.kv_manager import KVBudget, KVManager
from batchgen.engine.kv_pool import OutOfPagesError, slot_mapping, zeroed
from batchgen.engine.models.context import KVSpec
from batchgen.engine.sampling_params import InvalidRequestError, SamplingParams
from batchgen.engine.scheduler import DecodePlan, Scheduler
from batchgen.engine.sequence import KVLocation, Phase, Sequence

SPEC = KVSpec(num_layers=2, num_kv_heads=1, k_dim=4, v_dim=3)
PAGE = 4
PAGE_BYTES = SPEC.num_layers * PAGE * (SPEC.k_dim + SPEC.v_dim) * 4



def manager(device_pages: int, host_pages: int = 64, stage_pages: int = 0, reserve: int = 0,
            prefix_caching: bool = False, stream_host: bool = True) -> KVManager:
    budget = KVBudget(device_bytes=(device_pages * PAGE_BYTES + stage_pages * PAGE_BYTES // SPEC.num_layers),
                      host_bytes=host_pages * PAGE_BYTES, staging_bytes=stage_pages * PAGE_BYTES // SPEC.num_layers)
    return KVManager(SPEC, PAGE, torch.float32, budget, torch.device("cpu"), stream_host=stream_host,
                     prefix_caching=prefix_caching, reserve_pages=reserve)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_pool_is_zero_and_takes_memory_only_where_written(dtype):
    """An engine's constructor must not write gigabytes of zeros (start-up of an engine actor): host pools come
    zeroed from the OS, page by page as they are touched."""
    before = resident_bytes()
    pool = zeroed((4, 64, 1024, 256), dtype, torch.device("cpu"))  # 256 or 128 MiB
    assert pool.shape == (4, 64, 1024, 256) and pool.dtype == dtype and pool.is_contiguous()
    assert resident_bytes() - before < pool.nbytes // 8
    pool[1, 3] = 2.0
    assert resident_bytes() - before >= 1024 * 256 * pool.element_size()
    assert float(pool[1, 3].sum()) == 2.0 * 1024 * 256 and float(pool[1, 2:4].sum()) == float(pool[1, 3].sum())
    assert zeroed((2, 0, 3), dtype, torch.device("cpu")).shape == (2, 0, 3)


def sequence(seq_id: int, prompt_len: int = 3, generated: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", sample_index=0, prompt_ids=[1] * prompt_len,
                    sampling=SamplingParams(max_tokens=100), eos_token_ids=frozenset(), arrival=seq_id,
                    generated=[5] * generated)


def decoding(scheduler: Scheduler, kv: KVManager, seq: Sequence, location=KVLocation.DEVICE) -> Sequence:
    kv.allocate(seq, location, seq.num_tokens)
    seq.kv_len = seq.num_tokens
    scheduler.place_decoding(seq)
    return seq


def test_migrate_round_trip_keeps_kv_bit_exact():
    kv = manager(device_pages=4)
    seq = sequence(0, prompt_len=6)
    kv.allocate(seq, KVLocation.DEVICE, 6)
    seq.kv_len = 6
    packed = torch.empty(kv.geometry.packed_nbytes(6), dtype=torch.uint8)
    for part in kv.geometry.packed_views(packed, 6):  # k [L, T, Hkv, Dk], v [L, T, Hkv, Dv]
        part.copy_(torch.randn(part.shape))
    kv.free(seq)
    kv.load(seq, KVLocation.DEVICE, packed, 6)
    moved = kv.migrate(seq, KVLocation.HOST)
    assert seq.kv_location is KVLocation.HOST and seq.device_pages == [] and len(seq.host_pages) == 2
    assert kv.device.free_pages == 4 and moved == 2 * PAGE_BYTES
    kv.migrate(seq, KVLocation.DEVICE)
    exported = torch.empty_like(packed)
    kv.export(seq, exported)
    assert torch.equal(exported, packed)
    assert kv.migrations == {"to_host": 1, "to_device": 1}


def test_tiers_in_one_storage_name_each_slot_by_one_page_id():
    """Host pages attended in place on the device's memory: both pools are page ranges of one storage, so a page
    table may mix sequences of both tiers; each tier keeps its own pages, and a MIGRATE still moves the KV."""
    kv = manager(device_pages=4, host_pages=6, stream_host=False)
    assert kv.one_storage and kv.device.k is kv.host.k and kv.device.v is kv.host.v
    assert kv.device.k.shape[1] == 10
    seq = sequence(0, prompt_len=6)
    packed = torch.empty(kv.geometry.packed_nbytes(6), dtype=torch.uint8)
    for part in kv.geometry.packed_views(packed, 6):
        part.copy_(torch.randn(part.shape))
    kv.load(seq, KVLocation.DEVICE, packed, 6)
    device_pages = list(seq.device_pages)
    kv.migrate(seq, KVLocation.HOST)
    assert all(page >= 4 for page in seq.host_pages) and kv.device.free_pages == 4 and kv.host.free_pages == 4
    k, _ = kv.geometry.packed_views(packed, 6)
    assert torch.equal(kv.device.k[:, seq.host_pages[0]].flatten(1, 2), k[:, :PAGE].flatten(1, 2))
    kv.migrate(seq, KVLocation.DEVICE)
    assert all(page < 4 for page in seq.device_pages) and sorted(seq.device_pages) == sorted(device_pages)
    exported = torch.empty_like(packed)
    kv.export(seq, exported)
    assert torch.equal(exported, packed)
    with pytest.raises(OutOfPagesError):
        kv.host.allocate(7)
    assert sorted(kv.host.allocate(6)) == list(range(4, 10))


def test_coroutine_mode_yields_the_most_progressed_sequence_first():
    kv = manager(device_pages=3, stage_pages=8)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    few = decoding(scheduler, kv, sequence(0, prompt_len=2, generated=1))  # 3 tokens: 1 page
    most = decoding(scheduler, kv, sequence(1, prompt_len=1, generated=3))  # 4 tokens: page full
    middle = decoding(scheduler, kv, sequence(2, prompt_len=1, generated=2))
    plan = scheduler.schedule().decode
    assert isinstance(plan, DecodePlan)
    assert most.phase is Phase.SUSPENDED and most.kv_location is KVLocation.HOST
    assert plan.resident == [few, middle]
    assert plan.staged_groups == [[most]]  # a yielded sequence keeps decoding from the host store
    assert scheduler.yields == 1


def test_lockstep_mode_preempts_the_newest_and_does_not_run_it():
    kv = manager(device_pages=3)
    scheduler = Scheduler(scheduler_config(mode="lockstep"), kv)
    oldest = decoding(scheduler, kv, sequence(0, prompt_len=1, generated=3))
    decoding(scheduler, kv, sequence(1, prompt_len=1, generated=1))
    newest = decoding(scheduler, kv, sequence(2, prompt_len=1, generated=1))
    plan = scheduler.schedule().decode
    assert newest.phase is Phase.SUSPENDED and plan.staged_groups == []
    assert newest not in plan.resident and oldest in plan.resident


def test_suspended_sequences_refill_the_device_in_fifo_order():
    kv = manager(device_pages=2)
    scheduler = Scheduler(scheduler_config(mode="lockstep"), kv)
    first, second, third = (decoding(scheduler, kv, sequence(i), KVLocation.HOST) for i in range(3))
    assert list(scheduler.suspended.values()) == [first, second, third]
    plan = scheduler.schedule().decode
    assert plan.resident == [first, second]  # two pages: the oldest two come back, in order
    assert list(scheduler.suspended.values()) == [third] and scheduler.restores == 2
    scheduler.remove(first)
    assert scheduler.schedule().decode.resident == [second, third]


def test_prefill_goes_to_host_when_the_device_is_full_and_refills_below_threshold():
    kv = manager(device_pages=1, stage_pages=4)
    scheduler = Scheduler(scheduler_config(mode="coroutine", max_num_seqs=4), kv)
    for i in range(6):
        scheduler.admit(sequence(i, prompt_len=3))
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.prefill.seqs] == [0]  # the first prompt fits on the device alone
    assert plan.prefill.location is KVLocation.DEVICE and plan.decode is None
    for s in plan.prefill.seqs:
        s.kv_len = 3
        scheduler.place_decoding(s)
    plan = scheduler.schedule()
    prefill = plan.prefill
    assert prefill.location is KVLocation.HOST and [s.seq_id for s in prefill.seqs] == [1, 2, 3]  # up to max_num_seqs
    assert [s.seq_id for s in plan.decode.seqs] == [0]  # and sequence 0 decodes in the same step


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding():
    kv = manager(device_pages=8)
    scheduler = Scheduler(scheduler_config(mode="coroutine", max_prefill_tokens=4), kv)
    running = decoding(scheduler, kv, sequence(0, prompt_len=2, generated=1))
    long, short = sequence(1, prompt_len=10), sequence(2, prompt_len=3)
    scheduler.admit(long)
    scheduler.admit(short)
    spans = []
    for _ in range(3):
        plan = scheduler.schedule()
        assert plan.decode.resident == [running]  # decoding never waits for the long prompt
        spans.append([(c.seq.seq_id, c.start, c.end) for c in plan.prefill.chunks])
        for c in plan.prefill.chunks:
            c.seq.kv_len = c.end
    # the chunked prompt goes first in each step, the next prompt only once it is done
    assert spans == [[(1, 0, 4)], [(1, 4, 8)], [(1, 8, 10), (2, 0, 2)]]
    assert [s.seq_id for s in scheduler.schedule().prefill.completed] == [2]
    assert long.kv_location is KVLocation.DEVICE and len(long.device_pages) == kv.pages_needed(11)


def test_without_mixed_steps_a_refill_step_prefills_alone():
    kv = manager(device_pages=8)
    scheduler = Scheduler(scheduler_config(mode="coroutine", mixed_steps=False), kv)
    decoding(scheduler, kv, sequence(0, prompt_len=2, generated=1))
    scheduler.admit(sequence(1, prompt_len=3))
    plan = scheduler.schedule()
    assert plan.decode is None and [s.seq_id for s in plan.prefill.seqs] == [1]


def test_a_sequence_larger_than_every_pool_is_rejected_up_front():
    kv = manager(device_pages=2, stage_pages=1)
    with pytest.raises(InvalidRequestError, match="does not fit in the KV budget"):
        Scheduler(scheduler_config(mode="coroutine"), kv).check_fits(40, 8, 1)


@pytest.mark.parametrize("mode,host_pages,accepted", [("lockstep", 64, False), ("coroutine", 64, True),
                                                       ("coroutine", 8, False)])
def test_a_prompt_whose_samples_fit_no_pool_together_is_rejected_up_front(mode, host_pages, accepted):
    """Each of n=7 samples fits the device (prompt 10 + 6 tokens: 4 pages of 4), but the prompt's 3 pages and one
    per other sample (9: the forks share its whole pages) do not: the prefill waited for them forever, holding up
    every prompt behind it. n=5 (7 pages) fits: it was refused when each sample counted a whole copy (15)."""
    scheduler = Scheduler(scheduler_config(mode=mode), manager(device_pages=8, host_pages=host_pages))
    scheduler.check_fits(16, 10, samples=5)
    if accepted:
        scheduler.check_fits(16, 10, samples=7)
        return
    with pytest.raises(InvalidRequestError, match=r"a prompt of 10 tokens with n=7 needs 9 KV pages at once"):
        scheduler.check_fits(16, 10, samples=7)


def test_a_full_device_with_forked_samples_and_no_host_room_recomputes_until_the_sequence_grows():
    """Coroutine order evicts the most progressed sequence first; with no host room the newest is recomputed in its
    place. Forked samples holding only pages shared with their parent free nothing, and the victims sorted once ran
    out while the sequence needing a page still ran: an IndexError that failed the engine."""
    kv = manager(device_pages=4, host_pages=0)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    ahead = decoding(scheduler, kv, sequence(0, prompt_len=3, generated=5))  # 8 tokens: 2 full pages
    parent = decoding(scheduler, kv, sequence(1, prompt_len=7, generated=1))
    samples = []
    for i in (2, 3, 4):
        sample = sequence(i, prompt_len=7, generated=1)
        kv.fork(parent, sample, KVLocation.DEVICE)  # its pages all the parent's (8 tokens: 2 whole pages)
        scheduler.place_decoding(sample)
        samples.append(sample)
    assert kv.device.free_pages == 0 and all(kv.pages_of(s) == kv.pages_of(parent) for s in samples)
    plan = scheduler._plan_decode()
    assert [s.seq_id for s in plan.seqs] == [0] and len(kv.pages_of(ahead)) == 3
    assert scheduler.recomputes == 4 and sorted(s.seq_id for s in scheduler.waiting) == [1, 2, 3, 4]


def test_a_yield_the_host_pool_cannot_hold_recomputes_the_newest_sequence():
    """Lockstep, the device full, the host pool too small to keep a YIELD's KV: the newest sequence's KV is dropped
    (it waits first in line, its tokens kept), no prompt is admitted until a sequence leaves, then it is prefilled
    over its prompt and generated tokens. The engine used to fail here."""
    kv = manager(device_pages=4, host_pages=1)
    scheduler = Scheduler(scheduler_config(mode="lockstep"), kv)
    a, b = (decoding(scheduler, kv, sequence(i, prompt_len=7, generated=1)) for i in range(2))  # 2 pages each
    scheduler.admit(sequence(2, prompt_len=3))
    plan = scheduler.schedule()  # a's next token needs a third page: b would yield to a host pool of 1 page
    assert plan.prefill is None and plan.decode.resident == [a]
    assert list(scheduler.waiting)[0] is b and b.phase is Phase.WAITING and b.kv_len == 0 and b.device_pages == []
    assert (scheduler.recomputes, scheduler.yields, kv.host.free_pages, len(a.device_pages)) == (1, 0, 1, 3)
    a.kv_len += 1
    assert scheduler.schedule().prefill is None  # held: a keeps the pages b freed
    scheduler.remove(a)
    first = scheduler.schedule().prefill.chunks[0]
    assert (first.seq, first.start, first.end, first.completes) == (b, 0, 8, True)
    assert b.prefill_ids == [1] * 7 + [5] and b.prefill_samples == 1


def test_a_host_resident_sequence_the_full_host_pool_cannot_grow_recomputes_the_newest_one():
    kv = manager(device_pages=2, host_pages=4, stream_host=False)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    a, b = (decoding(scheduler, kv, sequence(i, prompt_len=7, generated=1), KVLocation.HOST) for i in range(2))
    plan = scheduler.schedule()
    assert plan.decode.seqs == [a] and list(scheduler.waiting) == [b] and scheduler.recomputes == 1
    assert len(a.host_pages) == 3 and b.kv_location is KVLocation.NONE


def test_a_yield_the_host_cannot_hold_takes_the_newest_sequence_where_its_kv_fits():
    """Coroutine mode yields the most progressed sequence first; where the host has no room for it but has for the
    newest, the newest moves there (and keeps its KV) instead of being recomputed."""
    kv = manager(device_pages=4, host_pages=2, stream_host=False)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    a = decoding(scheduler, kv, sequence(0, prompt_len=7, generated=5))  # 12 tokens, 3 pages: 13 needs a 4th
    b = decoding(scheduler, kv, sequence(1, prompt_len=3, generated=1))  # 4 tokens, the device's last page
    plan = scheduler.schedule()
    assert (scheduler.yields, scheduler.recomputes) == (1, 0) and b.kv_location is KVLocation.HOST
    assert set(plan.decode.seqs) == {a, b} and len(a.device_pages) == 4


def test_no_prompt_joins_a_held_step_even_when_a_chunked_prompt_completes_in_it():
    """A recompute preemption holds refills until a sequence leaves: the last chunk of a prompt already part-way
    through its prefill goes on, but the waiting prompts stay where they are."""
    kv = manager(device_pages=32)
    scheduler = Scheduler(scheduler_config(mode="coroutine", max_prefill_tokens=4), kv)
    a, b = (decoding(scheduler, kv, sequence(i, prompt_len=3, generated=1)) for i in range(2))
    chunked = sequence(2, prompt_len=6)
    scheduler.admit(chunked)
    assert scheduler.schedule().prefill.chunks[0].end == 4 and scheduler.prefilling is chunked
    chunked.kv_len = 4
    scheduler.recompute(b)
    scheduler.admit(sequence(3, prompt_len=2))
    plan = scheduler.schedule()
    assert [(c.seq, c.start, c.end, c.completes) for c in plan.prefill.chunks] == [(chunked, 4, 6, True)]
    assert [s.seq_id for s in scheduler.waiting] == [1, 3]
    scheduler.leave_after_prefill(chunked)  # done at its first token: the hold ends
    assert [c.seq.seq_id for c in scheduler.schedule().prefill.chunks] == [1]  # (its 4 tokens fill the step)


def test_lockstep_prefills_an_adopted_prompt_whose_samples_exceed_the_device_into_host_pages():
    """n=7 samples of a 9-token prompt prefilled here need 9 pages (its 3, one per other sample), the device has 8:
    check_fits admits such a prompt prefilled elsewhere for the host; adopted when no pool had room for a copy per
    sample, it is prefilled again here, into host pages (lockstep never offered them: it waited forever)."""
    scheduler = Scheduler(scheduler_config(mode="lockstep"), manager(device_pages=8, host_pages=24))
    scheduler.check_fits(12, 9, samples=7, imported=True)
    prompt = sequence(0, prompt_len=9)
    prompt.sampling = SamplingParams(max_tokens=3, n=7)
    scheduler.admit(prompt)
    assert scheduler.schedule().prefill.location is KVLocation.HOST


def test_a_step_whose_every_decoding_sequence_was_recomputed_has_no_decode_part():
    """It was an empty decode plan, which the engine counted as a decode step."""
    kv = manager(device_pages=2, host_pages=3, stream_host=False)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    a = decoding(scheduler, kv, sequence(0, prompt_len=11, generated=1), KVLocation.HOST)  # the host's 3 pages
    assert scheduler.schedule() is None and list(scheduler.waiting) == [a] and scheduler.recomputes == 1


def test_a_fork_finding_no_pages_is_told_to_recompute():
    kv = manager(device_pages=4, host_pages=1)
    scheduler = Scheduler(scheduler_config(mode="coroutine"), kv)
    parent = decoding(scheduler, kv, sequence(0, prompt_len=7))
    assert scheduler.fork_location(parent, KVLocation.DEVICE) is KVLocation.DEVICE
    decoding(scheduler, kv, sequence(1, prompt_len=7))  # the device full, the host's one page too few
    assert scheduler.fork_location(parent, KVLocation.DEVICE) is None


def test_prefilled_samples_land_together_where_all_of_them_fit():
    scheduler = Scheduler(scheduler_config(mode="lockstep"), manager(device_pages=8))
    assert scheduler.import_location(9, samples=2) is KVLocation.DEVICE  # 3 pages each
    assert scheduler.import_location(9, samples=3) is KVLocation.HOST  # 9 > 8: the second sample found no page
    scheduler.check_fits(12, 9, samples=3, imported=True)  # so an imported prompt may exceed the device
    full = Scheduler(scheduler_config(mode="lockstep"), manager(device_pages=8, host_pages=8))
    assert full.import_location(9, samples=3) is None  # neither pool has room now: the caller prefills it again


def test_combine_requires_one_program_point_and_partition_restores_rows():
    seqs = [sequence(i) for i in range(3)]
    a = CoroutineGroup(seqs[:2], torch.arange(8.0).reshape(2, 4), ProgramPoint(1, "ffn"))
    b = CoroutineGroup(seqs[2:], torch.arange(8.0, 12.0).reshape(1, 4), ProgramPoint(1, "ffn"))
    merged = combine([a, b])
    assert merged.seqs == seqs and merged.hidden.shape == (3, 4)
    parts = partition(merged, [(seqs[:2], 2, None), (seqs[2:], 1, None)])
    assert torch.equal(parts[0].hidden, a.hidden) and torch.equal(parts[1].hidden, b.hidden)
    with pytest.raises(ValueError, match="different program points"):
        combine([a, CoroutineGroup(seqs[2:], b.hidden, ProgramPoint(1, "attn"))])


@pytest.mark.parametrize("start,count", [(0, 0), (0, 4), (3, 1), (3, 6), (5, 11), (1, 14), (15, 1)])
def test_slot_mapping_is_each_positions_page_and_offset(start, count):
    pages = [7, 2, 9, 4]  # page ids in the sequence's order, not the pool's
    expected = [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + count)]
    assert slot_mapping(pages, start, count, PAGE) == expected


def test_a_steps_slot_tensors_equal_each_sequences_slot_mapping():
    """The batched slots of spans [start, end) over rows of different page counts (one row padded, one span
    empty, one starting mid-page) are the per-sequence slot_mapping laid end to end; likewise each row's next
    token, and index_tensor is torch.tensor's."""
    pages = [[7, 2, 9, 4], [3], [5, 8], [6, 1, 0]]
    starts, ends = [3, 0, 4, 9], [15, 4, 4, 12]
    device = torch.device("cpu")
    table = page_table(pages, device)
    assert table.tolist() == [[7, 2, 9, 4], [3, 0, 0, 0], [5, 8, 0, 0], [6, 1, 0, 0]] and table.dtype == torch.int32
    rows, positions = span_positions(starts, [e - s for s, e in zip(starts, ends)], device)
    assert positions.tolist() == [p for s, e in zip(starts, ends) for p in range(s, e)]
    expected = [slot for p, s, e in zip(pages, starts, ends) for slot in slot_mapping(p, s, e - s, PAGE)]
    assert token_slots(table, rows, positions, PAGE).tolist() == expected
    kv_lens = torch.tensor([14, 3, 7, 11])
    assert new_token_slots(table, kv_lens, PAGE).tolist() == [
        slot_mapping(p, n, 1, PAGE)[0] for p, n in zip(pages, kv_lens.tolist())]
    for dtype in (torch.int64, torch.int32):
        built = index_tensor([5, 0, 2**31 - 1], device, dtype)
        assert built.dtype == dtype and torch.equal(built, torch.tensor([5, 0, 2**31 - 1], dtype=dtype))
    assert index_tensor([], device).shape == (0,)
