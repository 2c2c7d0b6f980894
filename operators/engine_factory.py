"""An engine from a model URI and engine options: the checkpoint loader meets the engine here,
so neither package imports the other."""

from __future__ import annotations

from typing import Any

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig


def load_engine(model: str, storage_options: dict[str, Any] | None = None, **engine_options: Any) -> Engine:
    """`model`: a checkpoint directory, an fsspec URI or a preset name; `engine_options`: EngineConfig fields."""
    config = EngineConfig.from_kwargs(**engine_options)
    loaded = load_model(model, dtype=config.dtype, device=config.torch_device(), storage_options=storage_options)
    return Engine(loaded, config)
