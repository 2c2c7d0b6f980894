"""The sequence-coroutine engine; runs in a plain Python process (no Ray, no server)."""

from batchgen.engine.config import EngineConfig
from batchgen.engine.engine import Engine, PrefillOutput
from batchgen.engine.request import Completion, Request, Result, TokenLogprob
from batchgen.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "InvalidRequestError",
    "PrefillOutput",
    "Request",
    "Result",
    "SamplingParams",
    "TokenLogprob",
]
