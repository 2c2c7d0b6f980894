"""One engine over 1, 2 and 4 ranks (data-parallel attention, expert-parallel MoE) on this machine.

    python bench/ep.py [--json] [--ranks 1 2 4] [--tp-ranks 2] [--num-prompts 64] [--max-tokens 32]
                       [--model bench-moe]

The same workload (random prompts of 32-96 tokens, greedy, `--max-tokens` each, ignore_eos) through
load_engine(model, ep_size=N) for each N: the machine's torch threads are shared among the ranks (2 cores:
1 rank x 2 threads, 2 ranks x 1 thread, 4 ranks x 1 thread, oversubscribed). Each N is timed after a warm-up
run of its own group. Reported: tokens/s per rank count (`tokens_per_s.<N>`), the steps in which a rank had no
sequence of its own and only served its experts, and whether every rank count gave the 1-rank tokens
(`outputs_match`; a divergence is listed with its first differing position). `--tp-ranks` also runs
load_engine(model, tp_size=N) (`tp_tokens_per_s.<N>`, in the same comparison). Over gloo on one machine the
all-to-all is a memory copy through loopback TCP: this measures the engine's parallel overheads (collectives,
lockstep rounds), not what NCCL/DeepEP give across GPUs. With --json the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

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


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tp-ranks", type=int, nargs="*", default=[2], help="tensor-parallel groups to run too")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="bench-moe")
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
    report["outputs_match"] = not any(report["divergences"].values())
    report["machine"]["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(report) if args.json else f"outputs_match: {report['outputs_match']}")


if __name__ == "__main__":
    main()
