"""The coroutine engine against the reference runner: greedy tokens must not depend on batch
composition, memory budget, evictions or arrival order."""

from __future__ import annotations

import random
import re

import pytest
from tiny_models import ALL_ARCHITECTURES, kv_bytes_per_token, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, PrefillExporter, Request, SamplingParams
from batchgen.engine.reference import ReferenceRunner

MAX_TOKENS = 16
LENGTHS = (3, 9, 17, 5, 30, 12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def build_case(arch, directory):
    save_tiny_checkpoint(arch, directory)
    loaded = load_model(str(directory))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    return loaded, batch, expected


@pytest.fixture(scope="module", params=ALL_ARCHITECTURES)
def arch_case(request, tmp_path_factory):
    return build_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory):
    return build_case("mixtral", tmp_path_factory.mktemp("mixtral"))


def greedy_requests(batch, order=None, params=GREEDY):
    order = order if order is not None else range(len(batch))
    return [Request(f"r{i}", prompt_token_ids=batch[i], sampling=params) for i in order]


def tokens_by_id(results):
    assert all(r.error is None for r in results), [r.error for r in results]
    return {r.request_id: r.outputs[0].token_ids for r in results}


def in_order(got, n):
    return [got[f"r{i}"] for i in range(n)]


def test_every_architecture_matches_reference_with_split_batches_and_evictions(arch_case):
    loaded, batch, expected = arch_case
    assert len(set(expected[0])) > 1  # the tiny model does not just repeat one token
    order = list(range(len(batch)))
    random.Random(7).shuffle(order)
    budget = kv_bytes_per_token(loaded) * 4 * 24  # 24 pages of 4 tokens: far less than the batch needs
    # host-resident sequences stream their KV through the staging pool, as on a GPU
    engine = Engine(loaded, page_size=4, kv_budget_bytes=budget, b_attn=2, b_moe=5, stream_host_kv=True)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch, order))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["yields"] > 0
    assert metrics["staged_decode_batches"] > 0, "no host-resident sequence decoded through the staging pool"


@pytest.mark.parametrize("mode,b_attn,b_moe", [("coroutine", 256, 8192), ("coroutine", 1, 3),
                                                ("lockstep", 256, 8192)])
def test_batch_shapes_do_not_change_greedy_tokens(moe_case, mode, b_attn, b_moe):
    loaded, batch, expected = moe_case
    engine = Engine(loaded, mode=mode, b_attn=b_attn, b_moe=b_moe, page_size=4)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["staged_decode_batches"] == 0 and metrics["yields"] == 0  # everything fit on the device
    if mode == "coroutine" and b_moe == 3:
        assert 0 < metrics["max_ffn_tokens"] <= 3


@pytest.mark.parametrize("mode", ["coroutine", "lockstep"])
def test_tight_kv_budget_evicts_and_restores_without_changing_tokens(moe_case, mode):
    loaded, batch, expected = moe_case
    budget = kv_bytes_per_token(loaded) * 4 * 32
    engine = Engine(loaded, mode=mode, page_size=4, kv_budget_bytes=budget, b_attn=3, b_moe=16)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["yields"] > 0 and metrics["bytes_moved"] > 0
    if mode == "lockstep":  # preempted sequences wait in host pages; they never decode from there
        assert metrics["restores"] > 0 and metrics["staged_decode_batches"] == 0
    else:  # yielded sequences keep decoding from host pages (in place: the CPU default)
        assert metrics["staged_decode_batches"] > 0


def test_a_sequence_larger_than_the_staging_pool_waits_in_host_pages_for_a_device_restore(moe_case):
    """README (stream_host_kv=True): host-resident sequences stream through a staging pool (one layer's pages); one
    whose KV outgrows it is not staged (it could not be gathered there) but waits in host pages until device pages
    free up, and is restored: the tokens are the reference's."""
    loaded, batch, expected = moe_case
    page = kv_bytes_per_token(loaded) * 4
    engine = Engine(loaded, page_size=4, kv_budget_bytes=page * 20, staging_fraction=0.1, b_attn=3, b_moe=16,
                    stream_host_kv=True)
    stage_pages = engine.kv.stage.num_pages
    assert 0 < stage_pages < engine.kv.pages_needed(max(map(len, batch)) + MAX_TOKENS)
    waiting, staged_sizes = set(), []

    def observe(plan):
        staged = plan.decode.staged_groups if plan.decode else []
        staged_sizes.extend(engine.kv.pages_needed(s.kv_len) for group in staged for s in group)
        waiting.update(s.seq_id for s in engine.scheduler.suspended.values()
                       if engine.kv.pages_needed(s.kv_len + 1) > stage_pages)

    engine.observe_steps(observe)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert waiting and metrics["restores"] > 0  # some waited in host pages, and came back to the device
    assert staged_sizes and max(staged_sizes) <= stage_pages  # others streamed; none past the pool


