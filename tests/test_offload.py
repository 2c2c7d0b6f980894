"""Memory-constrained mode (engine/offload): weights in host memory, streamed through device slots within
`device_memory_bytes`; greedy tokens must equal the reference model's whatever the budget."""

from __future__ import annotations

import re

import pytest
from tiny_models import ALL_ARCHITECTURES, MOE_ARCHITECTURES, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig, Request, SamplingParams
from batchgen.engine.offload.memory_constrained import place_as_engine
from batchgen.engine.offload.offload_plan import plan_offload
from batchgen.engine.offload.weight_units import weight_units
from batchgen.engine.reference import ReferenceRunner
from batchgen.pipelines.cli import build_parser, job_config

MAX_TOKENS = 8
LENGTHS = (3, 9, 17, 5, 12, 7, 4, 15)
MAX_LEN = 32  # the longest prompt plus MAX_TOKENS fits: the minimum KV is one sequence this long
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=ALL_ARCHITECTURES)
def arch_case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(request.param, directory)
    loaded = load_model(str(directory))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    return request.param, str(directory), batch, expected


def generate(engine, batch):
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)])
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.outputs[0].token_ids for r in results]


def test_every_architecture_at_35_percent_of_its_weights_matches_the_reference(arch_case):
    arch, directory, batch, expected = arch_case
    loaded = load_model(directory)
    total = weight_units(loaded.model, "expert").total_bytes
    budget = int(total * 0.35)  # (the tiny dense Qwen3's minimum, a longest sequence beside the staging pool: 33 %)
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, b_attn=3, device_memory_bytes=budget)
    assert generate(engine, batch) == expected
    memory = engine.metrics()["device_memory"]
    assert memory["peak_bytes"] <= budget
    assert memory["resident_weight_bytes"] + memory["slot_bytes"] < budget < total
    assert memory["weight_bytes_streamed"] > total  # every step streams what is not resident
    streamer = engine.streamer
    assert streamer.modules is not None and streamer.modules.copies.copies > 0
    if arch in (*MOE_ARCHITECTURES, "deepseek_v3"):  # routed experts stream one by one
        assert streamer.experts is not None and streamer.experts.copies.copies > 0
    # host memory holds the streamed weights between uses
    assert all(p.device.type == "cpu" for p in loaded.model.lm_head.parameters())


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_layer_streaming_baseline_matches_the_reference(arch, tmp_path):
    """FlexGen-style: each attention and whole feed-forward block (router, experts, shared expert) streams."""
    save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    units = weight_units(loaded.model, "layer")
    assert not units.expert_layers and any(u.name.endswith(".mlp") for u in units.modules)
    budget = int(units.total_bytes * 0.6)
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, device_memory_bytes=budget,
                    weight_streaming="layer")
    assert generate(engine, batch) == expected
    assert engine.streamer.experts is None and engine.streamer.modules.copies.copies > 0
    assert engine.metrics()["device_memory"]["peak_bytes"] <= budget


