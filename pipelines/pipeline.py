"""Ready pipelines: Parquet in, generation, Parquet out in input order, resumable.

Two shapes, one job:
  "disaggregated": read -> tokenize -> prefill -> decode -> write, prefill and decode each their own
                   actor pool with its own concurrency, each prompt's KV carried to decode in the
                   prefill stage's output blocks;
  "single":        read -> BatchGen -> write, one engine pool doing both phases.

Every row is numbered by its input position on read (`row_index`) and written into part files
named by their row range (connectors/indexed_parquet.py), so a restarted job with the same output
skips the rows already written and writes none twice. Order needs no `preserve_order`: the sink
sorts each write's rows and the file names carry the order, so the pipeline leaves it off and a
slow batch never holds back the ones after it (head-of-line blocking would stretch the BCT).

Checks that fail the job before any inference: the model's files and tokenizer (no weights read),
the input's files, footers and prompt column, the output's writability, that no other run is writing
the output (output_lease.py), and that an existing output belongs to the same job.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq
import ray

from batchgen.connectors.indexed_parquet import (
    IndexedParquetSource,
    OrderedParquetSink,
    RangeSet,
    recover_output_parts,
)
from batchgen.connectors.io import StorageError, check_storage_options, check_writable, filesystem
from batchgen.engine import EngineConfig, SamplingParams
from batchgen.engine.chat import check_chat_template
from batchgen.engine.config import INT64_MAX
from batchgen.engine.planner.stage_split import StageSplit
from batchgen.engine.quantile_sketch import QuantileSketch
from batchgen.operators import BatchGen, Decode, Prefill, Tokenize, engine_actor_pool
from batchgen.operators.actor_ready import EngineActorReady
from batchgen.operators.columns import ERROR, check_input_columns, lists_outputs
from batchgen.operators.work_balancer import BalancerStats, start_work_balancer
from batchgen.pipelines.job_planning import plan_stages
from batchgen.pipelines.output_lease import STALE_S, LeaseHeld, OutputLease
from batchgen.pipelines.progress import Progress, ProgressTracker, ReportWritten
from batchgen.pipelines.progress import update as update_progress

MODES = ("disaggregated", "single")
MANIFEST = "_batchgen_job.json"


class JobError(RuntimeError):
    """The job cannot run or did not complete; the message says what to fix."""


# the options each pipeline mode reads alone; set for the other mode, they would be ignored
MODE_OPTIONS = {"single": ("concurrency", "engine_resources"),
                "disaggregated": ("prefill_concurrency", "decode_concurrency", "tokenize_concurrency",
                                  "prefill_resources", "decode_resources")}


def other_mode_options(mode: str) -> tuple[str, ...]:
    return next((names for other, names in MODE_OPTIONS.items() if other != mode), ()) if mode in MODES else ()


def other_mode_message(names: list[str], mode: str) -> str:
    return (f"{', '.join(names)} apply to the other mode than {mode!r}, where they would be ignored; give "
            f"{' / '.join(MODE_OPTIONS[mode])}" + (" (or engine_actors)" if mode == "disaggregated" else ""))


@dataclass
class JobConfig:
    model: str
    input: str
    output: str
    mode: str = "disaggregated"
    sampling_params: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    storage_options: dict[str, Any] = field(default_factory=dict)  # for input, output and model
    batch_size: int = 64
    concurrency: int = 1  # engine actors in "single" mode
    prefill_concurrency: int = 1
    decode_concurrency: int = 1
    tokenize_concurrency: int = 1
    engine_num_cpus: float | None = None  # per engine actor; None: a share of the cluster's CPUs
    engine_num_gpus: float = 0.0  # per rank of an engine (an engine actor asks for its ranks times this)
    # custom Ray resources each engine actor asks for, to pin a stage to the nodes that offer them,
    # e.g. {"decode_node": 1}: `engine_resources` for BatchGen (single), the others per split stage
    engine_resources: dict[str, float] = field(default_factory=dict)
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    rows_per_block: int = 256
    rows_per_file: int | None = None  # rows gathered per write task; None: Ray's choice
    list_outputs: bool | None = None
    chat_template: str | None = None  # the Jinja template of `messages` rows (None: the tokenizer's own)
    # MIGRATE requests from busy to idle engine actors (several of them: single, or the decode stage)
    migrate: bool = True
    # disaggregated: this many engine actors in all, split between prefill and decode by the planner (which
    # also fixes the engine settings left unset, for the job's input); prefill/decode_concurrency stay unset
    engine_actors: int | None = None

    def validate(self) -> None:
        if self.mode not in MODES:
            raise JobError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("batch_size", "concurrency", "prefill_concurrency", "decode_concurrency",
                     "tokenize_concurrency", "rows_per_block"):
            value = getattr(self, name)
            if not _is_count(value):  # (true is an int to Python: one-row blocks)
                raise JobError(f"{name} must be an integer in [1, 2^63 - 1], got {value!r}")
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(self)}
        ignored = [name for name in other_mode_options(self.mode) if getattr(self, name) != defaults[name]]
        if ignored:
            raise JobError(other_mode_message(ignored, self.mode))
        if self.engine_actors is not None:
            given = [name for name in ("prefill_concurrency", "decode_concurrency") if getattr(self, name) != 1]
            if given:
                raise JobError(f"engine_actors lets the planner split the engine actors: drop {' and '.join(given)}, "
                               "or give the two stage sizes alone")
            if self.mode != "disaggregated":
                raise JobError("engine_actors splits a disaggregated pipeline's engine actors; in single mode give "
                               "concurrency")
            if isinstance(self.engine_actors, bool) or not isinstance(self.engine_actors, int) \
                    or self.engine_actors < 2:
                raise JobError(f"engine_actors must be an integer >= 2 (a prefill and a decode actor at least), got "
                               f"{self.engine_actors!r}")
        if self.chat_template is not None:
            try:
                check_chat_template(self.chat_template)
            except ValueError as exc:
                raise JobError(str(exc)) from None
        if not isinstance(self.migrate, bool):
            raise JobError(f"migrate must be true or false, got {self.migrate!r}")
        if self.rows_per_file is not None and not _is_count(self.rows_per_file):
            raise JobError(f"rows_per_file must be an integer in [1, 2^63 - 1], got {self.rows_per_file!r}")
        for name in ("engine_num_cpus", "engine_num_gpus"):  # (a Ray actor may ask for none)
            value = getattr(self, name)
            if value is None and name == "engine_num_cpus":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise JobError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("engine_resources", "prefill_resources", "decode_resources"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                    for k, v in value.items()):
                raise JobError(f"{name} must map resource names to amounts >= 0, got {value!r}")
        try:
            defaults = SamplingParams.from_dict(self.sampling_params)
            engine = EngineConfig.from_kwargs(**self.engine)
        except (ValueError, TypeError) as exc:
            raise JobError(str(exc)) from None
        if engine.ranks > 1 and self.mode != "single":
            raise JobError(f"ep_size {engine.ep_size}, tp_size {engine.tp_size}: an engine over several ranks runs "
                           "in single mode (the prefill stage runs one rank per actor)")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):  # (None: none)
            raise JobError(f"storage_options must be a mapping, got {self.storage_options!r}")
        try:
            lists_outputs(self.list_outputs, defaults)
            check_storage_options([self.input, self.output, self.model], self.storage_options)
        except ValueError as exc:
            raise JobError(str(exc)) from None

    @property
    def samples_as_lists(self) -> bool:
        """The output schema's mode (operators/columns.py): lists when asked, or when n > 1."""
        return lists_outputs(self.list_outputs, SamplingParams.from_dict(self.sampling_params))


