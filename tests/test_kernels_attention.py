import pytest
import torch

from batchgen.kernels import ops, registry
from batchgen.kernels.attention_torch import paged_decode_attention_torch


def naive_attention(q, k, v, scale, visible):
    """float64 softmax attention of q [Lq, H, Dk] over k/v [Lk, Hkv, D] with a [Lq, Lk] bool mask."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("backend", ["torch", "cpu_c"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 1)])
@pytest.mark.parametrize("dim_k,dim_v", [(16, 16), (24, 8), (64, 40), (32, 88)])  # 88: 4 + 1 vectors + a tail
def test_prefill_matches_naive_with_prefix(heads, kv_heads, dim_k, dim_v, backend):
    g = torch.Generator().manual_seed(1)
    # whole prompts of similar and very different lengths (padded groups; past one C kernel item of 32 query rows)
    # and cached-prefix continuations; k and v as views of one fused projection (strided tokens)
    lens_q, lens_k = [5, 1, 7, 3, 6, 17, 2, 16, 45, 0], [5, 4, 12, 3, 6, 17, 2, 16, 70, 3]
    q = torch.randn(sum(lens_q), heads, dim_k, generator=g)
    kv = torch.randn(sum(lens_k), kv_heads, dim_k + dim_v, generator=g)
    k, v = kv[..., :dim_k], kv[..., dim_k:]
    scale = dim_k**-0.5
    with registry.use_backend("prefill_attention", backend):
        out = ops.prefill_attention(q, k, v, cu(lens_q), cu(lens_k), scale)
    assert registry.last_used("prefill_attention") == backend
    assert out.shape == (sum(lens_q), heads, dim_v)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
        visible = torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)
        expected = naive_attention(
            q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], scale, visible
        )
        torch.testing.assert_close(out[cq[b] : cq[b + 1]].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu_c"])
def test_prefill_rejects_more_queries_than_keys(backend):
    q = torch.randn(5, 2, 8)
    k = v = torch.randn(4, 2, 8)
    with registry.use_backend("prefill_attention", backend), pytest.raises(
            ValueError, match="sequence 1 has 3 queries but only 2 keys"):
        ops.prefill_attention(q, k, v, cu([2, 3]), cu([2, 2]), 1.0)


def test_prefill_cpu_c_rejects_offsets_past_the_rows_given():
    """The C kernel trusted cu_seqlens: offsets past q's or k's rows wrote past `out` (heap corruption)."""
    q, k, v = torch.randn(4, 2, 16), torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    with registry.use_backend("prefill_attention", "cpu_c"):
        with pytest.raises(ValueError, match=r"cu_seqlens_q must rise from 0 or more to at most the 4 rows given, "
                                             r"got \[0, 6\]"):
            ops.prefill_attention(q, k, v, cu([6]), cu([6]), 1.0)
        with pytest.raises(ValueError, match=r"cu_seqlens_k .* at most the 6 rows given, got \[0, 4, 2\]"):
            ops.prefill_attention(q, k, v, torch.tensor([0, 2, 4]), torch.tensor([0, 4, 2]), 1.0)


def test_prefill_rejects_bad_gqa():
    with pytest.raises(ValueError, match="H = 3 is not a multiple of Hkv = 2"):
        ops.prefill_attention(
            torch.randn(2, 3, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), cu([2]), cu([2]), 1.0
        )


def make_paged(seq_lens, page_size, kv_heads, dim_k, dim_v, dtype=torch.float32, seed=0):
    """Caches whose pages are handed out in a shuffled order, with -1 past each sequence's last page."""
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim_k, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim_v, generator=g).to(dtype)
    free = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(seq_lens), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def naive_decode(q, k_cache, v_cache, table, seq_lens, scale):
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = table[b, : -(-n // k_cache.shape[1])].long()
        keys = k_cache[pages].flatten(0, 1)[:n]
        values = v_cache[pages].flatten(0, 1)[:n]
        out.append(naive_attention(q[b : b + 1], keys, values, scale, torch.ones(1, n, dtype=torch.bool))[0])
    return torch.stack(out)


# Lengths straddle page boundaries (one page, one past it, a single key) and span several splits
# and key blocks.
SEQ_LENS = [8, 9, 1, 23, 100]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 1), (16, 2)])
def test_decode_torch_matches_naive(heads, kv_heads):
    k_cache, v_cache, table, lens = make_paged(SEQ_LENS, 8, kv_heads, 16, 12)
    q = torch.randn(len(SEQ_LENS), heads, 16)
    out = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.25)
    torch.testing.assert_close(
        out.double(), naive_decode(q, k_cache, v_cache, table, lens, 0.25), rtol=1e-5, atol=1e-5
    )


