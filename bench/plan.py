"""The planner against a sweep: does the configuration it picks run as fast as the best of a dozen others,
faster than the old fixed defaults, and does it predict each step's time?

    python bench/plan.py [--json] [--num-prompts 128] [--bulk-prompts 1024] [--repeats 2]
                         [--scenarios unconstrained,kv_budget,experts64,bulk]

Scenarios (bench/bct.py's bench-moe workload, greedy, fixed output lengths):
- unconstrained: device KV holds every sequence's full context;
- kv_budget: device KV holds 16 sequences of mean full context (bct.py's budget scenario);
- experts64: unconstrained, on the preset with 64 experts, top-4;
- bulk: unconstrained, `--bulk-prompts` short prompts (16-64 tokens) with short outputs (lognormal mu 2.0,
  at most 64): more prompts than the old default max_num_seqs admits at once, as an ETL job has.

In each scenario the same engine runs, one after another in one process: the sweep (configurations
spanning max_num_seqs, b_attn, b_moe and the refill threshold), the planner's choice for the scenario's
memory and workload, and the old fixed defaults (max_num_seqs 256, b_attn 256, b_moe 8192, refill 0.5,
staging 0.25). Every run is timed step by step and compared with the planner's prediction of the same
configuration (the scheduler replayed, each step priced by the cost curves): the median relative error
over steps. The profile is measured fresh at the start (its time is reported). Each configuration runs
`--repeats` times, round-robin (the CPU time the hypervisor gave other guests during each run is reported as
`stolen_s`).

Configurations that compute the same thing are one execution: the same replayed steps (the engine's own
scheduler: a test holds the replay equal to the engine's steps) cut into the same attention micro-batches and
feed-forward calls (a limit above every step's count cuts nothing). On a small workload most configurations
are one of a few executions, whose runs differ only by the machine's noise. A configuration's BCT
(`planned_bct_s`, `best_swept_bct_s` over the sweep, `default_bct_s`) is the median of every run of its
execution; each configuration's own runs are in `runs`, and the same comparisons on each configuration's best
own run in `by_configuration`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bct import WorkloadSpec, all_contexts_bytes, budget_bytes, make_workload, requests_for  # noqa: E402
from roofline import MoEShape  # noqa: E402

from batchgen.connectors.checkpoint import load_model  # noqa: E402
from batchgen.engine import Engine, EngineConfig  # noqa: E402
from batchgen.engine.host_view import streams_host_kv  # noqa: E402
from batchgen.engine.kv_budget import MemoryLimits, plan_kv_budget  # noqa: E402
from batchgen.engine.planner import PLANNED_FIELDS, WorkloadShape, plan_engine  # noqa: E402
from batchgen.engine.planner.planner import FIXED  # noqa: E402
from batchgen.engine.planner.profiler import profile_model  # noqa: E402
from batchgen.engine.planner.schedule_pricing import SchedulePricer  # noqa: E402
from batchgen.engine.planner.schedule_replay import replay_schedule  # noqa: E402

PAGE_SIZE = 64
SWEPT = ("max_num_seqs", "refill_threshold", "b_attn", "b_moe")
# (max_num_seqs, refill_threshold, b_attn, b_moe) for 128 prompts (populations scale with the prompt count):
# small to large populations, tiny to whole micro-batches
SWEEP = ((8, 0.5, 8, 8192), (16, 0.5, 16, 8192), (16, 0.75, 8, 1024), (32, 0.5, 32, 8192), (32, 0.25, 16, 512),
         (64, 0.5, 64, 8192), (64, 0.75, 16, 2048), (128, 0.5, 128, 8192), (128, 0.5, 32, 256),
         (128, 0.5, 128, 64), (256, 0.5, 64, 16384), (256, 0.5, 16, 4096), (512, 0.5, 512, 16384))
# name -> (model, device KV holding this many mean contexts or None: all of them, workload beside bct.py's)
SCENARIOS = {"unconstrained": ("bench-moe", None, {}), "kv_budget": ("bench-moe", 16, {}),
             "experts64": ("bench-moe?experts=64&top_k=4", None, {}),
             "bulk": ("bench-moe", None, dict(prompt_len=(16, 64), mu=2.0, max_output=64))}


@dataclasses.dataclass
class Measured:
    bct_s: float
    step_s: list[float]
    tokens: list[list[int]]


def run_config(loaded, config: EngineConfig, requests) -> Measured:
    """BCT from the first request to the last result, each step timed."""
    engine = Engine(loaded, config)
    gc.collect()
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    steps, results = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        results.extend(engine.step())
        steps.append(time.perf_counter() - t0)
    bct = time.perf_counter() - start
    by_id = {r.request_id: r for r in results}
    del engine
    return Measured(bct, steps, [by_id[r.request_id].outputs[0].token_ids for r in requests])


def replayed(loaded, config: EngineConfig, workload: WorkloadShape, curves) -> SchedulePricer:
    stream_host = streams_host_kv(config.stream_host_kv, loaded.device.type)
    schedule = replay_schedule(config, plan_kv_budget(config, stream_host), loaded.model.kv_spec(), loaded.dtype,
                               workload, stream_host, loaded.device.type)
    return SchedulePricer(schedule, curves)


def step_errors(predicted: list[float], measured: list[float]) -> list[float]:
    if len(predicted) != len(measured):
        raise RuntimeError(f"the replay predicted {len(predicted)} steps, the engine ran {len(measured)}")
    return [abs(p - m) / m for p, m in zip(predicted, measured)]


def _steal_s() -> float:
    """Seconds of CPU the hypervisor gave other guests so far (all CPUs; /proc/stat's steal column)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def scenario(name: str, model: str, budget_seqs: int | None, spec: WorkloadSpec, repeats: int, log) -> dict:
    loaded = load_model(model)
    shape = MoEShape.from_hf_config(loaded.config.to_dict())
    workload = make_workload(spec, shape.vocab)
    shape_only = WorkloadShape(tuple(map(len, workload.prompts)), tuple(workload.max_tokens))
    everything = all_contexts_bytes(shape, workload)
    device_bytes = budget_bytes(shape, workload, budget_seqs) if budget_seqs else everything
    memory = MemoryLimits(device_kv_bytes=device_bytes, host_kv_bytes=everything, activation_bytes=1 << 30)
    base = EngineConfig(page_size=PAGE_SIZE, kv_budget_bytes=device_bytes, host_kv_budget_bytes=everything)
    requests = requests_for(workload)
    run_config(loaded, dataclasses.replace(base, **FIXED), requests_for(make_workload(
        WorkloadSpec(num_prompts=4, seed=1, prompt_len=(16, 32), mu=1.0), shape.vocab)))  # warm-up

    start = time.perf_counter()
    curves = profile_model(loaded, progress=False)
    profile_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_engine(loaded, base, workload=shape_only, curves=curves, limits=memory)
    plan_s = time.perf_counter() - start
    planned = {k: getattr(plan.config, k) for k in PLANNED_FIELDS if not k.endswith("budget_bytes")}
    log(f"[{name}] profiled in {profile_s:.1f} s, planned in {plan_s:.1f} s: {planned} predicted "
        f"{plan.predicted_bct_s:.1f} s")

    scale = max(1, 2 ** round(math.log2(spec.num_prompts / 128)))  # the sweep's populations follow the prompts
    configs = {f"sweep{i}": dataclasses.replace(base, max_num_seqs=n * scale, refill_threshold=r, b_attn=a * scale,
                                               b_moe=m, staging_fraction=0.25)
               for i, (n, r, a, m) in enumerate(SWEEP)}
    configs["planned"] = plan.config
    configs["default"] = dataclasses.replace(base, **FIXED)
    pricers = {label: replayed(loaded, config, shape_only, curves) for label, config in configs.items()}
    executions: dict[tuple, int] = {}  # execution -> its number, in order of first appearance
    execution_of = {label: executions.setdefault(pricers[label].execution(config.b_attn, config.b_moe),
                                                 len(executions)) for label, config in configs.items()}
    log(f"[{name}] {len(configs)} configurations, {len(executions)} executions: {execution_of}")
    best: dict[str, Measured] = {}
    bcts: dict[str, list[float]] = {label: [] for label in configs}
    steal: dict[str, list[float]] = {label: [] for label in configs}
    for repeat in range(repeats):  # round-robin: a slow spell of the machine hits every configuration alike
        for label, config in configs.items():
            before = _steal_s()
            measured = run_config(loaded, config, requests)
            steal[label].append(_steal_s() - before)
            bcts[label].append(measured.bct_s)
            log(f"[{name}] {label:8s} run {repeat + 1}: BCT {measured.bct_s:6.2f} s (CPU time stolen by the host "
                f"{steal[label][-1]:.1f} s)")
            if label not in best or measured.bct_s < best[label].bct_s:
                best[label] = measured
            gc.collect()
    runs, errors, reference = {}, [], best["default"].tokens
    for label, config in configs.items():
        measured = best[label]
        predicted = pricers[label].step_seconds(config.b_attn, config.b_moe).tolist()
        errs = step_errors(predicted, measured.step_s)
        errors.extend(errs)
        differing = sum(a != b for a, b in zip(reference, measured.tokens))
        runs[label] = {"config": {k: getattr(config, k) for k in SWEPT}, "execution": execution_of[label],
                       "bct_s": [round(x, 3) for x in bcts[label]], "predicted_bct_s": round(sum(predicted), 3),
                       "steps": len(measured.step_s), "median_step_error": round(statistics.median(errs), 4),
                       "stolen_s": [round(x, 2) for x in steal[label]],
                       "sequences_differing_from_default": differing}
        log(f"[{name}] {label:8s} {runs[label]['config']} execution {execution_of[label]}: BCT {bcts[label]} s "
            f"(predicted {sum(predicted):6.2f}), {len(errs)} steps, median step error "
            f"{statistics.median(errs):.1%}, {differing} sequences differ from the defaults' run")
    per_execution = {number: statistics.median([x for label in configs if execution_of[label] == number
                                                for x in bcts[label]]) for number in executions.values()}
    by_execution = compare({label: per_execution[execution_of[label]] for label in configs})
    log(f"[{name}] by execution: {by_execution}")
    return {**by_execution, "by_configuration": compare({label: min(bcts[label]) for label in configs}),
            "execution_bct_s": {str(k): round(v, 3) for k, v in per_execution.items()},
            "median_step_prediction_error": round(statistics.median(errors), 4),
            "profile_s": round(profile_s, 2), "plan_s": round(plan_s, 2), "kv_budget_bytes": device_bytes,
            "workload": shape_only.describe(),
            "planned_config": runs["planned"]["config"], "runs": runs}


def compare(bct: dict[str, float]) -> dict:
    """The planned configuration's BCT against the best of the sweep and the defaults'."""
    best = min(v for k, v in bct.items() if k.startswith("sweep"))
    return {"planned_bct_s": round(bct["planned"], 3), "best_swept_bct_s": round(best, 3),
            "default_bct_s": round(bct["default"], 3), "planned_over_best": round(bct["planned"] / best, 3),
            "planned_over_default": round(bct["planned"] / bct["default"], 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--num-prompts", type=int, default=128, help="prompts per scenario but bulk")
    parser.add_argument("--bulk-prompts", type=int, default=1024, help="prompts of the bulk scenario")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {list(SCENARIOS)}")
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    out = {"load_average": os.getloadavg()[0], "threads": torch.get_num_threads(), "scenarios": {}}
    for name in names:
        model, budget_seqs, workload = SCENARIOS[name]
        workload = {**workload, "num_prompts": args.bulk_prompts if name == "bulk" else args.num_prompts}
        out["scenarios"][name] = scenario(name, model, budget_seqs, WorkloadSpec(**workload), args.repeats, log)
    out["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
