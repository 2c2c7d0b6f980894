"""The packed projection kernel (kernels/linear_packed_cpu.py) against F.linear on the checkpoint layout, and the
engine's packing of a model's projections (engine/models/weight_packing.py)."""

import pytest
import torch
import torch.nn.functional as F
from test_kernels_moe_packed import _greedy_requests

from batchgen.kernels import c_library, linear_packed_cpu, ops, registry


@pytest.fixture(autouse=True)
def packed_kernel():
    if linear_packed_cpu.unavailable():
        pytest.skip(linear_packed_cpu.unavailable())


def make_linear(out_features: int, dim: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, dim, generator=g) / dim**0.5
    return weight, torch.randn(out_features, generator=g) if bias else None


def test_the_packed_layout_puts_thirty_two_output_columns_at_each_input_index():
    weight, _ = make_linear(96, 40, False)
    packed = linear_packed_cpu.pack_linear(weight)
    assert packed.shape == (3, 40, 32)
    for block, k, j in [(0, 0, 0), (1, 39, 31), (2, 17, 5)]:
        assert packed[block, k, j] == weight[32 * block + j, k]
    storage = weight.data_ptr()
    in_place = linear_packed_cpu.pack_linear_in_place(weight.clone())
    assert torch.equal(in_place, packed)
    assert linear_packed_cpu.pack_linear_in_place(weight).data_ptr() == storage


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_matches_f_linear(rows, bias, threads):
    """Tiles of 12 rows and an uneven last few; more threads than blocks (O = 64: two)."""
    weight, b = make_linear(64, 72, bias, seed=rows)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.linear_packed(x, linear_packed_cpu.pack_linear(weight), b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, F.linear(x.double(), weight.double(), None if b is None else b.double()).float(),
                               rtol=1e-5, atol=1e-5)
    assert registry.last_used("linear_packed") == "cpu_c"


def test_rows_past_a_panel_run_in_panels_and_the_leading_dims_are_kept():
    """At D = 512 a panel holds 384 rows: 800 rows run as three panels, over the blocks of a 4096-wide head."""
    assert c_library.PANEL_BYTES // (512 * 4) == 384
    weight, b = make_linear(4096, 512, True)
    x = torch.randn(2, 400, 512, generator=torch.Generator().manual_seed(2))
    out = ops.linear_packed(x, linear_packed_cpu.pack_linear(weight), b)
    assert out.shape == (2, 400, 4096)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_a_rows_result_is_the_same_bits_alone_and_in_any_batch():
    weight, b = make_linear(128, 96, True)
    packed = linear_packed_cpu.pack_linear(weight)
    x = torch.randn(50, 96, generator=torch.Generator().manual_seed(3))
    whole = ops.linear_packed(x, packed, b)
    for start, stop in [(7, 8), (0, 13), (20, 50), (49, 50)]:
        assert torch.equal(ops.linear_packed(x[start:stop], packed, b), whole[start:stop])


def test_inputs_the_kernel_cannot_take_are_named():
    weight, b = make_linear(64, 48, True)
    packed = linear_packed_cpu.pack_linear(weight)
    with pytest.raises(ValueError, match=r"weight must be packed \[O/32, D, 32\]"):
        ops.linear_packed(torch.randn(3, 48), weight, b)
    with pytest.raises(ValueError, match=r"x \[3, 40\] does not match weight \[2, 48, 32\] in D"):
        ops.linear_packed(torch.randn(3, 40), packed, b)
    with pytest.raises(ValueError, match=r"bias must be \[64\], got \[63\]"):
        ops.linear_packed(torch.randn(3, 48), packed, b[:63])
    assert "multiple of 32" in linear_packed_cpu.packing_refusal(torch.randn(48, 64))
    assert linear_packed_cpu.packing_refusal(torch.randn(64, 48)) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3"])
def test_an_engine_packs_its_projections_and_generates_the_reference_tokens(family, tmp_path):
    """Attention's and dense MLPs' projections and an untied LM head run on the packed kernel; a tied LM head (qwen3's
    is the embeddings too) and widths the blocks do not divide (qwen2_moe's 48-wide shared expert, qwen3's 48-wide
    k and v) stay as they were. Greedy tokens equal transformers'."""
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.layers import Linear
    from batchgen.engine.models.weight_packing import packable_projections

    hf_model = save_tiny_checkpoint(family, tmp_path)
    batch = prompts(lengths=(4, 11, 30))
    loaded = load_model(str(tmp_path))
    packable = packable_projections(loaded.model)
    registry.reset_usage()
    results = Engine(loaded, kv_budget_bytes=8 << 20).generate(_greedy_requests(batch, 8))
    assert [r.outputs[0].token_ids for r in results] == hf_greedy_batch(hf_model, batch, 8)
    assert registry.usage_counts()[("linear_packed", "cpu_c")] > 0
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert [m.packed for m in linears] == [any(m is p for p in packable) for m in linears]
    assert not any(m.packed for m in linears if m.out_features % 32)
    assert any(m.out_features % 32 for m in linears) == (family != "mixtral")
    assert loaded.model.lm_head.packed == (not hf_model.config.tie_word_embeddings) == (family != "qwen3")


def test_projections_stay_in_the_checkpoint_layout_when_linear_runs_elsewhere(tmp_path):
    from tiny_models import save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.weight_packing import projection_refusal, projections_packed

    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    with registry.use_backend("linear", "torch"):
        assert projection_refusal(loaded) == "linear runs on the torch backend"
        Engine(loaded, kv_budget_bytes=8 << 20)
    assert not projections_packed(loaded.model)


def test_a_straggler_partition_refuses_a_model_whose_projections_were_packed(tmp_path):
    from tiny_models import save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.parallel.partition import partition_model

    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    Engine(loaded, kv_budget_bytes=8 << 20)
    with pytest.raises(ValueError, match="projections were packed for the CPU kernel"):
        partition_model(loaded.model, group=None)  # refused before it looks at the ranks