def test_host_resident_sequences_stream_their_kv_beside_streamed_weights(tmp_path):
    """A budget whose KV holds few sequences: the rest wait in host pages and decode through staging."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS * 3)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    total = weight_units(loaded.model, "expert").total_bytes
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, b_attn=4, max_num_seqs=24,
                    device_memory_bytes=int(total * 0.3), staging_fraction=0.5)
    assert generate(engine, batch) == expected
    metrics = engine.metrics()
    assert metrics["staged_decode_batches"] > 0 and metrics["yields"] > 0


def test_a_budget_below_the_minimum_fails_at_construction_naming_it(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    with pytest.raises(ValueError, match="below this model's minimum") as error:
        Engine(load_model(str(tmp_path)), page_size=4, max_model_len=MAX_LEN, device_memory_bytes=10_000)
    minimum = int(re.search(r"minimum of (\d+)", str(error.value)).group(1))
    assert "KV of one longest sequence" in str(error.value) and "weight slots" in str(error.value)
    with pytest.raises(ValueError, match="below this model's minimum"):
        Engine(load_model(str(tmp_path)), page_size=4, max_model_len=MAX_LEN, device_memory_bytes=minimum - 1)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(5, 9))
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, device_memory_bytes=minimum)
    assert engine.config.b_moe == 1  # the minimum leaves room for one token's activations
    assert generate(engine, batch) == expected
    assert engine.metrics()["device_memory"]["peak_bytes"] <= minimum


@pytest.mark.parametrize("staging_fraction", [None, 0.25, 0.5])
def test_a_budget_at_the_minimum_runs_a_sequence_of_the_whole_context(tmp_path, monkeypatch, staging_fraction):
    """The minimum held one longest sequence's KV, but coroutine mode takes its staging pool out of the same device
    budget: at the minimum a request of max_model_len tokens was refused ("does not fit in the KV budget") on a
    model too shallow for the staging pool to hold it either. Planned (None), the planner takes no staging share
    that leaves it no room where a smaller one does."""
    save_tiny_checkpoint("mixtral", tmp_path)
    options = {} if staging_fraction is None else {"staging_fraction": staging_fraction}
    with pytest.raises(ValueError, match="below this model's minimum") as error:
        Engine(load_model(str(tmp_path)), page_size=4, max_model_len=MAX_LEN, device_memory_bytes=10_000, **options)
    minimum = int(re.search(r"minimum of (\d+)", str(error.value)).group(1))
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(MAX_LEN - MAX_TOKENS,))
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    if staging_fraction is None:
        monkeypatch.setenv("BATCHGEN_PLAN", "1")  # planned: the staging share searched
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, device_memory_bytes=minimum, **options)
    assert generate(engine, batch) == expected
    assert engine.metrics()["device_memory"]["peak_bytes"] <= minimum


@pytest.mark.parametrize("fraction", [0.3, 0.6, 1.0, 2.0])
def test_the_plan_spends_the_budget_within_it_attention_first(fraction, tmp_path):
    save_tiny_checkpoint("qwen3_moe", tmp_path)
    model = load_model(str(tmp_path), weights=False).model
    units = weight_units(model, "expert")
    budget = int(units.total_bytes * fraction)
    plan = plan_offload(units, budget, "cpu", activation_bytes_per_token=1000, min_kv_bytes=20_000)
    assert plan.fixed_bytes + plan.resident_bytes + plan.ring_bytes + plan.activation_bytes + plan.kv_bytes == budget
    assert plan.kv_bytes >= 20_000
    attention = {u.name for u in units.modules if u.name.endswith(".attn")}
    if plan.resident_expert_layers:  # whole expert layers only after every attention module
        assert attention <= plan.resident_modules
    if fraction >= 2.0:  # room for everything: nothing streams
        assert plan.ring_bytes == 0 and len(plan.resident_expert_layers) == len(units.expert_layers)
    explicit = plan_offload(units, budget, "cpu", activation_bytes_per_token=1000, min_kv_bytes=20_000,
                            kv_bytes=plan.kv_bytes // 2, b_moe=7)
    assert explicit.kv_bytes == plan.kv_bytes // 2 and explicit.b_moe == 7 and explicit.activation_bytes == 7000
    assert explicit.weight_bytes + explicit.activation_bytes + explicit.kv_bytes <= budget


def test_a_cuda_plans_own_kv_budget_and_b_moe_given_back_plan_the_same_placement(tmp_path):
    """Two slots a ring on CUDA: a large LM head is lighter resident than streamed through its two slots, so the
    planned placement weighed less than the start the explicit KV budget was checked against, and every engine
    actor of a job, handed the plan's kv_budget_bytes, refused it as not fitting."""
    save_tiny_checkpoint("qwen3_moe", tmp_path, vocab_size=8192)
    units = weight_units(load_model(str(tmp_path), weights=False).model, "expert")
    head = next(u for u in units.modules if u.name == "lm_head")
    assert head.nbytes > 2 * max(u.nbytes for u in units.modules if u is not head)
    for fraction in (0.55, 0.7, 0.95, 1.0):
        budget = int(units.total_bytes * fraction)
        plan = plan_offload(units, budget, "cuda", activation_bytes_per_token=1000, min_kv_bytes=20_000)
        again = plan_offload(units, budget, "cuda", activation_bytes_per_token=1000, min_kv_bytes=20_000,
                             kv_bytes=plan.kv_bytes, b_moe=plan.b_moe)
        assert again == plan


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_plans_own_kv_budget_given_back_walks_to_the_same_placement_at_every_budget(tmp_path, device_type):
    """The walk can pass through a placement heavier than its last (the last streamed module made resident frees
    its slots): the KV was what the last left, and given back that budget rejected the heavier step, so engine
    actors streamed modules the job's plan kept resident (at 1.61-1.665x the weights on CUDA here)."""
    save_tiny_checkpoint("qwen3_moe", tmp_path)
    units = weight_units(load_model(str(tmp_path), weights=False).model, "expert")
    for step in range(20, 220):
        budget = int(units.total_bytes * step / 100)
        try:
            plan = plan_offload(units, budget, device_type, activation_bytes_per_token=1000, min_kv_bytes=20_000)
        except ValueError:  # below the minimum
            continue
        again = plan_offload(units, budget, device_type, activation_bytes_per_token=1000, min_kv_bytes=20_000,
                             kv_bytes=plan.kv_bytes, b_moe=plan.b_moe)
        assert again == plan, step
        assert plan.weight_bytes + plan.activation_bytes + plan.kv_bytes <= budget


