"""Choose the engine settings the user left unset: the configuration whose replayed schedule has the
shortest predicted batch completion time for the workload, under the memory really available.

Explicit values always win: a set field is never searched. Planned settings are remembered per
process (and the profile on disk), so an engine built again plans in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.host_view import streams_host_kv
from batchgen.engine.kv_budget import (
    MemoryLimits,
    activation_bytes_per_token,
    available_memory_bytes,
    memory_limits,
    plan_kv_budget,
)
from batchgen.engine.kv_pool import PoolGeometry
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.planner.cost_curves import CostCurves
from batchgen.engine.planner.profiler import profile_key, profile_model
from batchgen.engine.planner.schedule_pricing import SchedulePricer
from batchgen.engine.planner.schedule_replay import ReplayError, replay_schedule
from batchgen.engine.planner.step_model import StepShape
from batchgen.engine.planner.workload import WorkloadShape
from batchgen.kernels.calibration import cache_root, disk_cached, measuring
from batchgen.kernels.registry import invariant_batches

PLANNED_FIELDS = ("max_num_seqs", "refill_threshold", "b_attn", "b_moe", "kv_budget_bytes", "host_kv_budget_bytes",
                  "staging_fraction")
MAX_NUM_SEQS = (16, 32, 64, 128, 256, 512, 1024, 2048)
REFILL_THRESHOLDS = (0.25, 0.5, 0.75)
B_ATTN = (16, 64, 256, 1024)  # and max_num_seqs itself
B_MOE = (256, 1024, 4096, 8192, 16384)
STAGING_FRACTIONS = (0.1, 0.25, 0.5)
RUNNER_UPS = 5
PLANNER_VERSION = 2  # in the key of cached plans: bump when the search or the generic workload changes
# options that cannot change a plan: left out of its cache key, so setting them (or adding one) finds the
# plans already made
PLAN_NEUTRAL = ("seed", "partition_stragglers")
# what BATCHGEN_PLAN=0 gives the fields a config leaves unset (the KV budgets: max_num_seqs full contexts)
FIXED = {"max_num_seqs": 256, "refill_threshold": 0.5, "b_attn": 256, "b_moe": 8192, "staging_fraction": 0.25}


@dataclass(frozen=True)
class Candidate:
    settings: dict  # the planned fields' values
    predicted_bct_s: float


@dataclass
class Plan:
    config: EngineConfig  # every planned field set
    predicted_bct_s: float
    step_seconds: list[float]  # predicted, in schedule order
    steps: list[StepShape]
    runner_ups: list[Candidate]
    limits: MemoryLimits
    workload: WorkloadShape
    curves: CostCurves
    searched: int = 0  # configurations priced
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        planned = {name: getattr(self.config, name) for name in PLANNED_FIELDS}
        prefill = sum(1 for s in self.steps if s.prefill)
        return {"config": planned, "predicted_bct_s": round(self.predicted_bct_s, 3), "steps": len(self.steps),
                "prefill_steps": prefill,
                "predicted_step_s": {"mean": round(sum(self.step_seconds) / max(1, len(self.step_seconds)), 5),
                                     "max": round(max(self.step_seconds, default=0.0), 5)},
                "runner_ups": [{"config": c.settings, "predicted_bct_s": round(c.predicted_bct_s, 3)}
                               for c in self.runner_ups],
                "memory_limits": dataclasses.asdict(self.limits), "workload": self.workload.describe(),
                "searched": self.searched, "notes": self.notes}


def curves_for(loaded: LoadedModel, progress: bool | None = None, batch_invariant: bool = False) -> CostCurves:
    """The model's cost curves on its device, for an engine whose kernels run batch-invariant or not: from the
    on-disk cache, else profiled now and cached."""
    with invariant_batches(batch_invariant):  # the paths its kernels take, in the key and the timings
        return disk_cached(_cache_dir() / f"curves-{profile_key(loaded)}.json",
                           lambda: profile_model(loaded, progress=progress), CostCurves.from_json, CostCurves.to_json)


def plan_engine(loaded: LoadedModel, config: EngineConfig, workload: WorkloadShape | None = None,
                curves: CostCurves | None = None, limits: MemoryLimits | None = None,
                progress: bool | None = None) -> Plan:
    """Search the unset planned fields of `config` for the shortest predicted BCT of `workload`."""
    curves = curves or curves_for(loaded, progress, config.batch_invariant)
    max_model_len = loaded.context_length(config.max_model_len)
    spec = loaded.model.kv_spec()
    if loaded.device.type == "meta":  # planning from cost curves measured elsewhere: their device's memory
        device_type, free, host_free = curves.device_type, curves.device_free_bytes, curves.host_free_bytes
    else:
        device_type = loaded.device.type
        free, host_free = available_memory_bytes(loaded.device), available_memory_bytes(torch.device("cpu"))
    stream_host = streams_host_kv(config.stream_host_kv, device_type)
    limits = limits or memory_limits(device_type, config, free, host_free)
    per_token = activation_bytes_per_token(loaded, curves.top_k)
    if workload is not None:
        return search(config, curves, workload.fit(max_model_len), spec, loaded.dtype, stream_host, limits, per_token,
                      max_model_len)
    # the generic workload, cut to what a given device budget holds of one sequence; if the budgets cannot run
    # it even so, cut to half that length, and so on
    capacity = max_model_len
    if config.kv_budget_bytes is not None:
        pages = config.kv_budget_bytes // (curves.kv_bytes_per_token * config.page_size) - 2  # 2: reserve
        capacity = min(capacity, max(2, pages * config.page_size))
    while True:
        workload = WorkloadShape.default(capacity).fit(max_model_len)
        try:
            return search(config, curves, workload, spec, loaded.dtype, stream_host, limits, per_token, max_model_len,
                          COARSE)
        except ValueError:  # no sequence that long fits the budgets (a staging pool, a small host pool)
            if capacity <= 2 * config.page_size:
                raise
            capacity //= 2


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values of the planned fields (max_num_seqs and b_attn also capped by the workload)."""

    max_num_seqs: tuple[int, ...] = MAX_NUM_SEQS
    refill_thresholds: tuple[float, ...] = REFILL_THRESHOLDS
    b_attn: tuple[int, ...] = B_ATTN
    b_moe: tuple[int, ...] = B_MOE
    staging_fractions: tuple[float, ...] = STAGING_FRACTIONS


