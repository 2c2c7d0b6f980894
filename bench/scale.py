"""Scale of the data plane: rows/s and peak memory per process of `batchgen run` on N and 8N short rows.

    python bench/scale.py [--quick] [--json] [--rows 50000] [--seed 0] [--mode single]
                          [--batch-size 256] [--rows-per-block 4096]

Workload: the tiny-moe preset, prompts of random token ids (lengths uniform in [4, 16]), max_tokens 2
with ignore_eos, greedy: a scheduled ETL job of millions of short rows, where what the data plane costs
per row (read, parse, hand to the engine, build output columns, write) is not hidden behind long decodes.
Input: Parquet files of FILE_ROWS rows, one row group each (pyarrow's default up to a million rows).
For each size, N and 8N rows:

  engine       the engine alone in this process (model loaded and warmed up before the clock starts), fed
               the same prompt token ids file by file in chunks through add_request / step, at most twice
               max_num_seqs requests outstanding (the engine loop's admission bound in the actors); it
               keeps only counts, no results (the engine's own metrics hold a bounded quantile sketch);
  pipeline     `batchgen run --mode single` in a subprocess, which starts its own Ray runtime on the
               machine's CPUs as a user's run does; rows/s over the job's BCT as the command prints it
               (job start, Ray up, to the last row written: actor start and model load included), with
               the rate after the engine actors were ready, the command's wall time (Ray start included)
               and the CPU seconds of each process beside it;
  passthrough  a plain Ray Data read_parquet -> map_batches(identity) -> write_parquet of the same files,
               same batch size, in this process on a local runtime started as `batchgen run` starts one:
               the data plane's floor.

Peak RSS per process of the pipeline runs: the `batchgen run` process tree (the command is the driver; it
starts Ray, so raylet, GCS, agents, workers and actors are its descendants) sampled every 0.25 s, keyed by
process title (bench/process_account.py): the driver, the engine actors ('MapWorker(MapBatches(BatchGen))'),
the ProgressTracker actor, the read / write task workers and Ray's own processes. Goals: every peak at 8N
within 1.3x of that at N, and pipeline rows/s at 8N at least 0.75x the engine alone's.

The single shape is what a user runs for this workload: a row that decodes two tokens gains nothing from
separate prefill and decode engines, while the disaggregated shape pays a tokenizer stage and a KV
hand-off per row (`--mode disaggregated` measures it). Batches of 256 rows = the engine's max_num_seqs:
one batch refills the engine and the loop's admission bound (2 x max_num_seqs) holds two, so a batch's
tail overlaps the next one; per-batch costs (an async call, an engine-loop submission, a progress call,
the output columns) are paid once per 256 rows. Blocks of 4,096 rows (16 batches): per-block costs (an
actor task, a write task, a part file and its progress call) are paid once per 4,096 rows (about 3 s of
engine time here), while the 4 blocks in flight per engine actor stay a few MB and a crash redoes at
most those. Full run ~10 min on 2 cores, --quick about a minute. With --json the last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import torch
from process_account import ProcessAccount, cpu_text

from batchgen.connectors.presets import build_preset
from batchgen.engine import EngineConfig, Request, SamplingParams
from batchgen.operators.engine_factory import load_engine
from batchgen.pipelines.pipeline import JobConfig
from batchgen.pipelines.ray_runtime import init_ray

MODEL = "tiny-moe"
DEFAULT_ROWS = 50_000
QUICK_ROWS = 500
SCALE = 8  # the second size: SCALE x rows
FILE_ROWS = 100_000  # rows per input file
PROMPT_LENGTHS = (4, 16)  # inclusive
SAMPLING = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
BATCH_SIZE = 256  # rows per batch handed to the engine actors
ROWS_PER_BLOCK = 4096
ENGINE_CHUNK = 4096  # rows the engine-alone feed converts from Arrow at a time
SHAPES = {"single": ("BatchGen",), "disaggregated": ("Prefill", "Decode")}  # engine stages per shape
RSS_RATIO_GOAL = 1.3
PIPELINE_OVER_ENGINE_GOAL = 0.75


@dataclasses.dataclass
class Workload:
    rows: int
    seed: int

    def tables(self) -> Iterator[pa.Table]:
        """The input, FILE_ROWS rows at a time, generated without holding more than one file's rows."""
        rng = np.random.default_rng(self.seed)
        vocab = 2048  # tiny-moe's; ids from 4 skip the special tokens
        for start in range(0, self.rows, FILE_ROWS):
            n = min(FILE_ROWS, self.rows - start)
            lengths = rng.integers(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, n)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(4, vocab, int(offsets[-1]))))
            yield pa.table({"id": np.arange(start, start + n), "prompt_token_ids": ids})


