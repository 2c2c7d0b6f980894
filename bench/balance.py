"""MIGRATE between engine actors: batch completion time of a skewed job with and without it.

    python bench/balance.py [--json] [--rows 128] [--long-tokens 128] [--short-tokens 8] [--model bench-moe]

`batchgen run --mode single` with 2 engine actors of 1 CPU each, the rows in 8 blocks, greedy,
ignore_eos. Skewed: every long-output row (`--long-tokens`) in the first four blocks, every short one
in the last four; an actor takes four blocks at once, so the first one ready gets nearly all the work.
Balanced reference: the same rows interleaved, so both actors get the same output tokens. Three runs
in one Ray runtime: skewed without MIGRATE, skewed with it, and the balanced reference without it.
JSON keys: `bct_s` with `skewed_no_migration`, `skewed_migration`, `balanced_reference`; `ratio`
(skewed_migration / balanced_reference; goal at most 1.15), `migrations`, `kv_bytes_moved`,
`partition_events`, `busy_s` (engine step time per actor, with MIGRATE), `outputs_match` (each row's
tokens equal in all three runs, or where not, the first difference at a near-tie of the reference
model's logits or routing, judged as in bench/bct.py; `match` has the counts and each divergence).
With --json the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from bct import ROUTING_TIE_GAP, TIE_GAP, compare, lazy_reference_probe

from batchgen.connectors.presets import resolve_preset
from batchgen.pipelines.pipeline import JobConfig, run_job
from batchgen.pipelines.ray_runtime import init_ray


def write_rows(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path / "part-0.parquet")


def run(model: str, input_dir: Path, output: Path, rows_per_block: int, migrate: bool) -> tuple[float, dict, Any]:
    """`batchgen run` in single mode on 2 engine actors (each takes up to 4 blocks at once: the first actor
    ready takes the first blocks, the long ones in the skewed input)."""
    config = JobConfig(model=model, input=str(input_dir), output=str(output), mode="single", concurrency=2,
                       engine_num_cpus=1.0, rows_per_block=rows_per_block, batch_size=rows_per_block,
                       migrate=migrate, engine={"kv_budget_bytes": 1 << 30, "host_kv_budget_bytes": 1 << 30})
    start = time.perf_counter()
    summary = run_job(config)
    bct = time.perf_counter() - start
    table = pq.read_table(output, columns=["id", "generated_token_ids", "error"])
    assert not any(table.column("error").to_pylist()), "rows failed"
    return bct, dict(zip(table.column("id").to_pylist(), table.column("generated_token_ids").to_pylist())), \
        summary.balancing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=128)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = resolve_preset(args.model) or args.model
    rng = random.Random(0)
    half = args.rows // 2
    vocab = min(4000, json.loads((Path(model) / "config.json").read_text())["vocab_size"])  # ids the model takes
    rows = [{"id": i, "prompt_token_ids": [rng.randrange(8, vocab) for _ in range(rng.randint(16, 48))],
             "sampling_params": {"max_tokens": args.long_tokens if i < half else args.short_tokens,
                                 "temperature": 0.0, "ignore_eos": True}} for i in range(2 * half)]
    interleaved = [rows[i // 2] if i % 2 == 0 else rows[half + i // 2] for i in range(2 * half)]
    init_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)  # 2 engine CPUs + the light stages
    load_start = os.getloadavg()[0]
    bct, tokens, migration = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-balance-") as tmp:
        work = Path(tmp)
        write_rows(work / "skewed", rows)
        write_rows(work / "interleaved", interleaved)
        for name, source, migrate in (("skewed_no_migration", "skewed", False), ("skewed_migration", "skewed", True),
                                      ("balanced_reference", "interleaved", False)):
            bct[name], tokens[name], migration[name] = run(model, work / source, work / name, max(1, half // 4),
                                                           migrate)
            print(f"{name}: {bct[name]:.1f} s, balancing {migration[name] or 'off'}", flush=True)
    ray.shutdown()
    ids = sorted(tokens["skewed_no_migration"])
    by_id = {name: [tokens[name][i] for i in ids] for name in tokens}
    probe = lazy_reference_probe(model, [rows[i]["prompt_token_ids"] for i in ids])
    matches = {name: compare(by_id["skewed_no_migration"], by_id[name], probe, TIE_GAP["float32"],
                             ROUTING_TIE_GAP["float32"]) for name in ("skewed_migration", "balanced_reference")}
    report = {
        "workload": {"model": args.model, "rows": 2 * half, "long_tokens": args.long_tokens,
                     "short_tokens": args.short_tokens, "engine_actors": 2, "cpus_per_actor": 1.0},
        "bct_s": bct,
        "ratio": bct["skewed_migration"] / bct["balanced_reference"],
        "migrations": migration["skewed_migration"].migrations,
        "kv_bytes_moved": migration["skewed_migration"].kv_bytes_moved,
        "partition_events": migration["skewed_migration"].partition_events,
        "busy_s": migration["skewed_migration"].busy_s,
        "outputs_match": all(m.all_match for m in matches.values()),
        "match": {name: {"exact": m.exact, "total": m.total, "ties": m.ties, "divergences": m.divergences}
                  for name, m in matches.items()},
        "machine": {"load_avg_start": load_start, "load_avg_end": os.getloadavg()[0]},
    }
    print(f"skewed {bct['skewed_no_migration']:.1f} s -> {bct['skewed_migration']:.1f} s with MIGRATE "
          f"({report['migrations']} requests, {report['kv_bytes_moved'] / 2**20:.1f} MiB KV); balanced "
          f"{bct['balanced_reference']:.1f} s; ratio {report['ratio']:.2f}; outputs match: {report['outputs_match']}",
          flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
