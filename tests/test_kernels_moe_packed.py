import pytest
import torch
from test_kernels_moe import make_moe, naive_moe

from batchgen.kernels import moe_packed_cpu, ops, registry


@pytest.fixture(autouse=True)
def packed_kernel():
    if moe_packed_cpu.unavailable():
        pytest.skip(moe_packed_cpu.unavailable())


def packed(w_gate_up, w_down):
    return moe_packed_cpu.pack_gate_up(w_gate_up), moe_packed_cpu.pack_down(w_down)


@pytest.mark.parametrize("lanes", [8, 16])
def test_packed_layouts_put_a_vector_of_gate_and_up_columns_and_two_of_down_columns_at_each_index(lanes, monkeypatch):
    """The layout follows the CPU's vector width (AVX2's 8 floats, AVX-512's 16); both packings are checked here,
    whichever this CPU runs."""
    monkeypatch.setattr(moe_packed_cpu, "vector_lanes", lambda: lanes)
    gate, wide = lanes, 2 * lanes
    _, w13, w2, _, _ = make_moe(1, 64, 48, 3, 1)
    gate_up, down = packed(w13, w2)
    assert gate_up.shape == (3, 48 // gate, 64, wide) and down.shape == (3, 64 // wide, 48, wide)
    for expert, block, k, j in [(0, 0, 0, 0), (1, 48 // gate - 1, 63, gate - 1), (2, 1, 17, gate), (2, 2, 5, wide - 1)]:
        row = gate * block + j if j < gate else 48 + gate * block + j - gate  # a gate row, else the column's up row
        assert gate_up[expert, block, k, j] == w13[expert, row, k]
    for expert, block, i, j in [(0, 0, 0, 0), (1, 64 // wide - 1, 47, wide - 1), (2, 1, 3, 0)]:
        assert down[expert, block, i, j] == w2[expert, wide * block + j, i]


def test_packing_in_place_keeps_the_storage_and_gives_the_packed_tensor():
    _, w13, w2, _, _ = make_moe(1, 64, 48, 3, 1)
    expected_gate_up, expected_down = packed(w13, w2)
    storage = w13.data_ptr()
    gate_up = moe_packed_cpu.pack_in_place(w13, moe_packed_cpu.pack_gate_up)
    down = moe_packed_cpu.pack_in_place(w2, moe_packed_cpu.pack_down)
    assert gate_up.data_ptr() == storage
    assert torch.equal(gate_up, expected_gate_up) and torch.equal(down, expected_down)
    with pytest.raises(ValueError, match="must be contiguous"):
        moe_packed_cpu.pack_in_place(torch.randn(2, 64, 32).transpose(1, 2), moe_packed_cpu.pack_gate_up)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (33, 4), (90, 2)])
def test_packed_kernel_matches_naive(tokens, top_k, threads):
    """Expert 5 is picked by (nearly) every token: up to 90 rows, in tiles of ROWS (12 or 6) and an uneven
    last few; some pairs
    belong to experts of another rank (-1), and expert 2 gets no rows."""
    x, w13, w2, _, _ = make_moe(tokens, 64, 48, 7, 1)
    scores = torch.rand(tokens, 7, generator=torch.Generator().manual_seed(tokens))
    scores[:, 5] += 1
    scores[:, 2] -= 2
    weights, ids = scores.topk(top_k, dim=1)
    weights = weights / weights.sum(1, keepdim=True)
    ids[1::5, -1] = -1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.fused_moe_packed(x, *packed(w13, w2), weights, ids)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert registry.last_used("fused_moe_packed") == "cpu_c"


def test_an_expert_of_more_rows_than_a_panel_takes_runs_in_panels():
    """At D = 512, I = 1024 a panel holds 192 rows: expert 0's 400 rows run as three panels, in expert order with the
    others' rows of the same tokens."""
    from batchgen.kernels.moe_torch import fused_moe_torch

    x, w13, w2, weights, ids = make_moe(400, 512, 1024, 4, 2, seed=5)
    ids[:, 0] = 0
    ids[:, 1] = torch.where(ids[:, 1] == 0, 1, ids[:, 1])
    assert moe_packed_cpu.PANEL_BYTES // (1024 * 4) == 192
    out = ops.fused_moe_packed(x, *packed(w13, w2), weights, ids)
    torch.testing.assert_close(out, fused_moe_torch(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
    alone = ops.fused_moe_packed(x[390:], *packed(w13, w2), weights[390:], ids[390:])
    assert torch.equal(alone, out[390:])


@pytest.mark.parametrize("rows", [1, moe_packed_cpu.CHUNKED_ROWS, moe_packed_cpu.CHUNKED_ROWS + 1])
def test_h_chunked_for_few_rows_and_row_major_for_more_gives_the_same_bits(rows):
    """Expert 1 gets `rows` rows, its h chunk-major up to CHUNKED_ROWS and row-major past it; the first token's
    output is the same bits as alone (one row: chunk-major) and matches the naive sum."""
    x, w13, w2, weights, _ = make_moe(rows, 64, 48, 3, 2, seed=rows)
    ids = torch.tensor([[1, 0]] * rows)
    gate_up, down = packed(w13, w2)
    out = ops.fused_moe_packed(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.fused_moe_packed(x[:1], gate_up, down, weights[:1], ids[:1]), out[:1])


def test_a_rows_result_is_the_same_bits_alone_and_in_any_batch():
    """Each output element is one accumulator over its inputs in order, whichever rows share its tile, and a token's
    experts are added in expert order: the batch does not change a row's bits (the default kernel's paths do)."""
    x, w13, w2, weights, ids = make_moe(70, 128, 64, 4, 2, seed=3)
    gate_up, down = packed(w13, w2)
    full = ops.fused_moe_packed(x, gate_up, down, weights, ids)
    for first, last in [(5, 6), (0, 13), (40, 70)]:
        part = ops.fused_moe_packed(x[first:last], gate_up, down, weights[first:last], ids[first:last])
        assert torch.equal(part, full[first:last])


def test_packed_inputs_are_checked():
    x, w13, w2, weights, ids = make_moe(4, 64, 48, 3, 2)
    gate_up, down = packed(w13, w2)
    gate, wide = moe_packed_cpu.gate_columns(), moe_packed_cpu.down_columns()
    with pytest.raises(ValueError, match=rf"w_gate_up must be packed \[E, I/{gate}, D, {wide}\] on this CPU, got "
                                         r"\[3, 96, 64\]"):
        ops.fused_moe_packed(x, w13, down, weights, ids)
    with pytest.raises(ValueError, match=rf"w_down must be packed \[E, D/{wide}, I, {wide}\] = "
                                         rf"\[3, {64 // wide}, 48, {wide}\]"):
        ops.fused_moe_packed(x, gate_up, w2, weights, ids)
    with pytest.raises(ValueError, match="does not match x"):
        ops.fused_moe_packed(x[:, :32], gate_up, down, weights, ids)
    assert moe_packed_cpu.packing_refusal(64, 48) is None
    assert f"multiple of {gate}" in moe_packed_cpu.packing_refusal(64, gate + gate // 2)
    assert f"hidden size one of {wide}" in moe_packed_cpu.packing_refusal(wide + wide // 2, 48)


def _greedy_requests(batch, max_tokens):
    from batchgen.engine import Request, SamplingParams

    return [Request(f"r{i}", p, sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(batch)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_engine_packs_its_experts_in_place_and_decodes_transformers_greedy_tokens(arch, tmp_path):
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.layers import FusedExperts

    hf_model = save_tiny_checkpoint(arch, tmp_path)
    batch = prompts(lengths=(3, 9, 17, 30))
    expected = hf_greedy_batch(hf_model, batch, 10)
    loaded = load_model(str(tmp_path))
    experts = [m for m in loaded.model.modules() if isinstance(m, FusedExperts)]
    storage = [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts]
    registry.reset_usage()
    results = Engine(loaded, kv_budget_bytes=8 << 20).generate(_greedy_requests(batch, 10))
    assert [r.outputs[0].token_ids for r in results] == expected
    assert all(m.packed and m.gate_up_proj.dim() == 4 for m in experts)
    assert [(m.gate_up_proj.data_ptr(), m.down_proj.data_ptr()) for m in experts] == storage  # no second copy
    counts = registry.usage_counts()
    assert counts[("fused_moe_packed", "cpu_c")] > 0 and not any(op == "fused_moe" for op, _ in counts)


def test_experts_stay_in_the_checkpoint_layout_when_fused_moe_runs_elsewhere(tmp_path):
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.expert_packing import experts_packed, pack_experts, packing_refusal
    from batchgen.engine.models.layers import FusedExperts

    hf_model = save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(4, 11))
    loaded = load_model(str(tmp_path))
    with registry.use_backend("fused_moe", "torch"):
        assert packing_refusal(loaded) == "fused_moe runs on the torch backend"
        registry.reset_usage()
        results = Engine(loaded, kv_budget_bytes=8 << 20).generate(_greedy_requests(batch, 6))
        assert registry.usage_counts()[("fused_moe", "torch")] > 0
    assert [r.outputs[0].token_ids for r in results] == hf_greedy_batch(hf_model, batch, 6)
    assert not experts_packed(loaded)
    pack_experts(loaded)  # once fused_moe is the C kernel's again: both MoE layers
    assert [m.packed for m in loaded.model.modules() if isinstance(m, FusedExperts)] == [True, True]


def test_shared_or_streamed_host_weights_are_never_packed(tmp_path, monkeypatch):
    """A memory-constrained engine's host weights may be the node's shared file mapping: repacking them would write
    the file every later load maps (or copy every page). Neither a resident engine on such weights nor a
    memory-constrained one packs; the shared file keeps the checkpoint's bytes."""
    import hashlib

    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.expert_packing import experts_packed, packing_refusal

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    hf_model = save_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    batch = prompts(lengths=(4, 11))
    expected = hf_greedy_batch(hf_model, batch, 6)
    shared = load_model(str(tmp_path / "ckpt"), shared_host_weights=True)
    (store,) = (tmp_path / "cache" / "host-weights").glob("*.bin")
    written = hashlib.sha256(store.read_bytes()).hexdigest()
    assert packing_refusal(shared) == "its weights are a file mapping the node's processes share"
    results = Engine(shared, kv_budget_bytes=8 << 20).generate(_greedy_requests(batch, 6))
    assert [r.outputs[0].token_ids for r in results] == expected and not experts_packed(shared)
    assert hashlib.sha256(store.read_bytes()).hexdigest() == written
    streamed = load_model(str(tmp_path / "ckpt"))
    total = sum(p.numel() * p.element_size() for p in streamed.model.parameters())
    engine = Engine(streamed, device_memory_bytes=int(total * 0.5), page_size=4, max_model_len=256)
    assert [r.outputs[0].token_ids for r in engine.generate(_greedy_requests(batch, 6))] == expected
    assert not experts_packed(streamed) and "placed for streaming" in packing_refusal(streamed)


def test_a_memory_constrained_engine_streams_experts_an_earlier_engine_packed(tmp_path):
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine
    from batchgen.engine.models.expert_packing import experts_packed

    hf_model = save_tiny_checkpoint("mixtral", tmp_path)
    batch = prompts(lengths=(4, 11, 7))
    expected = hf_greedy_batch(hf_model, batch, 6)
    loaded = load_model(str(tmp_path))
    assert [r.outputs[0].token_ids for r in Engine(loaded).generate(_greedy_requests(batch, 6))] == expected
    assert experts_packed(loaded)
    total = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    engine = Engine(loaded, device_memory_bytes=int(total * 0.5), page_size=4, max_model_len=256)
    registry.reset_usage()
    assert [r.outputs[0].token_ids for r in engine.generate(_greedy_requests(batch, 6))] == expected
    assert registry.usage_counts()[("fused_moe_packed", "cpu_c")] > 0  # the slots hold packed experts


def test_a_module_whose_weights_cannot_be_packed_in_place_is_left_as_it_was():
    from batchgen.engine.models.layers import FusedExperts

    module = FusedExperts(4, 64, 48)  # its parameters uninitialised (torch.empty: NaNs now and then, unequal to all)
    module.gate_up_proj = torch.nn.Parameter(torch.randn(4, 96, 64), requires_grad=False)
    module.down_proj = torch.nn.Parameter(torch.randn(4, 48, 64).transpose(1, 2), requires_grad=False)
    before = module.gate_up_proj.detach().clone()
    with pytest.raises(ValueError, match="must be contiguous"):
        module.pack_for_cpu()
    assert not module.packed and torch.equal(module.gate_up_proj, before)


def _moe_call(tokens: int, seed: int):
    """An MoE call of `tokens` tokens (top-2 of 4 experts, 64 x 128): its inputs, packed weights and naive result."""
    x, w13, w2, _, _ = make_moe(tokens, 64, 128, 4, seed)
    weights, ids = torch.rand(tokens, 4, generator=torch.Generator().manual_seed(seed)).topk(2, dim=1)
    weights = weights / weights.sum(1, keepdim=True)
    return (x, *packed(w13, w2), weights, ids), naive_moe(x, w13, w2, weights, ids)


def test_calls_from_threads_at_once_each_get_their_own_buffers():
    """The grouped rows and h live in a buffer of the calling thread's: two threads calling at once, with calls of
    different sizes in turn (so each grows its buffer while the other computes), both get their own results."""
    import threading

    calls = [_moe_call(tokens, seed) for seed, tokens in enumerate([400, 3, 1500, 64])]
    failures = []

    def run(order):
        for i in order * 5:
            args, expected = calls[i]
            try:
                torch.testing.assert_close(ops.fused_moe_packed(*args).double(), expected, rtol=1e-5, atol=1e-5)
            except BaseException as exc:  # noqa: BLE001 (a kernel error ends the thread: the test must see it)
                failures.append(exc)

    threads = [threading.Thread(target=run, args=(order,)) for order in ([0, 1, 2, 3], [2, 3, 0, 1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def test_a_threads_buffer_is_freed_when_the_thread_ends():
    """Each of 100 short-lived threads makes a call whose buffer is ~4 MiB: kept past their end, they would hold
    ~420 MiB."""
    import threading

    args, expected = _moe_call(2731, 0)
    first = ops.fused_moe_packed(*args)
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-5)
    before, same = _resident_bytes(), []
    for _ in range(100):
        thread = threading.Thread(target=lambda: same.append(torch.equal(ops.fused_moe_packed(*args), first)))
        thread.start()
        thread.join()
    assert _resident_bytes() - before < 150 << 20
    assert same == [True] * 100  # every thread's call ran, and gave the same result
