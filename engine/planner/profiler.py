"""Measure one representative layer of a loaded model on its device, and the engine's own per-step
work, then fit the cost curves the planner prices steps with.

Modern models repeat one layer, so one layer's attention (decode over a grid of batch sizes and
context lengths, prefill over prompt counts and lengths) and feed-forward (over token counts: the
MoE's weight-read regime at a few tokens, its GEMM regime at thousands) stand for all of them. The
feed-forward runs over several of the model's layers in turn, as a forward reads them: one layer timed
again and again would find its weights in a last-level cache they do not stay in during a forward (a
32-expert bench-moe layer's 200 MB in a 300 MiB L3), and a planner pricing warm calls cut the
prefill's MoE batches into pieces that each read the weights again (b_moe 1024 against 16384: 6-21 %
slower). The engine's host work per step (scheduling, batch building, sampling) is measured on short
real runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from batchgen import kernels
from batchgen.engine.attention_context import DecodeContext, PrefillContext
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_budget import available_memory_bytes, plan_kv_budget
from batchgen.engine.kv_pool import KVPool, PoolGeometry
from batchgen.engine.models.expert_packing import experts_packed
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.planner.cost_curves import (
    DECODE_ATTENTION,
    HEAD,
    HOST,
    PREFILL_ATTENTION,
    CostCurves,
    LinearCost,
    TabulatedCost,
)
from batchgen.engine.planner.schedule_pricing import SchedulePricer
from batchgen.engine.planner.schedule_replay import replay_schedule
from batchgen.engine.planner.workload import WorkloadShape
from batchgen.kernels import cpu_identity, registry

PAGE = 64
DECODE_GRID = ((1, 64), (8, 256), (32, 1024), (128, 128), (256, 512))  # seqs, context
PREFILL_GRID = ((1, 16), (1, 1024), (16, 64), (64, 8), (8, 512), (2, 2048))  # prompts, length
FFN_GRID = tuple(2**i for i in range(13))  # tokens: 1 .. 4096 (beyond: along the last segment)
HEAD_GRID = (1, 64, 512)  # rows
HOST_RUNS = ((16, 6, 16), (64, 6, 64), (64, 6, 8), (128, 4, 128))  # prompts, output tokens each, b_attn
PROMPT_TOKENS = 8
HOST_REPEATS = 2


def profile_key(loaded: LoadedModel) -> str:
    """What the measurements depend on: device (on a CPU its model and threads), model shape, dtype, weight placement,
    versions, the sources that run a step, the kernel backends chosen, whether the experts are packed (the packed
    kernel, or the checkpoint layout's: a load sharing the node's host weights stays unpacked) and batch invariance
    (a changed kernel or layer costs differently: its curves are measured anew)."""
    device = loaded.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_identity.this_cpu()} threads={torch.get_num_threads()}"
    config = loaded.config.to_dict() if hasattr(loaded.config, "to_dict") else dict(loaded.config)
    shape = {k: v for k, v in sorted(config.items()) if isinstance(v, (int, str, bool, list, tuple))
             and not k.endswith(IGNORED_SUFFIXES) and k not in ("_name_or_path", "transformers_version", "dtype")}
    text = json.dumps([where, shape, str(loaded.dtype), loaded.weight_placement, torch.__version__, PROFILE_VERSION,
                       code_digest(), _backends(device.type, loaded.dtype), experts_packed(loaded),
                       registry.batch_invariant()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _backends(device_type: str, dtype: torch.dtype) -> dict[str, str]:
    """The backend each op runs on here (forced, BATCHGEN_KERNELS, or what is installed: flash-attn, Triton)."""
    chosen = {}
    for op in registry.OPS:
        try:
            chosen[op] = registry.resolve(op, device_type, dtype)[0]
        except registry.BackendUnavailableError:  # a meta device: planning from curves measured elsewhere
            chosen[op] = "-"
    return chosen


PROFILE_VERSION = 11  # bump when what the curves mean changes in a file code_digest does not cover
# config entries that do not change what a layer costs (token ids, names, init and rope details)
IGNORED_SUFFIXES = ("token_id", "_token_ids", "_range", "_eps", "_theta", "architectures", "torch_dtype",
                    "rope_scaling", "rope_parameters", "id2label", "label2id")


PACKAGE_ROOT = Path(kernels.__file__).parent.parent
# the sources whose change changes what a profiled step costs: the kernels (the C kernels' sources included), the
# model code and the runner's batch building around them, and the profiler's own measurements
PRICED_SOURCES = ("kernels/*.py", "engine/models/*.py", "engine/model_runner.py", "engine/coroutine.py",
                  "engine/batch_index.py", "engine/attention_context.py", "engine/decode_graphs.py",
                  "engine/planner/profiler.py")


@functools.cache
def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the PRICED_SOURCES under `root` (the package's own by default)."""
    digest = hashlib.sha256()
    for pattern in PRICED_SOURCES:
        for path in sorted(root.glob(pattern)):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_shape(loaded: LoadedModel) -> dict[str, int]:
    """What CostCurves scale one layer's measurements by: layers, the first MoE layer's routed experts and top-k
    (0 and 1 for a dense model), KV bytes per token of every layer."""
    model = loaded.model
    ffn_layer = next((layer for layer in model.layers if getattr(layer, "is_moe", False)), None)
    experts = getattr(ffn_layer.ffn.mlp, "num_experts", 0) if ffn_layer is not None else 0
    top_k = getattr(getattr(ffn_layer.ffn.mlp, "gate", None), "top_k", 1) if experts else 1
    return {"num_layers": len(model.layers), "num_experts": experts, "top_k": top_k,
            "kv_bytes_per_token": PoolGeometry(model.kv_spec(), 1, loaded.dtype).page_bytes}