# an engine built without a described workload: a coarser search, so construction stays around a second
COARSE = SearchSpace(max_num_seqs=(64, 256, 1024), refill_thresholds=(0.5,), b_attn=(64,), b_moe=(1024, 8192),
                     staging_fractions=(0.25,))


def search(config: EngineConfig, curves: CostCurves, workload: WorkloadShape, spec, dtype: torch.dtype,
           stream_host: bool, limits: MemoryLimits, activation_bytes_per_token: int, max_model_len: int,
           space: SearchSpace = SearchSpace()) -> Plan:
    """Every combination of candidate values for the unset fields, each schedule replayed once (b_attn and
    b_moe only re-price it, unless host-resident groups made the schedule depend on b_attn). In lockstep mode
    the micro-batch sizes are not searched: that policy runs every step as one batch. The KV pools hold the
    workload's sequences, and at least one of `max_model_len` tokens where the limits allow: a workload described
    by a sample (a job's first rows) must not refuse a longer request that the model takes."""
    token_bytes = curves.kv_bytes_per_token

    def pool_tokens(context: int) -> int:  # its pages, and two in reserve
        return -(-context // config.page_size) * config.page_size + 2 * config.page_size

    wanted_tokens, longest_tokens = pool_tokens(workload.max_context), pool_tokens(max_model_len)

    def options(name: str, values) -> tuple:
        explicit = getattr(config, name)
        return (explicit,) if explicit is not None else tuple(values)

    coroutine = config.mode == "coroutine"
    enough = next((n for n in space.max_num_seqs if n >= workload.sequences), space.max_num_seqs[-1])
    seqs_options = options("max_num_seqs", [n for n in space.max_num_seqs if n <= enough])
    refill_options = options("refill_threshold", space.refill_thresholds if coroutine else (0.5,))
    staging_options = options("staging_fraction", space.staging_fractions if stream_host and coroutine else (0.25,))
    fitting_moe = [b for b in space.b_moe if b * activation_bytes_per_token <= limits.activation_bytes]
    fitting_moe = fitting_moe or [max(1, limits.activation_bytes // activation_bytes_per_token)]  # all too large
    moe_options = options("b_moe", fitting_moe if coroutine else space.b_moe[-1:])
    admission = curves.host.seconds(prompts=len(workload.prompt_lens))
    best: list[tuple[float, dict, SchedulePricer]] = []
    searched = 0
    notes: list[str] = []
    for max_num_seqs, refill, staging in itertools.product(seqs_options, refill_options, staging_options):
        if len(refill_options) > 1 and workload.sequences <= max_num_seqs and refill != 0.5:
            continue  # every prompt is admitted at once: the refill threshold never matters
        wanted = token_bytes * max(max_num_seqs * wanted_tokens, longest_tokens)
        device = config.kv_budget_bytes or min(limits.device_kv_bytes, wanted)
        if staging > min(staging_options) and device * (1 - staging) < token_bytes * longest_tokens:
            continue  # its staging pool leaves the longest sequence no room on the device, which a smaller one does
        host = config.host_kv_budget_bytes or min(limits.host_kv_bytes, wanted)
        attn_options = options("b_attn", [b for b in space.b_attn if b < max_num_seqs and coroutine] + [max_num_seqs])
        schedule = None
        for b_attn in attn_options:
            trial = dataclasses.replace(config, max_num_seqs=max_num_seqs, refill_threshold=refill, b_attn=b_attn,
                                        b_moe=moe_options[0], kv_budget_bytes=device, host_kv_budget_bytes=host,
                                        staging_fraction=staging)
            if schedule is None or any(s.staged for s in schedule):
                try:
                    schedule = replay_schedule(trial, plan_kv_budget(trial, stream_host), spec, dtype, workload,
                                               stream_host, curves.device_type)
                except ReplayError as exc:
                    notes.append(f"max_num_seqs={max_num_seqs} refill={refill} b_attn={b_attn}: {exc}")
                    schedule = None
                    break
                pricer = SchedulePricer(schedule, curves)
            for b_moe in moe_options:
                bct = float(pricer.step_seconds(b_attn, b_moe).sum()) + admission
                settings = {name: getattr(trial, name) for name in PLANNED_FIELDS} | {"b_moe": b_moe}
                best.append((bct, settings, pricer))
                searched += 1
    if not best:
        raise ValueError(f"no configuration can run the workload within the memory limits {limits}: "
                         + "; ".join(notes[:3]))
    best.sort(key=lambda item: (item[0], -item[1]["max_num_seqs"]))
    bct, settings, pricer = best[0]
    times = pricer.step_seconds(settings["b_attn"], settings["b_moe"]).tolist()
    runner_ups, seen = [], {pricer.execution(settings["b_attn"], settings["b_moe"])}
    for other_bct, other, other_pricer in best[1:]:  # the next best that compute something else
        if len(runner_ups) == RUNNER_UPS:
            break
        execution = other_pricer.execution(other["b_attn"], other["b_moe"])
        if execution not in seen:
            seen.add(execution)
            runner_ups.append(Candidate(other, other_bct))
    return Plan(dataclasses.replace(config, **settings), bct, times, pricer.steps, runner_ups, limits, workload,
                curves, searched, notes)


_PLANS: dict[str, dict] = {}  # plan key -> the planned fields
_LOCK = threading.Lock()


def resolve_config(loaded: LoadedModel, config: EngineConfig, plan: bool = True) -> EngineConfig:
    """`config` with every planned field set: as given, or planned for the default workload, once per model,
    device, explicit values and free memory (as a power of two): remembered by the process and on disk. With
    BATCHGEN_PLAN=0 in the environment, or `plan` False (a rank of an engine spanning several: the profiler
    times one rank's layer alone, which an expert-parallel layer cannot be), the fixed settings of FIXED."""
    if all(getattr(config, name) is not None for name in PLANNED_FIELDS):
        return config
    free = _power_of_two(available_memory_bytes(loaded.device))
    host_free = _power_of_two(available_memory_bytes(torch.device("cpu")))
    limits = memory_limits(loaded.device.type, config, free, host_free)
    if not plan or not measuring():
        return fixed_config(config, loaded, limits)
    options = {k: v for k, v in dataclasses.asdict(config).items() if k not in PLAN_NEUTRAL}
    fields = json.dumps([PLANNER_VERSION, profile_key(loaded), options, dataclasses.asdict(limits)], sort_keys=True)
    key = hashlib.sha256(fields.encode()).hexdigest()[:20]
    with _LOCK:
        if key not in _PLANS:
            _PLANS[key] = disk_cached(
                _cache_dir() / f"plan-{key}.json",
                lambda: {n: getattr(plan_engine(loaded, config, limits=limits).config, n) for n in PLANNED_FIELDS},
                json.loads, json.dumps)
        return dataclasses.replace(config, **_PLANS[key])


def fixed_config(config: EngineConfig, loaded: LoadedModel, limits: MemoryLimits) -> EngineConfig:
    """The unset fields at FIXED values, KV budgets sized for max_num_seqs full contexts within `limits`."""
    settings = {name: value for name, value in FIXED.items() if getattr(config, name) is None}
    max_num_seqs = config.max_num_seqs or FIXED["max_num_seqs"]
    max_model_len = loaded.context_length(config.max_model_len)
    geometry = PoolGeometry(loaded.model.kv_spec(), config.page_size, loaded.dtype)  # whole pages per sequence
    wanted = geometry.page_bytes * geometry.pages_for(max_model_len) * max_num_seqs
    if config.kv_budget_bytes is None:
        settings["kv_budget_bytes"] = min(wanted, limits.device_kv_bytes)
    if config.host_kv_budget_bytes is None:
        settings["host_kv_budget_bytes"] = min(wanted, limits.host_kv_bytes)
    return dataclasses.replace(config, **settings)


def _power_of_two(n: int) -> int:
    """The largest power of two not above `n`: free memory moves between processes, the plan should not."""
    return 1 << max(0, n.bit_length() - 1)


def _cache_dir() -> Path:
    return cache_root() / "plans"
