import json
import os

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import ops, registry
from batchgen.kernels.c_library import vector_lanes
from batchgen.kernels.moe_align import align_to_blocks
from batchgen.kernels.moe_config import config_file_name, moe_config
from batchgen.kernels.moe_cpu import FEW_TOKENS
from batchgen.kernels.moe_torch import fused_moe_torch


def naive_moe(x, w_gate_up, w_down, topk_weights, topk_ids):
    """Token-by-token float64 evaluation of the fused_moe formula."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            h = w_gate_up[e].double() @ x[t].double()
            y = w_down[e].double() @ (F.silu(h[:inter]) * h[inter:])
            out[t] += float(topk_weights[t, k]) * y
    return out


def make_moe(tokens, dim, inter, experts, top_k, dtype=torch.float32, seed=0, skip_experts=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, dim, generator=g) / dim**0.5
    w_down = torch.randn(experts, dim, inter, generator=g) / inter**0.5
    allowed = torch.tensor([e for e in range(experts) if e not in skip_experts])
    scores = torch.rand(tokens, len(allowed), generator=g)
    topk_weights, picked = scores.topk(top_k, dim=1)
    topk_ids = allowed[picked]
    topk_weights = topk_weights / topk_weights.sum(1, keepdim=True)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), topk_weights, topk_ids


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (33, 8), (64, 2)])
def test_grouped_torch_matches_naive(tokens, top_k):
    args = make_moe(tokens, 16, 24, 10, top_k, skip_experts=(3,))
    torch.testing.assert_close(fused_moe_torch(*args).double(), naive_moe(*args), rtol=1e-5, atol=1e-5)


def test_grouped_torch_skips_remote_experts():
    x, w13, w2, weights, ids = make_moe(9, 16, 24, 4, 2)
    ids[::2, 1] = -1
    expected = naive_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        fused_moe_torch(x, w13, w2, weights, ids).double(), expected, rtol=1e-5, atol=1e-5
    )


def cpu_c_moe(monkeypatch, threads: int, *args):
    """fused_moe_cpu(*args) on `threads` threads, and the experts its GEMM path (oneDNN, one call pair per expert)
    computed: the others can only have come from the C kernel."""
    from batchgen.kernels import moe_cpu

    by_blas = []
    large = moe_cpu.large_experts

    def recorded(out, rows, experts, w_gate_up, w_down):
        by_blas.extend(experts)
        large(out, rows, experts, w_gate_up, w_down)

    monkeypatch.setattr(moe_cpu, "large_experts", recorded)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return moe_cpu.fused_moe_cpu(*args), by_blas
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (33, 4), (90, 2)])
def test_cpu_c_matches_naive(tokens, top_k, threads, monkeypatch):
    """Expert 5 is picked by (nearly) every token, so by many rows in the larger cases (oneDNN), expert 6 by
    three (the C kernel); some pairs belong to experts of another rank."""
    from batchgen.kernels import moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    x, w13, w2, _, _ = make_moe(tokens, 16, 24, 7, 1)
    scores = torch.rand(tokens, 7, generator=torch.Generator().manual_seed(tokens))
    scores[:, 5] += 1
    scores[:3, 6] += 2  # the first three tokens, and no other
    scores[3:, 6] *= 0.01
    weights, ids = scores.topk(top_k, dim=1)
    weights = weights / weights.sum(1, keepdim=True)
    ids[1::5, -1] = -1
    out, by_blas = cpu_c_moe(monkeypatch, threads, x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    counts = torch.bincount(ids[ids >= 0], minlength=7)
    used = {e for e in range(7) if counts[e]}
    assert 6 in used and 6 not in by_blas  # three rows: the C kernel's
    assert set(by_blas) == {e for e in used if counts[e] > moe_cpu.SMALL_ROWS}
    if tokens > moe_cpu.SMALL_ROWS:
        assert 5 in by_blas  # picked by every token: more rows than the kernel takes


def grouped_calls(monkeypatch) -> list:
    """Every moe_cpu.grouped_experts call's GroupedCall, in order."""
    from batchgen.kernels import moe_cpu

    calls = []
    grouped = moe_cpu.grouped_experts
    monkeypatch.setattr(moe_cpu, "grouped_experts", lambda *args: calls.append(grouped(*args)) or calls[-1])
    return calls


def layout_rows(call) -> list[list[int]]:
    """The experts a GroupedCall ran in the kernel: [first row, end row, h offset, xt offset or -1, blocked rows]."""
    return call.layout[: int((call.experts >= 0).sum())].tolist()


