"""`batchgen serve`: the OpenAI-compatible Batch API server over one engine."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.engine.request_normalizer import sampling_params
from batchgen.pipelines.cli_args import json_object

if TYPE_CHECKING:  # the server's modules load only when `serve` runs
    from fastapi import FastAPI

    from batchgen.engine import EngineLoop
    from batchgen.pipelines.openai_batch.store import BatchStore


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI Batch API (files, batches) over one engine",
        description="OpenAI-compatible Batch API server. Point the official openai client at "
                    "http://HOST:PORT/v1 and use client.files / client.batches as with OpenAI.")
    p.add_argument("--model", required=True, help="model directory, fsspec URI (s3://...) or preset name")
    p.add_argument("--storage", required=True,
                   help="where uploaded and result files live: a local directory or an fsspec URI (s3://...)")
    p.add_argument("--served-model-name", help="the name requests use in 'model' (default: the last path "
                                               "component of --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BATCHGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $BATCHGEN_API_KEY; unset = no auth)")
    p.add_argument("--state-dir", help="local directory for the SQLite metadata (default: the storage "
                                       "directory; required when --storage is remote)")
    p.add_argument("--storage-options", type=json_object, default=None,
                   help='fsspec options for --storage and --model as JSON, e.g. {"endpoint_url": "http://..."}')
    p.add_argument("--max-upload-bytes", type=int, default=200 * 1024 * 1024, help="largest accepted upload")
    p.add_argument("--max-batch-requests", type=int, default=50_000, help="most requests in one batch file")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests handed to the engine at once; cancellation waits for these to finish")
    p.add_argument("--sampling-params", type=json_object, default={},
                   help='defaults for the sampling fields a request body leaves out, as JSON, '
                        'e.g. {"temperature": 0, "max_tokens": 256}')
    p.add_argument("--engine", type=json_object, default={},
                   help='EngineConfig fields as JSON, e.g. {"max_num_seqs": 512}')
    p.add_argument("--chat-template", help="Jinja chat template (a file or the template itself) for models "
                                           "whose tokenizer has none")
    p.add_argument("--allow-custom-completion-window", action="store_true",
                   help="accept any completion_window '<n>s|m|h|d', not only '24h' (short windows for tests)")
    return p


def run_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from batchgen.engine import EngineLoop
    from batchgen.operators.engine_factory import load_engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    try:
        sampling_params(args.sampling_params)  # a bad default fails before the model loads
        store = open_store(args)
        loop = EngineLoop(lambda: load_engine(args.model, args.storage_options, **args.engine))
    except (ValueError, TypeError) as exc:  # bad options (the engine's own checks), unusable storage or model
        raise SystemExit(f"batchgen serve: error: {exc}") from None
    try:
        uvicorn.run(create_serve_app(args, loop, store), host=args.host, port=args.port, log_level="info")
    finally:
        loop.close()


def open_store(args: argparse.Namespace) -> BatchStore:
    from batchgen.pipelines.openai_batch.store import BatchStore

    return BatchStore(args.storage, args.state_dir, args.storage_options)


def create_serve_app(args: argparse.Namespace, loop: EngineLoop, store: BatchStore) -> FastAPI:
    """The server app for parsed `serve` arguments over a running engine loop (the caller closes both)."""
    from batchgen.pipelines.openai_batch.runner import BatchRunner, RunnerConfig
    from batchgen.pipelines.openai_batch.server import ServerConfig, create_app

    served_model = args.served_model_name or args.model.rstrip("/").rsplit("/", 1)[-1]
    chat_template = args.chat_template
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    runner = BatchRunner(loop, store, RunnerConfig(
        served_model=served_model, default_sampling=args.sampling_params, chat_template=chat_template,
        max_in_flight=args.max_in_flight, max_batch_requests=args.max_batch_requests))
    return create_app(store, runner, ServerConfig(
        served_model=served_model, api_key=args.api_key, max_upload_bytes=args.max_upload_bytes,
        allow_custom_completion_window=args.allow_custom_completion_window))