def test_a_cuda_plan_grows_its_expert_slots_two_at_a_time(tmp_path):
    """On CUDA the expert ring computes one half of its slots while the other loads (ExpertRing.window is
    slots // 2): an odd count planned left one slot budgeted, never used, its bytes taken from the KV."""
    save_tiny_checkpoint("qwen3_moe", tmp_path)
    units = weight_units(load_model(str(tmp_path), weights=False).model, "expert")
    counts = set()
    for step in range(20, 220, 2):
        try:
            plan = plan_offload(units, int(units.total_bytes * step / 100), "cuda", activation_bytes_per_token=1000,
                                min_kv_bytes=20_000)
        except ValueError:  # below the minimum
            continue
        counts.add(plan.expert_slots)
    assert counts - {0} and all(n % 2 == 0 for n in counts), counts
    assert max(counts) > 2  # the walk did widen the windows


def test_a_bf16_streamed_layers_windows_give_the_resident_layers_output_bit_for_bit(tmp_path):
    """Top-2 routing over 8 experts through 2 expert slots (four windows): in bf16 each window's sum was rounded to
    the model's dtype before the windows were added (the torch backend, bf16's on CPU, sums in float32 and rounds
    once), and 5,706 of 16,384 outputs differed from the resident layer's."""
    import torch

    from batchgen.engine.offload.weight_streamer import ExpertRing
    from batchgen.kernels import ops

    save_tiny_checkpoint("mixtral", tmp_path, num_local_experts=8)
    model = load_model(str(tmp_path), dtype="bfloat16").model
    layer = weight_units(model, "expert").expert_layers[0]
    experts = layer.experts
    ring = ExpertRing([layer], 2, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, experts.down_proj.shape[1], generator=generator).to(experts.down_proj.dtype)
    ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(64)])
    weights = torch.softmax(torch.randn(64, 2, generator=generator), dim=-1)
    resident = ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert torch.equal(ring.run(layer, x, weights, ids), resident)


def test_the_profile_of_a_placed_model_times_its_streamed_weights_loaded(tmp_path, monkeypatch):
    """After a timed call's warm-up the streamed unit stayed in its slot, so its timed repeats copied nothing: the
    planner priced a memory-constrained engine's steps as a resident model's."""
    from batchgen.engine.planner import profiler

    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    total = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    streamer, _ = place_as_engine(loaded, EngineConfig(device_memory_bytes=int(total * 0.3), page_size=4,
                                                       max_model_len=MAX_LEN))
    assert loaded.streamer is streamer and "layers.0.attn" not in streamer.plan.resident_modules
    measure, copies = profiler._Timer.__call__, []

    def counted(timer, fn):
        before = streamer.modules.copies.copies
        seconds = measure(timer, fn)
        copies.append(streamer.modules.copies.copies - before)
        return seconds

    monkeypatch.setattr(profiler._Timer, "__call__", counted)
    profiler.profile_model(loaded, progress=False)
    attention = copies[: len(profiler.DECODE_GRID) + len(profiler.PREFILL_GRID)]  # layer 0's, streamed
    assert min(attention) >= 4  # a warm-up and at least three timed calls, each loading the weights