def test_decode_rejects_lengths_beyond_the_page_table():
    k_cache, v_cache, table, lens = make_paged([5, 9], 4, 1, 8, 8)
    lens[1] = table.shape[1] * 4 + 1
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 17 exceeds page_table capacity 4 pages x 4"):
        ops.paged_decode_attention(torch.randn(2, 1, 8), k_cache, v_cache, table, lens, 1.0)


def test_decode_cpu_c_rejects_pages_outside_the_cache_and_keeps_nan_as_torch_does():
    """It read past the pool for a page id past it, before it for -1 (torch's indexing wraps it to the last page);
    and a NaN score gave zeros where torch gives NaN (hiding a numerical blow-up)."""
    from batchgen.kernels.attention_cpu import paged_decode_attention_cpu

    k_cache, v_cache, table, lens = make_paged([5, 9], 4, 1, 8, 8)
    q = torch.randn(2, 1, 8)
    for page in (k_cache.shape[0], -1):
        bad = table.clone()
        bad[1, 2] = page
        with pytest.raises(ValueError, match=rf"sequence 1 reads pages \[\d+, \d+, {page}\], not all in \[0, "
                                             rf"{k_cache.shape[0]}\)"):
            paged_decode_attention_cpu(q, k_cache, v_cache, bad, lens, 1.0)
    unused = table.clone()
    unused[0, 3] = -1  # past sequence 0's 5 tokens: never read
    torch.testing.assert_close(paged_decode_attention_cpu(q, k_cache, v_cache, unused, lens, 1.0),
                               paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 1.0))
    q[0, 0, 0] = float("nan")
    out = paged_decode_attention_cpu(q, k_cache, v_cache, table, lens, 1.0)
    assert out[0].isnan().all() and not out[1].isnan().any()
    assert paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 1.0)[0].isnan().all()


def test_decode_rejects_a_cache_of_another_dtype_than_the_queries():
    """A backend picked by q's dtype would read the cache's bytes as q's type, past its end for a wider one."""
    k_cache, v_cache, table, lens = make_paged([5, 9], 4, 1, 8, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"q, k_cache, v_cache dtypes differ: torch.float32, torch.float16"):
        ops.paged_decode_attention(torch.randn(2, 1, 8), k_cache, v_cache, table, lens, 1.0)


def test_decode_torch_chunks_large_batches(monkeypatch):
    import batchgen.kernels.attention_torch as attention_torch

    k_cache, v_cache, table, lens = make_paged([5, 17, 3, 30, 2], 4, 2, 8, 8)
    q = torch.randn(5, 4, 8)
    whole = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw),
    )
    monkeypatch.setattr(attention_torch, "DECODE_GATHER_BUDGET", 2 * 32 * 2 * 16)
    chunked = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3)
    assert len(calls) > 1
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize(
    "heads,kv_heads,dim_k,dim_v,dtype,min_keys",
    [
        (4, 4, 16, 16, torch.float32, 256),  # one split each
        (4, 1, 16, 8, torch.float32, 8),  # 100 keys in 13 splits, 23 in 3, 9 in 2
        (8, 1, 24, 16, torch.float16, 40),
        (16, 2, 16, 16, torch.float16, 16),
        (48, 1, 72, 512, torch.float32, 32),  # MLA-like: a KV head's 48 query heads in 3 blocks of 16 at Dv 512
    ],
)
@pytest.mark.triton_cpu
def test_decode_triton_matches_torch(heads, kv_heads, dim_k, dim_v, dtype, min_keys):
    from batchgen.kernels.decode_triton import paged_decode_attention_triton

    k_cache, v_cache, table, lens = make_paged(SEQ_LENS, 8, kv_heads, dim_k, dim_v, dtype=dtype)
    q = torch.randn(len(SEQ_LENS), heads, dim_k).to(dtype)
    expected = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, dim_k**-0.5)
    got = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, dim_k**-0.5, min_keys_per_split=min_keys)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.triton_cpu