@dataclass
class JobSummary:
    progress: Progress
    output: str
    files: int
    completion_time_p50_s: float | None  # over every row in the output, within QuantileSketch's 0.5 %
    completion_time_p99_s: float | None
    error_rows: int  # rows of the output with an error, those of earlier runs included (progress: this run's)
    engine_actors: list[EngineActorReady] = field(default_factory=list)  # each engine actor started by the run
    balancing: BalancerStats | None = None  # MIGRATE between the engine actors, when there was a balancer
    stage_split: StageSplit | None = None  # the planner's split of engine_actors, when asked for
    started_at: float = 0.0  # wall clock at the run's start, to place the engine actors' ready times

    @property
    def engines_ready_s(self) -> float | None:
        """Seconds from the run's start until its last first-started engine actor was ready: the start-up
        every job pays. An actor restarted after a crash is not counted: it started after its stage's first actor
        was ready (a crash comes after work)."""
        first_ready = {stage: min(a.ready_at for a in self.engine_actors if a.stage == stage)
                       for stage in {a.stage for a in self.engine_actors}}
        started = [a.ready_at for a in self.engine_actors if a.ready_at - a.init_s <= first_ready[a.stage]]
        return max(started) - self.started_at if started else None

    @property
    def bct_s(self) -> float:
        """Batch completion time: the run's start to its last row written."""
        return self.progress.elapsed_s


