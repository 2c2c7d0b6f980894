"""One engine over two ranks (gloo, one process each): data-parallel attention with expert-parallel MoE, and
tensor parallelism. Greedy and seeded tokens equal the single-process engine's, under KV eviction, while (expert
parallel) a rank left without sequences keeps serving its experts; each rank loads only its own experts, or heads
and columns; bad group shapes fail with the rank's reason; a Ray job's BatchGen actor runs such an engine."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import subprocess
import sys
import time

import pytest
import torch
from pipeline_helpers import ENGINE, SAMPLING, engine_outputs, read_output, workload, write_input
from tiny_models import kv_bytes_per_token, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig, PrefillExporter, Request, SamplingParams
from batchgen.engine.metrics import completion_quantiles
from batchgen.engine.models.layers import FusedExperts
from batchgen.engine.parallel import group_engine
from batchgen.engine.parallel.group_engine import (
    SUMMED_METRICS,
    GroupEngine,
    merge_rank_metrics,
    rank_spec,
    start_engine_group,
)
from batchgen.engine.parallel.rank_group import check_rank_devices, device_of_rank, free_address, use_device
from batchgen.engine.parallel.rank_worker import GroupStartError, RankSpec, common_budgets
from batchgen.engine.quantile_sketch import QuantileSketch
from batchgen.engine.reference import ReferenceRunner
from batchgen.operators.engine_factory import load_engine
from batchgen.pipelines.cli import summary_text
from batchgen.pipelines.pipeline import JobConfig, JobError, run_job

LENGTHS = (3, 9, 17, 5, 30, 12, 7, 21)
LONG, SHORT = 40, 16


def requests(batch: list[list[int]]) -> list[Request]:
    """The first prompt long (its rank keeps decoding after the other rank has finished), the rest short; every
    third one seeded sampling."""
    out = []
    for i, ids in enumerate(batch):
        seeded = i % 3 == 2
        params = SamplingParams(temperature=0.9 if seeded else 0.0, seed=i if seeded else None,
                                max_tokens=LONG if i == 0 else SHORT, ignore_eos=True)
        out.append(Request(f"r{i}", prompt_token_ids=ids, sampling=params))
    return out


def check_tokens(loaded, batch: list[list[int]], results, single) -> None:
    """The group's tokens equal the single-process engine's, and greedy ones the reference runner's."""
    assert all(r.error is None for r in results)
    tokens = [r.outputs[0].token_ids for r in results]
    assert tokens == [r.outputs[0].token_ids for r in single]
    greedy = [i for i in range(len(batch)) if i % 3 != 2]
    reference = ReferenceRunner(loaded.model).generate([batch[i] for i in greedy], max_new_tokens=LONG)
    assert [tokens[i] for i in greedy] == [ref[: len(tokens[i])] for i, ref in zip(greedy, reference)]


def single_process_case(arch: str, directory, pages: int, **overrides):
    """A tiny checkpoint of `arch`, its prompts, engine options with a device KV pool of `pages` pages of 4 tokens
    (MoE calls of at most 5 tokens), and what one process's engine generates with them."""
    save_tiny_checkpoint(arch, directory, **overrides)
    loaded = load_model(str(directory))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    options = dict(page_size=4, kv_budget_bytes=kv_bytes_per_token(loaded) * 4 * pages, b_attn=2, b_moe=5)
    return loaded, batch, options, Engine(loaded, **options).generate(requests(batch))


