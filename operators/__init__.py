"""batchgen.operators: the engine hosted inside Ray Data (map_batches callables).

The names below load lazily, so the CPU-only tokenize stage imports neither torch nor the engine
runtime.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BatchGen": "batchgen.operators.batch_gen",
    "Decode": "batchgen.operators.decode",
    "Prefill": "batchgen.operators.prefill",
    "Tokenize": "batchgen.operators.tokenize",
    "engine_actor_pool": "batchgen.operators.engine_actor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchgen.operators' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
