"""An engine from a model URI and engine options: the checkpoint loader meets the engine here,
so neither package imports the other."""

from __future__ import annotations

import functools
from typing import Any

import torch

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig
from batchgen.engine.parallel.group_engine import GroupEngine, rank_spec, start_engine_group
from batchgen.engine.process_heap import keep_freed_memory


def load_engine(model: str, storage_options: dict[str, Any] | None = None,
                **engine_options: Any) -> Engine | GroupEngine:
    """`model`: a checkpoint directory, an fsspec URI or a preset name; `engine_options`: EngineConfig fields.
    With `ep_size` or `tp_size` N > 1 the engine spans N ranks, this process being rank 0 (engine/parallel): the
    threads this process has are shared among them, and each rank loads only its own experts, or its own heads and
    columns. The process keeps its freed C heap for the engine's next steps (process_heap.keep_freed_memory)."""
    config = EngineConfig.from_kwargs(**engine_options)
    keep_freed_memory()
    if config.ranks > 1:
        load = functools.partial(load_model, model, dtype=config.dtype, storage_options=storage_options)
        threads = max(1, torch.get_num_threads() // config.ranks)
        return start_engine_group(rank_spec(load, config, threads))
    loaded = load_model(model, dtype=config.dtype, device=config.load_device(),
                        shared_host_weights=config.shares_host_weights, storage_options=storage_options)
    return Engine(loaded, config)