@pytest.mark.parametrize("arch,partition", [("mixtral", False), ("qwen3_moe", True), ("deepseek_v3", True)])
def test_two_rank_expert_parallel_engine_gives_the_single_engines_tokens(arch, partition, tmp_path):
    # 12 pages per rank, far less than its sequences need: evictions; the ranks' MoE call counts differ step by
    # step and the shorter one pads
    loaded, batch, options, single = single_process_case(arch, tmp_path, pages=12)
    group = load_engine(str(tmp_path), ep_size=2, partition_stragglers=partition, **options)
    try:
        experts = [m for m in group.engine.model.modules() if isinstance(m, FusedExperts)]
        assert experts and all(m.num_local_experts * 2 == m.num_experts for m in experts)
        results = group.generate(requests(batch))
        metrics = group.metrics()
        again = requests(batch)[1]
        group.add_request(again)
        group.add_request(again)  # the same id again, wherever the first one went: an error Result
        repeated = [r for _ in range(100) if group.has_unfinished() for r in group.step()]
    finally:
        group.close()
    check_tokens(loaded, batch, results, single)
    assert sorted(str(r.error) for r in repeated) == ["None", "duplicate request_id 'r1'"]
    ranks = metrics["ranks"]
    assert all(rank["finished_requests"] > 0 for rank in ranks)  # both ranks attended to sequences of their own
    assert ranks[1]["frozen_objects"] > 10_000  # the rank process froze its imports' heap (a test process does not)
    assert metrics["finished_requests"] == len(batch) and metrics["yields"] > 0
    # every rank's routing counted (the group's histogram and peaks were rank 0's alone)
    assert metrics["expert_histogram"] == [sum(c) for c in zip(*(rank["expert_histogram"] for rank in ranks))]
    assert metrics["peak_active"] == sum(rank["peak_active"] for rank in ranks) > ranks[0]["peak_active"]
    assert metrics["moe_calls"] == max(rank["moe_calls"] for rank in ranks)
    times = QuantileSketch()  # the quantiles are of every rank's requests (they were rank 0's alone)
    times.add_many([r.finished_at - r.submitted_at for r in results])
    assert {k: metrics[k] for k in completion_quantiles(times)} == completion_quantiles(times)
    if partition:  # the long first request was left alone at the end: every rank decoded it
        assert metrics["partitions"] >= 1 and metrics["partitioned_steps"] > 0, metrics
    else:  # the rank without it only served its experts meanwhile
        assert metrics["partitions"] == 0 and sum(rank["expert_only_steps"] for rank in ranks) > 0, metrics


def expert_group(directory, expert_columns: bool, **options) -> GroupEngine:
    """A 2-rank expert-parallel engine whose ranks also hold half of every expert's columns (`expert_columns`, as
    CPU ranks do) or only their own experts (as ranks on devices of their own)."""
    config = EngineConfig.from_kwargs(ep_size=2, **options)
    spec = rank_spec(functools.partial(load_model, str(directory)), config, threads=1)
    assert spec.expert_columns  # what a CPU group chooses
    return start_engine_group(dataclasses.replace(spec, expert_columns=expert_columns))


# GQA: KV split by heads; MLA: latent replicated. Experts: every routed expert's columns split over the ranks, or
# each rank's own experts whole
@pytest.mark.parametrize("arch,expert_columns", [("mixtral", True), ("deepseek_v3", True), ("mixtral", False)])
def test_a_straggler_partitions_over_every_rank_moves_back_for_new_work_and_keeps_its_tokens(arch, expert_columns,
                                                                                          tmp_path):
    """A lone request decodes on both ranks (half the heads each; half of every routed expert's columns, or the
    experts on their own ranks); a request arriving part-way moves it back to one rank with its KV heads joined;
    once that one finishes it partitions again."""
    loaded, batch, options, single = single_process_case(arch, tmp_path, pages=24)
    work = requests(batch)[:3]  # r0 greedy, 40 tokens; r1 greedy and r2 seeded, 16 tokens
    # the experts in the checkpoint's layout (an engine packs its model's for the CPU kernel)
    logical = load_model(str(tmp_path)).model.state_dict()
    single = Engine(loaded, **options).generate(work)
    group = expert_group(tmp_path, expert_columns, **options)
    results = []
    try:
        view = group.rank_engines.model  # half of the vocabulary's head rows on each rank
        assert view.lm_head.weight.shape[0] * 2 == loaded.model.vocab_size and view.gather_vocab is not None
        own = [m for m in group.engine.model.modules() if isinstance(m, FusedExperts)]
        shares = [m for m in view.modules() if isinstance(m, FusedExperts)]
        assert all(m.num_local_experts * 2 == m.num_experts for m in own)  # expert parallel: half the experts
        if expert_columns:  # the partition: every expert, half of each one's columns (rank 0: the first halves)
            full = {k: v for k, v in logical.items() if k.endswith("experts.down_proj")}
            for name, down in full.items():
                half = down.shape[2] // 2
                gate_up = logical[name.replace("down_proj", "gate_up_proj")]
                mine = torch.cat([gate_up[:, :half], gate_up[:, 2 * half: 3 * half]], dim=1)
                assert torch.equal(view.get_parameter(name.replace("down_proj", "gate_up_proj")), mine), name
                assert torch.equal(view.get_parameter(name), down[:, :, :half]), name
            assert full and len(shares) == len(own) and all(m.num_local_experts == m.num_experts for m in shares)
        else:  # each rank's own experts, whole
            assert all(m.gate_up_proj is o.gate_up_proj and m.down_proj is o.down_proj for m, o in zip(shares, own))
        group.add_request(work[0])
        while group.partitions == 0:
            results += group.step()
        steps = 0
        while steps < 5:  # decoding on both ranks
            results += group.step()
            steps += 1
        part_way = group.metrics()
        for request in work[1:]:
            group.add_request(request)  # r0 moves back to one rank first
        while group.has_unfinished():
            results += group.step()
        metrics = group.metrics()
    finally:
        group.close()
    assert part_way["partitions"] == 1 and part_way["partitioned_steps"] >= steps
    assert metrics["partitions"] == 2 and metrics["finished_requests"] == 3, metrics  # r0 alone again at the end
    assert metrics["migrated_out"] >= 2 and metrics["migrated_in"] >= 1  # r0 out of a rank twice, back once
    by_id = {r.request_id: r for r in results}
    check_tokens(loaded, batch[:3], [by_id[r.request_id] for r in work], single)


