"""The planner: cost-curve fitting, the layer DAG's critical path, the schedule replay against the engine,
memory limits, planned defaults against explicit configs, the stage split and `batchgen plan`."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig, Request, SamplingParams
from batchgen.engine.kv_budget import (
    MemoryLimits,
    available_memory_bytes,
    cgroup_room_bytes,
    device_room_bytes,
    meminfo_available_bytes,
    plan_kv_budget,
)
from batchgen.engine.kv_pool import PoolGeometry
from batchgen.engine.offload.memory_constrained import place_as_engine
from batchgen.engine.planner import PLANNED_FIELDS, CostCurves, LinearCost, WorkloadShape, plan_engine
from batchgen.engine.planner.cost_curves import HOST, TabulatedCost, nnls
from batchgen.engine.planner.layer_dag import LayerDag
from batchgen.engine.planner.planner import FIXED, curves_for, resolve_config
from batchgen.engine.planner.schedule_pricing import SchedulePricer
from batchgen.engine.planner.schedule_replay import replay_schedule
from batchgen.engine.planner.stage_split import plan_stage_split
from batchgen.engine.planner.step_model import StepShape, step_seconds
from batchgen.engine.reference import ReferenceRunner
from batchgen.pipelines.cli import main

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    save_tiny_checkpoint("mixtral", directory)
    return load_model(str(directory))


def synthetic_curves(**overrides) -> CostCurves:
    """Curves with round numbers, so a test knows every price."""
    values = dict(key="synthetic", device_type="cuda", device_free_bytes=1 << 34, host_free_bytes=1 << 35,
                  num_layers=4, num_experts=8, top_k=2, kv_bytes_per_token=4096,
                  decode_attention=LinearCost(("calls", "seqs", "kv_tokens"), (1e-4, 1e-6, 1e-8)),
                  prefill_attention=LinearCost(("calls", "seqs", "tokens", "pairs"), (2e-4, 1e-6, 2e-6, 1e-9)),
                  feed_forward=TabulatedCost(((1, 1e-3), (64, 2e-3), (1024, 8e-3), (8192, 5e-2))),
                  head=LinearCost(("calls", "rows"), (1e-4, 1e-6)),
                  host=LinearCost(HOST, (1e-3, 2e-5, 3e-4, 1e-5)),
                  copy_bytes_per_s=1e9)
    return CostCurves(**{**values, **overrides})


def test_linear_fit_recovers_a_known_curve_and_never_goes_negative():
    rng = random.Random(0)
    truth = (3e-4, 2e-6, 5e-9)
    rows = [{"calls": 1, "seqs": rng.randrange(1, 512), "kv_tokens": rng.randrange(64, 1 << 20)} for _ in range(40)]
    seconds = [sum(c * r[f] for c, f in zip(truth, ("calls", "seqs", "kv_tokens"))) for r in rows]
    fitted = LinearCost.fit(("calls", "seqs", "kv_tokens"), rows, seconds)
    assert fitted.coefficients == pytest.approx(truth, rel=1e-6)
    # a feature that only hurts the fit gets 0, not a negative cost that "pays back"
    x = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], dtype=torch.float64)
    coef = nnls(x, torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    assert coef[1] == 0.0 and coef[0] == pytest.approx(2.0)


def test_tabulated_cost_interpolates_and_extrapolates_its_points():
    cost = TabulatedCost(((1, 1.0), (3, 2.0), (7, 10.0)))
    assert cost.seconds(2) == pytest.approx(1.5)
    assert cost.seconds(5) == pytest.approx(6.0)
    assert cost.seconds(9) == pytest.approx(14.0)  # along the last segment
    assert cost.seconds(torch.tensor([1.0, 7.0])).tolist() == pytest.approx([1.0, 10.0])
    with pytest.raises(ValueError, match="increasing x"):
        TabulatedCost(((2, 1.0), (1, 2.0)))


def test_critical_path_of_hand_built_dags():
    dag = LayerDag()
    a = dag.add("attn0", 2.0, "compute")
    copy1 = dag.add("copy1", 5.0, "copy")
    dag.add("attn1", 1.0, "compute", after=(copy1,))  # waits for its copy, not only for attn0
    dag.add("moe", 3.0, "compute", after=(a,))
    assert dag.critical_path() == (9.0, ["copy1", "attn1", "moe"])
    quick = LayerDag()
    first = quick.add("attn0", 2.0, "compute")
    copy = quick.add("copy1", 0.5, "copy")  # hidden behind attn0
    quick.add("attn1", 1.0, "compute", after=(copy,))
    quick.add("moe", 3.0, "compute", after=(first,))
    assert quick.critical_path() == (6.0, ["attn0", "attn1", "moe"])
    assert LayerDag().critical_path() == (0.0, [])
    with pytest.raises(ValueError, match="unknown nodes"):
        LayerDag().add("x", 1.0, "compute", after=(3,))


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("streams_host", [False, True])
def test_vectorised_pricing_equals_each_step_dag(streams_host, device_type):
    rng = random.Random(1)
    # slow host link: groups attended in place on a GPU take their read over it in many steps, not in all
    curves = synthetic_curves(device_type=device_type, copy_bytes_per_s=5e10)
    steps = []
    for _ in range(30):
        prefill = tuple((0, rng.randrange(1, 300)) for _ in range(rng.randrange(0, 5)))
        resident = tuple(rng.randrange(1, 900) for _ in range(rng.randrange(40)))
        staged = tuple(tuple(rng.randrange(1, 500) for _ in range(rng.randrange(1, 9)))
                       for _ in range(rng.randrange(3)))
        steps.append(StepShape(prefill=prefill, resident=resident, staged=staged, completed=len(prefill),
                               migrated_bytes=rng.randrange(1 << 20), streams_host=streams_host))
    for b_attn, b_moe in ((4, 64), (16, 1024), (256, 8192)):
        vectorised = SchedulePricer(steps, curves).step_seconds(b_attn, b_moe).tolist()
        assert vectorised == pytest.approx([step_seconds(s, curves, b_attn, b_moe) for s in steps], rel=1e-9)


def test_execution_tells_configurations_that_compute_the_same_apart_from_those_that_do_not():
    curves = synthetic_curves()
    steps = [StepShape(prefill=((0, 100), (0, 60)), resident=(), staged=(), completed=2, migrated_bytes=0,
                       streams_host=False),
             StepShape(prefill=(), resident=(101, 61, 5), staged=(), completed=0, migrated_bytes=0,
                       streams_host=False)]
    pricer = SchedulePricer(steps, curves)
    # at most 3 sequences and 160 tokens a step: larger limits cut nothing, and time the same
    assert pricer.execution(4, 256) == pricer.execution(1024, 8192)
    assert pricer.step_seconds(4, 256).tolist() == pricer.step_seconds(1024, 8192).tolist()
    assert pricer.execution(2, 256) != pricer.execution(3, 256)  # 2 splits the decode step, 3 does not
    assert pricer.execution(4, 128) != pricer.execution(4, 160)  # 128 splits the prefill's 160 tokens
    assert SchedulePricer(steps[:1], curves).execution(4, 256) != pricer.execution(4, 256)


def test_runner_ups_compute_something_else_than_the_plan(loaded):
    """A small workload: every b_moe candidate holds a whole step, so most candidates are the plan again."""
    workload = WorkloadShape.synthetic(40, (4, 16), mu=1.5, sigma=0.5, max_output=8)
    plan = plan_engine(loaded, EngineConfig(page_size=8), workload=workload, curves=synthetic_curves(),
                       limits=MemoryLimits(device_kv_bytes=8 << 20, host_kv_bytes=8 << 20, activation_bytes=1 << 30))
    predicted = [plan.predicted_bct_s] + [c.predicted_bct_s for c in plan.runner_ups]
    assert plan.runner_ups and len(set(predicted)) == len(predicted)


def test_copies_on_the_critical_path_when_host_kv_streams():
    curves = synthetic_curves(copy_bytes_per_s=1e6)  # slow copies: the copy stream bounds the layer
    step = StepShape(prefill=(), resident=(), staged=((1000,), (1000,)), completed=0, migrated_bytes=0,
                     streams_host=True)
    in_place = dataclasses.replace(step, streams_host=False)
    copy_s = 1000 * curves.kv_bytes_per_token / curves.num_layers / curves.copy_bytes_per_s
    attention_s = curves.decode_attention.seconds(calls=1, seqs=1, kv_tokens=1000)
    # on a CPU the host pages attended in place are its own memory: no copy at all
    cpu = dataclasses.replace(curves, device_type="cpu")
    assert step_seconds(step, cpu, 8, 64) - step_seconds(in_place, cpu, 8, 64) >= \
        curves.num_layers * (2 * copy_s - 2 * attention_s)
    # on a GPU the kernel reads them over the host link: each group's attention takes its copy's time instead, and
    # the two groups' reads run one after the other as the two copies did
    assert step_seconds(in_place, curves, 8, 64) - step_seconds(in_place, cpu, 8, 64) == pytest.approx(
        curves.num_layers * 2 * (copy_s - attention_s))
    assert step_seconds(in_place, curves, 8, 64) == pytest.approx(step_seconds(step, curves, 8, 64) -
                                                                  curves.num_layers * attention_s)


@pytest.mark.parametrize("budget_tokens,samples", [(None, ()), (96, ()), (None, (1, 3, 1, 2, 1, 1, 4, 1)),
                                                   (96, (1, 3, 1, 2, 1, 1, 4, 1))])
def test_replay_is_the_engines_schedule_step_by_step(loaded, budget_tokens, samples):
    """Under a tight KV budget too (sequences yield to host pages and come back), and with prompts of several
    samples (forked from their prefill; the replay ran one sequence of n times the output)."""
    spec = loaded.model.kv_spec()
    token_bytes = spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * 4
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 40, 17, 5, 30, 12, 9, 22))
    outputs = [12, 3, 20, 7, 15, 1, 9, 25]
    config = EngineConfig(page_size=8, max_num_seqs=6, refill_threshold=0.5, b_attn=4, b_moe=64,
                          kv_budget_bytes=token_bytes * (budget_tokens or 4096),
                          host_kv_budget_bytes=token_bytes * 4096,
                          staging_fraction=0.25, max_prefill_tokens=48)
    engine = Engine(loaded, config)
    for i, (p, n) in enumerate(zip(batch, outputs)):
        engine.add_request(Request(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=n, ignore_eos=True, temperature=0.0, n=samples[i] if samples else 1)))
    per_step = []
    while engine.has_unfinished():
        before = engine.stats.sequence_steps
        engine.step()
        per_step.append(engine.stats.sequence_steps - before)
    workload = WorkloadShape(tuple(map(len, batch)), tuple(outputs), samples)
    steps = replay_schedule(config, plan_kv_budget(config, False), spec, loaded.dtype, workload, stream_host=False,
                            device_type="cpu")
    assert [len(s.prefill) + s.decoding for s in steps] == per_step
    # on a GPU attending in place the same schedule keeps host-resident sequences in micro-batches of their own
    on_gpu = replay_schedule(config, plan_kv_budget(config, False), spec, loaded.dtype, workload, stream_host=False,
                             device_type="cuda")
    assert [(s.prefill, sorted(s.resident + sum(s.staged, ()))) for s in on_gpu] == \
        [(s.prefill, sorted(s.resident)) for s in steps]
    if budget_tokens:
        # the replay yielded to host pages too; those sequences decode in the resident micro-batches (one storage)
        assert engine.scheduler.yields > 0 and engine.stats.staged_decode_batches > 0
        assert any(s.migrated_bytes for s in steps) and not any(s.staged for s in steps)
        assert any(s.staged for s in on_gpu)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_host_memory_available_stops_at_the_containers_memory_limit(version, tmp_path):
    """A container's limit less its working set (usage less inactive page cache); nothing without a limit."""
    if version == "v2":
        proc, where = "0::/kubepods/pod1\n", tmp_path / "kubepods/pod1"
        names = ("memory.max", "memory.current", "inactive_file")
    else:
        proc, where = "9:pids:/\n4:memory:/kubepods/pod1\n0::/\n", tmp_path / "memory/kubepods/pod1"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    where.mkdir(parents=True)
    (where / names[0]).write_text(f"{8 << 30}\n")
    (where / names[1]).write_text(f"{3 << 30}\n")
    (where / "memory.stat").write_text(f"anon 100\n{names[2]} {1 << 30}\n")
    assert cgroup_room_bytes(proc, tmp_path) == 6 << 30  # 8 GiB less a working set of 2
    (where / names[0]).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    assert cgroup_room_bytes(proc, tmp_path) is None
    assert cgroup_room_bytes("0::/elsewhere\n", tmp_path) is None  # nothing mounted there: no limit known
    write_cgroup(where.parent, names, limit=5 << 30, usage=4 << 30, inactive=0)  # a parent's limit binds too
    assert cgroup_room_bytes(proc, tmp_path) == 1 << 30


