"""A job's set-up decisions that need no Ray runtime: the record that ties an output to its job, and the CPUs
each engine actor asks for."""

from __future__ import annotations

import json

import pytest

from batchgen.pipelines.job_planning import stage_engines
from batchgen.pipelines.pipeline import JobConfig, JobError, _claim_output, _work_balancer, actor_cpu_share, job_record


def test_a_rerun_of_the_same_job_matches_its_record_whatever_json_makes_of_it(tmp_path):
    sampling = {"max_tokens": 4, "temperature": 0, "logit_bias": {"7": -100, 9: 2.5}, "stop": ["x", "y"]}
    config = JobConfig(model="m", input="in", output=str(tmp_path / "out"), sampling_params=sampling)
    (tmp_path / "out").mkdir()
    _claim_output(config, total_rows=10, input_digest="d1", input_versions="v1")
    record = json.loads(next((tmp_path / "out").iterdir()).read_text())
    assert record == job_record(config, 10, "d1", "v1")
    assert record["sampling_params"]["logit_bias"] == {"7": -100.0, "9": 2.5}
    # the rerun resumes: token ids read back as strings
    _claim_output(config, total_rows=10, input_digest="d1", input_versions="v1")
    for other in ({**sampling, "logit_bias": {"7": -99}}, {**sampling, "stop": ["x"]}):
        with pytest.raises(JobError, match=r"holds results of a different job \(differs in \['sampling_params'\]\)"):
            _claim_output(JobConfig(**{**config.__dict__, "sampling_params": other}), total_rows=10,
                          input_digest="d1", input_versions="v1")
    with pytest.raises(JobError, match=r"differs in \['chat_template'\]"):  # other prompts from the same rows
        _claim_output(JobConfig(**{**config.__dict__, "chat_template": "{{ 'x' }}"}), total_rows=10,
                      input_digest="d1", input_versions="v1")
    with pytest.raises(JobError, match=r"differs in \['total_rows'\]"):
        _claim_output(config, total_rows=11, input_digest="d1", input_versions="v1")
    with pytest.raises(JobError, match=r"differs in \['input_digest'\]"):  # a file edited, same rows in all
        _claim_output(config, total_rows=10, input_digest="d2", input_versions="v1")
    with pytest.raises(JobError, match=r"differs in \['input_versions'\]\) \(an input file was rewritten since"):
        _claim_output(config, total_rows=10, input_digest="d1", input_versions="v2")  # same sizes and rows


def test_a_damaged_job_record_is_a_job_error_and_an_older_one_without_newer_fields_resumes(tmp_path):
    config = JobConfig(model="m", input="in", output=str(tmp_path))
    record = tmp_path / "_batchgen_job.json"
    record.write_text('{"input": "in", "mod')
    with pytest.raises(JobError, match="damaged job record"):
        _claim_output(config, total_rows=3, input_digest="d", input_versions="v1")
    older = job_record(config, 3, "d", "v1")
    del older["input_digest"], older["input_versions"], older["chat_template"]
    record.write_text(json.dumps(older))
    _claim_output(config, total_rows=3, input_digest="d", input_versions="v1")


@pytest.mark.parametrize("nodes,actors,light,expected", [
    ([2.0], 1, 2, 1.5),  # one engine on a 2-CPU machine: two torch threads
    ([2.0], 2, 3, 0.625),  # prefill + decode beside read, write and one tokenizer
    ([2.0], 2, 5, 0.375),  # three tokenizer actors keep three slots
    ([4.0] * 4, 2, 2, 3.5),  # no more than a node holds beside the light stages
    ([2.0], 6, 2, 0.25),
    # every node hosts an actor: each keeps room for the read and write tasks (3.875 CPUs each left 0.125)
    ([4.0] * 4, 4, 2, 3.5),
    ([8.0, 8.0], 3, 2, 3.75),  # two actors on one node, one on the other (5.17 each: the third never started)
    ([8.0, 2.0], 2, 2, 3.75),  # the small node holds neither of two halves of 9.25
])
def test_engine_actors_share_what_the_light_stages_leave(nodes, actors, light, expected):
    assert actor_cpu_share(nodes, actors, light) == pytest.approx(expected)