def test_decode_triton_gives_a_sequence_the_same_bits_whatever_its_neighbours():
    """Its splits follow from its own length: not from the page table's width, which a longer neighbour (or a decode
    graph's padding) sets."""
    from batchgen.kernels.decode_triton import paged_decode_attention_triton

    k_cache, v_cache, table, lens = make_paged([300, 1000], 16, 1, 16, 16)
    q = torch.randn(2, 4, 16)
    together = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.25)
    alone = paged_decode_attention_triton(q[:1], k_cache, v_cache, table[:1, :19], lens[:1], 0.25)
    assert torch.equal(alone[0], together[0])


@pytest.mark.triton_cpu
def test_decode_triton_gives_a_sequence_of_no_keys_zeros_as_the_other_backends_do():
    """Every split of a length-0 row had lse -inf, and their merge divided 0 by 0 (NaN) where C and torch give 0."""
    from batchgen.kernels.decode_triton import paged_decode_attention_triton

    k_cache, v_cache, table, lens = make_paged([5, 0], 4, 1, 16, 16)
    out = paged_decode_attention_triton(torch.randn(2, 4, 16), k_cache, v_cache, table, lens, 0.25)
    assert out[1].eq(0).all() and out[0].isfinite().all()


# KV groups of 1, 4 and 8 query heads (taken four at a time), and of 6 and 3 (four, then one by one)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 1), (16, 2), (12, 2), (6, 2)])
@pytest.mark.parametrize("page_size", [8, 64])
def test_decode_cpu_c_matches_naive(heads, kv_heads, page_size):
    from batchgen.kernels.attention_cpu import paged_decode_attention_cpu, unavailable

    if unavailable():
        pytest.skip(unavailable())
    lens = [*SEQ_LENS, page_size, page_size + 1, 0]  # page boundaries and an empty sequence
    k_cache, v_cache, table, seq_lens = make_paged(lens, page_size, kv_heads, 16, 12)
    q = torch.randn(len(lens), heads, 16)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, 0.25)
    expected = naive_decode(q[:-1], k_cache, v_cache, table[:-1], seq_lens[:-1], 0.25)
    torch.testing.assert_close(out[:-1].double(), expected, rtol=1e-5, atol=1e-5)
    assert out[-1].eq(0).all()


@pytest.mark.parametrize("dim_v", [64, 128, 80, 200])
def test_decode_cpu_c_sums_values_in_register_blocks_and_a_tail(dim_v):
    """Four query heads per KV head sum V in register blocks (64 dims with AVX-512, 16 with AVX2), then the dims past
    the last block one by one (80, 200: blocks and a tail); a row of eight vectors (64 dims with AVX2, 128 with
    AVX-512) one head at a time over whole rows."""
    from batchgen.kernels.attention_cpu import paged_decode_attention_cpu, unavailable

    if unavailable():
        pytest.skip(unavailable())
    lens = [*SEQ_LENS, 40, 0]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 16, 2, 64, dim_v, seed=dim_v)
    q = torch.randn(len(lens), 8, 64)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, 0.125)
    expected = naive_decode(q[:-1], k_cache, v_cache, table[:-1], seq_lens[:-1], 0.125)
    torch.testing.assert_close(out[:-1].double(), expected, rtol=1e-5, atol=1e-5)
    assert out[-1].eq(0).all()


