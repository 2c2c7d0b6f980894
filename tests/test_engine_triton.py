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
from batchgen.engine import Engine, Request, SamplingParams, decode_graphs
from batchgen.kernels import capture, registry

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


@pytest.mark.triton_cpu
@pytest.mark.parametrize("arch, sequences", [("mixtral", 17), ("deepseek_v3", 3)])
def test_the_decode_forward_on_triton_kernels_reads_nothing_back_so_a_cuda_graph_can_capture_it(
        arch, sequences, tmp_path, monkeypatch):
    """What a CUDA graph captures, on CPU tensors under the interpreter: a decode step's forward (17 sequences padded
    to 24 rows, and 3 of MLA's) on the Triton kernels, run as kernels/cuda_graph.py captures it (inside
    capture.collect_effects, which refuses any op that reads a value back to the host). The recorder stands in for
    the CUDA one on CPU tensors, so each probed step then runs eagerly; the tokens are the torch path's."""
    pytest.importorskip("triton")
    save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=tuple(2 + i % 4 for i in range(sequences)))
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)]
    options = {"page_size": 4, "max_num_seqs": 32, "b_attn": 32, "b_moe": 64}  # one micro-batch decoding
    probed = []

    def capture_on_triton(fn, rows, real_rows, device):
        with capture.collect_effects(rows):
            fn()
        probed.append(rows)
        raise capture.CaptureRefused("probed")

    torch_tokens = [r.outputs[0].token_ids for r in Engine(loaded, **options, decode_graphs=False).generate(requests)]
    monkeypatch.setitem(decode_graphs.RECORDERS, "cpu", capture_on_triton)
    with contextlib.ExitStack() as forced:
        for op in TRITON_OPS:
            forced.enter_context(registry.use_backend(op, "triton"))
        engine = Engine(loaded, **options)
        triton_tokens = [r.outputs[0].token_ids for r in engine.generate(requests)]
    assert triton_tokens == torch_tokens
    assert probed == [decode_graphs.padded_rows(sequences, 64)] and engine.metrics()["decode_graph_refusals"] == 1