def write_input(directory: Path, workload: Workload) -> int:
    """The workload as Parquet files (one row group each); returns the prompt tokens written."""
    directory.mkdir(parents=True)
    tokens = 0
    for i, table in enumerate(workload.tables()):
        tokens += int(pc.sum(pc.list_value_length(table.column("prompt_token_ids"))).as_py())
        pq.write_table(table, directory / f"prompts-{i:04d}.parquet")
    return tokens


def input_prompts(directory: Path) -> Iterator[list[list[int]]]:
    """The input's prompts in input order, ENGINE_CHUNK rows at a time."""
    for path in sorted(directory.glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=ENGINE_CHUNK, columns=["prompt_token_ids"]):
            yield batch.column(0).to_pylist()


def run_engine(input_dir: Path) -> dict:
    """The engine alone over the input, with the engine loop's admission bound; counts only."""
    engine = load_engine(MODEL)
    sampling = SamplingParams.from_dict(SAMPLING)
    engine.generate([Request(f"warm-{i}", [5 + i] * 8, sampling=sampling) for i in range(8)])
    bound = 2 * engine.config.max_num_seqs
    ids = itertools.count()
    rows = tokens = errors = outstanding = 0

    def step() -> None:
        nonlocal rows, tokens, errors, outstanding
        for result in engine.step():
            outstanding -= 1
            rows += 1
            errors += result.error is not None
            tokens += sum(len(c.token_ids) for c in result.outputs)

    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for chunk in input_prompts(input_dir):
        for prompt in chunk:
            while outstanding >= bound:
                step()
            engine.add_request(Request(str(next(ids)), prompt, sampling=sampling))
            outstanding += 1
    while engine.has_unfinished():
        step()
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "generated_tokens": tokens,
            "errors": errors, "cpu_s": _cpu_seconds() - cpu_start, "torch_threads": torch.get_num_threads()}


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def run_pipeline(input_dir: Path, output: Path, mode: str, batch_size: int, rows_per_block: int) -> dict:
    """`batchgen run` in a subprocess, its process tree sampled; rows/s over the BCT it prints."""
    command = [sys.executable, "-m", "batchgen.pipelines.cli", "run", "--model", MODEL, "--input", str(input_dir),
               "--output", str(output), "--mode", mode, "--max-tokens", str(SAMPLING["max_tokens"]),
               "--temperature", str(SAMPLING["temperature"]), "--sampling-params", json.dumps({"ignore_eos": True}),
               "--batch-size", str(batch_size), "--rows-per-block", str(rows_per_block), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own runtime, as a user's run
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        with ProcessAccount(SHAPES[mode], root_pid=proc.pid) as account:
            out, _ = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"batchgen run exited {proc.returncode}:\n{out[-4000:]}")
    summary = _parse_summary(out)
    written = _check_output(output)
    startup = summary["startup_s"]
    return {"rows": written, "bct_s": summary["bct_s"], "rows_per_s": written / summary["bct_s"],
            "startup_s": startup, "steady_rows_per_s": written / (summary["bct_s"] - startup) if startup else None,
            "wall_s": wall, "errors": summary["errors"], "cpu_s": account.seconds,
            "cpu_s_by_process": account.by_process,
            "peak_rss_mb": {name: rss / 2**20 for name, rss in sorted(account.peak_rss.items())}}


