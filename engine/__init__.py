"""The sequence-coroutine engine; runs in a plain Python process (no Ray, no server).

The names below load lazily, so a process that only needs the request types and checks (a tokenize
stage) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ChatOptions": "batchgen.engine.chat",
    "Completion": "batchgen.engine.request",
    "Engine": "batchgen.engine.engine",
    "EngineConfig": "batchgen.engine.config",
    "EngineLoop": "batchgen.engine.engine_loop",
    "InvalidRequestError": "batchgen.engine.errors",
    "LoadedModel": "batchgen.engine.models.loaded_model",
    "EngineLoad": "batchgen.engine.engine_load",
    "MigratedRequest": "batchgen.engine.migration",
    "PrefillExporter": "batchgen.engine.prefill_export",
    "PrefillBatch": "batchgen.engine.prefill_output",
    "PrefillOutput": "batchgen.engine.prefill_output",
    "Request": "batchgen.engine.request",
    "RequestNormalizer": "batchgen.engine.request_normalizer",
    "Result": "batchgen.engine.request",
    "SamplingParams": "batchgen.engine.sampling_params",
    "StructuredOutputs": "batchgen.engine.structured_outputs",
    "TokenLogprob": "batchgen.engine.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchgen.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