def write_cgroup(where, names, limit: int, usage: int, inactive: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / names[0]).write_text(f"{limit}\n")
    (where / names[1]).write_text(f"{usage}\n")
    (where / "memory.stat").write_text(f"anon 100\n{names[2]} {inactive}\n")


def test_a_container_without_a_cgroup_namespace_finds_its_limit_at_the_mount_root(tmp_path):
    """cgroup v1 in Docker: /proc/self/cgroup names the host's path, the container's own cgroup is mounted at
    /sys/fs/cgroup/memory: the path under the mount did not exist and the limit went unseen."""
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    write_cgroup(tmp_path / "memory", names, limit=8 << 30, usage=3 << 30, inactive=1 << 30)
    assert cgroup_room_bytes("4:memory:/docker/0123abcd\n0::/\n", tmp_path) == 6 << 30


def test_a_process_with_a_share_of_a_device_has_room_within_that_share_less_what_it_holds():
    gib = 1 << 30
    assert device_room_bytes(free=60 * gib, total=80 * gib, reserved=20 * gib, share=1.0) == 60 * gib
    # half of an 80 GiB GPU, 28 GiB of weights held: 12 GiB more, though the device has 52 free
    assert device_room_bytes(free=52 * gib, total=80 * gib, reserved=28 * gib, share=0.5) == 12 * gib
    # the other half's engine took more than its share first: what is free bounds it
    assert device_room_bytes(free=8 * gib, total=80 * gib, reserved=28 * gib, share=0.5) == 8 * gib
    assert device_room_bytes(free=52 * gib, total=80 * gib, reserved=30 * gib, share=0.25) == 0