@pytest.mark.parametrize("mode", ["coroutine", "lockstep"])
def test_a_host_pool_too_small_for_the_yields_recomputes_without_changing_tokens(moe_case, mode):
    loaded, batch, expected = moe_case
    page = kv_bytes_per_token(loaded) * 4
    engine = Engine(loaded, mode=mode, page_size=4, kv_budget_bytes=page * 16, host_kv_budget_bytes=page * 8,
                    b_attn=3, b_moe=16)
    completed = []  # as a bench's roofline reads the steps, after they ran
    engine.observe_steps(lambda plan: completed.extend(plan.prefill.completed if plan.prefill else []))
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["recomputes"] > 0 and metrics["yields"] > 0
    assert len(completed) == len(batch) + metrics["recomputes"]  # every prefill counted once it completed
    assert metrics["prefill_tokens_saved"] == 0  # the prompts share nothing (a recompute's own cached pages aside)
    assert metrics["prompt_tokens"] == sum(map(len, batch)) and metrics["recomputed_tokens"] > metrics["recomputes"]


@pytest.mark.parametrize("stream_host_kv", [False, True])
def test_host_resident_sequences_decode_in_the_resident_micro_batches_where_the_tiers_are_one_memory(
        moe_case, stream_host_kv):
    """A CPU engine's host pages are its device memory: sequences yielded to them decode in the same attention
    micro-batches as the resident ones (one per step here), not in micro-batches of their own as when their KV
    streams through the staging pool."""
    loaded, batch, expected = moe_case
    budget = kv_bytes_per_token(loaded) * 4 * 32
    engine = Engine(loaded, page_size=4, kv_budget_bytes=budget, b_attn=len(batch), b_moe=64,
                    stream_host_kv=stream_host_kv)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["yields"] > 0 and metrics["staged_decode_batches"] > 0
    if stream_host_kv:
        assert metrics["decode_micro_batches"] == metrics["decode_steps"] + metrics["staged_decode_batches"]
    else:
        assert metrics["decode_micro_batches"] == metrics["decode_steps"]


def test_chunked_prefill_mixed_into_decode_steps_keeps_greedy_tokens(arch_case):
    loaded, batch, expected = arch_case
    # 7 prompt tokens per step: the 9-, 12-, 17- and 30-token prompts are prefilled in chunks, and at most 3
    # sequences decode at once, so refills keep landing in steps that also decode
    engine = Engine(loaded, page_size=4, max_prefill_tokens=7, max_num_seqs=3)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["chunked_prefills"] > 0 and metrics["mixed_steps"] > 0


@pytest.mark.parametrize("mode,mixed", [("lockstep", True), ("coroutine", False)])
def test_chunked_prefill_in_lockstep_and_without_mixed_steps_keeps_greedy_tokens(moe_case, mode, mixed):
    loaded, batch, expected = moe_case
    engine = Engine(loaded, mode=mode, mixed_steps=mixed, page_size=4, max_prefill_tokens=7, max_num_seqs=3)
    assert in_order(tokens_by_id(engine.generate(greedy_requests(batch))), len(batch)) == expected
    metrics = engine.metrics()
    assert metrics["chunked_prefills"] > 0
    assert (metrics["mixed_steps"] > 0) is mixed
    assert metrics["prefill_step_seconds"] > 0 and metrics["decode_step_seconds"] > 0  # timed apart