def test_decode_cpu_c_splits_only_calls_that_read_enough_over_threads():
    """A small call runs on one thread (starting another costs more than it saves); one reading more than three
    threads' worth of K/V runs on three, with the same result as the torch path."""
    from batchgen.kernels import attention_cpu

    if attention_cpu.unavailable():
        pytest.skip(attention_cpu.unavailable())
    assert attention_cpu.threads_for(attention_cpu.THREAD_BYTES - 1, 8) == 1
    assert attention_cpu.threads_for(2 * attention_cpu.THREAD_BYTES, 8) == 2
    assert attention_cpu.threads_for(100 * attention_cpu.THREAD_BYTES, 3) == 3
    kv_heads, dim = 2, 64
    per_token = kv_heads * 2 * dim * 4
    tokens = 3 * attention_cpu.THREAD_BYTES // per_token + 1
    lens = [tokens // 7] * 6 + [tokens - 6 * (tokens // 7)]
    k_cache, v_cache, table, seq_lens = make_paged(lens, 64, kv_heads, dim, dim)
    q = torch.randn(len(lens), 8, dim)
    assert attention_cpu.threads_for(int(seq_lens.sum()) * per_token, 3) == 3
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out = attention_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    expected = paged_decode_attention_torch(q, k_cache, v_cache, table, seq_lens, dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu_c", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_mla_latent_decode(backend):
    """DeepSeek-V3 absorbed MLA: one KV head, K = [latent | rope] (576), V = the latent part of K (512)."""
    rank, rope = 512, 64
    k_cache, _, table, lens = make_paged([3, 17], 16, 1, rank + rope, 1, seed=3)
    v_cache = k_cache[..., :rank]
    q = torch.randn(2, 4, rank + rope)
    scale = (128 + rope) ** -0.5
    with registry.use_backend("paged_decode_attention", backend):
        out = ops.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    assert registry.last_used("paged_decode_attention") == backend
    assert out.shape == (2, 4, rank)
    torch.testing.assert_close(
        out.double(), naive_decode(q, k_cache, v_cache, table, lens, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "backend,dtype",
    [("torch", torch.float32), ("torch", torch.float16), ("cpu_c", torch.float32),
     pytest.param("triton", torch.float32, marks=pytest.mark.triton_cpu),
     pytest.param("triton", torch.float16, marks=pytest.mark.triton_cpu)],
)
def test_write_kv_then_decode(backend, dtype):
    page_size, kv_heads = 4, 2
    k_cache = torch.zeros(6, page_size, kv_heads, 8, dtype=dtype)
    v_cache = torch.zeros(6, page_size, kv_heads, 4, dtype=dtype)
    slots = torch.tensor([5 * 4 + 3, 2 * 4 + 0, -1, 0 * 4 + 1], dtype=torch.int64)
    k = torch.randn(4, kv_heads, 8).to(dtype)
    v = torch.randn(4, kv_heads, 4).to(dtype)
    with registry.use_backend("write_kv", backend):
        ops.write_kv(k, v, k_cache, v_cache, slots)
    assert registry.last_used("write_kv") == backend
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[t]) and torch.equal(flat_v[slot], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert flat_k[untouched].eq(0).all() and flat_v[untouched].eq(0).all()


def test_write_kv_torch_rejects_non_flat_pages():
    cache = torch.zeros(4, 2, 4, 8).transpose(0, 1)  # [pages=2, page_size=4, ...] with pages not contiguous
    with pytest.raises(ValueError, match="k_cache pages are not laid out contiguously"):
        ops.write_kv(
            torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), cache, cache, torch.zeros(1, dtype=torch.int64)
        )


_UNDER_A_MEMORY_LIMIT = r"""
import resource, sys, torch
from batchgen.kernels.attention_cpu import paged_decode_attention_cpu
from batchgen.kernels.prefill_cpu import prefill_attention_cpu

torch.set_num_threads(1)

def vm_bytes():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024

def limited(call, headroom):
    call(small=True)  # compiled, warm
    args = call(small=False, build=True)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + headroom, resource.RLIM_INFINITY))
    try:
        call(*args)
    except MemoryError as e:
        print("MemoryError:", e)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

def prefill(*args, small=False, build=False):
    if args:
        return prefill_attention_cpu(*args)
    keys = 4 if small else 1 << 18  # a K^T buffer of 64 MiB, past the limit's headroom
    q, k, v = torch.randn(1, 1, 64), torch.randn(keys, 1, 64), torch.randn(keys, 1, 64)
    args = (q, k, v, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, keys], dtype=torch.int32), 1.0)
    return args if build else prefill_attention_cpu(*args)

def decode(*args, small=False, build=False):
    if args:
        return paged_decode_attention_cpu(*args)
    heads = 4 if small else 200_000  # an accumulator of 51 MB a thread, past the headroom left beside the output
    cache = torch.randn(2, 4, 1, 64)
    args = (torch.randn(1, heads, 64), cache, cache.clone(), torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32), 1.0)
    return args if build else paged_decode_attention_cpu(*args)

limited(prefill, 16 << 20)
limited(decode, (200_000 * 64 * 4) + (16 << 20))
"""


def test_cpu_c_attention_kernels_report_buffers_they_cannot_allocate():
    """Their working buffers came from unchecked mallocs: a sequence long enough (or heads enough) to exhaust the
    memory left wrote through a NULL pointer and killed the process; now a MemoryError names the call."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNDER_A_MEMORY_LIMIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "MemoryError: prefill_attention: no memory for the working buffers of sequences up to 262144 keys",
        "MemoryError: paged_decode_attention: no memory for the working buffers of 200000 query heads",
    ]
