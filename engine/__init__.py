"""The sequence-coroutine engine; runs in a plain Python process (no Ray, no server)."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine
from batchgen.engine.engine_loop import EngineLoop
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.prefill_export import PrefillExporter
from batchgen.engine.prefill_output import PrefillOutput
from batchgen.engine.request import Completion, Request, Result, TokenLogprob
from batchgen.engine.request_normalizer import RequestNormalizer
from batchgen.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "InvalidRequestError",
    "LoadedModel",
    "PrefillExporter",
    "PrefillOutput",
    "Request",
    "RequestNormalizer",
    "Result",
    "SamplingParams",
    "TokenLogprob",
]
