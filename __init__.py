"""BatchGen: batch inference for Mixture-of-Experts language models on Ray Data.

The names below load lazily, so `import batchgen` stays cheap and pulls in Ray only when the
operators are used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "batchgen.engine",
    "EngineConfig": "batchgen.engine",
    "Request": "batchgen.engine",
    "Result": "batchgen.engine",
    "SamplingParams": "batchgen.engine",
    "PrefillOutput": "batchgen.engine",
    "PrefillExporter": "batchgen.engine",
    "EngineLoop": "batchgen.engine",
    "load_model": "batchgen.connectors.checkpoint",
    "BatchGen": "batchgen.operators",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
