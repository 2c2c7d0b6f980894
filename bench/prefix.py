"""Shared-prefix caching: batch completion time with and without it, on prompts sharing a long prefix.

    python bench/prefix.py [--json] [--prompts 512] [--prefix-len 1024] [--max-tokens 32] [--model bench-moe]

Workload: `--prompts` prompts of random token ids, each one shared prefix of `--prefix-len` tokens (a
long system prompt or few-shot block) plus a unique suffix of 16-64 tokens, `--max-tokens` greedy
output tokens each (ignore_eos). The same requests run in two fresh engines, prefix caching off then
on, with the same KV budget. JSON keys: `bct_s.cached`, `bct_s.uncached`, `speedup` (uncached /
cached; goal at least 3), `prefill_tokens_saved`, `prefix_hit_rate`, `prompt_tokens` (computed, per
run), `outputs_match` (every token equal), and `match`: for each output that differs, the transformers
model judges the first difference as in bench/bct.py (a near-tie of its logits or of its routing
anywhere in the prefix, where float rounding that depends on the batch picks either way:
`match.ties`; `match.all_match` when every difference is such a tie). With --json the last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from bct import ROUTING_TIE_GAP, TIE_GAP, compare, lazy_reference_probe

from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.presets import resolve_preset
from batchgen.engine import Engine, Request, SamplingParams

ENGINE = {"kv_budget_bytes": 3 << 30, "host_kv_budget_bytes": 3 << 30}


def requests(count: int, prefix_len: int, max_tokens: int, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(8, vocab) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(str(i), prefix + [rng.randrange(8, vocab) for _ in range(rng.randint(16, 64))], sampling=params)
            for i in range(count)]


def run(loaded, batch: list[Request], caching: bool) -> tuple[float, list[list[int]], dict]:
    engine = Engine(loaded, prefix_caching=caching, **ENGINE)
    start = time.perf_counter()
    results = engine.generate(batch)
    wall = time.perf_counter() - start
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return wall, [r.outputs[0].token_ids for r in results], engine.metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model)
    batch = requests(args.prompts, args.prefix_len, args.max_tokens, loaded.model.vocab_size)
    run(loaded, requests(4, 64, 2, loaded.model.vocab_size, seed=1), caching=False)  # warm-up
    load_start = os.getloadavg()[0]
    walls, outputs, metrics = {}, {}, {}
    for mode, caching in (("uncached", False), ("cached", True)):
        walls[mode], outputs[mode], metrics[mode] = run(loaded, batch, caching)
        print(f"{mode}: {walls[mode]:.1f} s, {metrics[mode]['prompt_tokens']} prompt tokens computed", flush=True)
    probe = lazy_reference_probe(resolve_preset(args.model) or args.model, [r.prompt_token_ids for r in batch])
    match = compare(outputs["uncached"], outputs["cached"], probe, TIE_GAP["float32"], ROUTING_TIE_GAP["float32"])
    report = {
        "workload": {"model": args.model, "prompts": args.prompts, "prefix_len": args.prefix_len,
                     "suffix_len": "16-64", "max_tokens": args.max_tokens, "engine": ENGINE},
        "bct_s": walls,
        "speedup": walls["uncached"] / walls["cached"],
        "prefill_tokens_saved": metrics["cached"]["prefill_tokens_saved"],
        "prefix_hit_rate": metrics["cached"]["prefix_hit_rate"],
        "prompt_tokens": {mode: m["prompt_tokens"] for mode, m in metrics.items()},
        "outputs_match": outputs["cached"] == outputs["uncached"],
        "match": {"exact": match.exact, "total": match.total, "ties": match.ties, "all_match": match.all_match,
                  "divergences": match.divergences},
        "machine": {"torch_threads": torch.get_num_threads(), "load_avg_start": load_start,
                    "load_avg_end": os.getloadavg()[0]},
    }
    print(f"BCT {walls['uncached']:.1f} s -> {walls['cached']:.1f} s with prefix caching "
          f"({report['speedup']:.2f}x); {report['prefill_tokens_saved']} prompt tokens saved "
          f"(hit rate {report['prefix_hit_rate']:.1%}); outputs identical {match.exact}/{match.total}, the other "
          f"{match.total - match.exact} near-ties: {match.ties}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
