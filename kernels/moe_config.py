"""Block sizes for the Triton fused MoE kernel: tuned JSON files per (experts, intermediate size, device).

A file `E={E},N={N},device_name={device}.json` in kernels/configs/ (or $BATCHGEN_MOE_CONFIG_DIR) maps a
token count M to a config; the entry with the nearest M is used. bench/tune_moe.py writes these files.
Without a file, the defaults below apply (small BLOCK_M when experts see few tokens each).
"""

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_DIR_ENV = "BATCHGEN_MOE_CONFIG_DIR"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def config_dir() -> Path:
    return Path(os.environ.get(CONFIG_DIR_ENV) or Path(__file__).with_name("configs"))


def device_name(device: torch.device) -> str:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _device_name(device.type, index)


@functools.lru_cache(maxsize=16)
def _device_name(device_type: str, index: int | None) -> str:
    """Cached: asking CUDA for the name costs about 0.1 ms, and fused_moe asks at every call."""
    if device_type == "cuda":
        return torch.cuda.get_device_name(index).replace(" ", "_")
    return device_type


def config_file_name(num_experts: int, inter_size: int, device: str) -> str:
    return f"E={num_experts},N={inter_size},device_name={device}.json"


def validate_config(config: dict, source: str) -> dict[str, int]:
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"{source}: MoE config lacks {', '.join(missing)}")
    return {key: int(config[key]) for key in CONFIG_KEYS}


@functools.lru_cache(maxsize=64)
def load_configs(path: Path) -> dict[int, dict[str, int]] | None:
    """{M: config} from one tuned file, or None when there is no file."""
    if not path.is_file():
        return None
    with path.open() as f:
        raw = json.load(f)
    return {int(m): validate_config(cfg, f"{path} [M={m}]") for m, cfg in raw.items()}


def default_config(num_tokens: int, num_experts: int) -> dict[str, int]:
    if num_tokens <= num_experts:
        return dict(
            BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3
        )
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=3)


def moe_config(num_tokens: int, num_experts: int, inter_size: int, device: torch.device) -> dict[str, int]:
    """Config for a batch of num_tokens: tuned entry with the nearest M, else the default."""
    path = config_dir() / config_file_name(num_experts, inter_size, device_name(device))
    tuned = load_configs(path)
    if not tuned:
        return default_config(num_tokens, num_experts)
    return tuned[min(tuned, key=lambda m: abs(m - num_tokens))]
