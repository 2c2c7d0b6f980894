import importlib.util
import sys
import types

import pytest
import torch

from batchgen.kernels import ops, registry
from batchgen.kernels.attention_torch import prefill_attention_torch


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    for op in registry.OPS:
        registry.set_backend(op, None)
    registry.reset_usage()
    yield
    for op in registry.OPS:
        registry.set_backend(op, None)


def test_parse_overrides():
    assert registry.parse_overrides("fused_moe=torch, paged_decode_attention=triton") == {
        "fused_moe": "torch",
        "paged_decode_attention": "triton",
    }
    assert registry.parse_overrides("triton") == {
        "fused_moe": "triton",
        "paged_decode_attention": "triton",
        "write_kv": "triton",
    }
    with pytest.raises(ValueError, match="BATCHGEN_KERNELS: unknown backend 'cutlass' for fused_moe"):
        registry.parse_overrides("fused_moe=cutlass")
    with pytest.raises(ValueError, match="unknown kernel op 'matmul'"):
        registry.parse_overrides("matmul=torch")


def test_auto_picks_cpu_backends_even_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from batchgen.kernels import (
        argmax_cpu,
        attention_cpu,
        linear_cpu,
        moe_cpu,
        moe_packed_cpu,
        norm_cpu,
        prefill_cpu,
        rotary_cpu,
        router_cpu,
        write_kv_cpu,
    )

    # the C kernels where a compiler built them: every op has one
    modules = {"paged_decode_attention": attention_cpu, "fused_moe": moe_cpu, "linear": linear_cpu,
               "rms_norm": norm_cpu, "rotary": rotary_cpu, "write_kv": write_kv_cpu, "prefill_attention": prefill_cpu,
               "argmax": argmax_cpu, "router_topk": router_cpu}
    expected = {op: "torch" if module.unavailable() else "cpu_c" for op, module in modules.items()}
    assert set(modules) | {"fused_moe_packed"} == set(registry.OPS)
    for op in modules:
        assert registry.resolve(op, "cpu", torch.float32)[0] == expected[op]
    for op in expected:  # C kernels: fp32 only
        assert registry.resolve(op, "cpu", torch.float16)[0] == "torch"
    # packed experts: the C kernel's layout, nothing else computes it
    if not moe_packed_cpu.unavailable():
        assert registry.resolve("fused_moe_packed", "cpu", torch.float32)[0] == "cpu_c"
    with pytest.raises(registry.BackendUnavailableError, match="fused_moe_packed: no backend runs on cpu with"):
        registry.resolve("fused_moe_packed", "cpu", torch.float16)


def test_a_backend_whose_probe_fails_is_skipped_and_named_when_forced(monkeypatch):
    import batchgen.kernels.attention_cpu as attention_cpu

    monkeypatch.setattr(attention_cpu, "unavailable", lambda: "no C compiler (cc/gcc) on PATH")
    assert registry.resolve("paged_decode_attention", "cpu", torch.float32)[0] == "torch"
    registry.set_backend("paged_decode_attention", "cpu_c")
    with pytest.raises(registry.BackendUnavailableError, match="cpu_c.*no C compiler"):
        registry.resolve("paged_decode_attention", "cpu", torch.float32)


@pytest.mark.triton_cpu
def test_env_override_forces_triton_and_counts_use(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(registry.ENV_VAR, "write_kv=triton")
    k_cache = torch.zeros(2, 4, 1, 8)
    ops.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, k_cache.clone(), torch.tensor([5]))
    assert registry.last_used("write_kv") == "triton"
    assert k_cache[1, 1].eq(1).all()
    monkeypatch.setenv(registry.ENV_VAR, "")
    ops.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, k_cache.clone(), torch.tensor([0]))
    from batchgen.kernels import write_kv_cpu

    automatic = "torch" if write_kv_cpu.unavailable() else "cpu_c"  # the override gone: the automatic choice
    assert registry.last_used("write_kv") == automatic
    assert registry.usage_counts() == {("write_kv", "triton"): 1, ("write_kv", automatic): 1}


def test_set_backend_beats_env(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "paged_decode_attention=triton")
    registry.set_backend("paged_decode_attention", "torch")
    assert registry.resolve("paged_decode_attention", "cpu", torch.float32)[0] == "torch"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_forcing_missing_flash_attn_names_it():
    registry.set_backend("prefill_attention", "flash_attn")
    q = torch.randn(2, 2, 8)
    with pytest.raises(registry.BackendUnavailableError, match="flash-attn is not installed"):
        ops.prefill_attention(q, q, q, torch.tensor([0, 2]), torch.tensor([0, 2]), 1.0)


def test_forcing_triton_on_cpu_without_interpreter_names_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    registry.set_backend("fused_moe", "triton")
    with pytest.raises(
        registry.BackendUnavailableError, match="needs a cuda tensor .or TRITON_INTERPRET=1., got cpu"
    ):
        registry.resolve("fused_moe", "cpu", torch.float32)


def test_unknown_names():
    with pytest.raises(
        ValueError, match="set_backend: unknown backend 'flash_attn' for fused_moe; known: triton, cpu_c, torch"
    ):
        registry.set_backend("fused_moe", "flash_attn")
    with pytest.raises(ValueError, match="unknown kernel op"):
        registry.last_used("softmax")


def test_use_backend_restores_previous():
    registry.set_backend("fused_moe", "torch")
    with registry.use_backend("fused_moe", "triton"):
        assert registry._state.forced["fused_moe"] == "triton"
    assert registry._state.forced["fused_moe"] == "torch"


def test_every_c_kernel_builds_where_a_compiler_is_present():
    """At run time a kernel that fails to build leaves its op to torch, and its tests skip as on a machine without a
    compiler: with a compiler present, that would hide a broken kernel."""
    from batchgen.kernels import attention_cpu, c_library, linear_cpu, moe_cpu

    if c_library.compiler() is None:
        pytest.skip("no C compiler")
    assert [module.unavailable() for module in (attention_cpu, linear_cpu, moe_cpu)] == [None, None, None]


def test_the_flash_backend_leaves_heads_wider_than_flash_attn_takes_to_sdpa(monkeypatch):
    """flash-attn's kernels stop at 256-wide heads; DeepSeek's absorbed MLA prefill attends with 576 / 512."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        calls.append(q.shape[-1])
        return prefill_attention_torch(q, k, v, cu_q, cu_k, softmax_scale)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=varlen))
    monkeypatch.setitem(sys.modules, "batchgen.kernels.attention_flash", None)  # undone: the module built on the fake
    del sys.modules["batchgen.kernels.attention_flash"]
    from batchgen.kernels.attention_flash import prefill_attention_flash

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for dim_k, dim_v, heads, kv_heads in ((576, 512, 4, 1), (64, 64, 4, 2)):
        q, k = torch.randn(12, heads, dim_k, generator=g), torch.randn(12, kv_heads, dim_k, generator=g)
        v = torch.randn(12, kv_heads, dim_v, generator=g)
        out = prefill_attention_flash(q, k, v, cu, cu, dim_k**-0.5)
        torch.testing.assert_close(out, prefill_attention_torch(q, k, v, cu, cu, dim_k**-0.5))
    assert calls == [64]
    delattr(sys.modules["batchgen.kernels"], "attention_flash")  # the package kept the fake-built module too
