"""The `batchgen` command. Each subcommand is one entry of SUBCOMMANDS: (add its parser, run it).

    batchgen run --model URI --input URI --output URI [--mode disaggregated|single]
                 [--prefill-concurrency N --decode-concurrency M | --concurrency N] [--config job.yaml]
    batchgen demo
    batchgen serve --model URI --storage URI [--backend engine|ray]   (the OpenAI Batch API)
    batchgen plan --model URI [--input URI]   (what `run` would set, without running)

Exit status: 0 when the job completed, whatever its per-row errors; 1 when it failed or could not
start (the message says why); 2 for a bad command line or config file (an unknown or invalid option value).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO

from batchgen.operators.work_balancer import BalancerStats
from batchgen.pipelines.cli_args import (
    chat_template_text,
    json_object,
    parse_json_object,
    positive_int,
    positive_number,
)
from batchgen.pipelines.driver_priority import driver_yields_cpu
from batchgen.pipelines.openai_batch.serve_cli import add_serve_parser, run_serve
from batchgen.pipelines.pipeline import (
    JobConfig,
    JobError,
    JobPlan,
    JobSummary,
    execute_job,
    other_mode_message,
    other_mode_options,
    plan_job,
)
from batchgen.pipelines.plan_cli import add_plan_parser, run_plan
from batchgen.pipelines.progress import Progress
from batchgen.pipelines.ray_runtime import init_ray
from batchgen.pipelines.stderr_filter import filtered_stderr

# command-line shortcuts for the most used sampling parameters (full set: --sampling-params JSON)
_SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "n": int, "seed": int}
_JOB_FIELDS = {f.name for f in fields(JobConfig)}
_OBJECT_OPTIONS = {f.name for f in fields(JobConfig) if f.type.startswith("dict")}  # JSON objects on a command line
_ACTOR_COUNTS = {
    "--prefill-concurrency": "prefill engine actors (disaggregated)",
    "--decode-concurrency": "decode engine actors (disaggregated)",
    "--concurrency": "engine actors (single)",
    "--tokenize-concurrency": "tokenizer actors, CPU only (disaggregated)",
    "--engine-actors": "engine actors in all (disaggregated): the planner splits them between prefill and decode",
}


class UsageError(ValueError):
    """A bad command line or config file (exit status 2)."""


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="generate for every row of a Parquet dataset on Ray",
                              description="Read Parquet, generate, write Parquet in input order. Restarting "
                                          "with the same --output resumes: written rows are not redone.")
    p.add_argument("--config", help="YAML file with the job's options below (underscored names; not "
                                    "--device-memory-mb, --no-progress, --verbose: engine: {device_memory_bytes: N} "
                                    "for the first); command-line values override it")
    p.add_argument("--model", help="checkpoint directory, fsspec URI (s3://...) or preset name (tiny-moe)")
    p.add_argument("--input", help="Parquet file or folder (local or fsspec URI)")
    p.add_argument("--output", help="output folder (local or fsspec URI)")
    _add_job_options(p)
    return p


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="run the built-in demo: tiny-moe over the demo prompts",
                              description="Writes the demo prompts to OUT/demo_prompts.parquet, runs them "
                                          "through the Ray pipeline with the tiny-moe preset and writes "
                                          "OUT/results/ (replaced on every run).")
    p.add_argument("--out", default="out", help="demo folder (default ./out)")
    p.add_argument("--rows", type=positive_int, default=64, help="number of demo prompts (default 64)")
    _add_job_options(p)
    return p


DEMO_SAMPLING = {"max_tokens": 32, "temperature": 0.0}  # under --sampling-params and the sampling flags


def _add_job_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("disaggregated", "single"),
                   help="separate prefill and decode stages (default) or one engine stage")
    for flag, what in _ACTOR_COUNTS.items():
        p.add_argument(flag, type=int, help=what)
    p.add_argument("--batch-size", type=int, help="rows per batch handed to each stage")
    for name, kind in _SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=f"sampling default '{name}'")
    p.add_argument("--sampling-params", type=json_object, help="sampling defaults as JSON (rows override)")
    p.add_argument("--engine", type=json_object, help='EngineConfig fields as JSON, e.g. {"max_num_seqs": 512}')
    p.add_argument("--device-memory-mb", type=positive_number,
                   help="device memory per engine for weights, KV and activations together: weights stay in host "
                        "memory and what does not fit streams to the device (engine option device_memory_bytes)")
    p.add_argument("--engine-num-cpus", type=float, help="CPUs per engine actor (default: a share of the cluster)")
    p.add_argument("--engine-num-gpus", type=float,
                   help="GPUs per engine rank (default 0); an engine actor asks for ep_size x tp_size times this")
    for stage, actors in (("engine", "BatchGen (single)"), ("prefill", "prefill"), ("decode", "decode")):
        p.add_argument(f"--{stage}-resources", type=json_object,
                       help=f'custom Ray resources each {actors} engine actor asks for, to pin it to the nodes '
                            f'that offer them, as JSON, e.g. {{"{stage}_node": 1}}')
    p.add_argument("--chat-template", help="Jinja chat template (a file or the template itself) for the `messages` "
                                           "rows (default: the tokenizer's own)")
    p.add_argument("--rows-per-block", type=int, help="rows per block read from the input (default 256)")
    p.add_argument("--rows-per-file", type=int, help="rows gathered per output write (default: Ray's choice)")
    p.add_argument("--storage-options", type=json_object,
                   help='fsspec options for model, input and output as JSON, e.g. {"endpoint_url": "..."}')
    p.add_argument("--ray-address", help="Ray cluster to join (default: $RAY_ADDRESS, else a local one)")
    p.add_argument("--no-migrate", dest="migrate", action="store_false", default=None,
                   help="never move requests between engine actors (by default busy ones hand work to idle ones)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="show Ray's own log lines and worker output")


def job_config(args: argparse.Namespace) -> JobConfig:
    """Defaults < the --config YAML file < the command line."""
    values: dict[str, Any] = _read_yaml(args.config) if getattr(args, "config", None) else {}
    values["sampling_params"] = {**(values.get("sampling_params") or {}),
                                 **{k: values.pop(k) for k in _SAMPLING_FLAGS if k in values}}
    if getattr(args, "ray_address", None) is None:
        args.ray_address = values.get("ray_address")
    values.pop("ray_address", None)
    for name in _JOB_FIELDS:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = {**(values.get(name) or {}), **given} if isinstance(given, dict) else given
    for name in _SAMPLING_FLAGS:
        if getattr(args, name, None) is not None:
            values["sampling_params"][name] = getattr(args, name)
    if getattr(args, "device_memory_mb", None) is not None:
        values["engine"] = {**(values.get("engine") or {}), "device_memory_bytes": int(args.device_memory_mb * 2**20)}
    if values.get("engine_actors") is not None and any(
            values.get(k) is not None for k in ("prefill_concurrency", "decode_concurrency")):
        raise UsageError("--engine-actors lets the planner split the engine actors: drop --prefill-concurrency "
                         "and --decode-concurrency, or give those two alone")
    mode = values.get("mode") or "disaggregated"
    given = [name for name in other_mode_options(mode) if values.get(name) is not None]
    if given:  # even at their default value: JobConfig tells only values apart from it
        raise UsageError(other_mode_message(given, mode))
    missing = [f"--{name}" for name in ("model", "input", "output") if not values.get(name)]
    if missing:
        raise UsageError(f"missing {', '.join(missing)} (on the command line or in --config)")
    try:
        values["storage_options"] = parse_json_object(values.get("storage_options"), "storage options")
        if isinstance(values.get("chat_template"), str):  # a file's path, or the template itself
            values["chat_template"] = chat_template_text(values["chat_template"])
        config = JobConfig(**values)
        config.validate()  # a bad value is a bad command line or config file, found before anything starts
    except (ValueError, JobError) as exc:
        raise UsageError(str(exc)) from None
    return config


def _read_yaml(path: str) -> dict[str, Any]:
    """Any command-line option, underscored (batch_size, max_tokens, engine: {...}, ...)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read config file {path!r}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path!r} must hold a mapping of option: value")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = _JOB_FIELDS | set(_SAMPLING_FLAGS) | {"ray_address"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"config file {path!r}: unknown option(s) {unknown}; known: {sorted(known)}")
    for name in _OBJECT_OPTIONS & set(data):  # a mapping, or the JSON text the command line takes
        try:
            data[name] = parse_json_object(data[name], f"config file {path!r}: {name}")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return data