def test_a_rank_that_runs_out_of_requests_takes_some_of_the_busiest_ranks(tmp_path):
    """The first request is placed as 32 tokens of work but stops at its first token (every token is a stop
    token); the other rank holds four, one at a time: the idle rank takes waiting ones, tokens unchanged."""
    save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(5, 9, 7, 11, 6))
    stop_at_once = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=list(range(256)))
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    work = [Request(f"r{i}", ids, sampling=stop_at_once if i == 0 else short) for i, ids in enumerate(batch)]
    single = load_engine(str(tmp_path), max_num_seqs=1).generate(work)
    group = load_engine(str(tmp_path), ep_size=2, max_num_seqs=1)
    try:
        results = group.generate(work)
        ranks = group.metrics()["ranks"]
    finally:
        group.close()
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in single]
    assert len(results[0].outputs[0].token_ids) == 1
    assert ranks[0]["migrated_in"] == ranks[1]["migrated_out"] > 0


def test_a_group_gives_movable_requests_from_a_rank_that_can_spare_them(tmp_path):
    """A rank keeps its last request: asked of the busiest rank alone (one long request), a group whose other rank
    held four gave none, and the job's balancer asked it again every quarter second with nothing moving."""
    save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(5, 6, 7, 8, 9))
    group = load_engine(str(tmp_path), ep_size=2, page_size=4, b_attn=4, b_moe=16)
    try:
        group.add_request(Request("big", batch[0], sampling=SamplingParams(temperature=0, max_tokens=200,
                                                                           ignore_eos=True)))
        for i in range(1, 5):
            group.add_request(Request(f"s{i}", batch[i], sampling=SamplingParams(temperature=0, max_tokens=30,
                                                                                 ignore_eos=True)))
        group.step()
        group.step()
        assert group._where["big"] != group._where["s1"] == group._where["s4"]  # the long one alone on its rank
        movable = group.movable_requests(100)
    finally:
        group.close()
    assert movable and set(movable) <= {"s1", "s2", "s3", "s4"}


def test_a_request_that_ends_a_partition_goes_to_the_other_rank_than_the_straggler(tmp_path):
    """The straggler moving back was not counted as queued work: the request that ended its partition was placed
    beside it, the other rank idle until a rebalance a step later moved one of them again."""
    save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(9, 5))
    group = load_engine(str(tmp_path), ep_size=2, page_size=4, b_attn=2, b_moe=5)
    try:
        group.add_request(Request("r0", batch[0], sampling=SamplingParams(temperature=0, max_tokens=30,
                                                                          ignore_eos=True)))
        while group.partitions == 0:
            group.step()
        group.step()
        group.add_request(Request("r1", batch[1], sampling=SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True)))
        queued = [[call.method for call in calls] for calls in group._calls]
        while group.has_unfinished():
            group.step()
        moved = group.metrics()["migrated_in"]
    finally:
        group.close()
    assert sorted(queued) == [["add_request"], ["import_request"]]
    assert moved == 1  # the straggler's way back, and nothing after


def decode_prefilled(group, exported) -> tuple[list, dict]:
    """Every prefilled row decoded by the group to its end: the results and the group's metrics (then closed)."""
    try:
        for prefilled in exported:
            group.add_prefilled(prefilled)
        results = []
        while group.has_unfinished():
            results += group.step()
        return results, group.metrics()
    finally:
        group.close()


