"""The CPU C kernels of another commit against this tree's, in one process, alternated call by call.

    python bench/kernel_ab.py --base REV [--engine] [--rounds 7] [--json]

On a shared 2-core box two runs of the same code differ by 10-30 % from one minute to the next, more than most kernel
changes are worth; two builds alternated inside one process see the same moments. Every C kernel (kernels/*_cpu.py)
is built a second time from its source at REV (and REV's shared C snippets, kernels/c_library.py), and the two builds
take turns on the same inputs: the MoE kernels on random top-2 routings of 4-32 rows per expert (bench-moe's 16 experts
of 512 x 1024; the grouped kernel at this tree's crossover, so only the kernel differs; the packed kernel a CPU engine
runs, on packed weights in huge pages, and at prefill's ~450 rows per expert too), warm (one layer's weights, in cache)
and cold (six layers' weights in turn, 600 MB: more than the caches, as a decode step reads them), prefill attention
on a 4,096-token step of 32-256-token prompts and paged decode attention on 128 sequences of ~96-192 tokens
(bench-moe's heads). `--engine`
runs the engine on bct.py's unconstrained workload instead, the two builds' kernels swapped in run by run. Each point
reports both medians, their ratio (below 1: this tree faster) and whether the outputs were bit-identical. With --json
the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.engine.host_arena import host_arena
from batchgen.kernels import (
    activation_cpu,
    argmax_cpu,
    attention_cpu,
    linear_cpu,
    moe_cpu,
    moe_crossover,
    moe_packed_cpu,
    norm_cpu,
    prefill_cpu,
    rotary_cpu,
    router_cpu,
    write_kv_cpu,
)
from batchgen.kernels.c_library import CFunction

C_MODULES = (activation_cpu, argmax_cpu, attention_cpu, linear_cpu, moe_cpu, moe_packed_cpu, norm_cpu, prefill_cpu,
             rotary_cpu, router_cpu, write_kv_cpu)
REPO = Path(__file__).resolve().parent.parent
BASE_C_LIBRARY = "_kernel_ab_base_c_library"
COLD_LAYERS = 6  # the MoE cases' calls per point; the cold ones read a different layer's 100 MB of weights in each


def source_at(rev: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def base_kernels(rev: str) -> dict[tuple[types.ModuleType, str], CFunction]:
    """Each C function of this tree, rebuilt from its module's source at `rev` (which includes rev's c_library); one
    whose arguments changed since is left out (called through this tree's wrapper, rev's build would crash)."""
    c_library = types.ModuleType(BASE_C_LIBRARY)
    sys.modules[BASE_C_LIBRARY] = c_library
    exec(compile(source_at(rev, "kernels/c_library.py"), BASE_C_LIBRARY, "exec"), c_library.__dict__)
    kernels = {}
    for module in C_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        old = types.ModuleType(f"_kernel_ab_base_{name}")
        sys.modules[old.__name__] = old
        try:
            text = source_at(rev, f"kernels/{name}.py").replace("batchgen.kernels.c_library", BASE_C_LIBRARY)
        except subprocess.CalledProcessError:  # a kernel newer than rev
            print(f"kernel_ab: kernels/{name}.py is not in {rev}: its cases run this tree's build as both",
                  file=sys.stderr)
            continue
        exec(compile(text, old.__name__, "exec"), old.__dict__)
        for attr, function in vars(module).items():
            before = getattr(old, attr, None)
            if not isinstance(function, CFunction) or not hasattr(before, "source"):
                continue
            if _signature(before) != _signature(function):
                # this tree's wrapper would call rev's build with other arguments than it takes
                print(f"kernel_ab: {name}.{attr} takes other arguments at {rev}: its cases run this tree's build "
                      "as both", file=sys.stderr)
                continue
            kernels[(module, attr)] = dataclasses.replace(function, source=before.source)
    return kernels


def _signature(function: CFunction) -> tuple:
    """A C function's ctypes argument and result types, structures by their fields (each module defines its own)."""
    def shape(t):
        if isinstance(t, type) and issubclass(t, ctypes.Structure):
            return tuple((name, shape(field)) for name, field, *_ in t._fields_)
        return t

    return tuple(map(shape, function.argtypes)), shape(function.restype)


@dataclasses.dataclass
class Builds:
    head: dict[tuple[types.ModuleType, str], CFunction]
    base: dict[tuple[types.ModuleType, str], CFunction]

    def use(self, which: str) -> None:
        for (module, attr), function in getattr(self, which).items():
            setattr(module, attr, function)


def alternate(builds: Builds, cases: dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, float]]],
              rounds: int) -> dict[str, dict]:
    """Median seconds of each case under each build, the builds taking turns within a round. A case returns its
    output, or (output, seconds) when only part of the call is the work measured (an engine run's BCT, not its
    construction and warm-up)."""
    seconds = {name: {"head": [], "base": []} for name in cases}
    outputs = {}
    for _ in range(rounds + 1):  # the first round warms both builds up (compile, load, caches) and is dropped
        for which in ("head", "base"):
            builds.use(which)
            for name, case in cases.items():
                start = time.perf_counter()
                result = case()
                took = time.perf_counter() - start
                if isinstance(result, tuple):
                    result, took = result
                outputs[(name, which)] = result
                seconds[name][which].append(took)
    builds.use("head")
    report = {}
    for name, times in seconds.items():
        head, base = statistics.median(times["head"][1:]), statistics.median(times["base"][1:])
        report[name] = {"head_ms": head * 1e3, "base_ms": base * 1e3, "head_over_base": head / base,
                        "identical": torch.equal(outputs[(name, "head")], outputs[(name, "base")])}
    return report