def test_an_engine_on_a_model_placed_for_a_budget_records_no_decode_steps(tmp_path):
    """The planner profiles a model placed for a device memory budget with engines of its own, which stream
    nothing themselves: a recording of their steps would replay kernels on whatever the slots held then."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(5, 9, 12, 7))
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    total = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    place_as_engine(loaded, EngineConfig(device_memory_bytes=int(total * 0.3), page_size=4, max_model_len=MAX_LEN))
    engine = Engine(loaded, page_size=4, max_num_seqs=4, b_attn=4, b_moe=64, refill_threshold=0.5,
                    kv_budget_bytes=1 << 20, host_kv_budget_bytes=1 << 20, staging_fraction=0.25)
    assert generate(engine, batch) == expected
    metrics = engine.metrics()
    assert metrics["decode_steps"] > 4 and metrics["decode_graph_captures"] == metrics["decode_graph_refusals"] == 0


def test_options_that_cannot_combine_with_a_device_memory_budget_fail_clearly():
    with pytest.raises(ValueError, match="device_memory_bytes runs one engine on one device"):
        EngineConfig(device_memory_bytes=1 << 20, ep_size=2)
    with pytest.raises(ValueError, match="stream_host_kv false"):
        EngineConfig(device_memory_bytes=1 << 20, stream_host_kv=False)
    with pytest.raises(ValueError, match="weight_streaming must be one of"):
        EngineConfig(weight_streaming="tensor")
    assert EngineConfig(device_memory_bytes=1 << 20).load_device().type == "cpu"


def test_cli_device_memory_flag_sets_the_engine_budget(tmp_path):
    args = build_parser().parse_args(["run", "--model", "tiny-moe", "--input", "in.parquet", "--output", "out",
                                      "--engine", '{"max_num_seqs": 64}', "--device-memory-mb", "1.5"])
    config = job_config(args)
    assert config.engine == {"max_num_seqs": 64, "device_memory_bytes": 1536 * 1024}


def test_planned_settings_with_a_budget_match_the_reference(monkeypatch, tmp_path):
    """Planning on (as users get it): the profile times the streamed layer, cached apart from the resident one's."""
    from batchgen.engine.planner.profiler import profile_key

    monkeypatch.setenv("BATCHGEN_PLAN", "1")
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    save_tiny_checkpoint("qwen3_moe", tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    resident_key = profile_key(loaded)
    total = weight_units(loaded.model, "expert").total_bytes
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, device_memory_bytes=int(total * 0.4))
    assert engine.config.max_num_seqs is not None and engine.config.b_attn is not None
    assert profile_key(loaded) != resident_key and loaded.weight_placement.startswith("streamed by expert")
    assert generate(engine, batch) == expected
    with pytest.raises(ValueError, match="already placed"):
        Engine(loaded, page_size=4, max_model_len=MAX_LEN, device_memory_bytes=int(total * 0.4))


def test_a_steps_feed_forward_batches_reuse_the_experts_their_slots_hold(tmp_path):
    """B_moe far below the step's tokens: each layer's MoE runs in several batches that route to much the
    same experts; a slot still holding its expert is not loaded again, and tokens stay the reference's."""
    save_tiny_checkpoint("qwen3_moe", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    total = weight_units(loaded.model, "expert").total_bytes
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, b_attn=3, b_moe=8, staging_fraction=0.0,
                    device_memory_bytes=int(total * 0.4))  # no staging pool: no prefill layout, B_moe 8 always
    assert generate(engine, batch) == expected
    memory = engine.metrics()["device_memory"]
    assert engine.streamer.experts is not None and memory["expert_loads_reused"] > 0
    assert memory["peak_bytes"] <= memory["budget_bytes"]


def test_prefill_steps_lend_the_staging_pool_to_a_larger_moe_batch(tmp_path):
    """Local phase switching: steps that prefill with no host-resident sequence decoding release the staging
    pool and run MoE batches larger by its bytes; a step with staged decode takes it back. Tokens stay the
    reference's and the accounting (staging + activations, per step) stays within the budget."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS * 3)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    total = weight_units(loaded.model, "expert").total_bytes
    budget = int(total * 0.3)
    engine = Engine(loaded, page_size=4, max_model_len=MAX_LEN, b_attn=4, b_moe=16, max_num_seqs=24,
                    device_memory_bytes=budget, staging_fraction=0.5)
    assert generate(engine, batch) == expected
    metrics = engine.metrics()
    memory = metrics["device_memory"]
    assert metrics["staged_decode_batches"] > 0  # some steps needed the staging pool back
    assert memory["phase_switches"] >= 2 and memory["prefill_b_moe"] > 16
    assert metrics["max_ffn_tokens"] > 16  # a prefill step ran a MoE batch above the plan's B_moe
    assert memory["peak_bytes"] <= budget
    assert engine.kv.stage.k.shape[1] == engine.kv.stage.num_pages  # the last step decoded: pool allocated


def test_a_jobs_plan_for_a_device_memory_budget_is_one_its_engines_can_run(monkeypatch, tmp_path):
    """A disaggregated job plans once and hands every engine actor the settings: planned on the resident model,
    they were sized from host memory, and each actor's offload plan refused them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.pipelines.job_planning import _plan_on_engine_node

    monkeypatch.setenv("BATCHGEN_PLAN", "1")
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    save_tiny_checkpoint("qwen3_moe", tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    pq.write_table(pa.table({"prompt_token_ids": batch}), tmp_path / "in.parquet")
    budget = int(weight_units(loaded.model, "expert").total_bytes * 0.4)
    engine = {"page_size": 4, "max_model_len": MAX_LEN, "device_memory_bytes": budget}
    planned, split = _plan_on_engine_node(str(tmp_path / "model"), engine, str(tmp_path / "in.parquet"), {},
                                          {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}, 3)
    assert split.prefill_actors + split.decode_actors == 3
    actor = Engine(load_model(str(tmp_path / "model")), **{**engine, **planned})  # as each engine actor builds it
    assert actor.config.kv_budget_bytes == planned["kv_budget_bytes"] <= budget
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    assert generate(actor, batch) == expected
