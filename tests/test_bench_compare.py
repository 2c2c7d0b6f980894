"""bench/bct.py's output comparison: which divergences count as ties."""

import torch
from bench_helpers import import_bench


def test_a_divergence_is_a_tie_only_when_both_systems_picked_near_the_top(monkeypatch):
    bct = import_bench(monkeypatch, "bct")
    logits = torch.tensor([5.0, 5.0 - 1e-6, 1.0, -3.0])

    def probe(prompt, prefix):
        return logits, None

    reference = [[0, 0], [0, 0], [3, 0]]
    other = [[0, 1], [0, 3], [0, 0]]  # a near-tie; the other system far below the top; the reference far below
    report = bct.compare(reference, other, probe, tie_gap=1e-4)
    assert [d["tie"] for d in report.divergences] == [True, False, False]
    assert report.divergences[2]["reference_gap"] == 8.0 and report.divergences[2]["other_gap"] == 0.0
    assert not report.all_match  # before: the third (the reference system's token 8 below the top) was a tie
