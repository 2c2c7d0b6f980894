"""Planning a disaggregated job: how many of its engine actors prefill, and the engine settings they all
share, computed once where a decode engine actor would run (its device is the one profiled). What the plan sizes for
that node's memory (the KV budgets, and the MoE batch its activations must fit) goes to the decode actors alone: each
prefill actor sizes its own where it runs, as prefill nodes may hold less memory than decode nodes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import ray

from batchgen.engine.planner.stage_split import StageSplit

# the planned fields sized for the planning node's memory (b_moe: the tokens whose activations fit its free memory)
MEMORY_FIELDS = ("kv_budget_bytes", "host_kv_budget_bytes", "b_moe")

if TYPE_CHECKING:
    from batchgen.pipelines.pipeline import JobConfig


def plan_stages(config: JobConfig) -> tuple[JobConfig, StageSplit, dict[str, Any]]:
    """`config` with the prefill/decode split of its `engine_actors` and the planned engine fields every engine actor
    shares set; and the planned fields sized for that node's memory, for the decode actors alone (`stage_engines`)."""
    from batchgen.pipelines.pipeline import engine_actor_cpus

    sized = dataclasses.replace(config, prefill_concurrency=1, decode_concurrency=config.engine_actors - 1)
    # the worker exits after the task: it loaded a model, and runs as an engine actor's process does
    task = ray.remote(num_cpus=engine_actor_cpus(sized, "decode"), num_gpus=config.engine_num_gpus,
                      resources=config.decode_resources, max_calls=1)(_plan_on_engine_node)
    engine, split = ray.get(task.remote(config.model, config.engine, config.input, config.storage_options,
                                        config.sampling_params, config.engine_actors, config.chat_template))
    shared, decode_only = stage_engines(config.engine, engine)
    planned = dataclasses.replace(sized, engine=shared, prefill_concurrency=split.prefill_actors,
                                  decode_concurrency=split.decode_actors)
    return planned, split, decode_only


def stage_engines(given: dict[str, Any], planned: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine settings of both stages (`given`, and the planned fields but those sized for the planning node's
    memory), and those for the decode actors alone. A value the job gave is in `given`: both stages keep it (a
    null given is unset: planned per stage)."""
    decode_only = {name: planned[name] for name in MEMORY_FIELDS if name in planned and given.get(name) is None}
    shared = {**given, **{name: value for name, value in planned.items() if name not in decode_only}}
    return shared, decode_only


def _plan_on_engine_node(model: str, engine: dict[str, Any], input_uri: str, storage_options: dict[str, Any],
                         sampling: dict[str, Any], engine_actors: int,
                         chat_template: str | None = None) -> tuple[dict[str, Any], StageSplit]:
    """The planned engine settings and the stage split, as every engine actor will run them. A task given a
    fraction of a GPU plans within that share of it (prepare_engine_process), as each engine actor will run: two
    actors sharing a GPU each hold their own weights beside their pools."""
    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import EngineConfig, SamplingParams
    from batchgen.engine.offload.memory_constrained import place_as_engine
    from batchgen.engine.planner import PLANNED_FIELDS, plan_engine
    from batchgen.engine.planner.stage_split import plan_stage_split
    from batchgen.operators.engine_actor import prepare_engine_process
    from batchgen.operators.workload_sample import NoPromptToPlanFor, input_workload

    prepare_engine_process()  # the threads and priority the engine actors compute with: the profile times those
    config = EngineConfig.from_kwargs(**engine)
    loaded = load_model(model, dtype=config.dtype, device=config.load_device(),
                        shared_host_weights=config.shares_host_weights, storage_options=storage_options)
    _streamer, config = place_as_engine(loaded, config)  # kept while the plan profiles the streamed weights
    try:
        workload = input_workload(input_uri, loaded, SamplingParams.from_dict(sampling), storage_options,
                                  chat_template)
    except NoPromptToPlanFor:  # planned for a generic workload: the job writes each row's error
        workload = None
    plan = plan_engine(loaded, config, workload=workload, progress=False)
    split = plan_stage_split(engine_actors, plan.workload, plan.curves, plan.config)
    return {name: getattr(plan.config, name) for name in PLANNED_FIELDS}, split