def test_host_memory_available_counts_what_the_kernel_reclaims_not_only_free_pages():
    """The planner's memory limits on CPU come from MemAvailable (free pages plus reclaimable page cache): a machine
    whose files are cached has little free memory but much available."""
    meminfo = "MemTotal:       24731400 kB\nMemFree:         8042796 kB\nMemAvailable:   24089992 kB\n"
    assert meminfo_available_bytes(meminfo) == 24089992 * 1024
    assert meminfo_available_bytes("MemTotal: 1 kB\nMemFree: 1 kB\n") is None  # a kernel before 3.14
    with open("/proc/meminfo") as f:
        reported = meminfo_available_bytes(f.read())
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    measured = available_memory_bytes(torch.device("cpu"))
    assert reported is not None and measured >= free * 0.9  # every free page counts as available
    assert abs(measured - reported) < 0.1 * reported  # read a moment apart


def test_planner_respects_memory_limits_and_keeps_explicit_values(loaded):
    curves = synthetic_curves(device_type="cpu")
    workload = WorkloadShape.synthetic(200, (8, 64), mu=2.5, sigma=0.5, max_output=64)
    limits = MemoryLimits(device_kv_bytes=3 << 20, host_kv_bytes=5 << 20, activation_bytes=2 << 20)
    plan = plan_engine(loaded, EngineConfig(page_size=8, b_attn=7), workload=workload, curves=curves, limits=limits)
    config = plan.config
    assert all(getattr(config, name) is not None for name in PLANNED_FIELDS)
    assert config.b_attn == 7 and all(c.settings["b_attn"] == 7 for c in plan.runner_ups)
    assert config.kv_budget_bytes <= limits.device_kv_bytes and config.host_kv_budget_bytes <= limits.host_kv_bytes
    per_token = (4 * 64 + 3 * 96 * 2) * 4
    assert config.b_moe * per_token <= limits.activation_bytes
    tight = dataclasses.replace(limits, activation_bytes=100 * per_token)  # below every candidate (256 and up)
    assert plan_engine(loaded, EngineConfig(page_size=8), workload=workload, curves=curves,
                       limits=tight).config.b_moe == 100
    assert plan.searched > 10 and plan.predicted_bct_s == pytest.approx(sum(plan.step_seconds) + curves.host.seconds(
        prompts=200))
    assert plan.runner_ups[0].predicted_bct_s >= plan.predicted_bct_s