def test_prefilled_rows_reach_a_group_with_their_own_kv_alone(tmp_path, monkeypatch):
    """Each row's KV is a view of its hand-off batch's buffer: queued in a round as it was, every row pickled the
    whole buffer (R rows of a B-byte batch: R x B bytes a round)."""
    save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(5, 9, 7, 11, 6))
    work = requests(batch)
    single = load_engine(str(tmp_path)).generate(work)
    exported = PrefillExporter(load_engine(str(tmp_path))).prefill(work).outputs
    group = load_engine(str(tmp_path), ep_size=2)
    place, sent = group._place, []

    def measured(request_id, sampling, method, payload, rank=None):
        sent.append(len(pickle.dumps(payload)))
        return place(request_id, sampling, method, payload, rank)

    monkeypatch.setattr(group, "_place", measured)
    results, _ = decode_prefilled(group, exported)
    results.sort(key=lambda r: int(r.request_id[1:]))
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in single]
    assert all(size < prefilled.kv.numel() + 4096 for size, prefilled in zip(sent, exported)), sent


def test_prefilled_rows_whose_kv_leaves_out_a_shared_prefix_go_to_the_rank_caching_it(tmp_path):
    """The prefill stage sends a batch's shared prefix once (later rows' KV starts after it): placed by load alone,
    rows reached the rank without it and were prefilled again there (2 of 5 rows on two ranks)."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    base = prompts(vocab_size=loaded.model.vocab_size, lengths=(16, 3, 5, 4, 6, 2))
    work = [Request(f"r{i}", base[0] + tail, sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            for i, tail in enumerate(base[1:])]
    options = {"page_size": 4, "b_attn": 4, "b_moe": 16}
    single = {r.request_id: r.outputs[0].token_ids for r in Engine(loaded, **options).generate(work)}
    exported = PrefillExporter(Engine(loaded, **options)).prefill(work).outputs
    assert [o.kv_start for o in exported] == [0, 16, 16, 16, 16]
    results, metrics = decode_prefilled(load_engine(str(tmp_path), ep_size=2, **options), exported)
    assert {r.request_id: r.outputs[0].token_ids for r in results} == single
    assert [rank["handoff_prefills"] for rank in metrics["ranks"]] == [0, 0] and metrics["prompt_tokens"] == 0


def test_a_prefix_is_found_on_the_rank_its_last_prompt_went_to_and_forgotten_past_the_capacity():
    from batchgen.engine.parallel.prefix_placement import PrefixPlacement

    placement = PrefixPlacement(page_size=4, capacity=4)
    placement.placed(list(range(10)), rank=1)  # two whole pages: 0-3, 0-7
    assert placement.rank_of(list(range(8)) + [99], 8) == placement.rank_of(list(range(4)) + [7, 7], 4) == 1
    assert placement.rank_of([0, 1, 2, 9], 4) is None and placement.rank_of(list(range(10)), 0) is None
    placement.placed(list(range(4)) + [5, 5, 5, 5], rank=0)  # the first page again, now on rank 0
    assert placement.rank_of(list(range(4)), 4) == 0 and placement.rank_of(list(range(8)), 8) == 1
    placement.placed([7] * 12, rank=1)  # three more pages: the oldest forgotten
    assert placement.rank_of(list(range(8)), 8) is None and placement.rank_of([7] * 12, 12) == 1


@pytest.mark.parametrize("arch,overrides", [("mixtral", {}), ("qwen3_moe", {"attention_bias": True}),
                                            ("deepseek_v3", {})])
def test_two_rank_tensor_parallel_engine_gives_the_single_engines_tokens(arch, overrides, tmp_path):
    """Every rank runs every sequence with half the heads (GQA: half the KV heads; MLA: the whole latent) and
    half of every MLP's and expert's columns; the bias of the summed o_proj counts once."""
    # 24 pages on every rank, far less than the batch needs: evictions
    loaded, batch, options, single = single_process_case(arch, tmp_path, pages=24, **overrides)
    group = load_engine(str(tmp_path), tp_size=2, **options)
    try:
        full_spec, spec = loaded.model.kv_spec(), group.engine.model.kv_spec()
        results = group.generate(requests(batch))
        metrics = group.metrics()
    finally:
        group.close()
    assert spec.num_kv_heads == (1 if arch == "deepseek_v3" else full_spec.num_kv_heads // 2)
    check_tokens(loaded, batch, results, single)
    assert [rank["finished_requests"] for rank in metrics["ranks"]] == [len(batch)] * 2  # every rank ran all
    assert metrics["yields"] > 0


def test_a_rank_loads_only_its_share_of_the_heads_and_columns(tmp_path):
    save_tiny_checkpoint("qwen2_moe", tmp_path)  # q/k/v biases, a gated shared expert, a dense layer
    full = load_model(str(tmp_path)).model.state_dict()
    shard = load_model(str(tmp_path), tensor_shard=(1, 2)).model.state_dict()
    attn, ffn = "layers.0.attn.self_attn.", "layers.0.ffn.mlp."
    assert torch.equal(shard[attn + "q_proj.weight"], full[attn + "q_proj.weight"][32:])  # heads 2, 3 of 4
    assert torch.equal(shard[attn + "q_proj.bias"], full[attn + "q_proj.bias"][32:])
    assert torch.equal(shard[attn + "k_proj.weight"], full[attn + "k_proj.weight"][16:])  # KV head 1 of 2
    assert torch.equal(shard[attn + "o_proj.weight"], full[attn + "o_proj.weight"][:, 32:])
    gate_up, inter = full[ffn + "experts.gate_up_proj"], 32  # [E, 2I, D]: the second half of each of gate, up
    assert torch.equal(shard[ffn + "experts.gate_up_proj"],
                       torch.cat([gate_up[:, inter // 2 : inter], gate_up[:, inter + inter // 2 :]], dim=1))
    assert torch.equal(shard[ffn + "experts.down_proj"], full[ffn + "experts.down_proj"][:, :, inter // 2 :])
    assert torch.equal(shard[ffn + "shared_expert.down_proj.weight"],
                       full[ffn + "shared_expert.down_proj.weight"][:, 24:])
    for name in (ffn + "gate.weight", ffn + "shared_expert_gate.weight", "embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(shard[name], full[name]), name  # routers, gates, embeddings and head stay whole


def test_a_rank_loads_only_its_share_of_the_experts(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    full = load_model(str(tmp_path)).model.state_dict()
    shard = load_model(str(tmp_path), expert_shard=(1, 2)).model
    for name, tensor in shard.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(tensor, full[name][2:4]), name  # 4 experts: rank 1 of 2 holds experts 2 and 3
        else:
            assert torch.equal(tensor, full[name]), name
    assert {m.first_expert for m in shard.modules() if isinstance(m, FusedExperts)} == {2}


def test_a_rank_can_load_its_columns_of_every_expert_alone(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    tensor_shard = load_model(str(tmp_path), tensor_shard=(1, 2)).model
    columns = load_model(str(tmp_path), tensor_shard=(1, 2), experts_only=True).model
    loaded = {name for name, p in columns.named_parameters() if not p.is_meta}
    assert loaded and all(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in loaded)
    for name in loaded:  # every expert, the second half of its columns
        assert torch.equal(columns.get_parameter(name), tensor_shard.get_parameter(name)), name
    attention = columns.layers[0].attn.self_attn  # the rest not loaded, nor cut: heads need not split
    assert attention.q_proj.weight.is_meta and attention.num_kv_heads == 2 and columns.kv_spec().num_kv_heads == 2


def test_a_group_whose_heads_do_not_split_over_its_ranks_runs_without_partitions(tmp_path):
    """4 experts over 4 ranks, but 2 KV heads: no partition (and no expert columns loaded), the same tokens."""
    save_tiny_checkpoint("mixtral", tmp_path)
    work = [Request(f"r{i}", ids, sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            for i, ids in enumerate(prompts(lengths=(5, 9)))]
    single = load_engine(str(tmp_path)).generate(work)
    group = load_engine(str(tmp_path), ep_size=4)
    try:
        assert "2 KV heads, which do not split over 4 ranks" in group.partition_error
        results = group.generate(work)
        assert group.metrics()["partitions"] == 0
    finally:
        group.close()
    assert [r.outputs[0].token_ids for r in results] == [r.outputs[0].token_ids for r in single]


def test_experts_that_do_not_split_over_the_ranks_fail_the_group_with_each_ranks_reason(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)  # 4 experts
    with pytest.raises(GroupStartError, match=r"engine rank 0: .*4 experts do not split evenly over 3 ranks") as info:
        load_engine(str(tmp_path), ep_size=3)
    assert "engine rank 2:" in str(info.value)


def test_heads_that_do_not_split_over_the_ranks_are_refused_at_load(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"has 4 attention heads, which do not split over 3 ranks"):
        load_model(str(tmp_path), tensor_shard=(1, 3))


def test_a_dead_rank_fails_the_group_at_once_and_close_leaves_nothing_behind(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    group = load_engine(str(tmp_path), ep_size=2)
    worker = group._workers[0]
    worker.kill()
    worker.wait()
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # gloo: the peer closed the connection
        group.generate(requests(prompts(lengths=(5, 9))))
    assert time.monotonic() - started < 60  # not the collectives' 5-minute timeout
    with pytest.raises(RuntimeError, match="the engine group is broken"):
        group.step()
    group.close()
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_before_joining_fails_the_group_at_once_naming_it(tmp_path, monkeypatch):
    """Rank 0 waited in the group's store for the whole collective timeout (5 minutes), then raised a store timeout
    that did not say which rank was gone, or why."""
    save_tiny_checkpoint("mixtral", tmp_path)
    real = subprocess.Popen

    def dying(args, **kwargs):  # a rank process that fails at start (an import error, say)
        return real([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"], **kwargs)

    monkeypatch.setattr(group_engine.subprocess, "Popen", dying)
    started = time.monotonic()
    with pytest.raises(GroupStartError, match=r"engine rank 1 exited with code 3 before joining the group"):
        load_engine(str(tmp_path), ep_size=2)
    assert time.monotonic() - started < 60
    assert not torch.distributed.is_initialized()


def test_a_group_whose_first_rounds_fail_leaves_no_rank_behind(tmp_path, monkeypatch):
    save_tiny_checkpoint("mixtral", tmp_path)
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def broken_partition_check(self, calls):
        raise RuntimeError("a rank refused the first call")

    monkeypatch.setattr(group_engine.subprocess, "Popen", Recorded)
    monkeypatch.setattr(GroupEngine, "_ask", broken_partition_check)
    with pytest.raises(RuntimeError, match="a rank refused the first call"):
        load_engine(str(tmp_path), ep_size=2)
    assert len(started) == 1 and started[0].poll() is not None  # killed: it waited for the next round forever
    assert not torch.distributed.is_initialized()


def test_the_ranks_of_a_group_size_their_kv_pools_alike():
    """Each rank reads its own free memory (as a power of two): two readings either side of one gave pools of
    different sizes, and tensor-parallel ranks must schedule every request alike."""
    mine = EngineConfig(kv_budget_bytes=1 << 30, host_kv_budget_bytes=1 << 33)
    agreed = common_budgets(mine, [(1 << 30, 1 << 33), (1 << 29, 1 << 34)])
    assert (agreed.kv_budget_bytes, agreed.host_kv_budget_bytes) == (1 << 29, 1 << 33)
    assert dataclasses.replace(agreed, kv_budget_bytes=1 << 30, host_kv_budget_bytes=1 << 33) == mine


def test_a_gpu_rank_makes_its_own_gpu_the_current_device(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for rank in range(3):
        use_device(device_of_rank(torch.device("cuda"), rank))
    use_device(device_of_rank(torch.device("cpu"), 1))
    assert chosen == [torch.device("cuda", r) for r in range(3)]  # none for a CPU rank
    assert [device_of_rank(torch.device("cuda:2"), rank) for rank in range(2)] == [torch.device("cuda", 2),
                                                                                   torch.device("cuda", 3)]


def test_a_group_on_more_gpus_than_the_process_sees_fails_before_any_rank_starts(monkeypatch):
    """A rank on an invalid device ordinal died at once, and rank 0 waited 5 minutes for it to join, then raised
    a store timeout that did not say why."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(group_engine.subprocess, "Popen", lambda *a, **k: pytest.fail("a rank was started"))
    spec = RankSpec(size=2, address=free_address(), load=None, config=EngineConfig(device="cuda:1", ep_size=2),
                    threads=1)
    with pytest.raises(GroupStartError, match=r"an engine of 2 ranks on cuda:1 needs CUDA devices 1..2; this process "
                                              r"sees 2"):
        start_engine_group(spec)
    check_rank_devices(torch.device("cuda:0"), 2)  # fits


