"""The coroutine engine against the reference runner: greedy tokens must not depend on batch
composition, memory budget, evictions or arrival order."""

from __future__ import annotations

import random

import pytest
from tiny_models import ARCHITECTURES, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.engine.reference import ReferenceRunner

MAX_TOKENS = 20
LENGTHS = (3, 9, 17, 5, 30, 12, 7, 41)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(request.param, directory)
    loaded = load_model(str(directory))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=LENGTHS)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    return loaded, batch, expected


def kv_bytes_per_token(loaded) -> int:
    spec = loaded.model.kv_spec()
    return spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * 4


def greedy_requests(batch, order=None):
    order = order if order is not None else range(len(batch))
    return [Request(f"r{i}", prompt_token_ids=batch[i], sampling=GREEDY) for i in order]


def tokens_by_id(results):
    assert all(r.error is None for r in results), [r.error for r in results]
    return {r.request_id: r.outputs[0].token_ids for r in results}


@pytest.mark.parametrize("mode,b_attn,b_moe", [("coroutine", 256, 8192), ("coroutine", 3, 16),
                                                ("coroutine", 1, 5), ("lockstep", 256, 8192)])
def test_greedy_matches_reference_for_batch_shapes(arch_case, mode, b_attn, b_moe):
    loaded, batch, expected = arch_case
    engine = Engine(loaded, mode=mode, b_attn=b_attn, b_moe=b_moe, page_size=4)
    got = tokens_by_id(engine.generate(greedy_requests(batch)))
    assert [got[f"r{i}"] for i in range(len(batch))] == expected
    assert len(set(expected[0])) > 1  # the tiny model does not just repeat one token


@pytest.mark.parametrize("mode", ["coroutine", "lockstep"])
def test_greedy_matches_reference_under_evictions_in_shuffled_order(arch_case, mode):
    loaded, batch, expected = arch_case
    order = list(range(len(batch)))
    random.Random(7).shuffle(order)
    budget = kv_bytes_per_token(loaded) * 4 * 32  # 32 pages of 4 tokens: far less than 8 sequences need
    engine = Engine(loaded, mode=mode, page_size=4, kv_budget_bytes=budget, b_attn=3, b_moe=16)
    got = tokens_by_id(engine.generate(greedy_requests(batch, order)))
    assert [got[f"r{i}"] for i in range(len(batch))] == expected
    metrics = engine.metrics()
    assert metrics["yields"] > 0
    if mode == "lockstep":
        assert metrics["restores"] > 0
    assert metrics["bytes_moved"] > 0


def test_n_samples_share_prefill_and_match_greedy(arch_case):
    loaded, batch, expected = arch_case
    engine = Engine(loaded, page_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=params) for i, p in enumerate(batch)])
    for result, want in zip(results, expected):
        assert [o.index for o in result.outputs] == [0, 1, 2]
        assert all(o.token_ids == want for o in result.outputs)
    assert engine.metrics()["prefill_steps"] == 1  # samples were forked, not prefilled again


def test_disaggregated_prefill_then_decode_matches_reference(arch_case):
    loaded, batch, expected = arch_case
    prefill = Engine(loaded, page_size=4)
    decode = Engine(loaded, page_size=8, kv_budget_bytes=kv_bytes_per_token(loaded) * 8 * 16, b_attn=2)
    outputs = prefill.prefill(greedy_requests(batch))
    assert all(o.k.shape[1] == len(p) for o, p in zip(outputs, batch))
    for prefilled in outputs:
        decode.add_prefilled(prefilled)
    got = {}
    while decode.has_unfinished():
        got.update(tokens_by_id(decode.step()))
    assert [got[f"r{i}"] for i in range(len(batch))] == expected
