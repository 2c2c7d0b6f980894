"""Host overhead per engine step: the time a GPU would not hide.

    python bench/host_overhead.py [--json] [--seqs 128 512 2048] [--prompt-len 10] [--max-tokens 4] [--repeats 3]

The tiny-moe preset at several concurrency levels: for each level S, 2*S prompts of `--prompt-len`
random token ids, `--max-tokens` output tokens each (ignore_eos, greedy), max_num_seqs = b_attn = S,
so every step holds up to S sequences. Reported per level: the share of engine time (add_request +
step) spent outside the model forward (`host_share.<S>`), and the host microseconds per sequence per
step (`host_us_per_seq.<S>`: host seconds over the sum of sequences over steps), which should not grow
with S if every per-step cost is vectorised or O(changed sequences). Each level runs `--repeats` times and reports
its run of median host share (a level's run takes 0.1-1 s, where a shared machine's swings show). `--profile` prints
the top host functions of the largest level, from a run of its own before the others (its figures under
`profiled`, left out of the level's). The process
freezes its heap once the model is loaded, as engine actors do (engine/process_heap.py), so a full pass of Python's
collector over the imports' objects does not land in a level's timed run. With --json the last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import time

import torch

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.engine.process_heap import freeze_heap, keep_freed_memory


def requests(count: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(str(i), [rng.randrange(4, vocab) for _ in range(prompt_len)], sampling=params)
            for i in range(count)]


def measure(loaded, seqs: int, prompt_len: int, max_tokens: int, profile: bool) -> dict:
    vocab = loaded.model.vocab_size
    config = {"max_num_seqs": seqs, "b_attn": seqs, "b_moe": 1 << 20, "max_prefill_tokens": seqs * prompt_len,
              "kv_budget_bytes": 1 << 30, "host_kv_budget_bytes": 64 << 20, "page_size": 16}
    Engine(loaded, **config).generate(requests(8, prompt_len, 2, vocab, seed=1))  # warm-up
    engine = Engine(loaded, **config)
    work = requests(2 * seqs, prompt_len, max_tokens, vocab, seed=0)
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    results = engine.generate(work)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    assert all(r.error is None and len(r.outputs[0].token_ids) == max_tokens for r in results)
    m = engine.metrics()
    out = {"wall_s": wall, "host_share": m["host_share"], "host_us_per_seq": m["host_us_per_sequence_step"],
           "prefill_steps": m["prefill_steps"], "decode_steps": m["decode_steps"], "peak_active": m["peak_active"]}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--prompt-len", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    keep_freed_memory()  # as an engine process does (operators/engine_factory.py)
    loaded = load_model("tiny-moe")
    frozen = freeze_heap()  # as an engine actor does: the collector's full passes skip the imports' objects
    report = {"workload": {"model": "tiny-moe", "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "prompts_per_level": "2 x seqs"},
              "machine": {"torch_threads": torch.get_num_threads(), "load_avg_start": os.getloadavg()[0],
                          "frozen_objects": frozen},
              "host_share": {}, "host_us_per_seq": {}, "runs": {}}
    for seqs in args.seqs:
        profiled = args.profile and seqs == max(args.seqs)  # a run more, profiled first and left out of the figures
        runs = [measure(loaded, seqs, args.prompt_len, args.max_tokens, profiled and not i)
                for i in range(args.repeats + profiled)]
        profile = runs[0].pop("profile", None)
        timed = runs[1:] if profiled else runs
        run = sorted(timed, key=lambda r: r["host_share"])[(len(timed) - 1) // 2]
        run["host_share_runs"] = [r["host_share"] for r in timed]
        report["host_share"][str(seqs)] = run["host_share"]
        report["host_us_per_seq"][str(seqs)] = run["host_us_per_seq"]
        report["runs"][str(seqs)] = run
        print(f"{seqs:5d} seqs: host share {run['host_share']:.1%}, {run['host_us_per_seq']:.1f} us/seq/step, "
              f"wall {run['wall_s']:.2f} s ({run['prefill_steps']} prefill + {run['decode_steps']} decode steps)",
              flush=True)
        if profiled:  # its figures apart: how much the profiler slowed the host
            report["profiled"] = {"seqs": seqs, **{k: runs[0][k] for k in ("wall_s", "host_share", "host_us_per_seq")}}
            print(profile)
    report["machine"]["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
