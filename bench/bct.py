"""Batch completion time (BCT): BatchGen (the coroutine engine), the same engine in lockstep mode
(vLLM-style continuous batching) and transformers' own continuous batching, on the same weights,
in one process and one run.

    python bench/bct.py [--quick] [--json] [--seed 0] [--num-prompts 128] [--experts 16] [--top-k 2]
                        [--sigma 0.8] [--kv-budget-mb MB | --budget-seqs 16] [--dtype float32] [--repeats 3]
                        [--transformers-repeats 1] [--plan workload|generic] [--profile] [--eager]

Workload "bench-moe": the bench-moe preset (Mixtral-style, random weights), prompts of random token ids
with lengths uniform in [32, 256), output lengths lognormal(mu=3.5, sigma) + 1 capped at 512, fixed per
prompt by max_tokens with ignore_eos, greedy. Two scenarios: unconstrained (every sequence's full context
fits in device KV) and a device KV budget holding 16 (--budget-seqs) sequences of MEAN full context
(prompt + output): 2 * layers * kv_heads * head_dim * dtype bytes * mean context * 16, or --kv-budget-mb.
transformers gets the same bytes as its cache size (num_blocks); its CPU swap pool needs pinned memory, so
on a CPU-only torch it soft-resets (re-prefills) the requests it evicts.

Each system first runs a few short warm-up requests (kept out of the timings); BCT runs from the first request
submitted to the last result returned. The two engine modes run --repeats times each, interleaved (which goes first
alternates round by round), and report their median run (`bct_runs_s` lists every run): this machine's speed drifts
by more than the gap between modes that run one schedule. transformers runs once, after them, or in each of the
first --transformers-repeats rounds (its median run then reports). Each engine mode's unset settings (max_num_seqs,
b_attn, b_moe, refill) are planned for this workload's prompt and output lengths, as `batchgen run` plans a job's
engines for its input (`engine_settings` in the JSON); `--plan generic` leaves them to the engine's own plan for a
generic workload.
The roofline bound (bench/roofline.py) is measured in the same run, its peaks sampled at the start and after each
scenario and taken at their best (`machine.peak_samples`: a shared machine's speed drifts by minutes), for the workload
(the best schedule) and for each engine mode's steps as it ran them (Engine.observe_steps):
`speedup_vs_lockstep_at_bounds` is the speedup the two schedules would give if both ran every step at the roofline,
`over_schedule_bound` how far each run is from its own schedule's bound, and `step_classes` where that distance lies:
each mode's steps by class (prefill, decode by sequences decoded), their wall time against their bound. With --json the
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import inspect
import io
import json
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from roofline import (
    MachinePeaks,
    MoEShape,
    StepShape,
    best_peaks,
    measure_peaks,
    schedule_bound,
    step_seconds,
    workload_bound,
)

from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.presets import build_preset
from batchgen.engine import Engine, EngineConfig, Request, SamplingParams
from batchgen.engine.planner import PLANNED_FIELDS, WorkloadShape, plan_engine
from batchgen.engine.process_heap import freeze_heap, keep_freed_memory
from batchgen.engine.scheduler import StepPlan

SYSTEMS = ("batchgen", "lockstep", "transformers")
ENGINE_MODES = {"batchgen": "coroutine", "lockstep": "lockstep"}
PAGE_SIZE = 64
WARMUP_PROMPTS = 4
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 128
    prompt_len: tuple[int, int] = (32, 256)  # uniform in [low, high)
    mu: float = 3.5
    sigma: float = 0.8
    max_output: int = 512
    budget_seqs: int = 16  # the KV-budget scenario holds this many mean full contexts
    seed: int = 0


# --quick: the same model and systems, a workload small enough to finish in under a minute on 2 cores
QUICK = dict(num_prompts=16, prompt_len=(16, 64), mu=2.5, max_output=48, budget_seqs=8)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def contexts(self) -> list[int]:
        return [len(p) + n for p, n in zip(self.prompts, self.max_tokens)]


@dataclass
class SystemRun:
    tokens: list[list[int]]
    bct_s: float
    completion_times: list[float]
    mean_expert_batch: float
    engine_metrics: dict | None = None  # our engine's own counters
    steps: list[StepShape] | None = None  # our engine's schedule, step by step
    step_seconds: list[float] | None = None  # each of those steps' wall time (host work between steps included)


def make_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    rng = random.Random(spec.seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randrange(*spec.prompt_len))]
               for _ in range(spec.num_prompts)]
    max_tokens = [min(spec.max_output, int(rng.lognormvariate(spec.mu, spec.sigma)) + 1) for _ in prompts]
    return Workload(prompts, max_tokens)


def warmup_workload(workload: Workload) -> Workload:
    prompts = workload.prompts[:WARMUP_PROMPTS]
    return Workload(prompts, [WARMUP_TOKENS] * len(prompts))


def budget_bytes(shape: MoEShape, workload: Workload, budget_seqs: int) -> int:
    """Device KV bytes that hold `budget_seqs` sequences of the workload's mean full context."""
    return int(shape.kv_bytes_per_token * statistics.mean(workload.contexts) * budget_seqs)