def test_n_samples_share_one_prefill(moe_case):
    loaded, batch, expected = moe_case
    engine = Engine(loaded, page_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    results = engine.generate(greedy_requests(batch, params=params))
    for result, want in zip(results, expected):
        assert [o.index for o in result.outputs] == [0, 1, 2]
        assert all(o.token_ids == want for o in result.outputs)
    assert engine.metrics()["prefill_steps"] == 1


def test_disaggregated_prefill_then_decode_matches_reference(moe_case):
    loaded, batch, expected = moe_case
    prefill = Engine(loaded, page_size=4, max_prefill_tokens=8)  # long prompts exported after several chunks
    decode = Engine(loaded, page_size=8, kv_budget_bytes=kv_bytes_per_token(loaded) * 8 * 16, b_attn=2)
    exported = PrefillExporter(prefill).prefill(greedy_requests(batch))
    assert prefill.metrics()["chunked_prefills"] > 0
    geometry = prefill.kv.geometry
    assert [o.kv.numel() for o in exported.outputs] == [geometry.packed_nbytes(len(p)) for p in batch]
    # every output's KV is its slice of the one batch buffer, back to back in request order
    assert exported.kv_buffer.numel() == sum(o.kv.numel() for o in exported.outputs)
    assert [o.kv.data_ptr() - exported.kv_buffer.data_ptr() for o in exported.outputs] == [
        sum(o.kv.numel() for o in exported.outputs[:i]) for i in range(len(batch))]
    for prefilled in exported.outputs:
        decode.add_prefilled(prefilled)
    assert decode.kv.bytes_moved >= exported.kv_buffer.numel()
    got = {}
    while decode.has_unfinished():
        got.update(tokens_by_id(decode.step()))
    assert in_order(got, len(batch)) == expected


def test_prefilled_samples_that_fit_the_device_one_at_a_time_land_together_on_the_host(moe_case):
    """n=3 samples of a 30-token prompt need 4 pages of 8 each: the device's 10 hold one or two. All three used to
    land on the device and the third sample's pages ran out, failing the engine."""
    loaded, batch, expected = moe_case
    prefill = Engine(loaded, page_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    [prefilled] = PrefillExporter(prefill).prefill([Request("r", prompt_token_ids=batch[4], sampling=params)]).outputs
    decode = Engine(loaded, page_size=8, kv_budget_bytes=kv_bytes_per_token(loaded) * 8 * 10, prefix_caching=False)
    assert decode.kv.device.num_pages == 10
    decode.add_prefilled(prefilled)
    assert decode.scheduler.suspended and not decode.scheduler.running  # on the host, restored as room allows
    results = []
    while decode.has_unfinished():
        results += decode.step()
    assert [o.token_ids for o in results[0].outputs] == [expected[4]] * 3


def test_a_prefilled_prompt_this_model_could_not_have_made_is_refused_and_the_engine_goes_on(moe_case):
    """First tokens or prompt ids past the vocabulary (a prefill engine of a larger vocabulary and the same KV layout)
    were adopted, and the next step failed with an IndexError: every request of the decode actor, and every later
    batch on it. An empty prompt, or no first-token logprobs for a request asking for logprobs (one logprob short,
    misaligned), were adopted silently."""
    from dataclasses import replace

    from batchgen.engine import InvalidRequestError

    loaded, batch, expected = moe_case
    vocab = loaded.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    [good] = PrefillExporter(Engine(loaded, page_size=8)).prefill(
        [Request("r", prompt_token_ids=batch[1], sampling=params)]).outputs
    prompt = list(good.request.prompt_token_ids)
    cases = [
        (replace(good, first_token_ids=[vocab]),
         f"the prefilled prompt's first tokens: token {vocab} is outside the vocabulary [0, {vocab})"),
        (replace(good, request=replace(good.request, prompt_token_ids=[*prompt[:-1], vocab + 3])),
         f"token {vocab + 3} is outside the vocabulary"),
        (replace(good, request=replace(good.request, prompt_token_ids=[]), kv=good.kv[:0]), "prompt is empty"),
        (replace(good, first_logprobs=[None]), "the prefilled prompt carries no first-token logprobs"),
    ]
    decode = Engine(loaded, page_size=8)
    decode.add_request(Request("other", prompt_token_ids=batch[0], sampling=GREEDY))
    for bad, named in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(named)):
            decode.add_prefilled(bad)
    decode.add_prefilled(good)
    results = {r.request_id: r for r in decode.stream([])}
    assert results["other"].outputs[0].token_ids == expected[0]
    assert results["r"].outputs[0].token_ids == expected[1] and len(results["r"].outputs[0].logprobs) == MAX_TOKENS


def test_samples_forked_beside_their_prompt_share_its_whole_pages_in_admission_too(moe_case):
    """n=3 of a 30-token prompt: its 4 pages of 8 and one more per other sample fit the device's 10, its whole
    pages shared by the forks. Admission counted a whole copy per sample (12 pages) and refused the request, and a
    fork asked room for the whole prompt (else host pages or a recompute) though it takes one page."""
    loaded, batch, expected = moe_case
    engine = Engine(loaded, mode="lockstep", page_size=8, kv_budget_bytes=kv_bytes_per_token(loaded) * 8 * 10)
    assert engine.kv.device.num_pages == 10
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=3)
    [result] = engine.generate([Request("r", prompt_token_ids=batch[4], sampling=params)])
    assert len(batch[4]) == 30 and [o.token_ids for o in result.outputs] == [expected[4][:3]] * 3
    assert engine.kv.migrations == {"to_host": 0, "to_device": 0} and engine.metrics()["recomputes"] == 0