def test_group_sizes_must_be_positive_and_not_both_set():
    with pytest.raises(ValueError, match=r"ep_size must be an integer in \[1, 2\^63 - 1\]"):
        EngineConfig(ep_size=0)
    with pytest.raises(ValueError, match="either expert parallel or tensor parallel, not both"):
        EngineConfig(ep_size=2, tp_size=2)


@pytest.mark.slow
def test_a_single_mode_job_with_a_two_rank_engine_gives_the_engines_tokens(ray_cluster, tiny_moe_dir, tmp_path):
    """`batchgen run --mode single --engine '{"ep_size": 2}'`: the BatchGen actor starts its second rank, rows come
    out in input order with the tokens of the engine alone, and the summary says the engine spans two ranks."""
    prompts = workload(12)
    write_input(str(tmp_path / "in"), prompts)
    summary = run_job(JobConfig(model=tiny_moe_dir, input=str(tmp_path / "in"), output=str(tmp_path / "out"),
                                mode="single", sampling_params=SAMPLING, engine={**ENGINE, "ep_size": 2},
                                batch_size=4, rows_per_block=4))
    rows = read_output(str(tmp_path / "out")).to_pylist()
    assert [r["id"] for r in rows] == list(range(12))
    assert [list(r["generated_token_ids"]) for r in rows] == engine_outputs(tiny_moe_dir, prompts)
    assert [(a.stage, a.ranks) for a in summary.engine_actors] == [("BatchGen", 2)]
    assert "BatchGen over 2 ranks constructed in" in summary_text(summary)


