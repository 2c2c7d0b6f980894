"""EngineConfig.batch_invariant: a sequence's logits are the same bits whatever else its steps compute (other
sequences, chunked prefill, lockstep or coroutine schedules, a KV budget that moves it to the host tier), as vLLM's
and SGLang's batch-invariant modes promise; without it the kernels' row-count paths round apart."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineConfig, Request, SamplingParams
from batchgen.kernels import linear_cpu, moe_cpu, registry

SAMPLING = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def _c_kernels():
    if linear_cpu.unavailable() or moe_cpu.unavailable():
        pytest.skip(linear_cpu.unavailable() or moe_cpu.unavailable())


def logprobs_of_first(loaded, batch, invariant: bool, **options) -> tuple[list, dict]:
    """The first request's tokens and every logprob it was given, run beside the others of `batch`, and the
    engine's metrics."""
    engine = Engine(loaded, batch_invariant=invariant, page_size=8, **options)
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=SAMPLING) for i, p in enumerate(batch)])
    output = results[0].outputs[0]
    return [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in output.logprobs], engine.metrics()


# MLP widths of any size: the tiny Qwen2-MoE's shared expert has 48, and a Llama of 40 (silu through the C kernel,
# kernels/activation_cpu.py, whose rounding does not depend on an element's position)
@pytest.mark.parametrize("arch, options", [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("llama", {}),
                                           ("llama", {"intermediate_size": 40}), ("qwen2", {}), ("qwen3", {}),
                                           ("deepseek_v3", {})])
def test_a_sequences_logits_are_the_same_bits_in_any_batch(arch, options, tmp_path):
    save_tiny_checkpoint(arch, tmp_path, **options)
    loaded = load_model(str(tmp_path))
    spec = loaded.model.kv_spec()
    token_bytes = spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * 4
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=tuple(50 + 7 * i for i in range(40)))
    runs = {  # the first prompt alone, then beside 39 others: one prefill of ~3,000 rows, chunks, schedules, tiers
        "beside others": dict(),
        "chunked prefill": dict(max_prefill_tokens=16),
        "lockstep": dict(mode="lockstep"),
        "host tier": dict(kv_budget_bytes=token_bytes * 256, host_kv_budget_bytes=token_bytes * 8192),
        "four at a time": dict(max_num_seqs=4),
    }
    alone, _ = logprobs_of_first(loaded, batch[:1], invariant=True)
    for name, options in runs.items():
        logprobs, metrics = logprobs_of_first(loaded, batch, invariant=True, **options)
        assert logprobs == alone, name
        if name == "host tier":  # sequences really went to host pages and came back
            assert metrics["peak_suspended"] > 0 and metrics["restores"] > 0 and metrics["bytes_moved"] > 0, metrics
        if name == "chunked prefill":
            assert metrics["chunked_prefills"] > 0, metrics
    # without it the kernels' paths by row count (oneDNN's GEMMs, the blocked MoE path) give other bits
    default, _ = logprobs_of_first(loaded, batch[:1], invariant=False)
    assert any(logprobs_of_first(loaded, batch, invariant=False, **options)[0] != default
               for options in (runs["beside others"], runs["lockstep"]))


def test_batch_invariance_is_refused_where_its_kernels_do_not_run(tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    with registry.use_backend("linear", "torch"), pytest.raises(
            ValueError, match="engine option batch_invariant: batch-invariant kernels are the cpu_c backend's for "
                              "linear .*; torch runs it here"):
        Engine(loaded, batch_invariant=True)
    with registry.use_backend("router_topk", "torch"), pytest.raises(
            ValueError, match="batch-invariant kernels are the cpu_c backend's for router_topk .*; torch runs it"):
        Engine(loaded, batch_invariant=True)  # its F.linear is BLAS's, whose sums depend on the rows beside
    for dtype in (torch.float32, torch.bfloat16):  # a GPU engine: no backend there keeps a row's sums in one order
        assert registry.invariance_refusal("cuda", dtype).startswith(
            "batch-invariant kernels are the cpu_c backend's for linear (float32 CPU tensors)")
    with pytest.raises(ValueError, match="batch_invariant runs one engine's kernels in one process"):
        EngineConfig(batch_invariant=True, ep_size=2)
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        EngineConfig(batch_invariant="yes")


def test_seeded_samples_are_the_same_in_any_batch(tmp_path):
    """RL rollouts: a seeded request's sampled tokens (top-p, n = 2) and their logprobs reproduce alone, beside 39
    others and in lockstep mode."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=tuple(50 + 7 * i for i in range(40)))
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True, logprobs=1, n=2)

    def samples(others: list, **options) -> list:
        engine = Engine(loaded, batch_invariant=True, page_size=8, **options)
        results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=sampling)
                                   for i, p in enumerate([batch[0], *others])])
        return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in results[0].outputs]

    alone = samples([])
    assert len(alone) == 2 and alone[0][0] != alone[1][0]  # two different samples
    assert samples(batch[1:]) == alone and samples(batch[1:], mode="lockstep") == alone


def test_mla_per_head_products_read_row_contiguous_weights_without_copying_them_each_call(tmp_path, monkeypatch):
    """DeepSeek-V3's absorbed products go through the C linear kernel head by head in this mode; w_uk's heads are
    strided ([H, n, r] read transposed), so each call copied each head (and each decode recording kept such
    copies): the transposed rows are now made once per weight."""
    from batchgen.engine.models import deepseek_v3
    from batchgen.kernels import ops

    save_tiny_checkpoint("deepseek_v3", tmp_path)
    loaded = load_model(str(tmp_path))
    seen, linear = [], ops.linear

    def observed(x, weight, bias=None):
        seen.append(weight.stride(-1) == 1)
        return linear(x, weight, bias)

    monkeypatch.setattr(ops, "linear", observed)
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(5, 9, 14))
    Engine(loaded, batch_invariant=True, page_size=8).generate(
        [Request(f"r{i}", prompt_token_ids=p, sampling=SAMPLING) for i, p in enumerate(batch)])
    assert seen and all(seen)
    attention = [m for m in loaded.model.modules() if isinstance(m, deepseek_v3.MLAAttention)]
    made = {id(m._uk_rows_cache) for m in attention}
    Engine(loaded, batch_invariant=True, page_size=8).generate([Request("again", prompt_token_ids=batch[0],
                                                                        sampling=SAMPLING)])
    assert {id(m._uk_rows_cache) for m in attention} == made and len(made) == len(attention)
