"""The engine's expert histogram: routing decisions wait in a list and are counted in batches, yet every call lands."""

import torch

from batchgen.engine.metrics import ROUTES_PER_FOLD, EngineMetrics


def test_the_expert_histogram_counts_every_routed_call_across_folds():
    metrics, g = EngineMetrics(), torch.Generator().manual_seed(0)
    calls = [torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=g)), 2), generator=g)
             for _ in range(2 * ROUTES_PER_FOLD + 5)]
    for ids in calls[:ROUTES_PER_FOLD - 1]:
        metrics.record_route(ids, 6)
    assert metrics.expert_histogram is None and len(metrics.pending_routes) == ROUTES_PER_FOLD - 1
    metrics.record_route(calls[ROUTES_PER_FOLD - 1], 6)  # the batch is full: one bincount counts it
    assert metrics.pending_routes == [] and int(metrics.expert_histogram.sum()) == sum(c.numel() for c in
                                                                                      calls[:ROUTES_PER_FOLD])
    for ids in calls[ROUTES_PER_FOLD:]:
        metrics.record_route(ids, 8)  # another layer's 8 experts: the histogram grows
    expected = torch.bincount(torch.cat([c.reshape(-1) for c in calls]), minlength=8).tolist()
    assert metrics.expert_counts() == expected and metrics.pending_routes == []
    assert metrics.moe_calls == len(calls)