def test_a_prefilled_prompt_whose_samples_fit_only_sharing_its_pages_is_adopted_not_refused(moe_case):
    """n=3 of a 25-token prompt: a copy of its 4 pages of 8 per sample (12) fits neither the decode engine's 8 device
    pages nor its one host page, so the row was refused, though one engine runs it (4 pages and one per other
    sample). It is prefilled again here (the prefill engine's first tokens kept) and holds none of the hand-off's
    KV meanwhile (a view of the whole batch's buffer)."""
    loaded, batch, expected = moe_case
    prompt = (batch[4] * 2)[:25]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    request = Request("r", prompt_token_ids=prompt, sampling=params)
    [alone] = Engine(loaded, page_size=8).generate([request])
    [prefilled] = PrefillExporter(Engine(loaded, page_size=8)).prefill([request]).outputs
    page = kv_bytes_per_token(loaded) * 8
    decode = Engine(loaded, page_size=8, kv_budget_bytes=page * 8, host_kv_budget_bytes=page, prefix_caching=False)
    decode.add_prefilled(prefilled)
    assert decode._requests["r"].prefilled.kv.numel() == 0 and decode.metrics()["handoff_prefills"] == 1
    results = []
    while decode.has_unfinished():
        results += decode.step()
    assert [o.token_ids for o in results[0].outputs] == [o.token_ids for o in alone.outputs]


def test_a_prefill_exporters_duplicate_request_id_fails_in_its_own_place(moe_case):
    """Outputs were matched to requests by id: both came back as the second prompt's, and the first's slice of
    the batch buffer was never written."""
    loaded, batch, _ = moe_case
    exported = PrefillExporter(Engine(loaded, page_size=4)).prefill(
        [Request("x", prompt_token_ids=batch[0]), Request("x", prompt_token_ids=batch[1])]).outputs
    assert exported[0].request.prompt_token_ids == batch[0] and exported[0].kv_start == 0
    assert "duplicate request_id 'x'" in exported[1].error


def test_prefilled_prompts_finding_no_room_in_either_pool_are_prefilled_again_when_their_turn_comes(moe_case):
    """A decode engine handed more prefilled prompts than its device and host pages hold keeps them waiting and
    prefills each itself when room frees (the first tokens as the prefill engine drew them); it used to fail
    when the host pool ran out."""
    loaded, batch, expected = moe_case
    exported = PrefillExporter(Engine(loaded, page_size=4)).prefill(greedy_requests(batch))
    page = kv_bytes_per_token(loaded) * 4
    decode = Engine(loaded, page_size=4, kv_budget_bytes=page * 14, host_kv_budget_bytes=page * 4)
    for prefilled in exported.outputs:
        decode.add_prefilled(prefilled)
    assert decode.metrics()["handoff_prefills"] > 0
    got = {}
    while decode.has_unfinished():
        got.update(tokens_by_id(decode.step()))
    assert in_order(got, len(batch)) == expected


