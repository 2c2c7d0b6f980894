"""`batchgen plan`: the engine configuration the planner picks for a model, a workload and a device, with
the predicted step times and batch completion time, the runner-ups and, given a number of engine actors,
how many of them should prefill in the disaggregated pipeline.

    batchgen plan --model URI [--input URI] [--engine-actors N] [--engine JSON] [--max-tokens N]
                  [--chat-template T] [--curves FILE | --save-curves FILE] [--json]

Without --curves the model is loaded on the engine's device and one layer profiled (cached on disk);
with --curves (written by --save-curves on the target machine) only the model's config is read, so a GPU
cluster can be planned from a laptop.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from batchgen.pipelines.cli_args import chat_template_text, json_object


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="plan engine settings (and the stage split) for a model and workload",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory, fsspec URI or preset name")
    p.add_argument("--input", help="Parquet input: its prompt lengths and max_tokens are the workload (its first "
                                   "rows); default: a generic chat-sized workload")
    p.add_argument("--engine-actors", type=int, help="total engine actors: also plan how many prefill")
    p.add_argument("--engine", type=json_object, default={}, help="EngineConfig fields as JSON; these are kept")
    p.add_argument("--max-tokens", type=int, help="output tokens per row when a row does not say (default 16)")
    p.add_argument("--chat-template", help="the job's --chat-template, for the --input rows of messages")
    p.add_argument("--storage-options", type=json_object, default={}, help="fsspec options as JSON")
    p.add_argument("--curves", help="cost curves file to plan with instead of profiling this machine")
    p.add_argument("--save-curves", help="write the profiled cost curves to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_plan(args: argparse.Namespace) -> int:
    from batchgen.connectors.checkpoint import load_model
    from batchgen.connectors.io import StorageError
    from batchgen.engine import EngineConfig, SamplingParams
    from batchgen.engine.offload.memory_constrained import place_as_engine
    from batchgen.engine.planner import CostCurves, plan_engine
    from batchgen.engine.planner.planner import curves_for
    from batchgen.engine.planner.stage_split import plan_stage_split
    from batchgen.operators.workload_sample import input_workload
    from batchgen.pipelines.cli import UsageError

    try:
        config = EngineConfig.from_kwargs(**args.engine)
        defaults = SamplingParams(**({} if args.max_tokens is None else {"max_tokens": args.max_tokens}))
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if args.engine_actors is not None and args.engine_actors < 2:
        raise UsageError(f"--engine-actors must be at least 2 to split prefill from decode, got {args.engine_actors}")
    if args.curves and args.save_curves:
        raise UsageError("--curves plans with given curves; --save-curves saves profiled ones: pick one")
    if args.chat_template is not None and not args.input:
        raise UsageError("--chat-template renders the --input rows of messages: give --input too")
    try:
        template = None if args.chat_template is None else chat_template_text(args.chat_template)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    curves = None
    if args.curves and config.device_memory_bytes is not None:
        raise UsageError("--curves plans without the weights, which a device_memory_bytes engine must place: "
                         "profile instead (leave out --curves)")
    if args.curves:
        try:
            curves = CostCurves.load(args.curves)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        loaded = load_model(args.model, dtype=config.dtype, device=config.load_device(),
                            shared_host_weights=config.shares_host_weights,
                            storage_options=args.storage_options, weights=curves is None)
    except (ValueError, OSError) as exc:  # CheckpointError, PresetError, an unsupported model; storage errors
        raise UsageError(f"model {args.model!r} is not readable: {exc}") from None
    try:
        loaded.context_length(config.max_model_len)  # (the plan clamped a longer one without a word)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if curves is not None:
        check_curves_fit(curves, loaded)
    if curves is None:
        _streamer, config = place_as_engine(loaded, config)  # kept while the profile times the streamed weights
        curves = curves_for(loaded, progress=None if args.json else True, batch_invariant=config.batch_invariant)
        if args.save_curves:
            with open(args.save_curves, "w") as f:
                f.write(curves.to_json())
    workload = None
    if args.input:
        try:
            workload = input_workload(args.input, loaded, defaults, args.storage_options, template)
        except (ValueError, StorageError) as exc:
            raise UsageError(str(exc)) from None
    plan = plan_engine(loaded, config, workload=workload, curves=curves)
    out = plan.summary()
    if args.engine_actors is not None:
        split = plan_stage_split(args.engine_actors, plan.workload, curves, plan.config)
        out["stage_split"] = {"prefill_actors": split.prefill_actors, "decode_actors": split.decode_actors,
                              "predicted_bct_s": round(split.predicted_bct_s, 3),
                              "by_prefill_actors": {str(k): round(v, 3) for k, v in split.by_prefill_actors.items()}}
    print(json.dumps(out) if args.json else plan_text(out))
    return 0


def plan_text(out: dict) -> str:
    c = out["config"]
    lines = [f"workload     {out['workload']}",
             f"planned      max_num_seqs={c['max_num_seqs']} refill_threshold={c['refill_threshold']} "
             f"b_attn={c['b_attn']} b_moe={c['b_moe']} staging_fraction={c['staging_fraction']}",
             f"KV           device {c['kv_budget_bytes'] / 2**20:.1f} MiB, "
             f"host {c['host_kv_budget_bytes'] / 2**20:.1f} MiB",
             f"predicted    BCT {out['predicted_bct_s']:.2f} s over {out['steps']} steps (mean "
             f"{out['predicted_step_s']['mean'] * 1e3:.1f} ms, max {out['predicted_step_s']['max'] * 1e3:.1f} ms)"]
    for i, r in enumerate(out["runner_ups"], 1):
        rc = r["config"]
        lines.append(f"runner-up {i}  max_num_seqs={rc['max_num_seqs']} refill_threshold={rc['refill_threshold']} "
                     f"b_attn={rc['b_attn']} b_moe={rc['b_moe']}: {r['predicted_bct_s']:.2f} s")
    if "stage_split" in out:
        s = out["stage_split"]
        lines.append(f"stage split  {s['prefill_actors']} prefill + {s['decode_actors']} decode actors: "
                     f"{s['predicted_bct_s']:.2f} s ({s['by_prefill_actors']})")
    return "\n".join(lines)


def check_curves_fit(curves, loaded) -> None:
    """UsageError unless `curves` were measured on this model's shape and dtype: the key names the machine too,
    which a file measured elsewhere never matches, but a plan from another model's or another dtype's curves would
    size every budget wrong, silently."""
    from batchgen.engine.planner.profiler import model_shape
    from batchgen.pipelines.cli import UsageError

    differ = {name: (getattr(curves, name), value) for name, value in model_shape(loaded).items()
              if getattr(curves, name) != value}
    if differ:
        text = ", ".join(f"{name} {theirs} there, {ours} here" for name, (theirs, ours) in differ.items())
        raise UsageError(f"the cost curves were measured for another model or dtype ({text}): give --engine the "
                         f"dtype they were measured with, or profile this model")