def check_budget(shape: MoEShape, workload: Workload, device_bytes: int) -> None:
    """Lockstep must hold the longest sequence on the device, with the two pages it reserves ahead."""
    need = (-(-max(workload.contexts) // PAGE_SIZE) + 2) * PAGE_SIZE * shape.kv_bytes_per_token
    if device_bytes < need:
        raise ValueError(f"KV budget of {device_bytes / 2**20:.2f} MiB cannot hold the longest sequence "
                         f"({max(workload.contexts)} tokens + 2 reserved pages): "
                         f"--kv-budget-mb must be at least {need / 2**20:.2f}")


def all_contexts_bytes(shape: MoEShape, workload: Workload) -> int:
    """KV bytes of every sequence's full context in whole pages, plus the two pages each reserves ahead."""
    pages = sum(-(-n // PAGE_SIZE) + 2 for n in workload.contexts)
    return pages * PAGE_SIZE * shape.kv_bytes_per_token


def requests_for(workload: Workload) -> list[Request]:
    return [Request(request_id=f"p{i}", prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens))]


def engine_config(mode: str, device_bytes: int, host_bytes: int, decode_graphs: bool = True) -> EngineConfig:
    return EngineConfig(mode=mode, page_size=PAGE_SIZE, kv_budget_bytes=device_bytes,
                        host_kv_budget_bytes=host_bytes, decode_graphs=decode_graphs)


def planned_for(loaded, config: EngineConfig, workload: Workload) -> EngineConfig:
    """`config` with its unset fields planned for this workload's prompt and output lengths, as a job plans its
    engines for its input (pipelines/job_planning.py); unplanned, an engine plans for a generic workload."""
    shape = WorkloadShape(tuple(map(len, workload.prompts)), tuple(workload.max_tokens))
    return plan_engine(loaded, config, workload=shape, progress=False).config


def run_engine(loaded, config: EngineConfig, workload: Workload) -> SystemRun:
    Engine(loaded, config).generate(requests_for(warmup_workload(workload)))
    gc.collect()
    engine = Engine(loaded, config)
    steps: list[StepShape] = []
    ends: list[float] = []

    def observe(plan: StepPlan) -> None:
        steps.append(step_shape(plan))
        ends.append(time.perf_counter())

    engine.observe_steps(observe)
    start = time.perf_counter()
    results = engine.generate(requests_for(workload))
    bct = time.perf_counter() - start
    errors = [(r.request_id, r.error) for r in results if r.error]
    if errors:
        raise RuntimeError(f"{config.mode} engine failed requests: {errors[:3]}")
    metrics = engine.metrics()
    del engine
    gc.collect()
    return SystemRun(tokens=[r.outputs[0].token_ids for r in results], bct_s=bct,
                     completion_times=[r.finished_at - start for r in results],
                     mean_expert_batch=metrics["mean_expert_batch"], engine_metrics=metrics, steps=steps,
                     step_seconds=[end - begin for begin, end in zip([start, *ends], ends)])


def step_shape(plan: StepPlan) -> StepShape:
    """The work of one engine step as it ran (decoded sequences' kv_len counting the token just written)."""
    chunks = plan.prefill.chunks if plan.prefill else []
    decoded = plan.decode.seqs if plan.decode else []
    return StepShape(prompt_tokens=sum(c.end - c.start for c in chunks),
                     prompt_attended=sum((c.end - c.start) * c.start + (c.end - c.start) * (c.end - c.start + 1) // 2
                                         for c in chunks),
                     prompt_kv_read=sum(c.start for c in chunks),
                     prompts_completed=sum(c.completes for c in chunks),
                     decoded=len(decoded), decode_kv=sum(s.kv_len for s in decoded))


def step_class(step: StepShape) -> str:
    """A step's class for `step_classes`: "prefill" when it has prompt tokens (decodes COMBINE-d with them
    included), else decode by how many sequences it decoded, in power-of-two bins from 1-8."""
    if step.prompt_tokens:
        return "prefill"
    high = 8
    while step.decoded > high:
        high *= 2
    return f"decode_{1 if high == 8 else high // 2 + 1}_{high}"


def step_classes(shape: MoEShape, steps: list[StepShape], seconds: list[float], peaks: MachinePeaks) -> dict:
    """Where a run's time went: per step class, its steps, their wall time, their roofline and the ratio of the
    two (`over_bound`), so a gap to the schedule's bound shows at the batch sizes that make it."""
    classes: dict[str, dict] = {}
    for step, wall in zip(steps, seconds):
        entry = classes.setdefault(step_class(step), {"steps": 0, "seconds": 0.0, "bound_s": 0.0})
        entry["steps"] += 1
        entry["seconds"] += wall
        entry["bound_s"] += step_seconds(shape, step, peaks)[0]
    for entry in classes.values():
        entry["over_bound"] = entry["seconds"] / entry["bound_s"]
    largest = {name: 0 if name == "prefill" else int(name.rsplit("_", 1)[1]) for name in classes}
    return {name: classes[name] for name in sorted(classes, key=largest.get)}


def median_run(name: str, runs: list[SystemRun]) -> SystemRun:
    """The run of median BCT (the lower middle one of an even count); every run must have generated the same
    tokens: a system's outputs may not depend on when it ran."""
    for i, run in enumerate(runs[1:], 2):
        if run.tokens != runs[0].tokens:
            raise RuntimeError(f"{name}: run {i} generated other tokens than run 1")
    return sorted(runs, key=lambda r: r.bct_s)[(len(runs) - 1) // 2]


def profile_engine(loaded, config: EngineConfig, workload: Workload, top: int = 40) -> str:
    """cProfile of one more run on a fresh engine (the timed run stays unprofiled): functions by
    cumulative time, so the scheduler, KV copies, attention and MoE modules each show their share, then by
    own time, where per-call host overhead shows (on a GPU, waits show at the calls that synchronise)."""
    engine = Engine(loaded, config)
    profiler = cProfile.Profile()
    profiler.runcall(engine.generate, requests_for(workload))
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top // 2)
    return out.getvalue()


class ExpertBatchCounter:
    """Tokens per expert per MoE call in a transformers model (hooks on its fused experts modules)."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.tokens_per_expert = 0.0
        experts = [m for m in model.modules()
                   if type(m).__name__.endswith("Experts") and hasattr(m, "num_experts")]
        if not experts:
            raise ValueError(f"{type(model).__name__} has no fused experts module to count MoE batches on")
        self._hooks = [m.register_forward_pre_hook(self._count) for m in experts]

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        top_k_index = args[1]
        self.calls += 1
        self.tokens_per_expert += top_k_index.numel() / module.num_experts

    @property
    def mean(self) -> float:
        return self.tokens_per_expert / self.calls if self.calls else 0.0

    def reset(self) -> None:
        self.calls, self.tokens_per_expert = 0, 0.0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _drain(manager, workload: Workload, prefix: str) -> tuple[dict[str, list[int]], dict[str, float]]:
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        manager.add_request(prompt, request_id=f"{prefix}{i}", max_new_tokens=n, eos_token_id=-1)
    tokens, finished = {}, {}
    while len(tokens) < len(workload.prompts):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before finishing")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers failed request {result.request_id}: {result.error}")
            tokens[result.request_id] = list(result.generated_tokens)
            finished[result.request_id] = time.perf_counter()
    return tokens, finished


def run_transformers(hf_model, workload: Workload, device_bytes: int, host_bytes: int, kv_bytes_per_token: int
                     ) -> SystemRun:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens), eos_token_id=-1)
    offload_gib = host_bytes / 2**30 if torch.cuda.is_available() else 0.0  # its swap pool must be pinned
    # num_blocks sizes the cache; max_memory_percent only bounds transformers' own check of its footprint against
    # the memory it reads: on CPU its NUMA node's, which a VM may report as a fraction of the machine (8 of 24 GiB)
    # transformers 5.17 (a GPU host may carry it) names the page size `block_size`; newer ones `page_size`
    keywords = inspect.signature(ContinuousBatchingConfig).parameters
    page_keyword = "page_size" if "page_size" in keywords else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{page_keyword: PAGE_SIZE}, num_blocks=max(1, device_bytes // (PAGE_SIZE * kv_bytes_per_token)),
        allow_block_sharing=False, cpu_offload_space=offload_gib, seed=0, max_memory_percent=1.0)
    counter = ExpertBatchCounter(hf_model)
    manager = hf_model.init_continuous_batching(generation_config=generation,
                                                continuous_batching_config=cb_config)
    manager.start()
    try:
        _drain(manager, warmup_workload(workload), "warmup")
        counter.reset()
        start = time.perf_counter()
        tokens, finished = _drain(manager, workload, "p")
        bct = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()
        counter.remove()
    ids = [f"p{i}" for i in range(len(workload.prompts))]
    return SystemRun(tokens=[tokens[i] for i in ids], bct_s=bct,
                     completion_times=[finished[i] - start for i in ids], mean_expert_batch=counter.mean)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation) of per-request completion times; None when empty."""
    if not values:
        return None
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100))


# Reference top-2 logit gap under which a divergence is a near-tie (fp32 1e-4; half types round far coarser).
TIE_GAP = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
# The router margin (k-th minus (k+1)-th expert logit) under which a routing pick is a near-tie. Tighter than
# TIE_GAP: the margin is the minimum over every position and MoE layer of the prefix (thousands of them), so
# a loose bound would excuse real divergences; the flips seen in fp32 had margins of 6e-7 to 3e-6.
ROUTING_TIE_GAP = {"float32": 1e-5, "float16": 5e-4, "bfloat16": 3e-3}

NEAR_TIES = 4  # routing picks with the smallest margins a probe reports (each a flip compare may try)


@dataclass(frozen=True)
class NearTie:
    """One routing pick of the reference model: where (MoE layer in forward order, token position) and its margin
    between the router's k-th and (k+1)-th expert logit."""

    layer: int
    position: int
    margin: float


@dataclass
class Judgement:
    logits: torch.Tensor  # the reference model's next-token logits
    near_ties: list[NearTie]  # its NEAR_TIES smallest routing margins, smallest first (none for a dense model)


Probe = Callable[..., Judgement]  # (prompt index, generated tokens, flip: NearTie | None = None)


def reference_probe(hf_model, prompts: list[list[int]]) -> Probe:
    """The transformers model as the judge of a divergence: for prompt `i` followed by `generated`, its
    next-token logits and its smallest routing margins over every position and MoE layer. A near-zero margin is
    a routing near-tie: float rounding that depends on batch composition picks either expert there, and the
    sequence's hidden states, and soon its tokens, follow the pick. With `flip`, the model runs with that one pick
    the other way (the (k+1)-th expert for the k-th), as the other system may have: whether that flip explains a
    divergence."""
    config = hf_model.config
    experts = next((getattr(config, n) for n in ("num_local_experts", "n_routed_experts", "num_experts")
                    if getattr(config, n, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    # a router: a module named "gate" with an [experts, hidden] weight (nn.Linear, or transformers' router
    # modules, which return the router logits first)
    gates = [m for name, m in hf_model.named_modules() if name.rsplit(".", 1)[-1] == "gate" and experts
             and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.shape[0] == experts]

    def record(layer: int, routed: list[torch.Tensor], flip: NearTie | None):
        def hook(module, args, out):
            logits = out if isinstance(out, torch.Tensor) else out[0]
            routed.append(logits.detach().float().reshape(-1, experts))
            if flip is not None and flip.layer == layer:
                flip_pick(out, flip.position, top_k)
        return hook

    @torch.inference_mode()
    def probe(prompt: int, generated: list[int], flip: NearTie | None = None) -> Judgement:
        routed: list[torch.Tensor] = []
        hooks = [g.register_forward_hook(record(i, routed, flip)) for i, g in enumerate(gates)]
        try:
            ids = torch.tensor([prompts[prompt] + generated], device=hf_model.device)
            logits = hf_model(ids).logits[0, -1]
        finally:
            for hook in hooks:
                hook.remove()
        if not routed or not top_k:
            return Judgement(logits, [])
        ranked = [r.sort(dim=-1, descending=True).values for r in routed]
        margins = torch.stack([v[:, top_k - 1] - v[:, top_k] for v in ranked])  # [layers, positions]
        smallest = margins.flatten().topk(min(NEAR_TIES, margins.numel()), largest=False)
        positions = margins.shape[1]
        return Judgement(logits, [NearTie(int(i) // positions, int(i) % positions, float(v))
                                  for v, i in zip(smallest.values, smallest.indices)])

    return probe


def flip_pick(out, position: int, top_k: int) -> None:
    """A router's output with token `position`'s k-th expert replaced by its (k+1)-th, in place: on the logits (the
    caller picks the top k from them), or on the picks and their weights (transformers' router modules return
    logits, weights and picks, the weights the softmax of the picks, renormalised where the router does)."""
    if isinstance(out, torch.Tensor):
        ranked = out[position].float().argsort(descending=True)
        kth, nxt = int(ranked[top_k - 1]), int(ranked[top_k])
        out[position, kth], out[position, nxt] = out[position, nxt].clone(), out[position, kth].clone()
        return
    logits, weights, picks = out[0].reshape(-1, out[0].shape[-1]), out[1], out[2]
    renormalised = abs(float(weights[position].float().sum()) - 1) < 1e-4  # a router with norm_topk_prob, or not
    ranked = logits[position].float().argsort(descending=True)
    picks[position, picks[position] == ranked[top_k - 1]] = ranked[top_k]
    probs = logits[position].float().softmax(-1)[picks[position]]
    weights[position] = (probs / probs.sum() if renormalised else probs).to(weights.dtype)


def lazy_reference_probe(model_dir: str, prompts: list[list[int]]) -> Probe:
    """reference_probe over the transformers model, loaded on the first divergence only."""
    probe: list[Probe] = []

    def lazy(prompt: int, generated: list[int], flip: NearTie | None = None) -> Judgement:
        if not probe:
            probe.append(reference_probe(load_systems(model_dir, torch.device("cpu"), "float32")[1], prompts))
        return probe[0](prompt, generated, flip)

    return lazy


@dataclass
class MatchReport:
    exact: int
    total: int
    mean_prefix: float  # tokens matching before the first difference, averaged over prompts
    mean_prefix_share: float  # the same as a share of each output's length
    first_mismatch: dict | None  # prompt index, position and both tokens of the first difference
    ties: int = 0  # divergent sequences whose first difference is at a near-tie of the reference's logits or routing
    divergences: list[dict] = dataclasses.field(default_factory=list)  # each: where, the gap, the other's rank

    @property
    def all_match(self) -> bool:
        """Identical, or every divergence a near-tie (which token wins there is a rounding accident)."""
        return self.exact + self.ties == self.total


def compare(reference: list[list[int]], other: list[list[int]], probe: Probe | None = None, tie_gap: float = 0.0,
            routing_tie_gap: float = 0.0) -> MatchReport:
    """Token-for-token comparison. With `probe` (reference_probe), each divergence reports the reference
    model's top-2 logit gap at the first differing position, how far each system's token trails the top logit
    and the other's rank there, and the smallest routing margin over the shared prefix. It is a tie (`tie_kind`)
    when both tokens trail the top by less than `tie_gap` ("logits"), or when the reference, with one of its routing
    picks of margin under `routing_tie_gap` flipped, puts the token it ranked below the top (the other system's, or
    the reference system's own when its run routed apart from this forward) within `tie_gap` of its top ("routing",
    the flip in `flipped`): a near-tied pick somewhere in the prefix that does not explain the token excuses
    nothing."""
    prefixes, first, divergences = [], None, []
    for index, (a, b) in enumerate(zip(reference, other)):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append((prefix, len(a)))
        if a == b:
            continue
        where = {"prompt": index, "position": prefix, "reference": a[prefix] if prefix < len(a) else None,
                 "other": b[prefix] if prefix < len(b) else None}
        first = first or where
        if probe is not None and where["reference"] is not None and where["other"] is not None:
            judged = probe(index, a[:prefix])
            logits = judged.logits.float()
            top2 = logits.topk(2).values
            where["top2_gap"] = float(top2[0] - top2[1])
            where["other_gap"] = float(top2[0] - logits[where["other"]])  # how far the other's pick trails
            where["reference_gap"] = float(top2[0] - logits[where["reference"]])  # and the reference system's
            where["other_rank"] = int((logits > logits[where["other"]]).sum())
            where["router_margin"] = judged.near_ties[0].margin if judged.near_ties else None
            # both picks within tie_gap of the top: a system far below it is wrong however near the other one is
            where["tie_kind"] = "logits" if max(where["other_gap"], where["reference_gap"]) < tie_gap else None
            # the system whose token the reference forward ranks below the top while the other's is there: the other
            # one, or the reference system itself (its own run took another route at a near-tie than this forward
            # does); when neither token is at the top, no flip of one pick explains both
            behind = ("other" if where["reference_gap"] < tie_gap else
                      "reference" if where["other_gap"] < tie_gap else None)
            for tie in judged.near_ties if where["tie_kind"] is None and behind else []:
                if tie.margin >= routing_tie_gap:
                    break
                flipped = probe(index, a[:prefix], tie).logits.float()
                gap = float(flipped.max() - flipped[where[behind]])
                if gap < tie_gap:
                    where["tie_kind"] = "routing"
                    where["flipped"] = {**dataclasses.asdict(tie), f"{behind}_gap": gap}
                    break
            where["tie"] = where["tie_kind"] is not None
        divergences.append(where)
    exact = sum(a == b for a, b in zip(reference, other))
    return MatchReport(exact=exact, total=len(reference), mean_prefix=statistics.mean(p for p, _ in prefixes),
                       mean_prefix_share=statistics.mean(p / n for p, n in prefixes), first_mismatch=first,
                       ties=sum(bool(d.get("tie")) for d in divergences), divergences=divergences)


def scenario_summary(runs: dict[str, SystemRun], output_tokens: int, bound_s: float,
                     probe: Probe, tie_gap: float, routing_tie_gap: float, shape: MoEShape,
                     peaks: MachinePeaks) -> dict:
    """`probe`: the reference (transformers) model's judgement of a divergence (reference_probe).
    `schedule_bound_s`: each engine mode's roofline over the steps it ran (its own schedule), so
    `speedup_vs_lockstep_at_bounds` is the speedup the two schedules would give if both ran at the roofline, and
    `over_schedule_bound` how far each mode's run is from its own schedule's bound."""
    batchgen, lockstep, hf = runs["batchgen"], runs["lockstep"], runs["transformers"]
    schedule = {name: schedule_bound(shape, run.steps, peaks) for name, run in runs.items() if run.steps}
    vs_lockstep = compare(lockstep.tokens, batchgen.tokens, probe, tie_gap, routing_tie_gap)
    vs_hf = compare(hf.tokens, batchgen.tokens, probe, tie_gap, routing_tie_gap)
    engine_keys = ("scheduler_share", "yields", "restores", "recomputes", "bytes_moved", "peak_active",
                   "peak_suspended", "prefill_steps", "decode_steps", "mixed_steps", "moe_calls", "frozen_objects",
                   "decode_graph_captures", "decode_graph_replays", "decode_graph_refusals")
    return {
        "bct_s": {name: run.bct_s for name, run in runs.items()},
        "tokens_per_s": {name: output_tokens / run.bct_s for name, run in runs.items()},
        "mean_expert_batch": {name: run.mean_expert_batch for name, run in runs.items()},
        "speedup_vs_hf": runs["transformers"].bct_s / batchgen.bct_s,
        "speedup_vs_lockstep": lockstep.bct_s / batchgen.bct_s,
        "expert_batch_vs_lockstep": batchgen.mean_expert_batch / max(lockstep.mean_expert_batch, 1e-9),
        "bct_over_roofline": batchgen.bct_s / bound_s,
        "schedule_bound_s": schedule,
        "schedule_steps": {name: len(run.steps) for name, run in runs.items() if run.steps},
        "over_schedule_bound": {name: runs[name].bct_s / seconds for name, seconds in schedule.items()},
        "speedup_vs_lockstep_at_bounds": schedule["lockstep"] / schedule["batchgen"],
        "step_classes": {name: step_classes(shape, run.steps, run.step_seconds, peaks)
                         for name, run in runs.items() if run.steps},
        "scheduler_share": {name: run.engine_metrics["scheduler_share"] for name, run in runs.items()
                            if run.engine_metrics},
        "completion_time_s": {name: {f"p{q}": percentile(run.completion_times, q) for q in (50, 95, 99)}
                              for name, run in runs.items()},
        "engine": {name: {k: run.engine_metrics[k] for k in engine_keys}
                   for name, run in runs.items() if run.engine_metrics},
        "outputs_match": vs_lockstep.all_match and vs_hf.all_match,
        "outputs_match_by_pair": {"batchgen_vs_lockstep": vs_lockstep.all_match, "batchgen_vs_hf": vs_hf.all_match},
        "match": {"batchgen_vs_lockstep": dataclasses.asdict(vs_lockstep),
                  "batchgen_vs_hf": dataclasses.asdict(vs_hf)},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"scaled-down workload: {QUICK}")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompts and output lengths)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 128 (16 with --quick)")
    parser.add_argument("--experts", type=int, default=None, help="override the preset's expert count")
    parser.add_argument("--top-k", type=int, default=None, help="override the preset's experts per token")
    parser.add_argument("--sigma", type=float, default=0.8, help="sigma of the lognormal output lengths")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each engine mode per scenario, interleaved; BCT is their median (default 3; "
                             "transformers runs once)")
    parser.add_argument("--transformers-repeats", type=int, default=1,
                        help="runs of transformers per scenario, one in each of the first rounds of the engine modes "
                             "(default 1: after them); its median run reports")
    parser.add_argument("--plan", choices=("workload", "generic"), default="workload",
                        help="plan both engine modes' unset settings for this workload (as a job plans for its input), "
                             "or leave them to the engine's plan for a generic workload")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed runs, print a cProfile of one more BatchGen run per scenario")
    parser.add_argument("--kv-budget-mb", type=float, default=None,
                        help="device KV budget of the constrained scenario (default: 16 mean full contexts)")
    parser.add_argument("--dtype", default="float32", choices=sorted(TIE_GAP),
                        help="weights, KV and activations of every system (default float32)")
    parser.add_argument("--budget-seqs", type=int, default=None,
                        help="mean full contexts the constrained scenario's budget holds (default 16, 8 with --quick)")
    parser.add_argument("--eager", action="store_true",
                        help="both engine modes run every decode step eagerly (decode_graphs off: no recordings on a "
                             "CPU, no CUDA graphs on a GPU); the graphs' gain is a run with it against one without")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "experts", "top_k", "budget_seqs", "repeats", "transformers_repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.sigma < 0:
        parser.error(f"--sigma must be >= 0, got {args.sigma}")
    if args.kv_budget_mb is not None and args.kv_budget_mb <= 0:
        parser.error(f"--kv-budget-mb must be > 0, got {args.kv_budget_mb}")
    return args


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    spec = WorkloadSpec(**QUICK) if args.quick else WorkloadSpec()
    changes = {"seed": args.seed, "sigma": args.sigma}
    if args.num_prompts is not None:
        changes["num_prompts"] = args.num_prompts
    if args.budget_seqs is not None:
        changes["budget_seqs"] = args.budget_seqs
    return dataclasses.replace(spec, **changes)


def load_systems(model_dir: str, device: torch.device, dtype: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    keep_freed_memory()  # as a process hosting an engine does (operators/engine_factory.py); transformers gains too
    loaded = load_model(model_dir, dtype=dtype, device=str(device))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    return loaded, hf_model


def run(args: argparse.Namespace, log) -> dict:
    spec = workload_spec(args)
    overrides = {k: v for k, v in (("experts", args.experts), ("top_k", args.top_k)) if v is not None}
    model_dir = build_preset("bench-moe", **overrides)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = MoEShape.from_hf_config(config, dtype_bytes=getattr(torch, args.dtype).itemsize)
    workload = make_workload(spec, shape.vocab)
    output_tokens = sum(workload.max_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load_at_start = os.getloadavg()  # other jobs on a shared machine skew every timing: report them
    log(f"model {model_dir}: {shape.experts} experts top-{shape.top_k}, {shape.layers} layers; "
        f"{spec.num_prompts} prompts, {sum(map(len, workload.prompts))} prompt tokens, {output_tokens} "
        f"output tokens (max {max(workload.max_tokens)}); torch threads {torch.get_num_threads()}, {device}, "
        f"load average {load_at_start[0]:.2f}")

    samples = [measure_peaks(device=device, dtype=getattr(torch, args.dtype))]  # again after each scenario
    log_peaks(log, "roofline at the start", samples[0])

    loaded, hf_model = load_systems(model_dir, device, args.dtype)

    probe = reference_probe(hf_model, workload.prompts)
    # what the imports and the models left frozen, as an engine actor freezes its imports (engine/process_heap.py):
    # the collections between runs, and the collector's passes inside them, walk only what the runs create
    freeze_heap()

    host_bytes = all_contexts_bytes(shape, workload)
    constrained = budget_bytes(shape, workload, spec.budget_seqs)
    if args.kv_budget_mb:
        constrained = int(args.kv_budget_mb * 2**20)
    check_budget(shape, workload, constrained)
    # unconstrained: twice every full context, so room is left after coroutine mode's staging share
    budgets = {"unconstrained": 2 * host_bytes, "kv_budget": constrained}
    scenarios, finished = {}, {}
    for scenario, device_bytes in budgets.items():
        configs = {name: engine_config(mode, device_bytes, host_bytes, not args.eager)
                   for name, mode in ENGINE_MODES.items()}
        if args.plan == "workload":
            configs = {name: planned_for(loaded, config, workload) for name, config in configs.items()}
        repeated: dict[str, list[SystemRun]] = {name: [] for name in SYSTEMS}
        # interleaved: a drift of the machine's speed hits every system alike
        for round_ in range(max(args.repeats, args.transformers_repeats)):
            # the engine modes' order alternates round by round: neither always runs first (after transformers, or
            # right after the set-up)
            order = list(ENGINE_MODES) if round_ % 2 == 0 else list(reversed(ENGINE_MODES))
            for name in order if round_ < args.repeats else ():
                repeated[name].append(run_engine(loaded, configs[name], workload))
            if round_ < args.transformers_repeats:
                repeated["transformers"].append(run_transformers(hf_model, workload, device_bytes, host_bytes,
                                                                 shape.kv_bytes_per_token))
        runs = {name: median_run(name, repeated[name]) for name in SYSTEMS}
        for name in SYSTEMS:
            each = ", ".join(f"{r.bct_s:.2f}" for r in repeated[name])
            log(f"{scenario:>13} {name:>12}: BCT {runs[name].bct_s:7.2f} s"
                f"{f' (median of {each})' if len(repeated[name]) > 1 else ''}, "
                f"{output_tokens / runs[name].bct_s:7.1f} tok/s, "
                f"mean expert batch {runs[name].mean_expert_batch:.2f}")
        if args.profile:
            log(f"[{scenario}] BatchGen profile:\n" + profile_engine(loaded, configs["batchgen"], workload))
        settings = {name: {field: getattr(config, field) for field in PLANNED_FIELDS}
                    for name, config in configs.items()}
        if args.plan == "workload":
            log(f"[{scenario}] planned for the workload: " + "; ".join(
                f"{name} " + ", ".join(f"{k} {v}" for k, v in fields.items() if "bytes" not in k)
                for name, fields in settings.items()))
        scenarios[scenario] = {"kv_budget_bytes": device_bytes, "engine_settings": settings,
                               "bct_runs_s": {name: [r.bct_s for r in rs] for name, rs in repeated.items()}}
        finished[scenario] = runs
        samples.append(measure_peaks(device=device, dtype=getattr(torch, args.dtype)))

    # every scenario priced at the machine's best peaks of the run, each its best over the samples
    peaks = best_peaks(samples)
    bound = workload_bound(shape, [len(p) for p in workload.prompts], workload.max_tokens, peaks)
    log_peaks(log, f"roofline at the best of {len(samples)} samples (start, after each scenario)", peaks, bound)
    for scenario, runs in finished.items():
        summary = scenario_summary(runs, output_tokens, bound.seconds, probe, TIE_GAP[args.dtype],
                                   ROUTING_TIE_GAP[args.dtype], shape, peaks)
        scenarios[scenario].update(summary)
        log(describe(scenario, summary))

    return {
        "workload": {**dataclasses.asdict(spec), "experts": shape.experts, "top_k": shape.top_k,
                     "layers": shape.layers, "prompt_tokens": sum(map(len, workload.prompts)),
                     "output_tokens": output_tokens, "max_output_tokens": max(workload.max_tokens),
                     "budget_rule": ("--kv-budget-mb" if args.kv_budget_mb else
                                     "kv_bytes_per_token * mean(prompt + output) * budget_seqs"),
                     "kv_bytes_per_token": shape.kv_bytes_per_token, "host_kv_bytes": host_bytes},
        "machine": {"torch_threads": torch.get_num_threads(), "device": str(device),
                    "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
                    **dataclasses.asdict(peaks), "peak_samples": [dataclasses.asdict(s) for s in samples]},
        "roofline": dataclasses.asdict(bound),
        "decode_graphs": not args.eager,
        "scenarios": scenarios,
        "outputs_match": all(s["outputs_match"] for s in scenarios.values()),
        "outputs_match_by_pair": {key: all(s["outputs_match_by_pair"][key] for s in scenarios.values())
                                  for key in ("batchgen_vs_lockstep", "batchgen_vs_hf")},
    }


def log_peaks(log, what: str, peaks: MachinePeaks, bound=None) -> None:
    line = f"{what}: matmul {peaks.matmul_flops / 1e9:.0f} GFLOP/s, read {peaks.read_bandwidth / 1e9:.1f} GB/s"
    if bound is not None:
        line += (f" -> bound {bound.seconds:.2f} s (prefill {bound.prefill_seconds:.2f} s, {bound.decode_steps} "
                 f"decode steps {bound.decode_seconds:.2f} s, {bound.compute_bound_steps} of them compute-bound)")
    log(line)


def describe(scenario: str, summary: dict) -> str:
    lines = [f"[{scenario}] speedup vs transformers {summary['speedup_vs_hf']:.2f}x, "
             f"vs lockstep {summary['speedup_vs_lockstep']:.2f}x; "
             f"expert batch {summary['expert_batch_vs_lockstep']:.2f}x lockstep's; "
             f"BatchGen at {summary['bct_over_roofline']:.2f}x the roofline bound; scheduler share "
             + ", ".join(f"{k} {v:.1%}" for k, v in summary["scheduler_share"].items()),
             "  at the roofline of each mode's own schedule: "
             + ", ".join(f"{k} {v:.2f} s ({summary['over_schedule_bound'][k]:.2f}x)"
                         for k, v in summary["schedule_bound_s"].items())
             + f"; speedup vs lockstep there {summary['speedup_vs_lockstep_at_bounds']:.2f}x"]
    for name, classes in summary["step_classes"].items():
        lines.append(f"  {name} by step class: " + ", ".join(
            f"{k} {c['steps']} steps {c['seconds']:.2f} s ({c['over_bound']:.2f}x)" for k, c in classes.items()))
    for pair, match in summary["match"].items():
        line = (f"  outputs {pair}: {match['exact']}/{match['total']} identical, mean matching prefix "
                f"{match['mean_prefix']:.1f} tokens ({match['mean_prefix_share']:.1%})")
        if match["ties"]:
            line += f", {match['ties']} more diverge at a near-tie"
        for divergence in match["divergences"]:
            if not divergence.get("tie"):
                line += f"; divergence {divergence}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        report = run(args, log=lambda message: print(message, flush=True))
    finally:
        gc.unfreeze()  # run() froze the heap: thawed, as the caller (a test process) may build and drop engines
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