@pytest.mark.parametrize("tokens", [1, FEW_TOKENS, FEW_TOKENS + 1, 40])
def test_cpu_c_groups_and_runs_a_call_in_one_kernel_call_reading_nothing_back(tokens, monkeypatch):
    """While no expert gets more than SMALL_ROWS rows, one kernel call groups the (token, k) pairs by expert and runs
    every expert, and nothing is read back to the host (inside a recording, a read-back would be refused): a recorded
    forward can replay a call of any size. Up to FEW_TOKENS tokens every expert takes the dot-product path, past it
    experts of more than the crossover's rows the blocked one."""
    from batchgen.kernels import capture, moe_cpu, moe_crossover

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    kernel_calls = []
    kernel = moe_cpu._GROUPED
    monkeypatch.setattr(moe_cpu, "_GROUPED", lambda *a: kernel_calls.append(a) or kernel(*a))
    monkeypatch.setattr(moe_crossover, "dot_rows", lambda dim, inter: 8)
    calls = grouped_calls(monkeypatch)
    x, w13, w2, weights, ids = make_moe(tokens, 40, 24, 3, 2, seed=tokens)
    ids[::3, 0] = -1  # an expert of another rank
    with capture.record():
        out = moe_cpu.fused_moe_cpu(x, w13, w2, weights, ids.to(torch.int32))
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    (call,) = calls
    assert len(kernel_calls) == 1 and call.large == 0
    counts = torch.bincount(ids[ids >= 0], minlength=3).tolist()
    assert [row[1] - row[0] for row in layout_rows(call)] == [c for c in counts if c]
    blocked = [row[4] for row in layout_rows(call)]
    assert blocked == [0] * len(blocked) if tokens <= FEW_TOKENS else any(blocked)


