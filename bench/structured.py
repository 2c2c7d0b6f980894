"""Structured outputs: tokens/s under a JSON schema against free text, on the same tokens.

    python bench/structured.py [--json] [--prompts 256] [--max-tokens 96] [--model bench-moe] [--rounds 2]

Each round runs the same prompts twice in fresh engines: first greedy under a JSON schema (an
extraction record: a patterned name, bounded integers, an enum, a short list; compact JSON, as a
random-weight model left free to add whitespace fills max_tokens with it), then greedy free text
with each row's max_tokens set to the number of tokens it generated under the schema (ignore_eos), so
both runs generate exactly the same number of tokens per row and batch the same way. Rounds
alternate the two runs to spread machine noise; each run's best round counts.

JSON keys: `tokens_per_s.structured`, `tokens_per_s.free`, `slowdown` (free tok/s / structured tok/s;
goal at most 1.15), `valid_json` (share of structured outputs that parse and match the schema),
`finished` (share that ended on the grammar's end rather than max_tokens). With --json the last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

import torch

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city", "score", "tags"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lagos", "Lima", "Osaka", "Perth"]},
        "score": {"type": "integer", "minimum": -100, "maximum": 100},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "vip", "late", "ok"]}},
    },
}
ENGINE = {"page_size": 16, "kv_budget_bytes": 2 << 30, "host_kv_budget_bytes": 1 << 30}


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def run(loaded, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    engine = Engine(loaded, **ENGINE)
    requests = [Request(str(i), p, sampling=s) for i, (p, s) in enumerate(zip(batch, params))]
    start = time.perf_counter()
    results = engine.generate(requests)
    wall = time.perf_counter() - start
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return wall, [r.outputs[0] for r in results]


def follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    props = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(props)
            and re.fullmatch(props["name"]["pattern"].strip("^$"), value["name"]) is not None
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["city"] in props["city"]["enum"]
            and isinstance(value["score"], int) and -100 <= value["score"] <= 100
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in props["tags"]["items"]["enum"] for t in value["tags"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-moe")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model)
    batch = prompts(args.prompts, loaded.model.vocab_size)
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    structured = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=spec)]
    structured = structured * len(batch)
    run(loaded, batch[:8], structured[:8])  # warm-up: threads, allocator, the grammar compiler
    load_start = os.getloadavg()[0]
    best = {"structured": float("inf"), "free": float("inf")}
    outputs, free = None, None
    for round_ in range(args.rounds):
        wall, outputs = run(loaded, batch, structured)
        best["structured"] = min(best["structured"], wall)
        if free is None:
            free = [SamplingParams(max_tokens=len(o.token_ids), temperature=0.0, ignore_eos=True) for o in outputs]
        wall_free, free_outputs = run(loaded, batch, free)
        best["free"] = min(best["free"], wall_free)
        assert [len(o.token_ids) for o in free_outputs] == [len(o.token_ids) for o in outputs]
        print(f"round {round_}: structured {wall:.2f} s, free {wall_free:.2f} s", flush=True)
    tokens = sum(len(o.token_ids) for o in outputs)
    tps = {mode: tokens / seconds for mode, seconds in best.items()}
    report = {
        "workload": {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                     "generated_tokens": tokens, "schema": SCHEMA, "rounds": args.rounds},
        "tokens_per_s": tps,
        "slowdown": tps["free"] / tps["structured"],
        "valid_json": sum(follows_schema(o.text) for o in outputs) / len(outputs),
        "finished": sum(o.finish_reason == "stop" for o in outputs) / len(outputs),
        "machine": {"torch_threads": torch.get_num_threads(), "load_avg_start": load_start,
                    "load_avg_end": os.getloadavg()[0]},
    }
    print(f"{tokens} tokens: structured {tps['structured']:.1f} tok/s, free {tps['free']:.1f} tok/s, "
          f"slowdown {report['slowdown']:.3f}x; valid JSON {report['valid_json']:.1%}, "
          f"finished {report['finished']:.1%}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
