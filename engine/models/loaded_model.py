"""A model ready to serve: the module plus what generation needs from its checkpoint.

Built by the checkpoint loader (connectors/checkpoint.py) or by hand; the engine takes one and
never loads anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: Any  # the transformers PretrainedConfig
    tokenizer: Any | None  # transformers tokenizer, None when the checkpoint ships none
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    dtype: torch.dtype
    uri: str
    # "resident", or how memory-constrained mode placed the weights (engine/offload): what a layer's measured
    # cost depends on, besides the device and the shape
    weight_placement: str = "resident"
    streamer: Any = None  # the WeightStreamer that placed them (engine/offload), None while resident
    # the weights are a file mapping every process of the node shares (connectors/host_memory.py): never written
    host_weights_shared: bool = False

    @property
    def device(self) -> torch.device:
        """Where the model computes: its final norm's device (always resident, also when weights stream)."""
        return self.model.norm.weight.device

    def context_length(self, max_model_len: int | None) -> int:
        """The context an engine option max_model_len asks for (None: the model's); ValueError past the model's, as
        vLLM refuses it (it was clamped without a word)."""
        if max_model_len is not None and max_model_len > self.max_model_len:
            raise ValueError(f"engine option max_model_len ({max_model_len}) is more than the model's context length "
                             f"({self.max_model_len})")
        return max_model_len or self.max_model_len