def test_a_plan_for_a_sample_of_short_prompts_still_runs_a_request_as_long_as_the_context(loaded):
    """A job plans from its first rows: its pools held max_num_seqs of the sample's sequences, and a longer row
    later in the input, one the model takes, was refused as not fitting the KV budget."""
    token_bytes = PoolGeometry(loaded.model.kv_spec(), 1, loaded.dtype).page_bytes
    plan = plan_engine(loaded, EngineConfig(max_num_seqs=2), workload=WorkloadShape((10,) * 8, (5,) * 8),
                       curves=synthetic_curves(device_type="cpu", kv_bytes_per_token=token_bytes))
    prompt = [3 + i % 200 for i in range(440)]
    request = Request("long", prompt_token_ids=prompt, sampling=dataclasses.replace(GREEDY, max_tokens=60))
    [result] = Engine(loaded, plan.config).generate([request])
    assert result.error is None
    assert result.outputs[0].token_ids == ReferenceRunner(loaded.model).generate([prompt], 60)[0]


def test_no_staging_share_is_planned_that_leaves_the_longest_sequence_no_room_on_the_device(loaded):
    """Coroutine mode takes the staging pool out of the device KV budget: given a budget that holds one sequence of
    the whole context beside the fixed settings' share (a memory-constrained engine's minimum), the planner could
    pick a larger share, and such a request was then refused as not fitting the KV budget."""
    token_bytes = PoolGeometry(loaded.model.kv_spec(), 1, loaded.dtype).page_bytes
    max_len = 64
    budget = int(token_bytes * (max_len + 2 * 8) / (1 - 0.25)) + 1  # its pages and two in reserve, beside 25 %
    config = EngineConfig(page_size=8, max_model_len=max_len, kv_budget_bytes=budget, host_kv_budget_bytes=1 << 22,
                          stream_host_kv=True)
    plan = plan_engine(loaded, config, workload=WorkloadShape((40,) * 64, (24,) * 64),
                       curves=synthetic_curves(device_type="cpu", kv_bytes_per_token=token_bytes))
    shares = {c.settings["staging_fraction"] for c in plan.runner_ups} | {plan.config.staging_fraction}
    assert shares <= {0.1, 0.25}, shares
    prompt = [3 + i % 200 for i in range(max_len - 8)]
    request = Request("long", prompt_token_ids=prompt, sampling=dataclasses.replace(GREEDY, max_tokens=8))
    [result] = Engine(loaded, plan.config).generate([request])
    assert result.error is None
    assert result.outputs[0].token_ids == ReferenceRunner(loaded.model).generate([prompt], 8)[0]


