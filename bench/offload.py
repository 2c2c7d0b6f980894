"""Memory-constrained mode against a FlexGen-style offloading baseline, at device budgets below the weights.

    python bench/offload.py [--json] [--model bench-moe] [--budgets 1.0 0.5 0.25 0.1] [--num-prompts 256]
                            [--prompt-tokens 32] [--max-tokens 224] [--page-size 16] [--dtype float32]

Workload: --num-prompts random prompts of --prompt-tokens tokens, greedy, --max-tokens each (ignore_eos): decode
heavy, like the offline generation jobs offloading serves (on a CPU, prefill compute costs both systems the same
and would dominate a prompt-heavy workload). At each
budget fraction f, both systems get device_memory_bytes = f x the model's weight bytes (weights + KV + activations
must fit in it; the weights live in host memory, on this CPU-only machine the same RAM, so a fetch is a timed
memory copy into the device slots, accounted in bytes and seconds):

- batchgen: the coroutine engine with weight_streaming "expert": each routed expert streams alone through a few
  slots when the step's COMBINE-d MoE batch routes a token to it; attention and the LM head stay resident when
  the budget allows; sequences the device KV cannot hold wait in the host KV store and decode through staging
  pages. Every prompt is admitted at once (max_num_seqs = --num-prompts).
- flexgen_style: the same engine, weights and workload with weight_streaming "layer": every attention block and
  every whole feed-forward block (router and all experts) streams through slots that hold a whole block, as
  FlexGen and MoE-Lightning keep whole MoE layers on the device; the batch is what the device KV left beside
  that slot holds (max_num_seqs sized so that every admitted sequence's full context fits; no host KV tier).
  A budget too small for one whole block is reported with the reason instead of a rate.

Reported per budget (`budgets.<f>`): tokens/s of each (`tokens_per_s.batchgen`, `tokens_per_s.flexgen_style`),
their ratio, bytes streamed per output token, the copy seconds (on CUDA also the part of them the computation
waited for, the rest being hidden behind compute: `weight_stream_exposed_seconds`), each plan (resident bytes,
slot bytes, KV bytes, B_moe, batch) and the peak device bytes by the engine's accounting. `outputs_match`: every
run gave the tokens of the same engine with every weight resident. With --json the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig, Request, SamplingParams
from batchgen.engine.kv_pool import PoolGeometry
from batchgen.engine.offload.memory_constrained import offload_plan
from batchgen.engine.offload.weight_units import weight_units

SYSTEMS = ("batchgen", "flexgen_style")


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(f"p{i}", [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)], sampling=params)
            for i in range(args.num_prompts)]


def config_for(system: str | None, args: argparse.Namespace, budget: int | None, loaded) -> EngineConfig:
    """`system` None: every weight resident (the outputs' reference)."""
    context = args.prompt_tokens + args.max_tokens
    geometry = PoolGeometry(loaded.model.kv_spec(), args.page_size, loaded.dtype)
    per_seq = geometry.pages_for(context + 1) + 2  # the pages a sequence ends with, and the two reserved ahead
    everything = geometry.page_bytes * per_seq * args.num_prompts
    common = dict(page_size=args.page_size, max_model_len=context + args.page_size, b_attn=args.b_attn,
                  refill_threshold=0.5, max_num_seqs=args.num_prompts)
    if system is None:
        return EngineConfig(**common, kv_budget_bytes=everything, host_kv_budget_bytes=geometry.page_bytes * 4,
                            staging_fraction=0.0, b_moe=8192)
    if system == "batchgen":
        return EngineConfig(**common, device_memory_bytes=budget, host_kv_budget_bytes=everything,
                            staging_fraction=args.staging_fraction)
    # the baseline's batch: the sequences whose full contexts all fit the device KV its plan leaves beside a
    # whole layer; no host tier to overflow into (one sequence's pages, never used)
    config = EngineConfig(**common, device_memory_bytes=budget, weight_streaming="layer",
                          host_kv_budget_bytes=geometry.page_bytes * per_seq, staging_fraction=0.0)
    _, plan, _ = offload_plan(loaded, config, config.torch_device().type)  # as the engine plans on its device
    batch = min(args.num_prompts, plan.kv_bytes // geometry.page_bytes // per_seq)
    if batch == 0:
        raise ValueError(f"the device KV left beside a whole layer ({plan.kv_bytes} bytes) cannot hold one sequence "
                         f"of {context} tokens")
    return EngineConfig.from_kwargs(config, max_num_seqs=batch, b_attn=min(batch, args.b_attn))


def run_system(args: argparse.Namespace, system: str | None, budget: int | None) -> dict:
    gc.collect()
    # each engine places (and hooks) its own copy of the weights, loaded into host memory; the reference
    # loads straight onto the engine's device
    device = "cpu" if system is not None else EngineConfig().torch_device()
    loaded = load_model(args.model, dtype=args.dtype, device=device)
    try:
        engine = Engine(loaded, config_for(system, args, budget, loaded))
    except ValueError as exc:
        return {"error": str(exc)}
    work = workload(args, engine.normalizer.vocab_size)
    start = time.perf_counter()
    results = engine.generate(work)
    wall = time.perf_counter() - start
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    tokens = [r.outputs[0].token_ids for r in results]
    generated = sum(map(len, tokens))
    metrics = engine.metrics()
    out = {"tokens": tokens, "wall_s": wall, "tokens_per_s": generated / wall,
           "max_num_seqs": engine.config.max_num_seqs, "b_moe": engine.config.b_moe,
           "peak_active": metrics["peak_active"], "peak_suspended": metrics["peak_suspended"],
           "staged_decode_batches": metrics["staged_decode_batches"], "yields": metrics["yields"]}
    memory = metrics.get("device_memory")
    if memory is not None:
        out["device_memory"] = memory
        out["bytes_streamed_per_token"] = memory["weight_bytes_streamed"] / generated
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=224)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--b-attn", type=int, default=64)
    parser.add_argument("--staging-fraction", type=float, default=0.5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    weights = weight_units(load_model(args.model, dtype=args.dtype, weights=False).model, "expert").total_bytes
    reference = run_system(args, None, None)
    log = (lambda *a: None) if args.json else print
    log(f"{args.model}: {weights / 2**20:.0f} MiB of weights; everything resident: "
        f"{reference['tokens_per_s']:.1f} tokens/s")
    budgets, match = {}, True
    for fraction in args.budgets:
        budget = int(weights * fraction)
        entry: dict = {"device_memory_bytes": budget, "tokens_per_s": {}, "bytes_streamed_per_token": {},
                       "runs": {}}
        for system in SYSTEMS:
            run = run_system(args, system, budget)
            if "error" in run:
                entry["tokens_per_s"][system] = None
                entry["runs"][system] = run
                log(f"  {fraction:>5}: {system} cannot run: {run['error']}")
                continue
            tokens = run.pop("tokens")
            run["outputs_match"] = tokens == reference["tokens"]
            match &= run["outputs_match"]
            entry["tokens_per_s"][system] = run["tokens_per_s"]
            entry["bytes_streamed_per_token"][system] = run.get("bytes_streamed_per_token")
            entry["runs"][system] = run
            log(f"  {fraction:>5}: {system} {run['tokens_per_s']:.1f} tokens/s, batch {run['max_num_seqs']}, "
                f"{run['bytes_streamed_per_token'] / 2**20:.2f} MiB streamed per token, match {run['outputs_match']}")
        rates = entry["tokens_per_s"]
        entry["speedup"] = (rates["batchgen"] / rates["flexgen_style"]
                            if rates.get("batchgen") and rates.get("flexgen_style") else None)
        budgets[str(fraction)] = entry
    result = {"model": args.model, "weight_bytes": weights, "resident_tokens_per_s": reference["tokens_per_s"],
              "workload": {"num_prompts": args.num_prompts, "prompt_tokens": args.prompt_tokens,
                           "max_tokens": args.max_tokens},
              "budgets": budgets, "outputs_match": match,
              "machine": {"cpu_count": os.cpu_count(), "load_avg_start": load_start,
                          "load_avg_end": os.getloadavg()[0]}}
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "budgets"}, indent=1))


if __name__ == "__main__":
    main()
