"""Kernel speed against what bounds it, on the device the engine would use.

    python bench/kernels.py [--json] [--dim 512] [--inter 1024] [--experts 8] [--dtype float32] [--cold]

1. Expert GEMM versus tokens per expert: our grouped torch MoE (and on CPU the C kernels: the packed one the engine
   runs, on the weights repacked for it, and the one on the checkpoint's layout; the Triton kernel on CUDA) against
   transformers' Mixtral experts module on the same weights and routing. Routing is balanced so every
   expert sees exactly n tokens; FLOP/s counts the useful work only (6 * D * I per routed token). Each
   point also reports its weight-read bound (every expert's weights read once at the measured read
   bandwidth) and the time over that bound: at 1-8 tokens per expert a call should cost about one read
   of the weights.
2. Paged decode attention (`kernels.ops.paged_decode_attention`, the backend the registry picks) at the
   bench-moe attention shape, against its KV-read bound (every cached K/V byte read once at the measured
   read bandwidth).
3. Projections (`kernels.ops.linear`, the backend the registry picks: the C kernel on CPU) at a decode step's row
   counts and bench-moe's shapes (q/o_proj 512 x 512, k/v_proj 128 x 512, the LM head 4096 x 512), against torch's
   own F.linear (BLAS) on the same weight and the weight-read bound. With --json the last line is one JSON object.

Repeated calls on the same weights find them in the cache after the first (8 experts of 512 x 1024 are 50 MB; a
server CPU's last-level cache can hold hundreds of MB), so the bounds above, at memory's bandwidth, can read below
1. `--cold` sweeps twice the last-level cache (read from sysfs; 256 MiB on CUDA) before every timed call, untimed,
and times 5 calls per point: the weights and KV then come from memory, as a layer's do in a model step that read
the whole model since that layer last ran.
"""

import argparse
import json
import platform
import statistics
import time

import torch
from roofline import read_bandwidth

from batchgen.engine.host_arena import HUGE_PAGE, host_arena
from batchgen.kernels import moe_cpu, moe_packed_cpu, ops, registry
from batchgen.kernels.cpu_identity import last_level_cache_bytes
from batchgen.kernels.moe_torch import fused_moe_torch

TOP_K = 2
TOKENS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# transformers' batched_mm gathers a copy of the expert weights for every routed token: cap its memory.
BATCHED_MM_MAX_BYTES = 2 << 30