def test_planned_defaults_give_the_tokens_of_an_explicit_config(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setenv("BATCHGEN_PLAN", "1")
    # free memory is part of a plan's key (as a power of two); other tests running beside this one move it
    monkeypatch.setattr("batchgen.engine.planner.planner.available_memory_bytes", lambda device: 12 << 30)
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 9, 17, 5, 30, 12))
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)]
    planned = Engine(loaded)
    assert all(getattr(planned.config, name) is not None for name in PLANNED_FIELDS)
    assert list(tmp_path.glob("plans/curves-*.json"))  # profiled once, cached on disk
    explicit = Engine(loaded, max_num_seqs=2, b_attn=1, b_moe=3, refill_threshold=0.5, kv_budget_bytes=1 << 20,
                      host_kv_budget_bytes=1 << 20, staging_fraction=0.25)
    assert [r.outputs[0].token_ids for r in planned.generate(requests)] == \
        [r.outputs[0].token_ids for r in explicit.generate(requests)]
    again = resolve_config(loaded, EngineConfig())
    assert again == planned.config  # the same process plans a config once
    # options that cannot change a plan find the same one, and keep their own values
    neutral = resolve_config(loaded, EngineConfig(seed=7, partition_stragglers=False))
    assert neutral == dataclasses.replace(planned.config, seed=7, partition_stragglers=False)
    assert len(list(tmp_path.glob("plans/plan-*.json"))) == 1  # and other processes read it from disk


def test_without_planning_unset_fields_take_the_fixed_settings(loaded, monkeypatch):
    monkeypatch.setenv("BATCHGEN_PLAN", "0")
    config = resolve_config(loaded, EngineConfig(b_attn=3))
    assert config.b_attn == 3 and all(getattr(config, k) == v for k, v in FIXED.items() if k != "b_attn")
    spec = loaded.model.kv_spec()
    full_contexts = spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * 4 * 256 * loaded.max_model_len
    assert 0 < config.kv_budget_bytes <= full_contexts and 0 < config.host_kv_budget_bytes <= full_contexts


def test_stage_split_follows_the_work():
    curves = synthetic_curves()
    config = EngineConfig(max_num_seqs=64, b_attn=64, b_moe=8192, refill_threshold=0.5, kv_budget_bytes=1 << 30,
                          host_kv_budget_bytes=1 << 30, staging_fraction=0.25)
    prefill_heavy = WorkloadShape((2000,) * 64, (2,) * 64)
    decode_heavy = WorkloadShape((16,) * 64, (300,) * 64)
    heavy = plan_stage_split(6, prefill_heavy, curves, config)
    light = plan_stage_split(6, decode_heavy, curves, config)
    assert heavy.prefill_actors > light.prefill_actors
    assert heavy.prefill_actors + heavy.decode_actors == 6 and set(heavy.by_prefill_actors) == {1, 2, 3, 4, 5}
    assert heavy.predicted_bct_s == min(heavy.by_prefill_actors.values())
    with pytest.raises(ValueError, match="at least 2"):
        plan_stage_split(1, decode_heavy, curves, config)
    # each prompt's samples decode side by side: eight of them are eight sequences' decode work, one prefill
    one, eight = (plan_stage_split(6, WorkloadShape((1000,) * 64, (40,) * 64, (n,) * 64), curves, config)
                  for n in (1, 8))
    assert eight.prefill_actors < one.prefill_actors and eight.predicted_bct_s > one.predicted_bct_s