def test_a_prompt_prefilled_again_here_can_move_once_its_prefill_is_done():
    """A hand-off whose carried prefix this engine did not cache is prefilled here again; it stayed unmovable
    (MIGRATE, PARTITION) for its whole life, where only its re-prefill should keep it."""
    demo = load_model("tiny-moe")
    shared = list(range(100, 132))
    requests = [Request(str(i), shared + [200 + i, 201 + i], sampling=SamplingParams(max_tokens=50, ignore_eos=True))
                for i in range(3)]
    exported = PrefillExporter(Engine(demo, page_size=8)).prefill(requests)
    assert [o.kv_start for o in exported.outputs] == [0, 32, 32]  # the later two leave the shared prefix out
    decode = Engine(demo, page_size=8, prefix_caching=False)  # so it cannot find it: they are prefilled again
    for output in exported.outputs:
        decode.add_prefilled(output)
    for _ in range(5):
        decode.step()
    assert decode.metrics()["handoff_prefills"] > 0
    assert decode.export_request("1") is not None and decode.export_request("2") is not None


def test_a_hand_off_this_engine_cannot_finish_is_refused_by_name():
    """Before, a hand-off with fewer first tokens than samples was adopted and never finished (samples left pending),
    and one longer than this engine's context was adopted past it."""
    import dataclasses

    from batchgen.engine import InvalidRequestError

    demo = load_model("tiny-moe")
    request = Request("h", list(range(10, 40)), sampling=SamplingParams(max_tokens=4, n=2, temperature=0.5, seed=1))
    [output] = PrefillExporter(Engine(demo, page_size=8)).prefill([request]).outputs
    short = dataclasses.replace(output, first_token_ids=output.first_token_ids[:1])
    with pytest.raises(InvalidRequestError, match="carries 1 first tokens and 2 logprobs for n = 2 samples"):
        Engine(demo, page_size=8).add_prefilled(short)
    with pytest.raises(InvalidRequestError, match=r"prompt has 30 tokens, over the limit of 19 \(context length 20\)"):
        Engine(demo, page_size=8, max_model_len=20).add_prefilled(output)
    decode = Engine(demo, page_size=8)
    decode.add_prefilled(output)  # the whole hand-off is adopted and finishes
    results = list(decode.stream([]))
    assert [len(c.token_ids) for c in results[0].outputs] == [4, 4]


def test_a_sample_whose_fork_finds_no_pages_takes_its_first_token_and_is_prefilled_again(moe_case, monkeypatch):
    loaded, batch, expected = moe_case
    engine = Engine(loaded, page_size=4)
    monkeypatch.setattr(engine.scheduler, "fork_location", lambda parent, planned: None)  # every pool full
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    [result] = engine.generate([Request("r", prompt_token_ids=batch[1], sampling=params)])
    assert [o.token_ids for o in result.outputs] == [expected[1]] * 2
    assert engine.metrics()["recomputes"] == 1 and engine.metrics()["prefill_steps"] == 2


