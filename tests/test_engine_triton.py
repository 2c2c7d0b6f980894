"""The engine end to end on its Triton kernels: every op that has a Triton implementation forced to it
(through the registry), greedy tokens equal to the torch path's, and the registry's counters proving the
Triton kernels really ran. On a CUDA host the model runs on the GPU; elsewhere the kernels run on CPU
tensors under TRITON_INTERPRET=1 (set by conftest.py on hosts without CUDA)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.kernels import registry

TRITON_OPS = sorted({b.op for b in registry.BACKENDS if b.name == "triton"})
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.mark.parametrize("arch", ["deepseek_v3"])  # MoE, and MLA's latent KV (K and V of different widths)
def test_forced_triton_kernels_give_the_torch_paths_greedy_tokens(arch, tmp_path):
    pytest.importorskip("triton")
    assert set(TRITON_OPS) == {"fused_moe", "paged_decode_attention", "write_kv"}
    save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path), device=DEVICE)
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 9, 6))
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)]
    options = {"page_size": 4, "b_attn": 2, "b_moe": 5}  # several micro-batches, pages crossed mid-decode
    with contextlib.ExitStack() as forced:
        for op in TRITON_OPS:
            forced.enter_context(registry.use_backend(op, "torch"))
        torch_tokens = [r.outputs[0].token_ids for r in Engine(loaded, **options).generate(requests)]
    registry.reset_usage()
    with contextlib.ExitStack() as forced:
        for op in TRITON_OPS:
            forced.enter_context(registry.use_backend(op, "triton"))
        triton_tokens = [r.outputs[0].token_ids for r in Engine(loaded, **options).generate(requests)]
    counts = registry.usage_counts()
    assert triton_tokens == torch_tokens
    for op in TRITON_OPS:
        assert counts.get((op, "triton"), 0) > 0 and counts.get((op, "torch"), 0) == 0, (op, counts)