def test_batchgen_plan_samples_the_input_with_the_jobs_chat_template(loaded, tmp_path, capsys, monkeypatch):
    """--chat-template reaches the input's sample (operators/workload_sample.py renders with it: test_operators)."""
    from batchgen.operators import workload_sample

    seen = []

    def sample(uri, model, defaults, storage_options, chat_template=None):
        seen.append(chat_template)
        return WorkloadShape((30,) * 4, (10,) * 4)

    monkeypatch.setattr(workload_sample, "input_workload", sample)
    (tmp_path / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    curves = tmp_path / "curves.json"
    curves.write_text(curves_for(loaded).to_json())
    assert main(["plan", "--model", loaded.uri, "--input", str(tmp_path), "--curves", str(curves), "--chat-template",
                 str(tmp_path / "chat.jinja"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["mean_prompt"] == 30.0
    assert seen == ["{{ messages[0]['content'] }}"]
    assert main(["plan", "--model", loaded.uri, "--input", str(tmp_path), "--curves", str(curves), "--chat-template",
                 str(tmp_path / "missing.jinja")]) == 2
    assert "is no template" in capsys.readouterr().err
    assert main(["plan", "--model", loaded.uri, "--curves", str(curves), "--chat-template",
                 str(tmp_path / "chat.jinja")]) == 2  # it renders no rows: before, it was taken and never read
    assert "--chat-template renders the --input rows of messages: give --input too" in capsys.readouterr().err


def test_batchgen_plan_prints_the_plan_and_the_split(loaded, tmp_path, capsys):
    model_dir = loaded.uri
    rows = prompts(vocab_size=loaded.model.vocab_size, lengths=(20, 40, 60, 80) * 10)
    pq.write_table(pa.table({"prompt_token_ids": rows,
                             "sampling_params": [{"max_tokens": n} for n in (5, 10, 15, 20) * 10]}),
                   tmp_path / "in.parquet")
    curves = tmp_path / "curves.json"
    curves_file = curves_for(loaded)
    curves.write_text(curves_file.to_json())
    assert main(["plan", "--model", model_dir, "--input", str(tmp_path / "in.parquet"), "--engine-actors", "3",
                 "--curves", str(curves), "--engine", '{"refill_threshold": 0.75}', "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == {"prompts": 40, "mean_prompt": 50.0, "mean_output": 12.5, "max_output": 20}
    assert out["config"]["refill_threshold"] == 0.75 and out["predicted_bct_s"] > 0
    assert out["runner_ups"] and all(r["predicted_bct_s"] >= out["predicted_bct_s"] for r in out["runner_ups"])
    assert out["stage_split"]["prefill_actors"] + out["stage_split"]["decode_actors"] == 3
    assert main(["plan", "--model", model_dir, "--curves", str(tmp_path / "missing.json")]) == 2
    assert "not a cost-curve file" in capsys.readouterr().err
    assert main(["plan", "--model", model_dir, "--curves", str(curves), "--engine",
                 '{"device_memory_bytes": 1000000}']) == 2  # its weights must be placed to be profiled
    assert "--curves plans without the weights, which a device_memory_bytes engine must place" in \
        capsys.readouterr().err
    kv = curves_file.kv_bytes_per_token  # measured in float32: a bfloat16 plan would size its pools twice too big
    assert main(["plan", "--model", model_dir, "--curves", str(curves), "--engine", '{"dtype": "bfloat16"}']) == 2
    assert (f"the cost curves were measured for another model or dtype (kv_bytes_per_token {kv} there, {kv // 2} "
            f"here)") in capsys.readouterr().err
    assert main(["plan", "--model", model_dir, "--curves", str(curves), "--engine", '{"max_model_len": 1000000}']) == 2
    assert (f"engine option max_model_len (1000000) is more than the model's context length "
            f"({loaded.max_model_len})") in capsys.readouterr().err  # it was planned for the model's, silently
    saved = tmp_path / "saved.json"
    assert main(["plan", "--model", model_dir, "--curves", str(curves), "--save-curves", str(saved)]) == 2
    assert "pick one" in capsys.readouterr().err
    assert main(["plan", "--model", model_dir, "--save-curves", str(saved), "--json"]) == 0
    placed = load_model(model_dir)
    place_as_engine(placed, EngineConfig())  # its experts packed, as `plan` places the model it profiles
    assert CostCurves.load(str(saved)).to_json() == curves_for(placed).to_json()  # the plan's profile, cached
    capsys.readouterr()
    assert main(["plan", "--model", str(tmp_path / "no-model"), "--curves", str(curves)]) == 2  # not a traceback
    assert f"model '{tmp_path / 'no-model'}' is not readable: checkpoint directory" in capsys.readouterr().err


def test_the_feed_forward_is_timed_over_layers_whose_weights_leave_the_cache(loaded, monkeypatch):
    """One layer timed again and again finds its weights in the last-level cache, where a forward over every layer
    does not: the profile runs the MoE over as many layers as pass twice the cache (all when they all fit)."""
    from batchgen.engine.planner import profiler

    layers = list(loaded.model.layers)
    moe = [layer for layer in layers if layer.is_moe]
    per_layer = sum(p.numel() * p.element_size() for p in moe[0].ffn.parameters())
    assert len(moe) >= 2
    assert profiler._feed_forward_layers(loaded.model, moe[0], loaded.device) == moe  # the tiny model fits
    monkeypatch.setattr(profiler.cpu_identity, "last_level_cache_bytes", lambda: per_layer // 2 + 1)
    assert profiler._feed_forward_layers(loaded.model, moe[0], loaded.device) == moe[:2]
    monkeypatch.setattr(profiler.cpu_identity, "last_level_cache_bytes", lambda: per_layer // 4)
    assert profiler._feed_forward_layers(loaded.model, moe[0], loaded.device) == moe[:1]


def test_a_changed_kernel_or_model_source_changes_the_profile_key(tmp_path):
    """Cost curves are cached by profile key: measured with other kernels or layers they would price steps wrongly.
    The model code used to be left out (a changed layer kept its stale curves)."""
    import shutil

    from batchgen.engine.planner import profiler

    copy = tmp_path / "package"
    for pattern in profiler.PRICED_SOURCES:
        for path in profiler.PACKAGE_ROOT.glob(pattern):
            target = copy / path.relative_to(profiler.PACKAGE_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    (copy / "engine" / "engine.py").write_text("# not priced")
    digests = [profiler.code_digest(copy)]
    assert digests[0] == profiler.code_digest()  # the copy holds every priced source
    for name, old, new in [("kernels/moe_cpu.py", "SMALL_ROWS = ", "SMALL_ROWS = 1 + "),
                           ("engine/models/layers.py", "import torch", "import torch  # changed"),
                           ("engine/engine.py", "not", "still not")]:
        source = copy / name
        assert old in source.read_text()
        source.write_text(source.read_text().replace(old, new, 1))
        profiler.code_digest.cache_clear()
        digests.append(profiler.code_digest(copy))
    profiler.code_digest.cache_clear()
    assert len(set(digests[:3])) == 3 and digests[3] == digests[2]


def test_a_kernel_backend_forced_or_chosen_by_the_environment_changes_the_profile_key(loaded, monkeypatch):
    from batchgen.engine.planner import profiler
    from batchgen.kernels import registry

    default = profiler.profile_key(loaded)
    with registry.use_backend("fused_moe", "torch"):
        forced = profiler.profile_key(loaded)
    monkeypatch.setenv(registry.ENV_VAR, "paged_decode_attention=torch")
    from_environment = profiler.profile_key(loaded)
    monkeypatch.delenv(registry.ENV_VAR)
    assert len({default, forced, from_environment}) == 3 and profiler.profile_key(loaded) == default


def test_packed_experts_are_profiled_apart_from_the_checkpoint_layout(tmp_path):
    """A load sharing the node's host weights keeps the checkpoint layout (moe_cpu), a private one is packed
    (moe_packed_cpu): curves measured on one kernel must not plan the other."""
    from batchgen.engine.models.expert_packing import experts_packed, pack_experts
    from batchgen.engine.planner import profiler

    save_tiny_checkpoint("mixtral", tmp_path)
    private = load_model(str(tmp_path))
    unpacked = profiler.profile_key(private)
    pack_experts(private)
    assert experts_packed(private) and profiler.profile_key(private) != unpacked


def test_the_profile_key_tells_cpu_generations_apart_that_share_a_model_name(tmp_path, monkeypatch):
    """Curves measured on one CPU price steps wrongly on another: the key holds family, model and flags (the
    compiled kernels' cache uses the same identity)."""
    from batchgen.engine.planner import profiler
    from batchgen.kernels import cpu_identity

    zen4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nstepping\t: 1\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: Other\n")
    zen5 = zen4.replace("cpu family\t: 25\nmodel\t\t: 17", "cpu family\t: 26\nmodel\t\t: 2")
    assert cpu_identity.cpu_identity(zen4).startswith("AuthenticAMD 25 17 1 AMD EPYC flags=")
    assert cpu_identity.cpu_identity(zen4) != cpu_identity.cpu_identity(zen4.replace("avx512f", "avx512f avx512_bf16"))
    save_tiny_checkpoint("mixtral", tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"), device="cpu")
    keys = []
    try:
        for text in (zen4, zen5, zen4):
            monkeypatch.setattr(cpu_identity, "cpuinfo", lambda text=text: text)
            cpu_identity.this_cpu.cache_clear()
            keys.append(profiler.profile_key(loaded))
    finally:
        cpu_identity.this_cpu.cache_clear()  # the next caller reads the real CPU
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_a_disaggregated_job_whose_input_has_no_prompt_to_plan_for_is_planned_generically(loaded, tmp_path,
                                                                                          monkeypatch):
    """Its planning task raised, and the job failed with a Ray task's traceback; planned for a generic workload,
    the job writes each row's error, as one without the planner does."""
    from batchgen.operators import engine_actor
    from batchgen.pipelines import job_planning

    monkeypatch.setattr(engine_actor, "prepare_engine_process", lambda: torch.get_num_threads())  # this process's
    pq.write_table(pa.table({"prompt": pa.array([None, None], pa.string())}), tmp_path / "in.parquet")
    engine, split = job_planning._plan_on_engine_node(loaded.uri, {}, str(tmp_path / "in.parquet"), {},
                                                      {"max_tokens": 8}, 3)
    assert split.prefill_actors + split.decode_actors == 3 and set(engine) == set(PLANNED_FIELDS)


def test_a_batch_invariant_engine_is_planned_on_curves_of_its_own_kernel_paths(loaded, monkeypatch):
    """The planner priced a batch-invariant engine on the default paths' curves (oneDNN's GEMMs for prefill, which
    such an engine never runs), in the job's planning task and `batchgen plan` alike."""
    from batchgen.engine.planner import planner, profiler
    from batchgen.kernels.registry import invariant_batches

    with invariant_batches(True):
        invariant_key = profiler.profile_key(loaded)
    assert invariant_key != profiler.profile_key(loaded)  # cached apart
    asked = []

    def curves(model, progress=None, batch_invariant=False):
        asked.append(batch_invariant)
        raise RuntimeError("enough")

    monkeypatch.setattr(planner, "curves_for", curves)
    for invariant in (True, False):
        with pytest.raises(RuntimeError, match="enough"):
            plan_engine(loaded, EngineConfig(batch_invariant=invariant))
    assert asked == [True, False]


def test_a_split_of_many_actors_is_found_on_a_narrowing_grid_within_a_hair_of_trying_every_one():
    """Every split was simulated, each simulation's events growing with the actors: 64 actors took 23 s, hundreds
    minutes. Past SPLITS_AT_ONCE the best of a narrowing grid: here within 1 % of the best of all 39, from fewer
    simulations."""
    from batchgen.engine.planner.stage_split import SPLITS_AT_ONCE, simulate_disaggregated

    curves = synthetic_curves()
    config = EngineConfig(max_num_seqs=8, b_attn=8, b_moe=8192, refill_threshold=0.5, kv_budget_bytes=1 << 30,
                          host_kv_budget_bytes=1 << 30, staging_fraction=0.25)
    workload = WorkloadShape((600,) * 24 + (40,) * 24, (8,) * 24 + (60,) * 24)
    actors = 40
    split = plan_stage_split(actors, workload, curves, config)
    everyone = {p: simulate_disaggregated(workload, curves, config, p, actors - p, curves.copy_bytes_per_s / 2)
                for p in range(1, actors)}
    assert SPLITS_AT_ONCE <= len(split.by_prefill_actors) < actors - 1
    assert split.by_prefill_actors == {p: everyone[p] for p in split.by_prefill_actors}
    assert split.predicted_bct_s <= min(everyone.values()) * 1.01