def balanced_routing(tokens_per_expert: int, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t picks experts (t mod E/2) and (t mod E/2) + E/2: each expert gets exactly n tokens."""
    half = num_experts // 2
    tokens = tokens_per_expert * half
    first = torch.arange(tokens, device=device) % half
    topk_ids = torch.stack([first, first + half], dim=1)
    topk_weights = torch.rand(tokens, TOP_K, device=device).softmax(dim=1)
    return topk_ids, topk_weights


def transformers_experts(impl: str, w_gate_up: torch.Tensor, w_down: torch.Tensor):
    """transformers' MixtralExperts (the experts of MixtralSparseMoeBlock) holding our weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    num_experts, two_i, dim = w_gate_up.shape
    config = MixtralConfig(
        hidden_size=dim,
        intermediate_size=two_i // 2,
        num_local_experts=num_experts,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = impl
    experts = MixtralExperts(config).to(device=w_gate_up.device, dtype=w_gate_up.dtype)
    experts.gate_up_proj.data.copy_(w_gate_up)
    experts.down_proj.data.copy_(w_down)
    return lambda x, ids, weights: experts(x, ids, weights)


def implementations(device: torch.device, w_gate_up, w_down) -> dict:
    impls = {
        "batchgen_torch_grouped": lambda x, ids, weights: fused_moe_torch(x, w_gate_up, w_down, weights, ids)
    }
    if device.type == "cpu" and w_gate_up.dtype == torch.float32 and not moe_cpu.unavailable():
        impls["batchgen_cpu_c"] = lambda x, ids, weights: moe_cpu.fused_moe_cpu(x, w_gate_up, w_down, weights, ids)
    if (device.type == "cpu" and w_gate_up.dtype == torch.float32 and not moe_packed_cpu.unavailable()
            and moe_packed_cpu.packing_refusal(w_down.shape[1], w_down.shape[2]) is None):
        packed = (as_engine_holds(moe_packed_cpu.pack_gate_up(w_gate_up)),
                  as_engine_holds(moe_packed_cpu.pack_down(w_down)))
        impls["batchgen_cpu_packed"] = lambda x, ids, weights: ops.fused_moe_packed(x, *packed, weights, ids)
    if device.type == "cuda":
        from batchgen.kernels.moe_triton import fused_moe_triton

        impls["batchgen_triton"] = lambda x, ids, weights: fused_moe_triton(
            x, w_gate_up, w_down, weights, ids
        )
    for impl in ("eager", "grouped_mm", "batched_mm"):
        impls[f"transformers_{impl}"] = transformers_experts(impl, w_gate_up, w_down)
    return impls


COLD_CALLS = 5  # timed calls per point with --cold (each after a sweep of the cache)


def cache_sweep(device: torch.device):
    """A call that reads twice the last-level cache (of the GPU: 256 MiB), evicting what a kernel read before."""
    nbytes = (128 << 20) if device.type == "cuda" else last_level_cache_bytes()
    buffer = torch.ones(2 * nbytes // 4, device=device)
    return lambda: buffer.sum()


def seconds_per_call(fn, args, device: torch.device, min_time: float, best: bool = False, before=None) -> float:
    """Median (or best) seconds of repeated calls, at least `min_time` of them, after one warm-up; with `before`
    (untimed, before each call) COLD_CALLS of them."""
    fn(*args)  # warm-up (kernel compilation, allocator)
    times = []
    while (len(times) < COLD_CALLS) if before else (sum(times) < min_time or len(times) < 3):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


# bench-moe attention: 8 query heads, 2 KV heads, head dim 64, 64-token pages
DECODE_SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 64, "page_size": 64}
DECODE_BATCHES = ((8, 256), (32, 256), (128, 192), (128, 1024))  # (sequences, mean context)


def as_engine_holds(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor copied into huge pages, as a CPU engine holds its weights and KV pools (each in one arena of
    far more than a huge page: engine/host_arena.py), small tensors included; a GPU tensor as it is."""
    if tensor.device.type != "cpu":
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    arena = host_arena(max(nbytes, HUGE_PAGE))[:nbytes]
    return arena.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def decode_attention(device: torch.device, dtype: torch.dtype, bandwidth: float, min_time: float,
                     before=None) -> list[dict]:
    """Paged decode attention time per call against reading every cached K/V byte once."""
    heads, kv_heads, dim, page = (DECODE_SHAPE[k] for k in ("heads", "kv_heads", "head_dim", "page_size"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch, mean_len in DECODE_BATCHES:
        lens = torch.randint(mean_len // 2, mean_len * 3 // 2, (batch,), generator=g)
        pages_per_seq = (lens + page - 1) // page
        total_pages = int(pages_per_seq.sum())
        order = torch.randperm(total_pages, generator=g)  # pages scattered through the pool, as in the engine
        table = torch.zeros(batch, int(pages_per_seq.max()), dtype=torch.int32)
        start = 0
        for b, n in enumerate(pages_per_seq.tolist()):
            table[b, :n] = order[start : start + n].int()
            start += n
        k_cache = as_engine_holds(torch.randn(total_pages, page, kv_heads, dim, generator=g).to(device, dtype))
        v_cache = as_engine_holds(torch.randn(total_pages, page, kv_heads, dim, generator=g).to(device, dtype))
        q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
        args = (q, k_cache, v_cache, table.to(device), lens.int().to(device), dim**-0.5)
        seconds = seconds_per_call(lambda *a: ops.paged_decode_attention(*a), args, device, min_time, before=before)
        kv_bytes = int(lens.sum()) * kv_heads * 2 * dim * k_cache.element_size()
        bound = kv_bytes / bandwidth
        rows.append(dict(backend=registry.last_used("paged_decode_attention"), sequences=batch,
                         mean_context=mean_len, kv_mib=round(kv_bytes / 2**20, 2), ms=round(seconds * 1e3, 4),
                         kv_read_bound_ms=round(bound * 1e3, 4), over_bound=round(seconds / bound, 2)))
    return rows


# bench-moe projections (out, in): q_proj / o_proj, k_proj / v_proj, lm_head; row counts of decode steps
LINEAR_SHAPES = ((512, 512), (128, 512), (4096, 512))
LINEAR_ROWS = (1, 4, 8, 16, 24)


def projections(device: torch.device, dtype: torch.dtype, bandwidth: float, min_time: float,
                before=None) -> list[dict]:
    """ops.linear (the registry's backend) and torch's F.linear per call, against reading the weight once."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for out_features, dim in LINEAR_SHAPES:
        weight = as_engine_holds((torch.randn(out_features, dim, generator=g) / dim**0.5).to(device, dtype))
        bound = weight.numel() * weight.element_size() / bandwidth
        for count in LINEAR_ROWS:
            x = torch.randn(count, dim, generator=g).to(device, dtype)
            ours = seconds_per_call(lambda a, w: ops.linear(a, w), (x, weight), device, min_time, before=before)
            backend = registry.last_used("linear")
            blas = seconds_per_call(torch.nn.functional.linear, (x, weight), device, min_time, before=before)
            rows.append(dict(backend=backend, out_features=out_features, in_features=dim, rows=count,
                             ms=round(ours * 1e3, 4), torch_ms=round(blas * 1e3, 4),
                             weight_read_bound_ms=round(bound * 1e3, 4), over_bound=round(ours / bound, 2),
                             torch_over_bound=round(blas / bound, 2)))
    return rows


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    bandwidth = read_bandwidth(device)
    before = cache_sweep(device) if args.cold else None
    g = torch.Generator(device="cpu").manual_seed(0)
    w_gate_up = (torch.randn(args.experts, 2 * args.inter, args.dim, generator=g) / args.dim**0.5).to(
        device, dtype
    )
    w_down = (torch.randn(args.experts, args.dim, args.inter, generator=g) / args.inter**0.5).to(
        device, dtype
    )
    w_gate_up, w_down = as_engine_holds(w_gate_up), as_engine_holds(w_down)
    impls = implementations(device, w_gate_up, w_down)
    weight_bytes = (w_gate_up.numel() + w_down.numel()) * w_down.element_size()  # every expert is hit
    rows, skipped = [], {}
    with torch.inference_mode():
        for n in args.tokens_per_expert:
            topk_ids, topk_weights = balanced_routing(n, args.experts, device)
            x = torch.randn(topk_ids.shape[0], args.dim, device=device, dtype=dtype)
            reference = fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids).float()
            flops = topk_ids.numel() * 6 * args.dim * args.inter
            gathered_bytes = topk_ids.numel() * 3 * args.dim * args.inter * w_down.element_size()
            for name, fn in impls.items():
                if name == "transformers_batched_mm" and gathered_bytes > BATCHED_MM_MAX_BYTES:
                    skipped.setdefault(
                        name, f"from {n} tokens/expert: would gather {gathered_bytes / 2**30:.1f} GiB"
                    )
                if name in skipped:
                    continue
                try:
                    out = fn(x, topk_ids, topk_weights)
                except (RuntimeError, NotImplementedError) as exc:
                    skipped[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                    continue
                error = (out.float() - reference).abs().max().item()
                seconds = seconds_per_call(fn, (x, topk_ids, topk_weights), device, args.min_time, before=before)
                weight_bound = weight_bytes / bandwidth
                rows.append(
                    dict(
                        impl=name,
                        tokens_per_expert=n,
                        tokens=x.shape[0],
                        ms=round(seconds * 1e3, 4),
                        gflops=round(flops / seconds / 1e9, 2),
                        weight_read_bound_ms=round(weight_bound * 1e3, 4),
                        over_weight_bound=round(seconds / weight_bound, 2),
                        max_abs_err=float(f"{error:.3g}"),
                    )
                )
    return dict(
        bench="kernels.expert_gemm",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        device_type=device.type,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        dtype=args.dtype,
        experts=args.experts,
        top_k=TOP_K,
        dim=args.dim,
        inter=args.inter,
        read_bandwidth_gbs=round(bandwidth / 1e9, 2),
        cold_caches=args.cold,
        results=rows,
        skipped=skipped,
        decode_attention=decode_attention(device, dtype, bandwidth, args.min_time, before),
        projections=projections(device, dtype, bandwidth, args.min_time, before),
    )


def print_table(report: dict) -> None:
    names = sorted({r["impl"] for r in report["results"]}, key=lambda s: (not s.startswith("batchgen"), s))
    by_key = {(r["impl"], r["tokens_per_expert"]): r for r in report["results"]}
    print(
        f"expert GEMM GFLOP/s on {report['device_type']} ({report['device']}, {report['threads']} threads), "
        f"{report['dtype']}, E={report['experts']}, top-k={report['top_k']}, "
        f"D={report['dim']}, I={report['inter']}"
    )
    print(f"{'tokens/expert':>13} " + " ".join(f"{n:>24}" for n in names))
    for n in sorted({r["tokens_per_expert"] for r in report["results"]}):
        cells = [by_key.get((name, n)) for name in names]
        print(f"{n:>13} " + " ".join(f"{c['gflops']:>24.2f}" if c else f"{'-':>24}" for c in cells))
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}")
    for name in (n for n in names if n.startswith("batchgen")):
        ours = [r for r in report["results"] if r["impl"] == name and r["tokens_per_expert"] <= 8]
        print(f"{name} call vs weight-read bound ({report['read_bandwidth_gbs']} GB/s read): " + ", ".join(
            f"{r['tokens_per_expert']} tok/expert {r['ms']:.3f} ms = {r['over_weight_bound']}x" for r in ours))
    print("paged decode attention vs KV-read bound:")
    for r in report["decode_attention"]:
        print(f"  {r['backend']}: {r['sequences']} seqs x ~{r['mean_context']} tokens ({r['kv_mib']} MiB KV): "
              f"{r['ms']:.3f} ms, bound {r['kv_read_bound_ms']:.3f} ms, {r['over_bound']}x")
    print("projections (ops.linear vs torch F.linear) vs weight-read bound:")
    for r in report["projections"]:
        print(f"  {r['backend']}: {r['out_features']} x {r['in_features']}, {r['rows']} rows: {r['ms']:.4f} ms "
              f"({r['over_bound']}x), torch {r['torch_ms']:.4f} ms ({r['torch_over_bound']}x), "
              f"bound {r['weight_read_bound_ms']:.4f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--tokens-per-expert", type=int, nargs="+", default=list(TOKENS_PER_EXPERT))
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of timed calls per point")
    parser.add_argument("--cold", action="store_true", help="sweep the caches before every timed call")
    args = parser.parse_args()
    if args.experts % 2:
        parser.error("--experts must be even (balanced top-2 routing)")
    report = run(args)
    print_table(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
