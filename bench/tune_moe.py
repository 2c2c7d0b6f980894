"""Tune the Triton fused MoE block sizes for one (experts, intermediate size, device) and write the JSON file
kernels/moe_config.py reads (one entry per token count M).

    python bench/tune_moe.py --experts 8 --inter 14336 --dim 4096 --top-k 2 --dtype bfloat16

Run it on the GPU the configs are for. `--device cpu` (with TRITON_INTERPRET=1) only checks the plumbing:
interpreter timings say nothing about a GPU.
"""

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

from batchgen.kernels.moe_config import CONFIG_KEYS, config_dir, config_file_name, device_name
from batchgen.kernels.moe_triton import fused_moe_triton

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
FULL_SPACE = dict(
    BLOCK_SIZE_M=(16, 32, 64, 128),
    BLOCK_SIZE_N=(32, 64, 128, 256),
    BLOCK_SIZE_K=(64, 128, 256),
    GROUP_SIZE_M=(1, 16, 32, 64),
    num_warps=(4, 8),
    num_stages=(2, 3, 4, 5),
)
QUICK_SPACE = dict(
    BLOCK_SIZE_M=(16, 64),
    BLOCK_SIZE_N=(32, 64),
    BLOCK_SIZE_K=(64,),
    GROUP_SIZE_M=(1, 8),
    num_warps=(4,),
    num_stages=(3,),
)


def candidate_configs(space: dict, num_tokens: int, top_k: int, num_experts: int) -> list[dict[str, int]]:
    """All combinations, without BLOCK_M far above the rows an expert can receive (pure padding)."""
    rows_per_expert = max(1, num_tokens * top_k // num_experts)
    largest_useful_m = max(16, triton.next_power_of_2(rows_per_expert) * 2)
    combos = itertools.product(*(space[key] for key in CONFIG_KEYS))
    configs = [dict(zip(CONFIG_KEYS, values)) for values in combos]
    return [c for c in configs if c["BLOCK_SIZE_M"] <= largest_useful_m]


def time_ms(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=5, rep=reps * 5)
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def tune_one(args, num_tokens: int, weights, device, space) -> tuple[dict[str, int], float]:
    w_gate_up, w_down = weights
    x = torch.randn(num_tokens, args.dim, device=device, dtype=w_gate_up.dtype)
    logits = torch.randn(num_tokens, args.experts, device=device)
    topk_weights, topk_ids = logits.softmax(-1).topk(args.top_k, dim=-1)
    best, best_ms = None, float("inf")
    for config in candidate_configs(space, num_tokens, args.top_k, args.experts):
        run = lambda: fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, config=config)  # noqa: B023
        try:
            ms = time_ms(run, device, args.reps)
        except (OutOfResources, RuntimeError):
            continue  # too much shared memory / registers for this device
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise RuntimeError(f"no config ran for M={num_tokens}")
    return best, best_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True, help="intermediate size I (w_down is [E, D, I])")
    parser.add_argument("--dim", type=int, required=True, help="hidden size D")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small search space")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: kernels/configs")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: tune on the GPU the configs are for")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu needs TRITON_INTERPRET=1 (plumbing check only)")

    dtype = getattr(torch, args.dtype)
    w_gate_up = torch.randn(args.experts, 2 * args.inter, args.dim, device=device) / args.dim**0.5
    w_down = torch.randn(args.experts, args.dim, args.inter, device=device) / args.inter**0.5
    weights = (w_gate_up.to(dtype), w_down.to(dtype))
    space = QUICK_SPACE if args.quick else FULL_SPACE
    tuned = {}
    for num_tokens in args.batch_sizes:
        config, ms = tune_one(args, num_tokens, weights, device, space)
        tuned[str(num_tokens)] = config
        print(f"M={num_tokens:>5}: {ms:8.3f} ms  {config}", flush=True)
    out_dir = args.out_dir or config_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(args.experts, args.inter, device_name(device))
    path.write_text(json.dumps(tuned, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