def run_command(args: argparse.Namespace) -> int:
    config = job_config(args)
    summary = _run(config, args)
    print(summary_text(summary))
    return 0


def demo_command(args: argparse.Namespace) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.connectors.demo_data import demo_prompts

    out = Path(args.out)
    results = out / "results"
    shutil.rmtree(results, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "demo_prompts.parquet"
    pq.write_table(pa.table({"prompt": demo_prompts(args.rows)}), prompts, row_group_size=16)
    config = demo_config(args, str(prompts), str(results))
    print(f"batchgen demo: {args.rows} prompts, model tiny-moe, {config.mode} pipeline -> {results}/")
    summary = _run(config, args)
    print(summary_text(summary))
    first = _first_result(results)
    if first is not None:
        print(f"  first row    {first['prompt'][:60]!r}\n            -> {first['generated_text'][:60]!r}")
    return 0


def _run(config: JobConfig, args: argparse.Namespace) -> JobSummary:
    if args.verbose:
        return _execute(config, args, sys.stderr)
    with filtered_stderr() as terminal:  # Ray's harmless error-level lines stay out of the terminal
        return _execute(config, args, terminal)


def _execute(config: JobConfig, args: argparse.Namespace, terminal: TextIO) -> JobSummary:
    plan = plan_job(config)  # fails fast, before Ray starts
    try:
        return _execute_planned(plan, args, terminal)
    finally:
        plan.lease.release()  # execute_job's own release, unless Ray failed to start before it


def _execute_planned(plan: JobPlan, args: argparse.Namespace, terminal: TextIO) -> JobSummary:
    import ray

    if not ray.is_initialized():
        address = args.ray_address or os.environ.get("RAY_ADDRESS")
        # worker log lines and Ray's own warnings only with --verbose; a failing task still raises here
        init_ray(address, include_dashboard=False, log_to_driver=args.verbose,
                 logging_level=logging.INFO if args.verbose else logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.INFO if args.verbose else logging.ERROR)
    bar = None if args.no_progress else _ProgressBar(terminal)
    try:
        with driver_yields_cpu():  # on the engines' cores, the driver's work would stall their thread teams
            return execute_job(plan, on_progress=bar)
    finally:
        if bar is not None:
            bar.close()


class _ProgressBar:
    """Rows out of the engines / rows to do (and how many are written), generated tokens/s and the ETA
    since the start, on stderr."""

    def __init__(self, terminal: TextIO) -> None:
        self._terminal = terminal
        self._bar = None

    def __call__(self, p: Progress) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=p.total_rows - p.skipped_rows, unit="row", file=self._terminal,
                             desc="batchgen", dynamic_ncols=True)
        self._bar.n = p.done_rows
        eta = "?" if p.eta_s is None else f"{p.eta_s:.0f}s"
        self._bar.set_postfix_str(f"{p.rows} written, {p.tokens_per_s:.1f} tok/s, ETA {eta}, {p.errors} errors",
                                  refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def balancing_lines(b: BalancerStats | None) -> list[str]:
    """MIGRATE's part of the job summary (nothing when the job had no balancer)."""
    if b is None:
        return []
    busy = ", ".join(f"{s:.1f} s" for s in sorted(b.busy_s.values(), reverse=True)) or "none"
    return [f"  migrated     {b.migrations} requests between engine actors ({b.kv_bytes_moved / 2**20:.1f} MiB of "
            f"KV), {b.partition_events} partition moves, {b.lost} returned from a dead actor",
            f"  recovered    {b.restored} from checkpoints, {b.recomputed} recomputed "
            f"({b.checkpoints} checkpoints, {b.checkpoint_bytes / 2**20:.1f} MiB)",
            f"  engine busy  {busy} (per engine actor)"]


def summary_text(s: JobSummary) -> str:
    p = s.progress

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    return "\n".join([
        "batchgen: job complete",
        f"  output       {s.output} ({s.files} part files, input order)",
        f"  rows         {p.total_rows} total: {p.rows} written by this run, {p.skipped_rows} already there",
        f"  errors       {s.error_rows} rows with an error (see the 'error' column; {p.errors} by this run)",
        f"  BCT          {s.bct_s:.1f} s (start to last row written)",
        f"  throughput   {p.tokens_per_s:.1f} generated tokens/s ({p.generated_tokens} tokens)",
        f"  per row      completion time p50 {seconds(s.completion_time_p50_s)}, "
        f"p99 {seconds(s.completion_time_p99_s)}",
        f"  start-up     engines ready at {seconds(s.engines_ready_s)} ("
        + (", ".join(f"{a.stage}{f' over {a.ranks} ranks' if a.ranks > 1 else ''}{_budget(a)} constructed in "
                     f"{a.init_s:.1f} s" for a in s.engine_actors) or "none started") + ")",
        *balancing_lines(s.balancing),
        *([] if s.stage_split is None else [
            f"  stages       planned {s.stage_split.prefill_actors} prefill + {s.stage_split.decode_actors} decode "
            f"engine actors (simulated BCT {s.stage_split.predicted_bct_s:.1f} s)"]),
    ])


def _budget(actor) -> str:
    if actor.device_memory_bytes is None:
        return ""
    return f" (weights streamed within {actor.device_memory_bytes / 2**20:.1f} MiB of device memory)"


def demo_config(args: argparse.Namespace, prompts: str, results: str) -> JobConfig:
    """The demo's job: tiny-moe over `prompts` into `results`, with a demo-sized KV budget (the engine's default
    takes a share of free memory per actor) and DEMO_SAMPLING under what the command line sets."""
    args.model, args.input, args.output = "tiny-moe", prompts, results
    args.engine = {"kv_budget_bytes": 64 << 20, "host_kv_budget_bytes": 64 << 20, **(args.engine or {})}
    args.sampling_params = {**DEMO_SAMPLING, **(args.sampling_params or {})}
    return job_config(args)


def _first_result(results: Path) -> dict[str, Any] | None:
    import pyarrow.parquet as pq

    parts = sorted(results.glob("part-*.parquet"))
    if not parts:
        return None
    row = pq.read_table(parts[0], columns=["prompt", "generated_text", "error"]).slice(0, 1).to_pylist()[0]
    return None if row["error"] is not None else row


SUBCOMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], Any]]] = {
    "run": (add_run_parser, run_command),
    "demo": (add_demo_parser, demo_command),
    "serve": (add_serve_parser, run_serve),
    "plan": (add_plan_parser, run_plan),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgen", description="Batch inference for MoE models on Ray Data.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add, handler in SUBCOMMANDS.values():
        add(subparsers).set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except UsageError as exc:
        print(f"batchgen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"batchgen {args.command}: job failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
