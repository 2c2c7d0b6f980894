"""bench/bct.py's output comparison: which divergences count as ties, and the reference model's routing flips
that decide a routing tie."""

import pytest
import torch
from bench_helpers import import_bench
from transformers import AutoModelForCausalLM

ROUTING_GAP = 1e-5


def test_a_divergence_is_a_tie_only_when_both_systems_picked_near_the_top(monkeypatch):
    bct = import_bench(monkeypatch, "bct")
    logits = torch.tensor([5.0, 5.0 - 1e-6, 1.0, -3.0])

    def probe(prompt, prefix, flip=None):
        return bct.Judgement(logits, [])

    reference = [[0, 0], [0, 0], [3, 0]]
    other = [[0, 1], [0, 3], [0, 0]]  # a near-tie; the other system far below the top; the reference far below
    report = bct.compare(reference, other, probe, tie_gap=1e-4)
    assert [d["tie"] for d in report.divergences] == [True, False, False]
    assert report.divergences[2]["reference_gap"] == 8.0 and report.divergences[2]["other_gap"] == 0.0
    assert not report.all_match  # before: the third (the reference system's token 8 below the top) was a tie


def test_a_routing_near_tie_excuses_a_divergence_only_when_flipping_it_gives_the_other_systems_token(monkeypatch):
    """A routing margin under the gap anywhere in the prefix excused any divergence, whatever the other system's
    token (a long prefix has thousands of picks: some near-tie is likely, a real fault would pass as a tie)."""
    bct = import_bench(monkeypatch, "bct")
    near, nearer, far = (bct.NearTie(1, 4, 3e-6), bct.NearTie(0, 2, 1e-6), bct.NearTie(2, 0, 1e-3))
    # prompt 0: the pick at `near` decides; prompt 1: no flip gives the other's token; prompt 2: only a far margin
    flips_to = {(0, near): torch.tensor([1.0, 4.0, 0.0]), (0, nearer): torch.tensor([4.0, 1.0, 0.0]),
                (1, near): torch.tensor([4.0, 1.0, 0.0]), (1, nearer): torch.tensor([4.0, 1.0, 0.5])}
    tried = []

    def probe(prompt, prefix, flip=None):
        if flip is not None:
            tried.append((prompt, flip))
            return bct.Judgement(flips_to[prompt, flip], [])
        ties = [far] if prompt == 2 else [nearer, near, far]
        return bct.Judgement(torch.tensor([4.0, 1.0, 0.0]), ties)

    report = bct.compare([[0, 0]] * 3, [[0, 1]] * 3, probe, tie_gap=1e-4, routing_tie_gap=ROUTING_GAP)
    assert [d["tie_kind"] for d in report.divergences] == ["routing", None, None]
    assert report.divergences[0]["flipped"] == {"layer": 1, "position": 4, "margin": 3e-6, "other_gap": 0.0}
    assert report.divergences[1]["router_margin"] == 1e-6 and "flipped" not in report.divergences[1]
    assert tried == [(0, nearer), (0, near), (1, nearer), (1, near)]  # never a margin at or over the gap
    assert report.ties == 1 and not report.all_match


def test_a_routing_near_tie_explains_the_reference_systems_own_token_when_the_forward_gives_the_others(monkeypatch):
    """The reference forward ranks the other system's token at the top and the reference system's own below: the
    reference system's run routed apart at a near-tie. A flip giving its token is a routing tie; none, a divergence."""
    bct = import_bench(monkeypatch, "bct")
    near = bct.NearTie(3, 7, 2e-6)
    flips_to = {0: torch.tensor([1.0, 4.0 + 1e-5, 4.0]), 1: torch.tensor([1.0, 4.0, 0.0])}

    def probe(prompt, prefix, flip=None):
        if flip is not None:
            return bct.Judgement(flips_to[prompt], [])
        return bct.Judgement(torch.tensor([1.0, 4.0, 0.0]), [near])

    report = bct.compare([[1, 2]] * 2, [[1, 1]] * 2, probe, tie_gap=1e-4, routing_tie_gap=ROUTING_GAP)
    first, second = report.divergences
    assert first["other_gap"] == 0.0 and first["reference_gap"] == 4.0
    assert first["tie_kind"] == "routing" and first["flipped"]["reference_gap"] == pytest.approx(1e-5, abs=1e-6)
    assert second["tie_kind"] is None and report.ties == 1 and not report.all_match


def test_no_flip_excuses_a_divergence_where_the_forward_puts_neither_token_at_its_top(monkeypatch):
    bct = import_bench(monkeypatch, "bct")
    near = bct.NearTie(3, 7, 2e-6)
    tried = []

    def probe(prompt, prefix, flip=None):
        if flip is not None:
            tried.append(flip)
            return bct.Judgement(torch.tensor([1.0, 4.0, 0.0]), [])  # would put the other's token on top
        return bct.Judgement(torch.tensor([5.0, 4.0, 0.0]), [near])  # token 0 on top: neither system's

    report = bct.compare([[1, 2]], [[1, 1]], probe, tie_gap=1e-4, routing_tie_gap=ROUTING_GAP)
    assert report.divergences[0]["tie_kind"] is None and tried == []


def test_the_probe_flips_one_routing_pick_of_the_reference_model(monkeypatch, tiny_moe_dir):
    bct = import_bench(monkeypatch, "bct")
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    prompt = list(range(3, 40))
    probe = bct.reference_probe(model, [prompt])
    judged = probe(0, [5, 6])
    tie = judged.near_ties[0]
    assert tie.margin == min(t.margin for t in judged.near_ties) and len(judged.near_ties) == bct.NEAR_TIES
    layers = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    picked: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda module, args: picked.append(args[1].clone())) for m in layers]
    try:
        plain = probe(0, [5, 6]).logits
        flipped = probe(0, [5, 6], tie).logits
    finally:
        for hook in hooks:
            hook.remove()
    routed, rerouted = picked[:len(layers)], picked[len(layers):]
    gate = dict(model.named_modules())[f"model.layers.{tie.layer}.mlp.gate"]
    hidden_logits = None

    def keep(module, args, out):
        nonlocal hidden_logits
        hidden_logits = out[0].float()

    hook = gate.register_forward_hook(keep)
    try:
        probe(0, [5, 6])
    finally:
        hook.remove()
    top_k = model.config.num_experts_per_tok
    ranked = hidden_logits[tie.position].argsort(descending=True)
    expected = routed[tie.layer].clone()
    expected[tie.position][expected[tie.position] == ranked[top_k - 1]] = ranked[top_k]
    # that one pick flipped to the next expert; every layer before it routes as before
    assert torch.equal(rerouted[tie.layer], expected) and not torch.equal(expected, routed[tie.layer])
    assert all(torch.equal(rerouted[i], routed[i]) for i in range(tie.layer))
    assert not torch.equal(plain, flipped)
    assert float(hidden_logits[tie.position].sort(descending=True).values[top_k - 1]
                 - hidden_logits[tie.position].sort(descending=True).values[top_k]) == pytest.approx(tie.margin)
