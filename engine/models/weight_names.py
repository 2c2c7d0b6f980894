"""Checkpoint tensor names -> our parameter names.

Our modules keep the transformers-5 names inside each block, so the mapping is: drop the `model.`
prefix, put a layer's norm + attention under `.attn` and its norm + MLP under `.ffn`, and fold
per-expert tensors (`experts.{e}.gate_proj|up_proj|down_proj`, Mixtral's `experts.{e}.w1|w3|w2`)
into the fused expert parameters `experts.gate_up_proj` [E, 2I, D] (gate rows, then up rows) and
`experts.down_proj` [E, D, I]. Families add their own renames first (Mixtral: block_sparse_moe -> mlp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GATE, UP = 0, 1

_BLOCKS = (
    (re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|self_attn)\."), r"layers.\1.attn.\2."),
    (re.compile(r"^model\.layers\.(\d+)\.(post_attention_layernorm|mlp)\."), r"layers.\1.ffn.\2."),
    (re.compile(r"^model\.(embed_tokens|norm)\."), r"\1."),
)
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_HALF = {"w1": GATE, "gate_proj": GATE, "w3": UP, "up_proj": UP}


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, or one expert's row (and gate/up half) of it."""

    param: str
    expert: int | None = None
    half: int | None = None  # GATE or UP rows of a fused gate_up_proj


def checkpoint_target(name: str, renames: tuple[tuple[str, str], ...] = ()) -> WeightTarget:
    """The parameter a checkpoint tensor fills (it may name no parameter of the model: the caller checks)."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    for pattern, replacement in _BLOCKS:
        name = pattern.sub(replacement, name)
    match = _PER_EXPERT.match(name)
    if match is None:
        return WeightTarget(name)
    proj = match["proj"]
    fused = "down_proj" if proj in ("w2", "down_proj") else "gate_up_proj"
    return WeightTarget(f"{match['experts']}.{fused}", int(match["expert"]), _HALF.get(proj))


def checkpoint_name(param: str) -> str:
    """The transformers-5 checkpoint name of one of our parameters (for error messages)."""
    name = re.sub(r"^layers\.(\d+)\.(attn|ffn)\.", r"model.layers.\1.", param)
    return re.sub(r"^(embed_tokens|norm)\.", r"model.\1.", name)