def test_engine_actors_the_cluster_cannot_hold_beside_the_light_stages_are_refused():
    # 7 x 0.25 + 2 x 0.25 > 2 CPUs: the read tasks would never be scheduled and the job would wait forever
    with pytest.raises(JobError, match=r"7 engine actors do not fit 2 CPUs beside the read, write and tokenize "
                                       r"stages \(2 x 0.25 CPUs\)"):
        actor_cpu_share([2.0], 7, 2)


def _nodes(*specs):
    """ray.nodes() as a cluster of (CPUs, other resources) nodes would list them."""
    return [{"Alive": True, "Resources": {"CPU": cpus, **other}} for cpus, other in specs]


def test_engine_actors_are_sized_on_the_nodes_that_can_host_them(monkeypatch):
    """Sized on every node, an engine actor asking for a GPU was given a CPU-only head node's share (63.5 CPUs of a
    64-CPU head beside an 8-CPU GPU node): no node held it and the job waited forever; so did stage actors pinned
    to nodes smaller than the others."""
    import ray

    from batchgen.pipelines.pipeline import engine_actor_cpus

    monkeypatch.setattr(ray, "nodes", lambda: _nodes((64.0, {}), (8.0, {"GPU": 1.0})))
    gpu_job = JobConfig(model="m", input="i", output="o", mode="single", engine_num_gpus=1.0)
    assert engine_actor_cpus(gpu_job, "single") == pytest.approx(7.5)  # the GPU node's 8 less read and write
    two = JobConfig(model="m", input="i", output="o", mode="single", engine_num_gpus=1.0, concurrency=2)
    with pytest.raises(JobError, match=r"2 engine actors do not fit 8 CPUs .* on the 1 node\(s\) that can host them"):
        engine_actor_cpus(two, "single")  # one GPU: one actor
    cpu_job = JobConfig(model="m", input="i", output="o", mode="single")
    assert engine_actor_cpus(cpu_job, "single") == pytest.approx(63.5)

    monkeypatch.setattr(ray, "nodes", lambda: _nodes((8.0, {"prefill_node": 1.0}), (32.0, {"decode_node": 2.0}),
                                                     (2.0, {})))
    pinned = JobConfig(model="m", input="i", output="o", prefill_resources={"prefill_node": 1},
                       decode_resources={"decode_node": 1}, decode_concurrency=2)
    assert engine_actor_cpus(pinned, "prefill") == pytest.approx(8 - 3 * 0.25)  # beside read, write, a tokenizer
    assert engine_actor_cpus(pinned, "decode") == pytest.approx((32 - 3 * 0.25) / 2)
    three = JobConfig(model="m", input="i", output="o", prefill_resources={"prefill_node": 1},
                      decode_resources={"decode_node": 1}, decode_concurrency=3)  # the node's 2 units hold two
    with pytest.raises(JobError, match=r"3 engine actors do not fit 32 CPUs"):
        engine_actor_cpus(three, "decode")
    unpinned = JobConfig(model="m", input="i", output="o", decode_concurrency=2)  # three actors anywhere
    assert engine_actor_cpus(unpinned, "prefill") == engine_actor_cpus(unpinned, "decode") == pytest.approx(31.25 / 3)
    elsewhere = JobConfig(model="m", input="i", output="o", mode="single", engine_resources={"gpu_node": 1})
    with pytest.raises(JobError, match=r"no node of the cluster has what a single engine actor asks for \(0 GPUs, "
                                       r"resources \{'gpu_node': 1\}\); give engine_num_cpus"):
        engine_actor_cpus(elsewhere, "single")
    told = JobConfig(model="m", input="i", output="o", mode="single", engine_resources={"gpu_node": 1},
                     engine_num_cpus=3.0)
    assert engine_actor_cpus(told, "single") == 3.0


@pytest.mark.parametrize("mode,options,named", [
    ("disaggregated", {"concurrency": 8}, "concurrency"),
    ("disaggregated", {"engine_resources": {"gpu_node": 1}}, "engine_resources"),
    ("single", {"decode_concurrency": 4, "tokenize_concurrency": 2}, "decode_concurrency, tokenize_concurrency"),
    ("single", {"prefill_resources": {"a": 1}}, "prefill_resources"),
])
def test_options_of_the_other_mode_are_refused_not_ignored(mode, options, named):
    """`--concurrency 8` in the default (disaggregated) mode ran one prefill and one decode actor, saying nothing."""
    config = JobConfig(model="m", input="i", output="o", mode=mode, **options)
    with pytest.raises(JobError, match=rf"^{named} apply to the other mode than '{mode}', where they would be "
                                       r"ignored; give "):
        config.validate()
    JobConfig(model="m", input="i", output="o", mode=mode).validate()