def kernel_cases() -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    experts, dim, inter = 16, 512, 1024
    layers = [(torch.randn(experts, 2 * inter, dim, generator=g) / dim**0.5,
               torch.randn(experts, dim, inter, generator=g) / inter**0.5) for _ in range(COLD_LAYERS)]
    packed = [(_packed(w_gate_up, moe_packed_cpu.pack_gate_up), _packed(w_down, moe_packed_cpu.pack_down))
              for w_gate_up, w_down in layers]
    dot_rows = moe_crossover.dot_rows(dim, inter)
    cases = {}
    for mean in (4, 8, 16, 32, 450):
        tokens = experts * mean // 2
        weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(2)
        x = torch.randn(tokens, dim, generator=g)

        def moe(layer_weights: list, x=x, weights=weights, ids=ids) -> torch.Tensor:
            return torch.stack([moe_cpu.grouped_experts(x, w_gate_up, w_down, weights, ids, dot_rows).out
                                for w_gate_up, w_down in layer_weights])

        def moe_packed(layer_weights: list, x=x, weights=weights, ids=ids) -> torch.Tensor:
            return torch.stack([moe_packed_cpu.fused_moe_packed_cpu(x, w_gate_up, w_down, weights, ids)
                                for w_gate_up, w_down in layer_weights])

        if mean <= 32:  # decode sizes; the grouped kernel runs only there in an engine whose experts are packed
            cases[f"moe_{mean}_rows_per_expert"] = functools.partial(moe, layers[:1] * COLD_LAYERS)
            cases[f"moe_{mean}_rows_per_expert_cold"] = functools.partial(moe, layers)
        cases[f"moe_packed_{mean}_rows_per_expert"] = functools.partial(moe_packed, packed[:1] * COLD_LAYERS)
        cases[f"moe_packed_{mean}_rows_per_expert_cold"] = functools.partial(moe_packed, packed)
    heads, kv_heads, head_dim, page = 8, 2, 64, 64
    rng = random.Random(0)
    lens = []
    while sum(lens) < 4096:
        lens.append(rng.randrange(32, 256))
    q, k, v = (torch.randn(sum(lens), h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    cases["prefill_attention_4096_tokens"] = lambda: prefill_cpu.prefill_attention_cpu(q, k, v, cu, cu, 0.125)
    seqs, context = 128, 192
    pages = seqs * (context // page + 1)
    k_cache, v_cache = (torch.randn(pages, page, kv_heads, head_dim, generator=g) for _ in range(2))
    table = torch.randperm(pages, generator=g).to(torch.int32).reshape(seqs, -1)
    seq_lens = torch.randint(context // 2, context, (seqs,), generator=g, dtype=torch.int32)
    queries = torch.randn(seqs, heads, head_dim, generator=g)
    cases["decode_attention_128_seqs"] = lambda: attention_cpu.paged_decode_attention_cpu(
        queries, k_cache, v_cache, table, seq_lens, 0.125)
    return cases


def _packed(weights: torch.Tensor, pack) -> torch.Tensor:
    """`weights` packed for moe_packed_cpu in a huge-page arena, as a CPU engine holds its experts."""
    held = host_arena(weights.numel() * weights.element_size()).view(weights.dtype).view(weights.shape)
    return moe_packed_cpu.pack_in_place(held.copy_(weights), pack)


def engine_case() -> dict[str, Callable[[], torch.Tensor]]:
    """bct.py's unconstrained BatchGen run, as one case: its BCT, its tokens for the comparison."""
    import bct
    from roofline import MoEShape

    from batchgen.connectors.checkpoint import load_model
    from batchgen.connectors.presets import build_preset
    from batchgen.engine.process_heap import keep_freed_memory

    model_dir = build_preset("bench-moe")
    shape = MoEShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    workload = bct.make_workload(bct.WorkloadSpec(), shape.vocab)
    keep_freed_memory()
    loaded = load_model(model_dir, dtype="float32", device="cpu")
    host = bct.all_contexts_bytes(shape, workload)
    config = bct.planned_for(loaded, bct.engine_config("coroutine", 2 * host, host), workload)

    def run() -> tuple[torch.Tensor, float]:
        ran = bct.run_engine(loaded, config, workload)
        return torch.tensor([t for row in ran.tokens for t in row]), ran.bct_s

    return {"engine_bct": run}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit whose kernels are compared against this tree's")
    parser.add_argument("--engine", action="store_true", help="whole engine runs on bct.py's workload instead")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --engine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.engine else 7)
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    base = base_kernels(args.base)
    builds = Builds(head={key: getattr(*key) for key in base}, base=base)
    changed = sorted(f"{module.__name__.rsplit('.', 1)[1]}.{attr}" for (module, attr), function in base.items()
                     if function.source != getattr(module, attr).source)
    print(f"kernels whose source differs from {args.base}: {', '.join(changed) or 'none'}; torch threads "
          f"{torch.get_num_threads()}")
    report = alternate(builds, engine_case() if args.engine else kernel_cases(), rounds)
    for name, point in report.items():
        print(f"{name:>32}: this tree {point['head_ms']:9.2f} ms, {args.base} {point['base_ms']:9.2f} ms, "
              f"ratio {point['head_over_base']:.3f}, bit-identical {point['identical']}")
    if args.json:
        print(json.dumps({"base": args.base, "changed": changed, "rounds": rounds, "points": report}))


if __name__ == "__main__":
    main()