def profile_model(loaded: LoadedModel, progress: bool | None = None) -> CostCurves:
    """Cost curves of `loaded` on its device (10-30 s for a 160M-parameter model on two cores); measured
    context lengths are capped by the model's own."""
    model, device = loaded.model, loaded.device
    limit = loaded.max_model_len
    attn_layer = model.layers[0]
    ffn_layer = next((layer for layer in model.layers if getattr(layer, "is_moe", False)), attn_layer)
    ffn_layers = _feed_forward_layers(model, ffn_layer, device)
    spec = model.kv_spec()
    hidden_size = model.embed_tokens.embedding_dim
    decode = [(s, min(c, limit - 1)) for s, c in DECODE_GRID]
    prefill = [(n, min(length, limit)) for n, length in PREFILL_GRID]
    layer_spec = dataclasses.replace(spec, num_layers=attn_layer.attn.self_attn.layer + 1)
    pages = max(s * -(-(c + 1) // PAGE) for s, c in decode + prefill)
    pool = KVPool(PoolGeometry(layer_spec, PAGE, loaded.dtype), pages, device)
    # a streamed unit timed again found its weights still in their slot: a step does not (each load is timed)
    measure = _Timer(device, None if loaded.streamer is None else loaded.streamer.forget)
    bar = tqdm(total=len(decode) + len(prefill) + len(FFN_GRID) + len(HEAD_GRID) + len(HOST_RUNS) + 1,
               desc="profiling one layer", disable=None if progress is None else not progress, leave=False)
    rows: dict[str, tuple[list[dict], list[float]]] = {name: ([], []) for name in ("decode", "prefill", "ffn", "head")}

    def record(name: str, features: dict, seconds: float) -> None:
        rows[name][0].append(features)
        rows[name][1].append(seconds)
        bar.update()

    with torch.inference_mode():
        for seqs, ctx in decode:
            x = torch.randn(seqs, hidden_size, dtype=loaded.dtype, device=device)
            context = _decode_context(seqs, ctx, pool, device)
            record("decode", {"calls": 1, "seqs": seqs, "kv_tokens": seqs * (ctx + 1)},
                   measure(lambda x=x, context=context: attn_layer.attn(x, context)))
        for prompts, length in prefill:
            x = torch.randn(prompts * length, hidden_size, dtype=loaded.dtype, device=device)
            context = _prefill_context(prompts, length, pool, device)
            record("prefill", {"calls": 1, "seqs": prompts, "tokens": prompts * length,
                               "pairs": prompts * length * (length + 1) / 2},
                   measure(lambda x=x, context=context: attn_layer.attn(x, context)))
        for tokens in FFN_GRID:
            x = torch.randn(tokens, hidden_size, dtype=loaded.dtype, device=device)
            seconds = measure(lambda x=x: [layer.ffn(x) for layer in ffn_layers])
            record("ffn", {"tokens": tokens}, seconds / len(ffn_layers))
        for n in HEAD_GRID:
            x = torch.randn(n, hidden_size, dtype=loaded.dtype, device=device)
            record("head", {"calls": 1, "rows": n}, measure(lambda x=x: model.head(x)))
        del pool
        copy_rate = _copy_bytes_per_s(device, measure)
        bar.update()
    if device.type == "cuda":  # what the profile allocated stays in torch's cache, which mem_get_info counts as used
        torch.cuda.empty_cache()
    curves = CostCurves(
        key=profile_key(loaded), device_type=device.type, device_free_bytes=available_memory_bytes(device),
        host_free_bytes=available_memory_bytes(torch.device("cpu")), **model_shape(loaded),
        decode_attention=LinearCost.fit(DECODE_ATTENTION, *rows["decode"]),
        prefill_attention=LinearCost.fit(PREFILL_ATTENTION, *rows["prefill"]),
        feed_forward=TabulatedCost(tuple((r["tokens"], t) for r, t in zip(*rows["ffn"]))),
        head=LinearCost.fit(HEAD, *rows["head"]),
        host=LinearCost(HOST, (0.0,) * len(HOST)),
        copy_bytes_per_s=copy_rate,
    )
    curves = dataclasses.replace(curves, host=_host_cost(loaded, curves, bar))
    bar.close()
    return curves


def _feed_forward_layers(model, first, device: torch.device) -> list:
    """`first` and the layers of its kind (MoE or dense) after it, until their feed-forward weights pass twice the
    device's last-level cache (all of them when the model's fit in it: then its forward finds them there too)."""
    cache = (torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda"
             else cpu_identity.last_level_cache_bytes())
    layers, weight_bytes = [], 0
    start = next(i for i, layer in enumerate(model.layers) if layer is first)
    for layer in list(model.layers)[start:]:
        if getattr(layer, "is_moe", False) == getattr(first, "is_moe", False):
            layers.append(layer)
            weight_bytes += sum(p.numel() * p.element_size() for p in layer.ffn.parameters())
            if weight_bytes >= 2 * cache:
                break
    return layers


class _Timer:
    """The best of a few timed calls after a warm-up, synchronising the device; fewer repeats for slow calls.
    The best, not the median: on a shared machine contention only ever adds time."""

    def __init__(self, device: torch.device, before_each: Callable[[], None] | None = None):
        self.device = device
        self.before_each = before_each  # run before every call, untimed

    def __call__(self, fn: Callable[[], object]) -> float:
        def once() -> float:
            if self.before_each is not None:
                self.before_each()
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - start

        first = once()  # pays for allocation and kernel selection
        if first < 0.05:
            first = once()
        repeats = 3 if first > 0.02 else 5
        return min(once() for _ in range(repeats))


def _decode_context(seqs: int, ctx: int, pool: KVPool, device: torch.device) -> DecodeContext:
    per_seq = -(-(ctx + 1) // PAGE)
    table = torch.arange(seqs * per_seq, dtype=torch.int32, device=device).view(seqs, per_seq)
    return DecodeContext(positions=torch.full((seqs,), ctx, device=device),
                         slots=table[:, ctx // PAGE].long() * PAGE + ctx % PAGE,
                         page_table=table, seq_lens=torch.full((seqs,), ctx + 1, dtype=torch.int32, device=device),
                         pool=pool)


def _prefill_context(prompts: int, length: int, pool: KVPool, device: torch.device) -> PrefillContext:
    per_seq = -(-length // PAGE)
    slots = torch.cat([torch.arange(length, device=device) + i * per_seq * PAGE for i in range(prompts)])
    cu = torch.arange(prompts + 1, dtype=torch.int32, device=device) * length
    return PrefillContext(positions=torch.arange(length, device=device).repeat(prompts), cu_seqlens=cu,
                          slots=slots.to(pool.device), pool=pool)


def _copy_bytes_per_s(device: torch.device, measure: _Timer) -> float:
    """Bandwidth of a page copy between host and device memory (both ways on a GPU, a plain copy on CPU)."""
    host = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty_like(host, device=device)
    return host.numel() / measure(lambda: target.copy_(host, non_blocking=False))


def _host_cost(loaded: LoadedModel, model_curves: CostCurves, bar: tqdm) -> LinearCost:
    """The engine's time per step beyond the attention, feed-forward and head calls the other curves price
    (scheduling, batch building, COMBINE/PARTITION of micro-batches, sampling), calibrated on short greedy
    runs whose decode steps all have the same shape: each run's median over its decode steps of measured
    time minus the curves' price of the replayed step is one row, fitted per step, per sequence and per
    attention micro-batch; admission is timed per prompt. Each run's configuration is given in full, so
    nothing is planned inside."""
    from batchgen.engine.engine import Engine
    from batchgen.engine.request import Request
    from batchgen.engine.sampling_params import SamplingParams

    rows, residuals, scale = [], [], []
    admission, admitted = 0.0, 0
    vocab = loaded.model.vocab_size
    for prompts, output, b_attn in HOST_RUNS:
        config = EngineConfig(b_attn=b_attn, b_moe=8192, max_num_seqs=prompts, refill_threshold=0.5,
                              kv_budget_bytes=_bytes_for(loaded, prompts * 3 * PAGE), staging_fraction=0.25,
                              host_kv_budget_bytes=_bytes_for(loaded, prompts * PAGE), prefix_caching=False,
                              batch_invariant=registry.batch_invariant())  # the kernels' paths the curves price
        runs = []
        for _ in range(HOST_REPEATS):  # a step's best time of the repeats: contention only ever adds time
            engine = Engine(loaded, config)
            for i in range(prompts):
                engine.add_request(Request(f"r{i}", sampling=SamplingParams(max_tokens=output, ignore_eos=True),
                                           prompt_token_ids=[(i * 7 + j) % vocab for j in range(PROMPT_TOKENS)]))
            runs.append([])
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                runs[-1].append(time.perf_counter() - start)
            admission += engine.stats.admission_seconds
            admitted += prompts
        measured = [min(times) for times in zip(*runs)]
        workload = WorkloadShape((PROMPT_TOKENS,) * prompts, (output,) * prompts)
        stream_host = engine.kv.stream_host
        schedule = replay_schedule(config, plan_kv_budget(config, stream_host), loaded.model.kv_spec(),
                                   loaded.dtype, workload, stream_host, loaded.device.type)
        pricer = SchedulePricer(schedule, model_curves)
        predicted = pricer.step_seconds(b_attn, config.b_moe)
        features = pricer.host_features(b_attn)
        decode = [i for i, step in enumerate(schedule) if not step.prefill]
        rows.append({name: float(column[decode[0]]) for name, column in features.items()})
        residuals.append(statistics.median(measured[i] - float(predicted[i]) for i in decode))
        scale.append(statistics.median(measured[i] for i in decode))
        bar.update()
    fitted = LinearCost.fit(HOST[:-1], rows, residuals, scale=scale)
    return LinearCost(HOST, (*fitted.coefficients, admission / admitted))


def _bytes_for(loaded: LoadedModel, tokens: int) -> int:
    return PoolGeometry(loaded.model.kv_spec(), 1, loaded.dtype).page_bytes * tokens