def test_the_command_line_refuses_an_option_of_the_other_mode_even_at_its_default():
    from batchgen.pipelines.cli import UsageError, build_parser, job_config

    run = ["run", "--model", "m", "--input", "i", "--output", "o"]
    with pytest.raises(UsageError, match=r"^concurrency apply to the other mode than 'disaggregated'"):
        job_config(build_parser().parse_args([*run, "--concurrency", "1"]))
    with pytest.raises(UsageError, match=r"^tokenize_concurrency apply to the other mode than 'single'"):
        job_config(build_parser().parse_args([*run, "--mode", "single", "--tokenize-concurrency", "1"]))
    assert job_config(build_parser().parse_args([*run, "--mode", "single", "--concurrency", "1"])).concurrency == 1


def test_no_balancer_without_migrate_a_second_engine_actor_or_with_a_tensor_parallel_engine():
    """--no-migrate (migrate: false), one engine actor, or an engine whose KV is split by heads over its ranks:
    the job starts no WorkBalancer (starting one needs Ray, which these do not touch)."""
    from batchgen.pipelines.cli import build_parser, job_config

    args = build_parser().parse_args(["run", "--model", "m", "--input", "i", "--output", "o", "--mode", "single",
                                      "--concurrency", "2", "--no-migrate"])
    assert job_config(args).migrate is False and _work_balancer(job_config(args)) is None
    base = dict(model="m", input="i", output="o", mode="single")
    assert _work_balancer(JobConfig(**base, concurrency=1)) is None
    assert _work_balancer(JobConfig(**base, concurrency=2, engine={"tp_size": 2})) is None


@pytest.mark.parametrize("given", [{"prefill_concurrency": 2}, {"decode_concurrency": 3},
                                   {"prefill_concurrency": 2, "decode_concurrency": 3}])
def test_stage_sizes_beside_engine_actors_are_refused(given):
    """The planner's split replaced them without a word (the CLI refused the pair; the Python API took it)."""
    config = JobConfig(model="m", input="i", output="o", mode="disaggregated", engine_actors=4, **given)
    with pytest.raises(JobError, match=f"engine_actors lets the planner split the engine actors: drop "
                                       f"{' and '.join(given)}"):
        config.validate()


def test_a_stage_plan_gives_what_it_sized_for_the_decode_nodes_memory_to_the_decode_actors_alone():
    """The plan runs on a decode node and sizes the KV budgets and the MoE batch (its activations) for its memory:
    prefill actors, maybe on smaller devices, size their own; the schedule the plan picked is both stages'. Values
    the job gave stay both stages'."""
    planned = {"max_num_seqs": 64, "b_attn": 64, "b_moe": 4096, "kv_budget_bytes": 1 << 30,
               "host_kv_budget_bytes": 1 << 31, "staging_fraction": 0.25}
    shared, decode_only = stage_engines({"dtype": "float32"}, planned)
    assert decode_only == {"kv_budget_bytes": 1 << 30, "host_kv_budget_bytes": 1 << 31, "b_moe": 4096}
    assert shared == {"dtype": "float32", "max_num_seqs": 64, "b_attn": 64, "staging_fraction": 0.25}
    shared, decode_only = stage_engines({"kv_budget_bytes": 1 << 28, "b_moe": 512},
                                        {**planned, "kv_budget_bytes": 1 << 28, "b_moe": 512})
    assert decode_only == {"host_kv_budget_bytes": 1 << 31}
    assert shared["kv_budget_bytes"] == 1 << 28 and shared["b_moe"] == 512 and "host_kv_budget_bytes" not in shared
    # a null given (`--engine '{"kv_budget_bytes": null}'`) is unset: planned per stage, as if left out
    shared, decode_only = stage_engines({"kv_budget_bytes": None}, planned)
    assert decode_only["kv_budget_bytes"] == 1 << 30 and shared["kv_budget_bytes"] is None
