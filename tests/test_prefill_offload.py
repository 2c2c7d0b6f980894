"""Prefill KV offload (engine/prefill_offload.py): prompts prefilled straight into host pages leave each layer's
K/V for them right after that layer's attention, one copy per run of consecutive slots; greedy tokens equal the
reference model's, chunked prompts included, on the CPU and (marked `gpu`) on a GPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.engine.kv_pool import KVPool, PoolGeometry
from batchgen.engine.models.context import KVSpec
from batchgen.engine.prefill_offload import PrefillOffload, slot_runs
from batchgen.engine.reference import ReferenceRunner

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_slot_runs_cover_every_token_once_in_order():
    assert slot_runs([]) == []
    assert slot_runs([4, 5, 6, 7, 32, 33, 9, 3]) == [(0, 4, 4), (4, 32, 2), (6, 9, 1), (7, 3, 1)]
    slots = [40, 41, 42, 43, 12, 13, 14, 15, 16, 17]
    runs = slot_runs(slots)
    assert runs == [(0, 40, 4), (4, 12, 6)]
    assert [s + i for _, s, n in runs for i in range(n)] == slots


def test_an_offloaded_layer_lands_in_exactly_its_slots():
    geometry = PoolGeometry(KVSpec(num_layers=2, num_kv_heads=2, k_dim=3, v_dim=5), page_size=4,
                            dtype=torch.float32)
    host = KVPool(geometry, num_pages=6, device=torch.device("cpu"))
    offload = PrefillOffload(host, torch.device("cpu"))
    slots = [9, 10, 11, 12, 13, 2, 3]  # pages 2-3 run on; then page 0
    k, v = torch.randn(len(slots), 2, 3), torch.randn(len(slots), 2, 5)
    offload.write(1, k, v, slot_runs(slots))
    offload.flush()
    flat_k, flat_v = host.k[1].flatten(0, 1), host.v[1].flatten(0, 1)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = [s for s in range(24) if s not in slots]
    assert not flat_k[untouched].any() and not host.k[0].any()  # nothing else written, other layers neither
    assert offload.summary() == {"layer_writes": 1, "copies": 4, "bytes": k.nbytes + v.nbytes,
                                 "max_layers_in_flight": 0}


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_prompts_prefilled_into_host_pages_give_the_reference_tokens(arch, device, tmp_path):
    """A device KV pool of a few pages: most prompts go straight to the host store (some in chunks) and decode
    from there; every layer's prefill KV reached the host pages through the offload, by runs of slots (on a GPU
    copied on a side stream, several layers' copies in flight at once)."""
    save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path), device=device)
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(13, 30, 7, 22, 9, 17, 26, 11))
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    geometry = PoolGeometry(loaded.model.kv_spec(), 4, loaded.dtype)
    engine = Engine(loaded, page_size=4, max_model_len=48, b_attn=3, max_prefill_tokens=20,
                    kv_budget_bytes=geometry.page_bytes * 12, host_kv_budget_bytes=geometry.page_bytes * 200,
                    staging_fraction=0.0, stream_host_kv=False, max_num_seqs=8)
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)])
    assert [r.outputs[0].token_ids for r in results] == expected
    metrics = engine.metrics()
    offload = metrics["prefill_offload"]
    layers = loaded.model.kv_spec().num_layers
    assert offload["layer_writes"] > 0 and offload["layer_writes"] % layers == 0
    assert metrics["chunked_prefills"] > 0  # the 30- and 26-token prompts span steps (max_prefill_tokens 20)
    token_bytes = geometry.page_bytes // geometry.page_size // layers  # one token's K and V in one layer
    tokens_offloaded = offload["bytes"] // token_bytes // layers
    assert offload["bytes"] == tokens_offloaded * token_bytes * layers
    assert offload["copies"] < 2 * tokens_offloaded * layers // 2  # consecutive slots went as one copy
    assert (offload["max_layers_in_flight"] > 0) is (device == "cuda")