@dataclass
class JobPlan:
    """A job that passed every check, ready to run: its input (rows already written skipped), and the lease on its
    output that it holds from its plan to its end (execute_job releases it; a caller that plans a job and then does
    not execute it releases it itself)."""

    config: JobConfig
    source: IndexedParquetSource
    lease: OutputLease


def run_job(config: JobConfig, on_progress: Callable[[Progress], None] | None = None,
            poll_s: float = 0.5) -> JobSummary:
    """Run (or resume) a job to completion; raises JobError when it cannot run or did not finish."""
    return execute_job(plan_job(config), on_progress, poll_s)


def plan_job(config: JobConfig) -> JobPlan:
    """Every check that can fail a job up front, with no Ray and no inference: options, model files and
    tokenizer, output writability, input files and columns, no other run on the output (output_lease.py), output
    ownership; then the resume scan."""
    config.validate()
    _check_model(config)
    _check_output(config)
    try:
        source = IndexedParquetSource(config.input, config.storage_options, rows_per_block=config.rows_per_block)
        check_input_columns(source.columns, f"input {config.input!r}")
    except (StorageError, ValueError) as exc:
        raise JobError(str(exc)) from exc
    lease = OutputLease(config.output, config.storage_options)
    try:
        lease.acquire()
    except LeaseHeld as exc:
        raise JobError(str(exc)) from exc
    except OSError as exc:
        raise JobError(f"output {config.output!r}: cannot take its lease: {exc}") from exc
    try:
        _claim_output(config, source.num_rows, source.digest, source.versions_digest)
        parts = recover_output_parts(config.output, config.storage_options)
    except BaseException:
        lease.release()
        raise
    source.skip = RangeSet.of((p.first, p.last) for p in parts)
    return JobPlan(config, source, lease)


def execute_job(plan: JobPlan, on_progress: Callable[[Progress], None] | None = None,
                poll_s: float = 0.5) -> JobSummary:
    try:
        return _run_planned(plan, on_progress, poll_s)
    finally:
        plan.lease.release()


def _run_planned(plan: JobPlan, on_progress: Callable[[Progress], None] | None, poll_s: float) -> JobSummary:
    config, source = plan.config, plan.source
    split = None
    progress = Progress(total_rows=source.num_rows, skipped_rows=source.skip.count)
    decode_engine: dict[str, Any] = {}
    started, started_at = time.perf_counter(), time.time()  # the stage plan's model load and profile count too
    if config.engine_actors is not None and progress.skipped_rows < progress.total_rows:  # not a finished job's
        config, split, decode_engine = plan_stages(config)
    tracker = ProgressTracker.remote()
    balancer = _work_balancer(config)
    try:
        if progress.skipped_rows < progress.total_rows:
            ds = build_dataset(config, source, tracker, balancer, decode_engine)
            sink = OrderedParquetSink(config.output, config.storage_options, config.rows_per_file,
                                      on_written=ReportWritten(tracker, "num_generated_tokens", ERROR))
            _run_with_progress(lambda: ds.write_datasink(sink, ray_remote_args={"num_cpus": _CPU_STAGE_CPUS}),
                               tracker, progress, started, on_progress, poll_s)
        progress.elapsed_s = time.perf_counter() - started
        update_progress(progress, tracker)
        if plan.lease.lost:
            raise JobError(f"another run took over output {config.output!r} while this one ran (this run's lease "
                           f"went stale: stopped for longer than {STALE_S:.0f} s?); let that run finish")
        summary = _summarise(config, progress)
        summary.engine_actors, summary.started_at = ray.get(tracker.ready_actors.remote()), started_at
        summary.stage_split = split
        if balancer is not None:
            summary.balancing = ray.get(balancer.summary.remote())
        return summary
    finally:  # a failed or stopped job's too: a serving process runs job after job
        for actor in (tracker, balancer):
            if actor is not None:
                ray.kill(actor)


