"""`batchgen serve`: the OpenAI-compatible Batch API server, over one in-process engine (`--backend engine`)
or a Ray job per batch (`--backend ray`)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from batchgen.connectors.io import check_storage_options
from batchgen.engine.request_normalizer import sampling_params
from batchgen.pipelines.cli_args import chat_template_text, json_object, port_number, positive_int

if TYPE_CHECKING:  # the server's modules load only when `serve` runs
    from fastapi import FastAPI

    from batchgen.engine import EngineLoop
    from batchgen.pipelines.openai_batch.backend import BackendConfig, BatchBackend
    from batchgen.pipelines.openai_batch.store import BatchStore
    from batchgen.pipelines.pipeline import JobConfig

log = logging.getLogger(__name__)

# JobConfig fields `serve` sets itself from its own options, or per batch
_SET_BY_SERVE = ("model", "input", "output", "sampling_params", "engine", "storage_options", "list_outputs",
                 "chat_template")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI Batch API (files, batches) over one engine or a Ray job per batch",
        description="OpenAI-compatible Batch API server. Point the official openai client at "
                    "http://HOST:PORT/v1 and use client.files / client.batches as with OpenAI.")
    p.add_argument("--model", required=True, help="model directory, fsspec URI (s3://...) or preset name")
    p.add_argument("--storage", required=True,
                   help="where uploaded and result files live: a local directory or an fsspec URI (s3://...)")
    p.add_argument("--served-model-name", help="the name requests use in 'model' (default: the last path "
                                               "component of --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BATCHGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $BATCHGEN_API_KEY; unset = no auth)")
    p.add_argument("--state-dir", help="local directory for the SQLite metadata (default: the storage "
                                       "directory; required when --storage is remote)")
    p.add_argument("--storage-options", type=json_object, default=None,
                   help='fsspec options for --storage and --model as JSON, e.g. {"endpoint_url": "http://..."}')
    p.add_argument("--max-upload-bytes", type=positive_int, default=200 * 1024 * 1024, help="largest accepted upload")
    p.add_argument("--max-batch-requests", type=positive_int, default=50_000, help="most requests in one batch file")
    p.add_argument("--max-in-flight", type=positive_int, default=None,
                   help="with --backend engine: requests handed to the engine at once (default 256; a cancel aborts "
                        "those of its batch)")
    p.add_argument("--sampling-params", type=json_object, default={},
                   help='defaults for the sampling fields a request body leaves out, as JSON, '
                        'e.g. {"temperature": 0, "max_tokens": 256}')
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto (default): the sampling defaults the model's generation_config.json recommends "
                        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) apply under "
                        "--sampling-params, as vLLM's server applies them; vllm: they do not")
    p.add_argument("--engine", type=json_object, default={},
                   help='EngineConfig fields as JSON, e.g. {"max_num_seqs": 512}')
    p.add_argument("--chat-template", help="Jinja chat template (a file or the template itself) that renders "
                                           "every request's messages, in place of the tokenizer's own")
    p.add_argument("--allow-custom-completion-window", action="store_true",
                   help="accept any completion_window '<n>s|m|h|d', not only '24h' (short windows for tests)")
    p.add_argument("--backend", choices=("engine", "ray"), default="engine",
                   help="engine: one in-process engine (default); ray: each batch runs as a `batchgen run` job "
                        "on Ray engine actors (resumable, input order), shaped by --ray-job")
    p.add_argument("--ray-job", type=json_object, default={},
                   help='with --backend ray: the jobs\' `batchgen run` settings as JSON (JobConfig fields), e.g. '
                        '{"mode": "single", "concurrency": 4, "engine_num_gpus": 1}')
    p.add_argument("--ray-address", help="with --backend ray: the Ray cluster to join (default: $RAY_ADDRESS, "
                                         "else a local one)")
    return p


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from batchgen.engine import EngineLoop
    from batchgen.operators.engine_factory import load_engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    check_serve_options(args)  # a bad option value is a bad command line (exit 2), before the model loads
    loop = None
    try:
        store = open_store(args)
        if args.backend == "ray":
            _connect_ray(args.ray_address)
        else:
            loop = EngineLoop(lambda: load_engine(args.model, args.storage_options, **args.engine))
        app = create_serve_app(args, loop, store)
    except (ValueError, TypeError) as exc:  # bad options (the engine's own checks), unusable storage or model
        if loop is not None:
            loop.close()
        raise SystemExit(f"batchgen serve: error: {exc}") from None
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        if loop is not None:
            loop.close()


def check_serve_options(args: argparse.Namespace) -> None:
    """UsageError naming a bad option value, or an option of the other backend (given, it would be ignored)."""
    from batchgen.engine import EngineConfig
    from batchgen.pipelines.cli import UsageError

    other = {"engine": {"--ray-job": bool(args.ray_job), "--ray-address": args.ray_address is not None},
             "ray": {"--max-in-flight": args.max_in_flight is not None}}[args.backend]
    given = [flag for flag, set_ in other.items() if set_]
    if given:
        raise UsageError(f"{' and '.join(given)} apply to the other backend; this server runs --backend {args.backend}")
    try:
        check_storage_options([args.storage, args.model], args.storage_options)
        sampling_params(args.sampling_params)
        if args.chat_template is not None:
            chat_template_text(args.chat_template)
        EngineConfig.from_kwargs(**args.engine)
        if args.backend == "ray":
            ray_job_config(args)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None


def _connect_ray(address: str | None) -> None:
    import ray

    from batchgen.pipelines.ray_runtime import init_ray

    if not ray.is_initialized():
        init_ray(address or os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def open_store(args: argparse.Namespace) -> BatchStore:
    from batchgen.pipelines.openai_batch.store import BatchStore

    return BatchStore(args.storage, args.state_dir, args.storage_options)


def create_serve_app(args: argparse.Namespace, loop: EngineLoop | None, store: BatchStore) -> FastAPI:
    """The server app for parsed `serve` arguments: over a running engine loop with `--backend engine`, over the
    Ray runtime this process is connected to with `--backend ray` (`loop` None). The caller closes both."""
    from batchgen.pipelines.openai_batch.backend import BackendConfig
    from batchgen.pipelines.openai_batch.server import ServerConfig, create_app

    served_model = args.served_model_name or args.model.rstrip("/").rsplit("/", 1)[-1]
    chat_template = None if args.chat_template is None else chat_template_text(args.chat_template)
    config = BackendConfig(
        served_model=served_model, default_sampling=serve_sampling_defaults(args), chat_template=chat_template,
        max_batch_requests=args.max_batch_requests,
        **({} if args.max_in_flight is None else {"max_in_flight": args.max_in_flight}))
    return create_app(store, _backend(args, loop, store, config), ServerConfig(
        served_model=served_model, api_key=args.api_key, max_upload_bytes=args.max_upload_bytes,
        allow_custom_completion_window=args.allow_custom_completion_window))


def serve_sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling defaults of a request body's unset fields: --sampling-params over those the model's generation
    config recommends (with --generation-config auto: vLLM's server default)."""
    from batchgen.connectors.checkpoint_files import load_generation_defaults

    recommended = load_generation_defaults(args.model, args.storage_options) if args.generation_config == "auto" \
        else {}
    if recommended:
        log.info("sampling defaults from the model's generation config: %s (--sampling-params overrides them; "
                 "--generation-config vllm leaves them out)", recommended)
    return {**recommended, **args.sampling_params}


def _backend(args: argparse.Namespace, loop: EngineLoop | None, store: BatchStore,
             config: BackendConfig) -> BatchBackend:
    if args.backend == "ray":
        from batchgen.pipelines.openai_batch.ray_backend import RayBackend

        return RayBackend(store, config, ray_job_config(args), args.storage.rstrip("/") + "/jobs")
    from batchgen.pipelines.openai_batch.runner import BatchRunner

    return BatchRunner(loop, store, config)


def ray_job_config(args: argparse.Namespace) -> JobConfig:
    """The settings every batch's job runs with: --ray-job over the model, engine and storage options of
    `serve` itself; raises ValueError naming what is wrong."""
    from batchgen.pipelines.pipeline import JobConfig, JobError

    clash = sorted(set(args.ray_job) & set(_SET_BY_SERVE))
    if clash:
        raise ValueError(f"--ray-job cannot set {clash}: serve sets them from its own options or per batch")
    try:
        job = JobConfig(model=args.model, input="", output="", engine=args.engine,
                        storage_options=args.storage_options or {}, sampling_params=args.sampling_params,
                        list_outputs=True, **args.ray_job)
        job.validate()
    except (TypeError, JobError) as exc:
        raise ValueError(f"--ray-job: {exc}") from None
    return job