def _parse_summary(text: str) -> dict:
    """The BCT, error count and start-up (job start -> engines ready, when shown) from the command's
    summary (pipelines/cli.py summary_text)."""
    bct = re.search(r"^\s*BCT\s+([\d.]+) s", text, re.MULTILINE)
    errors = re.search(r"^\s*errors\s+(\d+) rows", text, re.MULTILINE)
    startup = re.search(r"engines ready at ([\d.]+) s", text)
    if bct is None or errors is None:
        raise RuntimeError(f"no job summary in the output of batchgen run:\n{text[-4000:]}")
    return {"bct_s": float(bct.group(1)), "errors": int(errors.group(1)),
            "startup_s": float(startup.group(1)) if startup else None}


def _check_output(output: Path) -> int:
    """Rows written, from the part files' names and footers: every row once, in contiguous ranges."""
    expected = 0
    for path in sorted(output.glob("part-*.parquet")):
        first, last = (int(x) for x in path.stem.split("-")[1:])
        if first != expected or pq.ParquetFile(path).metadata.num_rows != last - first + 1:
            raise RuntimeError(f"{path.name}: the output is not each input row once in order")
        expected = last + 1
    return expected


def run_passthrough(input_dir: Path, output: Path, batch_size: int) -> dict:
    """read -> identity map -> write with Ray Data alone (Ray already up)."""
    start = time.perf_counter()
    # a lambda travels by value: workers need not import this script (a test imports it from bench/)
    ds = ray.data.read_parquet(str(input_dir)).map_batches(lambda batch: batch, batch_size=batch_size,
                                                            batch_format="pyarrow")
    ds.write_parquet(str(output))
    seconds = time.perf_counter() - start
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in output.glob("*.parquet"))
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"N = {QUICK_ROWS} (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--rows", type=int, default=None,
                        help=f"N; the bench runs N and {SCALE}N rows (default {DEFAULT_ROWS}, --quick {QUICK_ROWS})")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--mode", choices=tuple(SHAPES), default="single", help="pipeline shape (default single)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"rows per batch (default {BATCH_SIZE})")
    parser.add_argument("--rows-per-block", type=int, default=ROWS_PER_BLOCK,
                        help=f"rows per block read from the input (default {ROWS_PER_BLOCK})")
    args = parser.parse_args(argv)
    if args.rows is None:
        args.rows = QUICK_ROWS if args.quick else DEFAULT_ROWS
    for name in ("rows", "batch_size", "rows_per_block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def run(args: argparse.Namespace, workdir: Path, log) -> dict:
    build_preset(MODEL)  # once, before any timing
    sizes = (args.rows, SCALE * args.rows)
    load_at_start = os.getloadavg()  # other jobs on a shared machine skew every timing: report them
    log(f"{MODEL}, prompts of {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} token ids, {SAMPLING}; sizes {sizes}; "
        f"{args.mode} shape, batch {args.batch_size}, block {args.rows_per_block} rows; "
        f"load average {load_at_start[0]:.2f}")
    runs: dict[str, dict[int, dict]] = {"engine": {}, "pipeline": {}, "passthrough": {}}
    prompt_tokens = {}
    for rows in sizes:
        input_dir = workdir / f"in-{rows}"
        prompt_tokens[rows] = write_input(input_dir, Workload(rows, args.seed))
        runs["engine"][rows] = run_engine(input_dir)
        gc.collect()
        log(f"{rows} rows: engine alone {runs['engine'][rows]['rows_per_s']:.0f} rows/s "
            f"({runs['engine'][rows]['seconds']:.1f} s)")
        runs["pipeline"][rows] = pipeline = run_pipeline(input_dir, workdir / f"out-{rows}", args.mode,
                                                         args.batch_size, args.rows_per_block)
        log(f"{rows} rows: pipeline {pipeline['rows_per_s']:.0f} rows/s (BCT {pipeline['bct_s']:.1f} s, engines "
            f"ready at {pipeline['startup_s']} s, command {pipeline['wall_s']:.1f} s); {cpu_text(pipeline['cpu_s'])}; "
            "peak RSS MB " +
            ", ".join(f"{name} {mb:.0f}" for name, mb in pipeline["peak_rss_mb"].items()))
        runs["passthrough"][rows] = passthrough_run(input_dir, workdir / f"passthrough-{rows}", args.batch_size)
        log(f"{rows} rows: passthrough {runs['passthrough'][rows]['rows_per_s']:.0f} rows/s")
        for name in ("engine", "pipeline", "passthrough"):
            if runs[name][rows]["rows"] != rows:
                raise RuntimeError(f"{name}: {runs[name][rows]['rows']} of {rows} rows came out")
    return report(args, sizes, runs, prompt_tokens, load_at_start)


def passthrough_run(input_dir: Path, output: Path, batch_size: int) -> dict:
    """run_passthrough on a local Ray runtime of this process's own, started as `batchgen run` starts one,
    or on the caller's."""
    own_ray = not ray.is_initialized()
    if own_ray:
        init_ray(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)  # as `batchgen run`
    data_context = ray.data.DataContext.get_current()
    data_logger = logging.getLogger("ray.data")
    progress_bars, log_level = data_context.enable_progress_bars, data_logger.level  # process-wide: put back
    data_context.enable_progress_bars = False
    data_logger.setLevel(logging.ERROR)
    try:
        return run_passthrough(input_dir, output, batch_size)
    finally:
        data_context.enable_progress_bars = progress_bars
        data_logger.setLevel(log_level)
        if own_ray:
            ray.shutdown()


def report(args: argparse.Namespace, sizes: tuple[int, int], runs: dict, prompt_tokens: dict,
           load_at_start: tuple[float, float, float]) -> dict:
    small, large = sizes
    pipelines = runs["pipeline"]
    processes = sorted(set(pipelines[small]["peak_rss_mb"]) | set(pipelines[large]["peak_rss_mb"]))
    peak_rss = {p: {rows: pipelines[rows]["peak_rss_mb"].get(p) for rows in sizes} for p in processes}
    ratios = {p: v[large] / v[small] for p, v in peak_rss.items() if v[small] and v[large]}
    over_engine = pipelines[large]["rows_per_s"] / runs["engine"][large]["rows_per_s"]
    return {
        "workload": {"model": MODEL, "rows": list(sizes), "prompt_lengths": list(PROMPT_LENGTHS),
                     "prompt_tokens": prompt_tokens, "sampling": SAMPLING, "seed": args.seed,
                     "rows_per_input_file": FILE_ROWS},
        "setup": {"mode": args.mode, "batch_size": args.batch_size, "rows_per_block": args.rows_per_block,
                  "engine_config": dataclasses.asdict(EngineConfig()), "job_defaults": {
                      "batch_size": JobConfig.batch_size, "rows_per_block": JobConfig.rows_per_block}},
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_at_start,
                    "load_average_at_end": os.getloadavg()},
        "rows_per_s": {name: {rows: run["rows_per_s"] for rows, run in by_size.items()}
                       for name, by_size in runs.items()},
        "peak_rss_mb": peak_rss,
        "peak_rss_ratio": ratios,
        "pipeline_over_engine": {rows: pipelines[rows]["rows_per_s"] / runs["engine"][rows]["rows_per_s"]
                                 for rows in sizes},
        "goals": {"rss_ratio_max": RSS_RATIO_GOAL, "worst_rss_ratio": max(ratios.values(), default=None),
                  "rss_met": all(r <= RSS_RATIO_GOAL for r in ratios.values()),
                  "pipeline_over_engine_min": PIPELINE_OVER_ENGINE_GOAL, "pipeline_over_engine": over_engine,
                  "rows_per_s_met": over_engine >= PIPELINE_OVER_ENGINE_GOAL},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-scale-") as workdir:
        result = run(args, Path(workdir), log=lambda message: print(message, flush=True))
    goals = result["goals"]
    print(f"goals: worst peak-RSS ratio {goals['worst_rss_ratio']:.2f} (<= {RSS_RATIO_GOAL}: {goals['rss_met']}); "
          f"pipeline / engine rows/s at {SCALE}N {goals['pipeline_over_engine']:.2f} "
          f"(>= {PIPELINE_OVER_ENGINE_GOAL}: {goals['rows_per_s_met']})", flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
