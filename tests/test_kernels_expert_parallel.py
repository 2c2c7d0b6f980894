import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchgen.kernels.expert_parallel import AllToAllDispatcher, LocalDispatcher, make_dispatcher
from batchgen.kernels.moe_torch import fused_moe_torch
from batchgen.kernels.registry import BackendUnavailableError

NUM_EXPERTS, DIM, INTER, TOP_K = 6, 8, 12, 2
TOKENS_PER_RANK = (7, 3)


def routed_inputs(rank):
    """Same weights on every rank; rank-specific tokens. Rank 1 routes only to experts 0..2 (rank 0's)."""
    g = torch.Generator().manual_seed(0)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * INTER, DIM, generator=g)
    w_down = torch.randn(NUM_EXPERTS, DIM, INTER, generator=g)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = TOKENS_PER_RANK[rank]
    x = torch.randn(tokens, DIM, generator=g)
    experts = NUM_EXPERTS if rank == 0 else NUM_EXPERTS // 2
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, TOP_K, generator=g)
    return x, w_gate_up, w_down, topk_weights, topk_ids


def moe_through(dispatcher, x, w_gate_up, w_down, topk_weights, topk_ids):
    first = dispatcher.rank * dispatcher.num_local_experts
    local = slice(first, first + dispatcher.num_local_experts)
    sent = dispatcher.dispatch(x, topk_ids, topk_weights)
    y = fused_moe_torch(sent.x, w_gate_up[local], w_down[local], sent.topk_weights, sent.topk_ids)
    return dispatcher.combine(y, sent), sent


def all_to_all_worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        dispatcher = make_dispatcher(NUM_EXPERTS, backend="auto")
        assert isinstance(dispatcher, AllToAllDispatcher)
        args = routed_inputs(rank)
        out, sent = moe_through(dispatcher, *args)
        expected, _ = moe_through(LocalDispatcher(NUM_EXPERTS), *args)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert sent.topk_ids.max() < dispatcher.num_local_experts
        if rank == 1:  # rank 1 owns experts 3..5, which only rank 0's tokens may pick
            assert sent.x.shape[0] <= TOKENS_PER_RANK[0]
    finally:
        dist.destroy_process_group()


def test_all_to_all_over_gloo_matches_local(tmp_path):
    mp.spawn(all_to_all_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_local_dispatcher_is_identity():
    args = routed_inputs(0)
    out, sent = moe_through(LocalDispatcher(NUM_EXPERTS), *args)
    assert sent.x is args[0]
    torch.testing.assert_close(out, fused_moe_torch(*args))


def test_auto_without_process_group_is_local():
    assert isinstance(make_dispatcher(NUM_EXPERTS), LocalDispatcher)


def test_forced_all_to_all_without_process_group_says_so():
    with pytest.raises(BackendUnavailableError, match="torch.distributed is not initialized"):
        make_dispatcher(NUM_EXPERTS, backend="all_to_all")


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed")
def test_forced_deep_ep_names_missing_module(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(BackendUnavailableError, match="deep_ep is not installed"):
            make_dispatcher(NUM_EXPERTS, backend="deep_ep", device="cuda")
    finally:
        dist.destroy_process_group()


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown expert parallel backend 'nccl'"):
        make_dispatcher(NUM_EXPERTS, backend="nccl")


@pytest.mark.parametrize("dtype, backend", [(torch.bfloat16, "auto"), (torch.float32, "all_to_all"),
                                            (torch.float16, "all_to_all")])
def test_a_models_moe_layers_leave_deep_ep_to_bfloat16_models(monkeypatch, dtype, backend):
    """DeepEP's kernels take bfloat16 activations only: a model in another dtype dispatches through torch's
    all_to_all even where "auto" would pick DeepEP (CUDA, several ranks, deep_ep importable); every MoE layer of one
    expert count shares one dispatcher (DeepEP's buffers are large)."""
    from types import SimpleNamespace

    from batchgen.engine.models.layers import FusedExperts
    from batchgen.engine.parallel import group_model

    asked = []

    def make(num_experts, backend, group, device, exchange=None):
        asked.append((num_experts, backend))
        return LocalDispatcher(num_experts)

    monkeypatch.setattr(group_model, "make_dispatcher", make)
    model = torch.nn.ModuleList([FusedExperts(NUM_EXPERTS, 8, 16) for _ in range(3)])
    group_model.attach_dispatchers(model, SimpleNamespace(size=1, rank=0, data=None), torch.device("cpu"), dtype)
    assert asked == [(NUM_EXPERTS, backend)]
    assert len({id(layer.dispatcher) for layer in model}) == 1