def test_a_split_job_refuses_a_multi_rank_engine():
    with pytest.raises(JobError, match="ep_size 2, tp_size 1: an engine over several ranks runs in single mode"):
        JobConfig(model="m", input="i", output="o", mode="disaggregated", engine={"ep_size": 2}).validate()


def test_the_stage_operators_refuse_the_ranks_their_stage_cannot_run():
    """Before any model loads: prefill runs one rank per actor, decode adopts whole heads' KV (no tp_size)."""
    from batchgen.operators import Decode, Prefill

    for ranks in ({"ep_size": 2}, {"tp_size": 2}):
        with pytest.raises(ValueError, match="the prefill stage runs one rank per engine actor"):
            Prefill("absent-model", **ranks)
    with pytest.raises(ValueError, match="the decode stage adopts prefilled KV of whole heads: tp_size > 1"):
        Decode("absent-model", tp_size=2)


def test_an_expert_parallel_groups_metrics_merge_its_ranks():
    rank = dict(generated_tokens=10, prompt_tokens=40, prefill_tokens_saved=8, prefix_query_tokens=40,
                prefix_hit_rate=0.2, moe_calls=12, decode_moe_calls=8, mean_expert_batch=2.0,
                mean_decode_expert_batch=1.0, expert_histogram=[3, 0, 5, 1], peak_active=4, peak_suspended=1,
                max_ffn_tokens=16, prefill_step_seconds=0.5, decode_step_seconds=2.0, decode_micro_batches=9,
                decode_graph_captures=1, decode_graph_replays=5, decode_graph_refusals=0, scheduler_share=0.1)
    other = {**rank, "prefill_tokens_saved": 0, "prefix_query_tokens": 60, "prefix_hit_rate": 0.0, "moe_calls": 11,
             "decode_moe_calls": 7, "mean_expert_batch": 4.0, "mean_decode_expert_batch": 2.0,
             "expert_histogram": [1, 2, 0, 0], "peak_active": 6, "max_ffn_tokens": 24, "decode_step_seconds": 2.5,
             "scheduler_share": 0.3}
    for key in set(SUMMED_METRICS) - set(rank):
        rank[key] = other[key] = 1
    merged = merge_rank_metrics([rank, other])
    assert merged["prefix_hit_rate"] == 8 / 100  # the summed counts' rate, not rank 0's 0.2
    assert merged["expert_histogram"] == [4, 2, 5, 1] and merged["peak_active"] == 10
    assert merged["moe_calls"] == 12 and merged["mean_expert_batch"] == (2.0 * 12 + 4.0 * 11) / 12
    assert merged["mean_decode_expert_batch"] == (1.0 * 8 + 2.0 * 7) / 8
    assert merged["max_ffn_tokens"] == 24 and merged["decode_step_seconds"] == 2.5
    assert merged["decode_micro_batches"] == 18 and merged["scheduler_share"] == 0.1