def _is_count(value: Any) -> bool:
    """A positive integer (not a bool) that fits the 64-bit ints Arrow and the read tasks hold it in."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT64_MAX


_CPU_STAGE_CPUS = 0.25  # read, tokenize, write: light, and must never starve the engine actors
_MIN_ENGINE_CPUS = 0.25  # the least an engine actor asks for (one torch thread)


def build_dataset(config: JobConfig, source: IndexedParquetSource, progress: ray.actor.ActorHandle | None = None,
                  balancer: ray.actor.ActorHandle | None = None,
                  decode_engine: dict[str, Any] | None = None) -> ray.data.Dataset:
    """The lazy dataset of the job's pipeline, from read to the last operator (no write). `progress`: a
    ProgressTracker the engine actors tell about every batch of rows they finish; `balancer`: the
    WorkBalancer of the decoding stage's engine actors (`_work_balancer`); `decode_engine`: engine settings of the
    decode actors alone, over `config.engine` (the KV budgets a stage plan sized on a decode node)."""
    common = {"storage_options": config.storage_options}
    engine_kwargs = {**common, **config.engine}
    finishing = {"progress": progress}  # engine actors report when ready; the last stage, rows as they leave it
    balancing = {} if balancer is None else {"balancer": balancer}

    def engine_res(stage: str, resources: dict[str, float]) -> dict[str, Any]:
        ranks = EngineConfig.from_kwargs(**config.engine).ranks  # engine_num_gpus is per rank
        return {"num_cpus": engine_actor_cpus(config, stage), "num_gpus": config.engine_num_gpus * ranks,
                "resources": resources}

    cpu_res = {"num_cpus": _CPU_STAGE_CPUS}
    ds = source.read_dataset(num_cpus=_CPU_STAGE_CPUS)
    if config.mode == "single":
        return ds.map_batches(BatchGen, batch_size=config.batch_size, batch_format="pyarrow",
                              compute=engine_actor_pool(config.concurrency),
                              **engine_res("single", config.engine_resources),
                              fn_constructor_kwargs={
                                  "model": config.model, "sampling_params": config.sampling_params,
                                  "list_outputs": config.samples_as_lists, "chat_template": config.chat_template,
                                  **finishing, **engine_kwargs, **balancing})
    ds = ds.map_batches(Tokenize, batch_size=config.batch_size, batch_format="pyarrow",
                        compute=_pool(config.tokenize_concurrency), **cpu_res, fn_constructor_kwargs={
                            "model": config.model, "sampling_params": config.sampling_params,
                            "list_outputs": config.samples_as_lists, "chat_template": config.chat_template, **common})
    ds = ds.map_batches(Prefill, batch_size=config.batch_size, batch_format="pyarrow",
                        compute=_pool(config.prefill_concurrency),
                        **engine_res("prefill", config.prefill_resources),
                        fn_constructor_kwargs={"model": config.model, **finishing, **engine_kwargs})
    return ds.map_batches(Decode, batch_size=config.batch_size, batch_format="pyarrow",
                          compute=engine_actor_pool(config.decode_concurrency),
                          **engine_res("decode", config.decode_resources),
                          fn_constructor_kwargs={"model": config.model, "list_outputs": config.samples_as_lists,
                                                 **finishing, **engine_kwargs, **(decode_engine or {}), **balancing})


def _work_balancer(config: JobConfig) -> ray.actor.ActorHandle | None:
    """The job's WorkBalancer when its decoding stage has several engine actors to balance (None otherwise).
    An actor is short of work under its engine's refill threshold (its share of max_num_seqs, as the engine
    reports it: planned or given); the job's tail is PARTITIONed once it would fit one engine's batch."""
    engine_actors = config.concurrency if config.mode == "single" else config.decode_concurrency
    if not config.migrate or engine_actors < 2 or EngineConfig.from_kwargs(**config.engine).tp_size > 1:
        return None  # a tensor-parallel engine's KV is split by heads over its ranks: its requests stay
    return start_work_balancer()


def _pool(size: int) -> ray.data.ActorPoolStrategy:
    return ray.data.ActorPoolStrategy(size=size)


def engine_actor_cpus(config: JobConfig, stage: str) -> float:
    """CPUs each engine actor of `stage` ("single", "prefill" or "decode") asks for, unless told (engine_num_cpus):
    what the light stages leave on the nodes that can host it (actor_cpu_share), shared with the other stage's actors
    where those can land on the same nodes. A node hosts it when it has the actor's GPUs and the stage's custom
    resources: sized on every node, a share fitting a CPU-only head node was asked on a GPU node of fewer CPUs, and
    the job waited for it forever."""
    if config.engine_num_cpus is not None:
        return config.engine_num_cpus
    gpus = config.engine_num_gpus * EngineConfig.from_kwargs(**config.engine).ranks
    if config.mode == "single":
        stages, light_slots = {"single": (config.concurrency, config.engine_resources)}, 2
    else:  # read and write, and one slot per tokenizer actor (an actor pool holds its CPUs for the job)
        stages = {"prefill": (config.prefill_concurrency, config.prefill_resources),
                  "decode": (config.decode_concurrency, config.decode_resources)}
        light_slots = 2 + config.tokenize_concurrency
    alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    hosts = {name: [i for i, node in enumerate(alive) if actor_slots(node, gpus, resources) >= 1]
             for name, (_, resources) in stages.items()}
    mine = hosts[stage]
    if not mine:
        raise JobError(f"no node of the cluster has what a {stage} engine actor asks for ({gpus:g} GPUs, resources "
                       f"{stages[stage][1]}); give engine_num_cpus to size the actors for nodes yet to join")
    actors = sum(count for name, (count, _) in stages.items() if set(hosts[name]) & set(mine))
    return actor_cpu_share([alive[i].get("CPU", 0.0) for i in mine], actors, light_slots,
                           [actor_slots(alive[i], gpus, stages[stage][1]) for i in mine])


def actor_slots(node: dict[str, float], gpus: float, resources: dict[str, float]) -> float:
    """Engine actors asking for `gpus` GPUs and `resources` that a node's resources (ray.nodes()) hold, CPUs apart."""
    needs = {"GPU": gpus, **resources} if gpus > 0 else dict(resources)
    return min((node.get(name, 0.0) // amount for name, amount in needs.items() if amount > 0), default=math.inf)


def actor_cpu_share(node_cpus: list[float], actors: int, light_slots: int,
                    node_slots: list[float] | None = None) -> float:
    """CPUs each of `actors` engine actors asks for: the most that lets all of them fit on the nodes (`node_cpus`,
    each holding at most its `node_slots` actors: its GPUs' worth, say) while every node keeps `light_slots` slots of
    _CPU_STAGE_CPUS for the light stages (read, write, tokenize), so they never starve wherever Ray places the actors;
    the engine actors compute with the rest (prepare_engine_process gives them that many torch threads, rounded up),
    which on a 2-CPU machine means two threads for a single engine, not one. A JobError names actors the cluster
    cannot hold at _MIN_ENGINE_CPUS each: their requests would leave the read tasks no CPU, or one actor none, and
    the job would wait forever."""
    slots = node_slots or [math.inf] * len(node_cpus)
    rooms = [(cpus - light_slots * _CPU_STAGE_CPUS, cap) for cpus, cap in zip(node_cpus, slots)]
    rooms = [(room, cap) for room, cap in rooms if room > 0 and cap >= 1]

    def placed(share: float) -> int:  # actors of `share` CPUs the nodes hold
        return sum(min(int(room / share + 1e-9), cap) for room, cap in rooms)

    # the largest share is some node's room split k ways
    shares = sorted({room / k for room, _ in rooms for k in range(1, actors + 1)}, reverse=True)
    share = next((s for s in shares if placed(s) >= actors), 0.0)
    if share < _MIN_ENGINE_CPUS:
        raise JobError(f"{actors} engine actors do not fit {sum(node_cpus):g} CPUs beside the read, write and tokenize "
                       f"stages ({light_slots} x {_CPU_STAGE_CPUS} CPUs)"
                       + ("" if node_slots is None else f" on the {len(node_cpus)} node(s) that can host them")
                       + ": run fewer engine actors, or give engine_num_cpus")
    return share


def _run_with_progress(write: Callable[[], None], tracker, progress: Progress, started: float,
                       on_progress: Callable[[Progress], None] | None, poll_s: float) -> None:
    failure: list[BaseException] = []

    def target() -> None:
        try:
            write()
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=target, name="batchgen-job", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(poll_s)
        if on_progress is not None:
            progress.elapsed_s = time.perf_counter() - started
            update_progress(progress, tracker)
            on_progress(progress)
    if failure:
        raise JobError(f"the job failed: {failure[0]}") from failure[0]


def _check_model(config: JobConfig) -> None:
    from batchgen.connectors.checkpoint_files import load_tokenizer

    try:
        load_tokenizer(config.model, config.storage_options)
    except Exception as exc:  # CheckpointError, PresetError, fsspec and botocore errors alike
        raise JobError(f"model {config.model!r} is not readable: {exc}") from exc


def _check_output(config: JobConfig) -> None:
    try:
        check_writable(config.output, config.storage_options)
    except StorageError as exc:
        raise JobError(str(exc)) from exc


def _claim_output(config: JobConfig, total_rows: int, input_digest: str, input_versions: str) -> None:
    """Record which job the output belongs to; refuse to mix a different job's rows into it."""
    fs, path = filesystem(config.output, config.storage_options)
    manifest = posixpath.join(path, MANIFEST)
    mine = job_record(config, total_rows, input_digest, input_versions)
    fs.invalidate_cache(path)
    if fs.exists(manifest):
        try:
            theirs = json.loads(fs.cat_file(manifest))
        except ValueError as exc:
            raise JobError(f"output {config.output!r} has a damaged job record {MANIFEST!r} ({exc}); remove it to "
                           "claim the output again") from exc
        # a key the record lacks was not recorded by the version that wrote it (input_digest): not compared
        differing = sorted(k for k in mine if k in theirs and theirs[k] != mine[k])
        if differing:
            edited = (" (an input file was rewritten since: its ETag or modification time changed)"
                      if differing == ["input_versions"] else "")
            raise JobError(f"output {config.output!r} holds results of a different job (differs in "
                           f"{differing}){edited}; give a new output path or remove the old one")
        return
    with fs.open(manifest, "w") as f:
        json.dump(mine, f, indent=2)


def job_record(config: JobConfig, total_rows: int, input_digest: str, input_versions: str) -> dict:
    """What identifies a job's output, as its record file holds it: through JSON, so a rerun's record compares
    equal to the one read back (JSON makes a logit_bias's token ids strings and tuples lists). `input_digest`:
    the input files' names, sizes and rows (IndexedParquetSource.digest); `input_versions`: their names and
    versions (versions_digest)."""
    return json.loads(json.dumps({"input": config.input, "input_digest": input_digest,
                                  "input_versions": input_versions, "model": config.model,
                                  "total_rows": total_rows,
                                  "sampling_params": SamplingParams.from_dict(config.sampling_params).to_dict(),
                                  "list_outputs": config.samples_as_lists, "chat_template": config.chat_template}))


def _summarise(config: JobConfig, progress: Progress) -> JobSummary:
    parts = recover_output_parts(config.output, config.storage_options)
    written = RangeSet.of((p.first, p.last) for p in parts)
    if written.count != progress.total_rows:
        raise JobError(f"the job ended with {written.count} of {progress.total_rows} rows in "
                       f"{config.output!r}; run it again to finish the rest")
    fs, _ = filesystem(config.output, config.storage_options)
    times = QuantileSketch()  # one part file's columns in memory at a time, not every row's value
    errors = 0
    for part in parts:
        with fs.open(part.path, "rb") as f:
            table = pq.read_table(f, columns=["completion_time_s", ERROR])
        times.add_many(table.column(0).to_numpy())
        errors += len(table) - table.column(1).null_count
    return JobSummary(progress, config.output, len(parts), times.quantile(0.5), times.quantile(0.99), errors)
