"""DeepSeek-V3 (absorbed MLA, group-limited sigmoid MoE) against transformers, token for token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import copy_to_memory, hf_greedy, prompts
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen.connectors.checkpoint import load_model
from batchgen.engine.models.context import KVSpec
from batchgen.engine.models.deepseek_v3 import GroupLimitedSigmoidRouter, build_deepseek_v3, softmax_scale
from batchgen.engine.models.registry import UnsupportedModelError
from batchgen.engine.reference import ReferenceRunner

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
    topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=24, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-5,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
CONFIGS = {
    # q through a low-rank bottleneck, interleaved rope with yarn scaling (mscale_all_dim enters the scale)
    "q_lora_yarn": dict(
        q_lora_rank=24, rope_interleave=True, n_shared_experts=1, norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                             original_max_position_embeddings=128, beta_fast=32, beta_slow=1),
    ),
    # full-rank q projection, half-split rope, two shared experts, unnormalised top-k weights
    "q_full_default_rope": dict(
        q_lora_rank=None, rope_interleave=False, n_shared_experts=2, norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}
NEW_TOKENS = 32


def tiny_deepseek(name: str, seed: int = 0):
    """The transformers model, float32, with a non-zero e_score_correction_bias so the bias is exercised."""
    config = AutoConfig.for_model("deepseek_v3", **{**BASE, **CONFIGS[name]})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, transformers model, local directory) of a saved tiny DeepSeek-V3."""
    directory = tmp_path_factory.mktemp(request.param)
    model = tiny_deepseek(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory


@pytest.mark.parametrize("where", ["local", "memory"])
def test_prefill_logits_match_transformers(checkpoint, where):
    name, hf, directory = checkpoint
    uri = str(directory) if where == "local" else copy_to_memory(directory, f"dsv3-{name}")
    runner = ReferenceRunner(load_model(uri, dtype="float32").model)
    for prompt in prompts(VOCAB, lengths=(5, 23)):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        got = runner.prefill_logits(prompt)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers_generate(checkpoint):
    _, hf, directory = checkpoint
    runner = ReferenceRunner(load_model(str(directory)).model)
    batch = prompts(VOCAB, lengths=(3, 9, 17))
    ours = runner.generate(batch, NEW_TOKENS)
    for prompt, tokens in zip(batch, ours):
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
        assert len(set(tokens)) > 1, "greedy output is one repeated token: the test would prove little"


def test_structure_and_latent_kv_cache(checkpoint):
    _, hf, directory = checkpoint
    config = hf.config
    model = load_model(str(directory)).model
    assert model.kv_spec() == KVSpec(3, 1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank)
    assert [layer.is_moe for layer in model.layers] == [False, True, True]
    expected_scale = hf.model.layers[0].self_attn.scaling
    assert model.layers[0].attn.self_attn.scale == pytest.approx(expected_scale, rel=1e-12)


def test_fused_expert_tensor_names_load_identically(checkpoint, tmp_path):
    """transformers-5 in-memory names (experts.gate_up_proj [E, 2I, D]) instead of per-expert tensors."""
    _, hf, directory = checkpoint
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    prompt = prompts(VOCAB, lengths=(11,))[0]
    per_expert = ReferenceRunner(load_model(str(directory)).model).prefill_logits(prompt)
    fused = ReferenceRunner(load_model(str(tmp_path)).model).prefill_logits(prompt)
    torch.testing.assert_close(fused, per_expert, atol=0, rtol=0)


def test_bf16_load_keeps_router_in_float32(checkpoint):
    _, hf, directory = checkpoint
    model = load_model(str(directory), dtype="bfloat16").model
    router = model.layers[1].ffn.mlp.gate
    assert isinstance(router, GroupLimitedSigmoidRouter)
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(router.weight, hf.model.layers[1].mlp.gate.weight, atol=0, rtol=0)
    assert model.layers[1].attn.self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    prompt = prompts(VOCAB, lengths=(9,))[0]
    logits = ReferenceRunner(model).prefill_logits(prompt)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - expected).abs().max() < 0.1 * expected.abs().max()


def test_router_group_limit_and_scaling():
    """Experts outside the topk_group best groups are never chosen, even with higher scores."""
    router = GroupLimitedSigmoidRouter(hidden_size=2, num_experts=8, top_k=2, num_groups=4, topk_groups=1,
                                       normalize=False, scaling_factor=2.0)
    with torch.no_grad():
        router.weight.zero_()
        # group 1 (experts 2, 3) wins on the sum of its two best biased scores; expert 6 alone scores highest
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.9, 0.0]))
    weights, ids = router(torch.zeros(1, 2))
    assert sorted(ids[0].tolist()) == [2, 3]
    # weights are the unbiased sigmoid scores (0.5 for zero logits) times routed_scaling_factor
    torch.testing.assert_close(weights, torch.full((1, 2), 1.0))


def test_softmax_scale_follows_yarn_mscale_all_dim():
    config = AutoConfig.for_model("deepseek_v3", **{**BASE, **CONFIGS["q_lora_yarn"]})
    mscale = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert softmax_scale(config) == pytest.approx(24**-0.5 * mscale**2)
    plain = AutoConfig.for_model("deepseek_v3", **{**BASE, **CONFIGS["q_full_default_rope"]})
    assert softmax_scale(plain) == pytest.approx(24**-0.5)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(n_group=3), "n_group"),
        (dict(topk_group=5), "topk_group"),
        (dict(num_experts_per_tok=5, topk_group=2), "num_experts_per_tok"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_config_names_the_field(change, field):
    config = AutoConfig.for_model("deepseek_v3", **{**BASE, **CONFIGS["q_full_default_rope"]})
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=field):
        build_deepseek_v3(config)


def test_unsupported_config_fails_in_the_loader(tmp_path):
    model = tiny_deepseek("q_full_default_rope")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_group"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="n_group"):
        load_model(str(tmp_path))