def test_cpu_c_leaves_experts_past_its_row_limit_to_the_gemm_path_which_a_recording_refuses(monkeypatch):
    """An expert of more than SMALL_ROWS rows is left out of the kernel call (counted in `large`) for the GEMM path,
    whose per-expert calls need the rows' counts on the host: a recording refuses that read-back."""
    from batchgen.kernels import capture, moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    calls = grouped_calls(monkeypatch)
    x, w13, w2, _, _ = make_moe(moe_cpu.SMALL_ROWS + 1, 16, 24, 3, 1)
    ids = torch.zeros(moe_cpu.SMALL_ROWS + 1, 2, dtype=torch.int64)
    ids[:, 1] = 1 + torch.arange(moe_cpu.SMALL_ROWS + 1) % 2  # expert 0 gets every token, 1 and 2 half each
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4))
    out = moe_cpu.fused_moe_cpu(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert calls[-1].large == 1 and [row[0] for row in layout_rows(calls[-1])] == [moe_cpu.SMALL_ROWS + 1,
                                                                                 moe_cpu.SMALL_ROWS + 34]
    with pytest.raises(capture.CaptureRefused, match="read back"), capture.record():
        moe_cpu.fused_moe_cpu(x, w13, w2, weights, ids)


@pytest.mark.parametrize("tokens,threads", [(21, 1), (600, 2)])
def test_cpu_c_routes_rows_as_the_torch_grouping_does(tokens, threads, monkeypatch):
    """The C kernel's grouping by expert (a counting sort) yields torch's rows in torch's order: the same gathered
    hidden states, output rows, weights and per-expert counts, ids of another rank (< 0) left out; 600 tokens copy
    rows on two threads."""
    from batchgen.kernels import moe_cpu
    from batchgen.kernels.moe_torch import route_rows

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, w13, w2, weights, ids = make_moe(tokens, 112, 8, 9, 3, seed=tokens)
    ids[::4, 1] = -1
    ours, theirs = moe_cpu.grouped_experts(x, w13, w2, weights, ids, 8).routed(), route_rows(x, weights, ids, 9)
    assert ours.counts == theirs.counts and ours.starts == theirs.starts
    assert sum(ours.counts) == tokens * 3 - len(range(0, tokens, 4))
    assert torch.equal(ours.token_rows, theirs.token_rows)
    assert torch.equal(ours.weights, theirs.weights)
    assert torch.equal(ours.xs, theirs.xs)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_c_takes_any_row_count_up_to_its_limit_and_sizes_off_the_vector_width(threads, monkeypatch):
    """Rows go eight at a time: expert 0 gets SMALL_ROWS rows (whole blocks), expert 3 all but nine of them (a
    partial block after whole ones), expert 1 eight, expert 2 one; D = 21 (odd: the last output column alone; a
    tail past 16 lanes) and I = 40 (a tail)."""
    from batchgen.kernels import moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    x, w13, w2, _, _ = make_moe(moe_cpu.SMALL_ROWS, 21, 40, 4, 1)
    ids = torch.full((moe_cpu.SMALL_ROWS, 2), 3)
    ids[:, 0] = 0
    ids[:8, 1], ids[8, 1] = 1, 2
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    out, by_blas = cpu_c_moe(monkeypatch, threads, x, w13, w2, weights, ids)
    assert (moe_cpu.SMALL_ROWS - 9) % 8 and not by_blas  # a partial block; every expert in the C kernel
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_c_blocked_path_takes_partial_blocks_and_tails_of_every_dimension(threads, monkeypatch):
    """Experts of more than DOT_ROWS rows go transposed, LANES rows to a vector, a last partial block of at most
    DOT_ROWS rows to the dot-product path: with 16 lanes expert 0 gets 45 rows (two whole blocks and a padded one of
    13), expert 3 20 (a whole block, then 4 dot-product rows), expert 1 9 (one padded block), experts 2 and 4 the dot
    path's 8.
    D = 21 (a tail of 5 past one 16-column output block and past one 16-element vector of a row) and I = 42 (5
    column blocks of 8 and a tail of 2)."""
    from batchgen.kernels import moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    calls = grouped_calls(monkeypatch)
    x, w13, w2, _, _ = make_moe(45, 21, 42, 5, 1)
    ids = torch.zeros((45, 2), dtype=torch.int64)
    ids[:9, 1], ids[9:17, 1], ids[17:37, 1], ids[37:, 1] = 1, 2, 3, 4
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2))
    out, by_blas = cpu_c_moe(monkeypatch, threads, x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    layout = layout_rows(calls[-1])
    assert not by_blas and [row[1] - row[0] for row in layout] == [45, 9, 8, 20, 8]
    # rows on the blocked path; h: padded blocks, then the dot-product rows; transposed rows only for the blocked
    # experts' padded blocks. With 8 lanes (AVX2) every partial block has at most DOT_ROWS rows: dot-product rows.
    blocked, h, xt = {
        16: ([45, 9, 0, 16, 0], [0, 48, 64, 72, 72 + 16 + 4], [0, 48, -1, 64, -1]),
        8: ([40, 8, 0, 16, 0], [0, 40 + 5, 45 + 8 + 1, 54 + 8, 62 + 16 + 4], [0, 40, -1, 48, -1]),
    }[vector_lanes()]
    assert [row[4] for row in layout] == blocked
    assert [row[2] for row in layout] == [rows * 42 for rows in h]
    assert [row[3] for row in layout] == [rows * 21 if rows >= 0 else -1 for rows in xt]


def test_engine_moe_on_both_c_paths_decodes_transformers_greedy_tokens(tmp_path, monkeypatch):
    """A Mixtral of 4 experts whose intermediate size (36) the packed kernel's tiles do not divide, so the engine
    keeps the checkpoint layout: the prefill of 29 tokens gives each expert ~15 rows (the blocked path), the decode
    steps of 3 sequences a few (the dot-product path); the engine's greedy tokens are transformers' own."""
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine, Request, SamplingParams
    from batchgen.kernels import moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    calls = grouped_calls(monkeypatch)
    hf_model = save_tiny_checkpoint("mixtral", tmp_path, intermediate_size=36)
    batch = prompts(lengths=(3, 9, 17))
    expected = hf_greedy_batch(hf_model, batch, 10)
    requests = [Request(f"r{i}", p, sampling=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
                for i, p in enumerate(batch)]
    results = Engine(load_model(str(tmp_path)), kv_budget_bytes=8 << 20).generate(requests)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert any(row[3] >= 0 for call in calls for row in layout_rows(call))  # a blocked expert ran


def test_cpu_c_reads_strided_expert_views():
    """An expert-parallel rank's experts are a slice of the layer's tensors; weights may be column views."""
    from batchgen.kernels import moe_cpu

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    x, w13, w2, weights, ids = make_moe(5, 16, 24, 8, 2)
    wide = torch.randn(8, 48, 20)
    wide[:, :, :16] = w13
    view = wide[:, :, :16]  # rows strided by 20, last dim dense
    torch.testing.assert_close(moe_cpu.fused_moe_cpu(x, view, w2, weights, ids).double(),
                               naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)



def _openmp_libraries() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}


def test_cpu_c_kernels_run_on_the_openmp_runtime_torch_loaded(monkeypatch):
    """The kernels' threads are torch's OpenMP pool: their library binds to the OpenMP runtime already in the
    process, never a second one (whose threads would run against torch's spinning ones)."""
    from batchgen.kernels import attention_cpu, moe_cpu

    if moe_cpu.unavailable() or attention_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable() or attention_cpu.unavailable())
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads the process's mappings (Linux)")
    torch.ones(4096, 4096).sum()  # torch's own OpenMP runtime is loaded and running
    before = _openmp_libraries()
    if not before:
        pytest.skip("this torch runs no OpenMP runtime the kernels could share")
    x, w13, w2, weights, ids = make_moe(5, 16, 24, 8, 2)
    out, by_blas = cpu_c_moe(monkeypatch, 2, x, w13, w2, weights, ids)
    assert not by_blas  # the C kernel ran, on two threads
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert _openmp_libraries() == before