def test_seeded_sampling_is_independent_of_batch_composition(moe_case):
    loaded, batch, _ = moe_case
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = Engine(loaded, page_size=4).generate([Request("x", prompt_token_ids=batch[2], sampling=params)])
    crowd = [Request(f"o{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=7))
             for i, p in enumerate(batch)]
    mixed = Engine(loaded, page_size=4, b_attn=2, seed=99).generate(
        crowd[:3] + [Request("x", prompt_token_ids=batch[2], sampling=params)] + crowd[3:])
    together = {r.request_id: r for r in mixed}
    assert together["x"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other_seed = Engine(loaded, page_size=4).generate(
        [Request("x", prompt_token_ids=batch[2], sampling=SamplingParams(
            temperature=0.9, top_p=0.9, top_k=50, seed=4321, max_tokens=MAX_TOKENS, ignore_eos=True))])
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_results_stream_as_sequences_finish(moe_case):
    loaded, batch, _ = moe_case
    engine = Engine(loaded, page_size=4)
    requests = [Request(f"r{i}", prompt_token_ids=p,
                        sampling=SamplingParams(temperature=0.0, max_tokens=2 + 3 * (len(batch) - i), ignore_eos=True))
                for i, p in enumerate(batch)]
    finished = [r.request_id for r in engine.stream(requests)]
    assert finished == [f"r{i}" for i in reversed(range(len(batch)))]
    metrics = engine.metrics()
    assert metrics["generated_tokens"] == sum(2 + 3 * (len(batch) - i) for i in range(len(batch)))
    assert metrics["completion_time_p50"] <= metrics["completion_time_p99"]
    assert metrics["mean_expert_batch"] > metrics["mean_decode_expert_batch"] > 0  # prefill batches are larger
    assert sum(metrics["expert_histogram"]) > 0


@pytest.mark.parametrize("options,named", [
    (dict(seed=2**64), "seed must be an integer in [0, 2^63 - 1]"),  # was: torch's unnamed overflow in the engine
    (dict(kv_budget_bytes=2**70), "kv_budget_bytes must be an integer in [1, 2^63 - 1]"),
    (dict(device="cuda:abc"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),  # torch refused it in the actor
    (dict(device="cuda:-1"), "device must be"),
    (dict(stream_host_kv=0), "stream_host_kv must be true, false or null"),  # 0 == False passed, then became True
    (dict(weight_streaming="layer"), "weight_streaming 'layer' streams weights within device_memory_bytes"),
])
def test_engine_options_that_could_not_run_as_given_are_refused_by_name(options, named):
    from batchgen.engine import EngineConfig

    with pytest.raises(ValueError, match=re.escape(named)):
        EngineConfig(**options)


@pytest.mark.parametrize("mode", ["coroutine", "lockstep"])
def test_kv_budgets_of_no_page_a_sequence_could_run_in_are_refused(moe_case, mode):
    """Budgets holding no page built an engine whose every request then failed as not fitting: a job reported them
    row by row and exited 0. A device budget that is all staging pool still runs (coroutine mode decodes from the
    host pages through it)."""
    loaded, batch, expected = moe_case
    page = kv_bytes_per_token(loaded) * 4
    tight = dict(mode=mode, page_size=4, max_num_seqs=4, b_attn=4, b_moe=64, refill_threshold=0.5)
    with pytest.raises(ValueError, match=r"the KV budgets \(engine options kv_budget_bytes 1 and host_kv_budget_bytes "
                                         rf"1, given or planned\) hold no page of 4 tokens \({page} bytes\)"):
        Engine(loaded, kv_budget_bytes=1, host_kv_budget_bytes=1, staging_fraction=0.25, **tight)
    if mode == "coroutine":
        staged = Engine(loaded, kv_budget_bytes=page * 20, host_kv_budget_bytes=page * 40, staging_fraction=1.0,
                        stream_host_kv=True, **tight)
        assert staged.kv.device.num_pages == 0
        results = staged.generate(greedy_requests(batch[:3]))
        assert [r.outputs[0].token_ids for r in results] == expected[:3]


def test_a_max_model_len_past_the_models_context_is_refused(moe_case):
    """It was clamped to the model's silently (the config still said the larger): vLLM refuses it."""
    loaded = moe_case[0]
    with pytest.raises(ValueError, match=rf"max_model_len \(1000000\) is more than the model's context length "
                                         rf"\({loaded.max_model_len}\)"):
        Engine(loaded, max_model_len=1_000_000)
    assert Engine(loaded, max_model_len=loaded.max_model_len, kv_budget_bytes=8 << 20, host_kv_budget_bytes=8 << 20,
                  max_num_seqs=4, b_attn=4, b_moe=64, refill_threshold=0.5, staging_fraction=0.25).max_model_len \
        == loaded.max_model_len


def test_kv_pools_the_machine_cannot_map_are_a_memory_error_naming_the_budgets(moe_case):
    """A host budget past the machine failed the constructor with mmap's bare "[Errno 12] Cannot allocate memory".
    256 TiB: past x86-64's 128 TiB of user address space, whatever the kernel's overcommit policy."""
    loaded = moe_case[0]
    with pytest.raises(MemoryError, match=r"the KV pools of engine options kv_budget_bytes \(8388608\) and "
                                          r"host_kv_budget_bytes \(281474976710656\) could not be allocated"):
        Engine(loaded, page_size=4, kv_budget_bytes=8 << 20, host_kv_budget_bytes=1 << 48, staging_fraction=0.25,
               max_num_seqs=4, b_attn=4, b_moe=64, refill_threshold=0.5)
