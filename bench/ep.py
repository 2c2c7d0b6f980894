"""One engine over 1, 2 and 4 ranks (data-parallel attention, expert-parallel MoE) on this machine.

    python bench/ep.py [--json] [--ranks 1 2 4] [--tp-ranks 2] [--num-prompts 64] [--max-tokens 32]
                       [--model bench-moe] [--straggler-tokens 512] [--straggler-ranks 2] [--straggler-model M]

The same workload (random prompts of 32-96 tokens, greedy, `--max-tokens` each, ignore_eos) through
load_engine(model, ep_size=N) for each N: the machine's torch threads are shared among the ranks (2 cores:
1 rank x 2 threads, 2 ranks x 1 thread, 4 ranks x 1 thread, oversubscribed). Each N is timed after a warm-up
run of its own group. Reported: tokens/s per rank count (`tokens_per_s.<N>`), the steps in which a rank had no
sequence of its own and only served its experts, and whether every rank count gave the 1-rank tokens
(`outputs_match`; a divergence is listed with its first differing position). `--tp-ranks` also runs
load_engine(model, tp_size=N) (`tp_tokens_per_s.<N>`, in the same comparison). Over gloo on one machine the
all-to-all is a memory copy through loopback TCP: this measures the engine's parallel overheads (collectives,
lockstep rounds), not what NCCL/DeepEP give across GPUs. With --json the last line printed is one JSON object.

The straggler case: one request of `--straggler-tokens` tokens (a 32-token prompt, greedy) alone, timed on one
rank of one thread (`straggler_s.single`), PARTITIONed over `--straggler-ranks` ranks of one thread each
(`straggler_s.partition`), and on such a group with partitioning off (`straggler_s.unpartitioned`: one rank
attends, the others serve their experts); `outputs_match` also requires the three to give the same tokens.
A partition's ranks repeat the step's host work (module calls, norms, routing, ~2.4 ms a step for bench-moe's six
layers on the dev box) and split only its weight reads, so the speed-up grows with the model:
`--straggler-model large-moe` times the case on a larger one. Those reads share the machine's memory: the report
gives the read bandwidth of one thread and of `--straggler-ranks` threads, measured just before the timed runs
(`straggler.read_bandwidth_gbs.<threads>`), and their ratio (`straggler.bandwidth_scaling`): about the most a
read-bound partition can gain on this host (on GPUs every rank reads its own memory). On a VM that shares its host's
memory the ratio moves from minute to minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from roofline import read_bandwidth

from batchgen.engine import Request, SamplingParams
from batchgen.operators.engine_factory import load_engine


def requests(count: int, max_tokens: int, vocab: int, seed: int, tag: str = "") -> list[Request]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(f"{tag}{i}", [rng.randrange(4, vocab) for _ in range(rng.randrange(32, 96))], sampling=params)
            for i in range(count)]


def measure(model: str, ranks: int, num_prompts: int, max_tokens: int, threads: int, kind: str = "ep_size") -> dict:
    torch.set_num_threads(threads)  # the group shares this process's threads among its ranks
    options = {kind: ranks, "max_num_seqs": num_prompts, "b_attn": num_prompts, "b_moe": 8192,
               "kv_budget_bytes": 1 << 30, "host_kv_budget_bytes": 64 << 20}
    started = time.perf_counter()
    engine = load_engine(model, **options)
    start_s = time.perf_counter() - started
    try:
        vocab = engine.normalizer.vocab_size
        engine.generate(requests(8, 4, vocab, seed=1, tag="warm-"))
        work = requests(num_prompts, max_tokens, vocab, seed=0)
        start = time.perf_counter()
        results = engine.generate(work)
        wall = time.perf_counter() - start
        metrics = engine.metrics()
    finally:
        if ranks > 1:
            engine.close()
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    tokens = [r.outputs[0].token_ids for r in results]
    per_rank = metrics.get("ranks", [metrics])
    return {"tokens": tokens, "wall_s": wall, "start_s": start_s, "tokens_per_s": sum(map(len, tokens)) / wall,
            "requests_per_rank": [m["finished_requests"] for m in per_rank],
            "expert_only_steps": [m["expert_only_steps"] for m in per_rank]}


def straggler(model: str, ranks: int, max_tokens: int, partition: bool) -> dict:
    """One request of `max_tokens` tokens (a 32-token prompt) alone: on one rank of one thread (`ranks` 1), or
    on a group of `ranks` ranks of one thread each, PARTITIONed over them or (`partition` False) on one rank
    while the others serve its experts. Timed after a warm-up request through the same path."""
    torch.set_num_threads(ranks)  # one thread per rank
    options = {"kv_budget_bytes": 256 << 20, "host_kv_budget_bytes": 64 << 20}
    if ranks > 1:
        options.update(ep_size=ranks, partition_stragglers=partition)
    engine = load_engine(model, **options)
    try:
        vocab = engine.normalizer.vocab_size
        rng = random.Random(7)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([Request("warm", [rng.randrange(4, vocab) for _ in range(32)],
                                 sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])
        request = Request("straggler", [rng.randrange(4, vocab) for _ in range(32)], sampling=params)
        start = time.perf_counter()
        (result,) = engine.generate([request])
        wall = time.perf_counter() - start
        metrics = engine.metrics()
    finally:
        if ranks > 1:
            engine.close()
    assert result.error is None, result.error
    return {"tokens": result.outputs[0].token_ids, "wall_s": wall,
            "partitioned_steps": metrics.get("partitioned_steps", 0), "partitions": metrics.get("partitions", 0)}


def straggler_case(args: argparse.Namespace) -> tuple[dict, dict]:
    """straggler_s.{single, partition, unpartitioned}, and the details (each case's first divergence from the
    single rank's tokens under `straggler.<case>.first_divergence`)."""
    model = args.straggler_model or args.model
    bandwidth = {threads: read_bandwidth(torch.device("cpu"), threads) for threads in (1, args.straggler_ranks)}
    runs = {"single": straggler(model, 1, args.straggler_tokens, partition=False),
            "partition": straggler(model, args.straggler_ranks, args.straggler_tokens, partition=True),
            "unpartitioned": straggler(model, args.straggler_ranks, args.straggler_tokens, partition=False)}
    base = runs["single"]["tokens"]
    details = {"model": model, "ranks": args.straggler_ranks, "max_tokens": args.straggler_tokens,
               "speedup": runs["single"]["wall_s"] / runs["partition"]["wall_s"],
               "read_bandwidth_gbs": {str(t): b / 1e9 for t, b in bandwidth.items()},
               "bandwidth_scaling": bandwidth[args.straggler_ranks] / bandwidth[1]}
    for name, run in runs.items():
        tokens = run.pop("tokens")
        details[name] = {**run, "first_divergence": first_divergence(base, tokens)}
        if not args.json:
            print(f"straggler {name}: {run['wall_s']:.2f} s, partitioned steps {run['partitioned_steps']}")
    details["outputs_match"] = all(details[name]["first_divergence"] is None for name in runs)
    return {name: run["wall_s"] for name, run in runs.items()}, details


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tp-ranks", type=int, nargs="*", default=[2], help="tensor-parallel groups to run too")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--straggler-tokens", type=int, default=512,
                        help="the straggler case's output length (0: skip the case)")
    parser.add_argument("--straggler-ranks", type=int, default=2)
    parser.add_argument("--straggler-model", help="the straggler case's model (default: --model)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    report = {"workload": {"model": args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                           "prompt_len": [32, 96]},
              "machine": {"torch_threads": threads, "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()[0]},
              "tokens_per_s": {}, "tp_tokens_per_s": {}, "runs": {}, "divergences": {}}
    baseline = None
    groups = [("ep_size", r) for r in args.ranks] + [("tp_size", r) for r in args.tp_ranks]
    for kind, ranks in groups:
        run = measure(args.model, ranks, args.num_prompts, args.max_tokens, threads, kind)
        tokens = run.pop("tokens")
        baseline = baseline if baseline is not None else tokens
        diverged = {i: first_divergence(a, b) for i, (a, b) in enumerate(zip(baseline, tokens)) if a != b}
        name = str(ranks) if kind == "ep_size" else f"tp{ranks}"
        report["divergences"][name] = diverged
        report["tokens_per_s" if kind == "ep_size" else "tp_tokens_per_s"][str(ranks)] = run["tokens_per_s"]
        report["runs"][name] = run
        if not args.json:
            print(f"{kind} {ranks}: {run['tokens_per_s']:.1f} tokens/s, {run['wall_s']:.1f} s "
                  f"(group start {run['start_s']:.1f} s), requests per rank {run['requests_per_rank']}, "
                  f"expert-only steps {run['expert_only_steps']}, {len(diverged)} sequences differ from 1 rank")
    if args.straggler_tokens:
        report["straggler_s"], report["straggler"] = straggler_case(args)
        torch.set_num_threads(threads)
    report["outputs_match"] = not any(report["divergences"].values()) and report.get(
        "straggler", {}).get("outputs_match", True)
    report["machine"]["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(report) if args.json else f"outputs_match: {report['outputs_match']}")


if __name__ == "__main__":
    main()