def test_align_groups_pairs_by_expert_in_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [2, 2]])
    blocks = align_to_blocks(ids, num_experts=4, block_m=4)
    used = int(blocks.num_padded)
    assert used == 12  # expert 0: 2 pairs -> one block of 4; expert 2: 5 pairs -> two blocks
    sentinel = ids.numel()
    assert blocks.sorted_ids[:used].tolist() == [1, 4, sentinel, sentinel, 0, 2, 5, 6, 7] + [sentinel] * 3
    assert blocks.expert_ids[:3].tolist() == [0, 2, 2]
    assert blocks.sorted_ids[used:].eq(sentinel).all()


def test_align_counts_each_pair_once():
    ids = torch.randint(0, 16, (50, 3))
    blocks = align_to_blocks(ids, num_experts=16, block_m=16)
    used = int(blocks.num_padded)
    real = blocks.sorted_ids[:used]
    real = real[real < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    flat = ids.reshape(-1)
    for block, expert in enumerate(blocks.expert_ids[: used // 16].tolist()):
        rows = blocks.sorted_ids[block * 16 : (block + 1) * 16]
        rows = rows[rows < ids.numel()]
        assert flat[rows.long()].eq(expert).all()


def test_config_file_nearest_m(tmp_path, monkeypatch):
    tuned = {
        "1": dict(
            BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2
        ),
        "256": dict(
            BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3
        ),
    }
    (tmp_path / config_file_name(8, 24, "cpu")).write_text(json.dumps(tuned))
    monkeypatch.setenv("BATCHGEN_MOE_CONFIG_DIR", str(tmp_path))
    assert moe_config(200, 8, 24, torch.device("cpu"))["BLOCK_SIZE_N"] == 128
    assert moe_config(3, 8, 24, torch.device("cpu"))["BLOCK_SIZE_M"] == 16
    assert moe_config(3, 8, 32, torch.device("cpu"))["BLOCK_SIZE_K"] == 64  # no file: default


def test_config_file_missing_key_is_named(tmp_path, monkeypatch):
    (tmp_path / config_file_name(4, 8, "cpu")).write_text(json.dumps({"1": {"BLOCK_SIZE_M": 16}}))
    monkeypatch.setenv("BATCHGEN_MOE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="lacks BLOCK_SIZE_N"):
        moe_config(1, 4, 8, torch.device("cpu"))


def test_ops_validates_shapes():
    x, w13, w2, weights, ids = make_moe(4, 16, 24, 4, 2)
    with pytest.raises(ValueError, match="w_down must be"):
        ops.fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        ops.fused_moe(x, w13, w2, weights[:, :1], ids)


def test_ops_picks_the_c_kernel_for_float32_on_cpu_and_torch_otherwise():
    from batchgen.kernels import moe_cpu

    args = make_moe(5, 16, 24, 4, 2)
    ops.fused_moe(*args)
    assert registry.last_used("fused_moe") == ("torch" if moe_cpu.unavailable() else "cpu_c")
    ops.fused_moe(*make_moe(5, 16, 24, 4, 2, dtype=torch.bfloat16))
    assert registry.last_used("fused_moe") == "torch"


SMALL_BLOCKS = dict(
    BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=2
)


@pytest.mark.parametrize(
    "tokens,top_k,dtype,skip",
    [
        (1, 1, torch.float32, ()),
        (13, 2, torch.float32, (1,)),
        (20, 8, torch.float32, ()),
        (13, 2, torch.float16, (0, 5)),
        (6, 8, torch.float16, ()),
    ],
)
@pytest.mark.triton_cpu
def test_triton_matches_torch(tokens, top_k, dtype, skip):
    from batchgen.kernels.moe_triton import fused_moe_triton

    args = make_moe(tokens, 40, 24, 10, top_k, dtype=dtype, skip_experts=skip)
    expected = fused_moe_torch(*args)
    got = fused_moe_triton(*args, config=SMALL_BLOCKS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert got.dtype == dtype


@pytest.mark.triton_cpu
def test_triton_default_config_and_remote_experts_through_ops():
    x, w13, w2, weights, ids = make_moe(9, 32, 16, 4, 2)
    ids[1::3, 0] = -1
    with registry.use_backend("fused_moe", "triton"):
        got = ops.fused_moe(x, w13, w2, weights, ids)
    assert registry.last_used("fused_moe") == "triton"
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_crossover_is_the_largest_within_tolerance_of_the_fastest():
    from batchgen.kernels.moe_crossover import TOLERANCE, choose_dot_rows

    assert choose_dot_rows({8: 1.2, 10: 1.1, 12: 1.0, 14: 1.3, 16: 1.4}) == 12
    assert choose_dot_rows({16: 1.1, 14: 1.0, 12: 1.0, 10: 1.2, 8: 1.3}) == 14
    assert choose_dot_rows({8: 1.05, 10: 1.0, 12: 1.0 + TOLERANCE / 2}) == 12  # inside the noise: the larger


def test_crossover_is_measured_once_per_machine_and_not_at_all_under_fixed_settings(tmp_path, monkeypatch):
    from batchgen.kernels import moe_cpu, moe_crossover

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    measured = []
    measure = moe_crossover.measure
    monkeypatch.setattr(moe_crossover, "measure", lambda *shape: measured.append(shape) or measure(*shape))
    monkeypatch.setattr(moe_crossover, "cache_root", lambda: tmp_path)
    monkeypatch.delenv("BATCHGEN_PLAN", raising=False)
    moe_crossover.dot_rows.cache_clear()
    try:
        first = moe_crossover.dot_rows(24, 40)
        assert measured == [(24, 40)] and first in moe_crossover.CANDIDATES
        (record,) = [json.loads(p.read_text()) for p in (tmp_path / "calibration").glob("*.json")]
        assert record["dot_rows"] == first and sorted(map(int, record["seconds"])) == list(moe_crossover.CANDIDATES)
        moe_crossover.dot_rows.cache_clear()  # another process of the machine: reads the file
        assert moe_crossover.dot_rows(24, 40) == first and len(measured) == 1
        monkeypatch.setenv("BATCHGEN_PLAN", "0")
        moe_crossover.dot_rows.cache_clear()
        assert moe_crossover.dot_rows(32, 40) == moe_crossover.DEFAULT_DOT_ROWS and len(measured) == 1
    finally:
        moe_crossover.dot_rows.cache_clear()


def test_cpu_c_kernel_takes_the_crossover_for_its_expert_shape(monkeypatch):
    """Experts of 12 and 40 rows: both blocked at the default crossover (with 16 lanes one padded block, two whole
    blocks and 8 dot-product rows), the first on the dot path at 16, both at the kernel's limit (every expert on the
    dot path)."""
    from batchgen.kernels import moe_cpu, moe_crossover

    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    calls = grouped_calls(monkeypatch)
    x, w13, w2, _, _ = make_moe(52, 16, 24, 2, 1)  # more tokens than FEW_TOKENS: the crossover applies
    ids = (torch.arange(52) >= 12).to(torch.int64).unsqueeze(1)  # 12 rows for expert 0, 40 for expert 1
    weights = torch.rand(52, 1, generator=torch.Generator().manual_seed(3))
    lanes = vector_lanes()  # rows to a vector: 16 with AVX-512, 8 with AVX2 (then 12 rows are a block and 4 dot rows)
    expected = {16: ([12, 32], [0, 32]), 8: ([8, 40], [0, 40])}[lanes]
    for crossover, blocked in ((moe_crossover.DEFAULT_DOT_ROWS, expected[0]), (16, expected[1]),
                               (moe_cpu.SMALL_ROWS, [0, 0])):
        monkeypatch.setattr(moe_crossover, "dot_rows", lambda dim, inter, value=crossover: value)
        out, by_blas = cpu_c_moe(monkeypatch, 2, x, w13, w2, weights, ids)
        torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
        assert not by_blas and [row[4] for row in layout_rows(calls[-1])] == blocked
