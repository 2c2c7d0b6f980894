"""Ray's overhead: output tokens/s of the Ray Data pipeline, in both shapes, against the engine alone.

    python bench/pipeline.py [--quick] [--json] [--seed 0] [--num-prompts 1024] [--experts 16] [--batch-size 64]
                             [--ray-address ADDR]

Workload "bench-moe", the same as bench/bct.py: the bench-moe preset, prompts of random token ids with
lengths uniform in [32, 256), output lengths lognormal(mu=3.5, sigma=0.8) + 1 capped at 512 and fixed
per prompt by max_tokens with ignore_eos, greedy, seed 0. The prompts are written to a Parquet file
(`prompt_token_ids` plus a per-row `sampling_params` struct) that both pipeline shapes read:

  engine          Engine.generate in this process (model loaded and warmed up before the clock starts);
  single          pipelines.run_job(mode="single"): read -> map_batches(BatchGen) -> write, its driver's
                  threads at `batchgen run`'s niceness (pipelines/driver_priority.py);
  disaggregated   pipelines.run_job(mode="disaggregated"): read -> tokenize -> prefill -> (KV in
                  the blocks, Ray object store) -> decode -> write.

One engine actor per engine stage, every engine with the same EngineConfig. Ray gets the machine's CPUs
and the engine actors the job's default share of them (pipelines.pipeline.engine_actor_cpus), which
sets their torch threads (operators.engine_actor.engine_threads): on 2 cores the single shape's one
engine computes on 2 threads like the in-process engine, the disaggregated shape's two on 1 each.
A pipeline's BCT runs from `run_job` called (Ray already up)
to its summary returned, so it includes actor start and model load; Ray's task timeline says how much
of it that start-up was. Overhead = 1 - pipeline tokens/s / engine tokens/s, split into start-up
(job start -> the last engine actor constructed, over the pipeline BCT) and the steady-state rest;
each run's CPU seconds are booked per process (engine actors, Ray's other processes, the driver, other
users' jobs) to show where the rest went. Full run ~10 min on 2 cores, --quick under a minute.
With --json the last line printed is one JSON object.

By default the bench starts its own Ray runtime (and shuts it down). `--ray-address ADDR` joins a
running one instead, and `main()` called in a process already connected to Ray uses that one (the
tests do); only a runtime this process started has its processes' CPU seconds booked.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from bct import (
    PAGE_SIZE,
    QUICK,
    ROUTING_TIE_GAP,
    TIE_GAP,
    Probe,
    Workload,
    WorkloadSpec,
    all_contexts_bytes,
    compare,
    engine_config,
    lazy_reference_probe,
    make_workload,
    run_engine,
)
from process_account import ProcessAccount, cpu_text
from roofline import MoEShape

from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.presets import build_preset
from batchgen.engine.planner.planner import curves_for
from batchgen.engine.process_heap import keep_freed_memory
from batchgen.kernels.calibration import measuring
from batchgen.operators.engine_actor import engine_threads
from batchgen.pipelines.driver_priority import driver_yields_cpu
from batchgen.pipelines.pipeline import JobConfig, engine_actor_cpus, run_job
from batchgen.pipelines.ray_runtime import init_ray

DEFAULT_PROMPTS = 1024
RESIDENT_SEQS = 256  # sequences the KV budgets are sized for
SHAPES = {"single": ("BatchGen",), "disaggregated": ("Prefill", "Decode")}  # engine stages per shape
OVERHEAD_GOAL = 0.10  # at most 10 % for both shapes


def write_prompts(path: Path, workload: Workload) -> None:
    """The workload as the pipelines read it: token-id prompts, each row's own sampling params."""
    sampling = [{"max_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in workload.max_tokens]
    table = pa.table({"id": list(range(len(workload.prompts))),
                      "prompt_token_ids": pa.array(workload.prompts, pa.list_(pa.int64())),
                      "sampling_params": sampling})
    pq.write_table(table, path)


def kv_budgets(shape: MoEShape, workload: Workload) -> tuple[int, int]:
    """(device, host) KV bytes: the longest contexts that can be resident at once (max_num_seqs of
    them) fit on the device twice over, room left after coroutine mode's staging share, as in bct.py's
    unconstrained scenario; without paying for every prompt's KV in each of the three engines."""
    resident = min(len(workload.prompts), RESIDENT_SEQS)
    longest = sorted(range(len(workload.prompts)), key=lambda i: workload.contexts[i])[-resident:]
    host = all_contexts_bytes(shape, Workload([workload.prompts[i] for i in longest],
                                              [workload.max_tokens[i] for i in longest]))
    return 2 * host, host


@dataclasses.dataclass
class PipelineRun:
    tokens: list[list[int]]
    bct_s: float
    generated_tokens: int
    errors: int
    started_at: float  # wall clock (time.time()), to place Ray's timeline events
    timeline: dict
    cpu_s: dict[str, float]
    cpu_by_process: dict[str, float]


def run_pipeline(mode: str, model_dir: str, input_path: Path, output: Path, engine: dict,
                 batch_size: int) -> PipelineRun:
    config = JobConfig(model=model_dir, input=str(input_path), output=str(output), mode=mode,
                       engine=engine, batch_size=batch_size)
    with ProcessAccount(SHAPES[mode]) as cpu:
        started_at, start = time.time(), time.perf_counter()
        with driver_yields_cpu():  # as `batchgen run` runs a job
            summary = run_job(config)
        bct = time.perf_counter() - start
    table = pq.read_table(output, columns=["row_index", "generated_token_ids", "error"]).sort_by("row_index")
    if table.column("row_index").to_pylist() != list(range(table.num_rows)):
        raise RuntimeError(f"{mode}: output rows {output} are not each input row once")
    timeline = engine_timeline(ray.timeline(), started_at, SHAPES[mode])
    return PipelineRun(tokens=[ids or [] for ids in table.column("generated_token_ids").to_pylist()],
                       bct_s=bct, generated_tokens=summary.progress.generated_tokens,
                       errors=summary.progress.errors, started_at=started_at, timeline=timeline,
                       cpu_s=cpu.seconds, cpu_by_process=cpu.by_process)


def engine_timeline(events: list[dict], started_at: float, stages: tuple[str, ...]) -> dict:
    """Each engine actor's construction and tasks, in seconds after job start, from Ray's task events:
    `MapWorker(MapBatches(X)).__init__` is the actor's constructor (imports, model load, KV pools),
    each `.submit` a task (one block's batches) handed to it; `Write` tasks commit the output."""
    since_us = started_at * 1e6

    def spans(cat: str) -> list[tuple[float, float]]:
        return sorted((e["ts"] / 1e6 - started_at, (e["ts"] + e["dur"]) / 1e6 - started_at)
                      for e in events if e["cat"] == cat and e["ts"] >= since_us)

    actors = {}
    for stage in stages:
        name = f"task::MapWorker(MapBatches({stage}))"
        inits, tasks = spans(f"{name}.__init__"), spans(f"{name}.submit")
        if not inits or not tasks:
            raise RuntimeError(f"Ray's timeline has no {name} constructor or task since the job started; "
                               "cannot split start-up from steady state")
        actors[stage] = {"init_start_s": inits[0][0], "init_s": inits[0][1] - inits[0][0],
                         "ready_s": inits[0][1], "constructions": len(inits), "tasks": len(tasks),
                         "first_task_s": tasks[0][0], "last_task_end_s": max(end for _, end in tasks),
                         "peak_tasks_in_flight": _peak_overlap(tasks)}
    writes = spans("task::Write")
    return {"actors": actors, "startup_s": max(a["ready_s"] for a in actors.values()),
            "first_engine_task_s": min(a["first_task_s"] for a in actors.values()),
            "last_engine_task_end_s": max(a["last_task_end_s"] for a in actors.values()),
            "last_write_end_s": max((end for _, end in writes), default=None)}


def _peak_overlap(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    peak = level = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def pipeline_summary(run: PipelineRun, engine_bct: float, output_tokens: int, reference: list[list[int]],
                     probe: Probe) -> dict:
    """Overhead = 1 - E/P (E, P: engine and pipeline BCT over the same tokens) = S/P + (P - S - E)/P:
    start-up S's share and the steady-state rest, which a longer run keeps paying."""
    startup = run.timeline["startup_s"]
    overhead = 1 - engine_bct / run.bct_s
    match = compare(reference, run.tokens, probe, TIE_GAP["float32"], ROUTING_TIE_GAP["float32"])
    return {
        "bct_s": run.bct_s,
        "tokens_per_s": output_tokens / run.bct_s,
        "overhead": overhead,
        "overhead_startup": startup / run.bct_s,
        "overhead_steady": (run.bct_s - startup - engine_bct) / run.bct_s,
        "startup_share_of_overhead": startup / (run.bct_s - engine_bct) if run.bct_s > engine_bct else None,
        "steady_state_overhead": 1 - engine_bct / (run.bct_s - startup),  # what a much longer run tends to
        "startup_s": startup,
        # after start-up: the engines' working span (compare with the engine's BCT), then the tail
        # (last rows detokenized and written, output scanned, summary)
        "engine_phase_s": run.timeline["last_engine_task_end_s"] - startup,
        "tail_s": run.bct_s - run.timeline["last_engine_task_end_s"],
        **{k: v for k, v in run.timeline.items() if k != "startup_s"},
        "cpu_s": run.cpu_s,
        "cpu_s_by_process": run.cpu_by_process,
        "rows_with_errors": run.errors,
        "generated_tokens_reported": run.generated_tokens,
        "outputs_match": match.all_match,
        "match": dataclasses.asdict(match),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"scaled-down workload: {QUICK}")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts and output lengths)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"default {DEFAULT_PROMPTS} ({QUICK['num_prompts']} with --quick)")
    parser.add_argument("--experts", type=int, default=None, help="override bench-moe's expert count (as bct.py)")
    parser.add_argument("--batch-size", type=int, default=JobConfig.batch_size,
                        help="rows per batch handed to each pipeline stage (JobConfig's default)")
    parser.add_argument("--ray-address", default=None,
                        help="join this running Ray runtime instead of starting one (e.g. 127.0.0.1:6379)")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "experts", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    spec = WorkloadSpec(**QUICK) if args.quick else WorkloadSpec(num_prompts=DEFAULT_PROMPTS)
    changes = {"seed": args.seed}
    if args.num_prompts is not None:
        changes["num_prompts"] = args.num_prompts
    return dataclasses.replace(spec, **changes)


def run(args: argparse.Namespace, workdir: Path, log) -> dict:
    spec = workload_spec(args)
    model_dir = build_preset("bench-moe", **({"experts": args.experts} if args.experts else {}))
    shape = MoEShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    workload = make_workload(spec, shape.vocab)
    output_tokens = sum(workload.max_tokens)
    device_bytes, host_bytes = kv_budgets(shape, workload)
    config = engine_config("coroutine", device_bytes, host_bytes)
    threads = torch.get_num_threads()
    load_at_start = os.getloadavg()  # other jobs on a shared machine skew every timing: report them
    log(f"model {model_dir}; {spec.num_prompts} prompts, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{output_tokens} output tokens (max {max(workload.max_tokens)}); "
        f"KV budget {device_bytes / 2**20:.0f} MiB device + {host_bytes / 2**20:.0f} MiB host per engine; "
        f"torch threads {threads}; load average {load_at_start[0]:.2f}")

    keep_freed_memory()  # as the engine actors' processes do (operators/engine_factory.py)
    load_start = time.perf_counter()
    loaded = load_model(model_dir, dtype=config.dtype, device="cpu")
    engine_load_s = time.perf_counter() - load_start
    with ProcessAccount(()) as engine_cpu:
        engine = run_engine(loaded, config, workload)
    log(f"engine: BCT {engine.bct_s:.2f} s, {output_tokens / engine.bct_s:.1f} tok/s (model load "
        f"{engine_load_s:.2f} s, not counted); {cpu_text(engine_cpu.seconds)}")

    input_path = workdir / "prompts.parquet"
    write_prompts(input_path, workload)
    init_start = time.perf_counter()
    own_ray = not ray.is_initialized()  # else: called as a library by a Ray driver, use its runtime
    if own_ray and args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    elif own_ray:
        init_ray(include_dashboard=False, log_to_driver=False)  # the machine's CPUs, as `batchgen run` does
    if not own_ray or args.ray_address:
        log(f"using the running Ray runtime at {ray.get_runtime_context().gcs_address}")
    ray_init_s = time.perf_counter() - init_start
    ray_cpus = ray.cluster_resources().get("CPU", 0.0)
    # what the job gives each engine actor by default, and the torch threads that makes
    actor_cpus = {m: engine_actor_cpus(JobConfig(model_dir, "", "", mode=m), "single" if m == "single" else "decode")
                  for m in SHAPES}  # (a split pipeline's two stages share the same nodes here: the same share)
    log(f"Ray: {ray_cpus:g} CPUs; CPUs per engine actor {actor_cpus}")
    # the engine actors plan like the engine alone, whose one-layer profile was made before its clock; a
    # profile is cached on disk per machine and thread count, so a deployed node has it from its first job:
    # make the actors' here too, outside every clock (with BATCHGEN_PLAN=0 nothing plans: 10-20 s saved a profile)
    if measuring():
        for actor_threads in sorted({engine_threads(c) for c in actor_cpus.values()}):
            torch.set_num_threads(actor_threads)
            curves_for(loaded)
        torch.set_num_threads(threads)
    del loaded
    gc.collect()
    data_context = ray.data.DataContext.get_current()
    progress_bars = data_context.enable_progress_bars  # process-wide: put back for whoever runs next
    data_context.enable_progress_bars = False
    pipelines = {}
    probe = lazy_reference_probe(model_dir, workload.prompts)
    try:
        for mode in SHAPES:
            result = run_pipeline(mode, model_dir, input_path, workdir / f"out-{mode}",
                                  dataclasses.asdict(config), args.batch_size)
            pipelines[mode] = pipeline_summary(result, engine.bct_s, output_tokens, engine.tokens, probe)
            log(describe(mode, pipelines[mode]))
    finally:
        data_context.enable_progress_bars = progress_bars
        if own_ray:
            ray.shutdown()

    return {
        "workload": {**dataclasses.asdict(spec), "prompt_tokens": sum(map(len, workload.prompts)),
                     "output_tokens": output_tokens, "max_output_tokens": max(workload.max_tokens),
                     "experts": shape.experts},
        "setup": {"engine_config": dataclasses.asdict(config), "batch_size": args.batch_size,
                  "rows_per_block": JobConfig.rows_per_block, "engine_actors_per_stage": 1,
                  "engine_actor_cpus": actor_cpus, "ray_logical_cpus": ray_cpus,
                  "torch_threads_per_engine": threads,
                  "torch_threads_per_engine_actor": {m: engine_threads(c) for m, c in actor_cpus.items()},
                  "page_size": PAGE_SIZE},
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_at_start,
                    "load_average_at_end": os.getloadavg()},
        "engine_load_s": engine_load_s,
        "engine_cpu_s": engine_cpu.seconds,  # warm-up (4 prompts x 8 tokens) included
        "ray_init_s": ray_init_s,
        "bct_s": {"engine": engine.bct_s, **{m: p["bct_s"] for m, p in pipelines.items()}},
        "tokens_per_s": {"engine": output_tokens / engine.bct_s,
                         **{m: p["tokens_per_s"] for m, p in pipelines.items()}},
        "overhead": {m: p["overhead"] for m, p in pipelines.items()},
        "overhead_goal": OVERHEAD_GOAL,
        "pipelines": pipelines,
        "outputs_match": all(p["outputs_match"] for p in pipelines.values()),
        "outputs_match_by_shape": {m: p["outputs_match"] for m, p in pipelines.items()},
    }


def describe(mode: str, summary: dict) -> str:
    line = (f"{mode}: BCT {summary['bct_s']:.2f} s, {summary['tokens_per_s']:.1f} tok/s, overhead "
            f"{summary['overhead']:.1%} = start-up {summary['overhead_startup']:.1%} (engines ready at "
            f"{summary['startup_s']:.2f} s) + steady state {summary['overhead_steady']:.1%} (engines busy "
            f"{summary['engine_phase_s']:.2f} s, tail {summary['tail_s']:.2f} s); outputs match the engine: "
            f"{summary['match']['exact']}/{summary['match']['total']}")
    line += f"; {cpu_text(summary['cpu_s'])}"
    if summary["match"]["first_mismatch"]:
        line += f", first difference {summary['match']['first_mismatch']}"
    return line


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-pipeline-") as workdir:
        report = run(args, Path(workdir), log=lambda message: print(message, flush=True))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
