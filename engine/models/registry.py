"""model_type -> how to build the model and how to name its checkpoint tensors.

The dense and MoE Llama/Qwen/Mixtral families are one generic decoder with a few switches each.
Families in their own module (DeepSeek-V3) are imported on first use: the module exposes
`FAMILY: ModelFamily`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from batchgen.engine.models.decoder import DecoderConfig, MoEConfig, build_decoder


class UnsupportedModelError(ValueError):
    """A checkpoint whose model_type (or a feature of its config) we cannot run."""


@dataclass(frozen=True)
class ModelFamily:
    build: Callable[..., nn.Module]  # hf_config -> model (the loader calls it on the meta device)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # regex substitutions before weight_names' mapping


def _common(c) -> dict:
    if c.hidden_act != "silu":
        raise UnsupportedModelError(f"{c.model_type}: activation {c.hidden_act!r} unsupported (only silu)")
    window = sliding_window(c)
    if window is not None and window < c.max_position_embeddings:  # a window past every position attends to all
        raise UnsupportedModelError(
            f"{c.model_type}: sliding-window attention (sliding_window={window}) is not supported"
        )
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(c.tie_word_embeddings),
    )


def sliding_window(c) -> int | None:
    """The attention window transformers gives some layer of this config, or None: Llama has none, Mixtral and
    Qwen3-MoE apply `sliding_window` to every layer when it is set, Qwen2, Qwen3 and Qwen2-MoE to the layers
    `layer_types` marks "sliding_attention" (their configs derive it from use_sliding_window and
    max_window_layers)."""
    if c.model_type == "llama":
        return None
    if c.model_type in ("mixtral", "qwen3_moe"):
        return getattr(c, "sliding_window", None) or None
    return c.sliding_window if "sliding_attention" in (getattr(c, "layer_types", None) or ()) else None


def _qwen_moe_layers(c) -> tuple[int, ...]:
    """Qwen2/3-MoE: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    dense = set(getattr(c, "mlp_only_layers", None) or ())
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return tuple(i for i in range(c.num_hidden_layers)
                 if i not in dense and c.num_experts > 0 and (i + 1) % step == 0)


def llama(c) -> DecoderConfig:
    bias = c.attention_bias
    return DecoderConfig(**_common(c), qkv_bias=bias, o_bias=bias, mlp_bias=c.mlp_bias)


def qwen2(c) -> DecoderConfig:
    return DecoderConfig(**_common(c), qkv_bias=True)


def qwen3(c) -> DecoderConfig:
    return DecoderConfig(**_common(c), qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True)


def mixtral(c) -> DecoderConfig:
    moe = MoEConfig(c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, normalize_topk=True,
                    round_weights_to_model_dtype=False)
    return DecoderConfig(**_common(c), moe=moe, moe_layers=tuple(range(c.num_hidden_layers)))


def qwen2_moe(c) -> DecoderConfig:
    moe = MoEConfig(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                    round_weights_to_model_dtype=True, shared_expert_size=c.shared_expert_intermediate_size,
                    shared_expert_gated=True)
    return DecoderConfig(**_common(c), qkv_bias=c.qkv_bias, moe=moe, moe_layers=_qwen_moe_layers(c))


def qwen3_moe(c) -> DecoderConfig:
    moe = MoEConfig(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                    round_weights_to_model_dtype=True)
    return DecoderConfig(**_common(c), qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True,
                         moe=moe, moe_layers=_qwen_moe_layers(c))


def _decoder_family(to_decoder_config: Callable, renames: tuple[tuple[str, str], ...] = ()) -> ModelFamily:
    return ModelFamily(lambda c: build_decoder(to_decoder_config(c), c), renames)


FAMILIES: dict[str, ModelFamily] = {
    "llama": _decoder_family(llama),
    "qwen2": _decoder_family(qwen2),
    "qwen3": _decoder_family(qwen3),
    "mixtral": _decoder_family(mixtral, ((r"\.block_sparse_moe\.", ".mlp."),)),
    "qwen2_moe": _decoder_family(qwen2_moe),
    "qwen3_moe": _decoder_family(qwen3_moe),
}
# Families living in their own module, which defines `FAMILY: ModelFamily`; imported on first use.
MODULE_FAMILIES: dict[str, str] = {
    "deepseek_v3": "batchgen.engine.models.deepseek_v3",
}


def supported_model_types() -> list[str]:
    return sorted([*FAMILIES, *MODULE_FAMILIES])


def model_family(model_type: str | None) -> ModelFamily:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in MODULE_FAMILIES:
        return importlib.import_module(MODULE_FAMILIES[model_type]).FAMILY
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
