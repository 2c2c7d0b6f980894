"""Our model implementations + loader + reference runner against transformers, for every architecture."""

import re

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    copy_to_memory,
    hf_greedy_batch,
    prompts,
    save_tiny_checkpoint,
    tiny_hf_model,
)

from batchgen.connectors.checkpoint import load_model
from batchgen.engine.models.context import KVSpec
from batchgen.engine.reference import ReferenceRunner

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    """(arch, local dir, transformers model) for each architecture, saved once per module."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, save_tiny_checkpoint(request.param, directory)


def test_matches_transformers_from_local_and_memory(checkpoint):
    arch, directory, hf = checkpoint
    local = load_model(directory)
    remote = load_model(copy_to_memory(directory, f"test-models-{arch}"))
    for (name, ours), (_, theirs) in zip(local.model.state_dict().items(), remote.model.state_dict().items()):
        assert torch.equal(ours, theirs), name

    runner = ReferenceRunner(remote.model)
    batch = prompts()
    for prompt in batch:
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(runner.prefill_logits(prompt), expected, atol=1e-4, rtol=0)

    ours = runner.generate(batch, NEW_TOKENS)
    assert ours == hf_greedy_batch(hf, batch, NEW_TOKENS)
    assert all(len(tokens) == NEW_TOKENS and len(set(tokens)) > 1 for tokens in ours)


def test_model_structure(checkpoint):
    arch, directory, hf = checkpoint
    model = load_model(directory).model
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [layer.is_moe for layer in model.layers] == hf_sparse
    assert any(hf_sparse) == (arch in MOE_ARCHITECTURES)
    head_dim = hf.config.head_dim if getattr(hf.config, "head_dim", None) else 64 // 4
    assert model.kv_spec() == KVSpec(2, 2, head_dim, head_dim)
    assert model.vocab_size == 256
    if hf.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_on_route_sees_every_routing_decision(arch, tmp_path):
    hf = save_tiny_checkpoint(arch, tmp_path)
    model = load_model(tmp_path).model
    routes = []
    moe_layers = [layer.ffn.mlp for layer in model.layers if layer.is_moe]
    for moe in moe_layers:
        moe.on_route = routes.append
    prompt = prompts()[1]
    ReferenceRunner(model).prefill_logits(prompt)
    assert len(routes) == len(moe_layers)
    for ids in routes:
        assert ids.shape == (len(prompt), hf.config.num_experts_per_tok)
        assert 0 <= int(ids.min()) and int(ids.max()) < moe_layers[0].num_experts


def _write_checkpoint(directory, hf, tensors: dict[str, torch.Tensor]) -> None:
    hf.config.save_pretrained(directory)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))


def _per_expert_names(arch: str, fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers-5 fused expert tensors -> the classic one-tensor-per-expert names of each family."""
    mixtral = arch == "mixtral"
    gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in fused.items():
        prefix = re.sub(r"\.mlp\.", ".block_sparse_moe.", name) if mixtral else name
        if name.endswith("experts.gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            for e, rows in enumerate(tensor):
                gate, up = rows.chunk(2, dim=0)
                out[f"{base}{e}.{gate_name}.weight"], out[f"{base}{e}.{up_name}.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = prefix.removesuffix("down_proj")
            for e, rows in enumerate(tensor):
                out[f"{base}{e}.{down_name}.weight"] = rows
        else:
            out[prefix] = tensor
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_expert_tensor_layouts_load(arch, layout, tmp_path):
    hf = tiny_hf_model(arch, seed=1)
    fused = hf.state_dict()  # transformers-5 names: mlp.experts.gate_up_proj [E, 2I, D], down_proj [E, D, I]
    assert any(name.endswith("experts.gate_up_proj") for name in fused)
    tensors = fused if layout == "fused" else _per_expert_names(arch, fused)
    assert any(".experts.0." in name for name in tensors) == (layout == "per_expert")
    _write_checkpoint(tmp_path, hf, tensors)
    runner = ReferenceRunner(load_model(tmp_path).model)
    prompt = prompts()[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(runner.prefill_logits(prompt), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_half_precision_load(arch, tmp_path):
    hf = save_tiny_checkpoint(arch, tmp_path)
    prompt = prompts()[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    for dtype in ("bfloat16", "float16"):
        loaded = load_model(tmp_path, dtype=dtype)
        assert loaded.dtype == getattr(torch, dtype)
        assert {p.dtype for p in loaded.model.parameters()} == {loaded.dtype}
        runner = ReferenceRunner(loaded.model)
        logits = runner.prefill_logits(prompt)
        assert logits.dtype == loaded.dtype
        error = (logits.float() - expected).abs().max() / expected.abs().max()
        assert error < 0.05, f"{dtype}: relative logit error {error:.3f}"
        tokens = runner.generate([prompt], 8)[0]
        assert len(tokens) == 8 and all(0 <= t < 256 for t in tokens)


def test_generation_stops_at_eos(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    runner = ReferenceRunner(load_model(tmp_path).model)
    batch = prompts()
    free = runner.generate(batch, NEW_TOKENS)
    eos = free[0][5]
    stopped = runner.generate(batch, NEW_TOKENS, eos_token_ids=(eos,))
    for full, cut in zip(free, stopped):
        end = full.index(eos) + 1 if eos in full else NEW_TOKENS
        assert cut == full[:end]
    assert stopped[0][-1] == eos and len(stopped[0]) <= 6


def test_reference_runner_rejects_bad_prompts(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    runner = ReferenceRunner(load_model(tmp_path).model)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        runner.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match=r"token 999 is outside the vocabulary \[0, 256\)"):
        runner.generate([[1, 999]], 4)
