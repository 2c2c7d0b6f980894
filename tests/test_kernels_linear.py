import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import gemm_onednn, linear_cpu, ops, registry


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls that reached the C kernel (the rest went to BLAS)."""
    if linear_cpu.unavailable():
        pytest.skip(linear_cpu.unavailable())
    calls = []

    class Counted:
        """The kernel, counting its calls' rows; still the registry's probe (a bare function was not: an engine
        whose `linear` backend was not yet resolved in this process failed on it)."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *args):
            calls.append(args[1])
            return self.kernel(*args)

        def unavailable(self):
            return self.kernel.unavailable()

    monkeypatch.setattr(linear_cpu, "_KERNEL", Counted(linear_cpu._KERNEL))
    return calls


def on_threads(threads: int, fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def test_c_kernel_reads_a_strided_bias_from_memory_it_holds(kernel_calls):
    """The bias's contiguous copy lived only while its pointer was taken: the kernel read freed memory."""
    g = torch.Generator().manual_seed(5)
    x, weight, biases = torch.randn(3, 133, generator=g), torch.randn(301, 133, generator=g), torch.randn(301, 2)
    bias = biases[:, 1]  # every other float
    for _ in range(3):
        torch.testing.assert_close(linear_cpu.linear_cpu(x, weight, bias).double(), reference(x, weight, bias),
                                   rtol=1e-5, atol=1e-4)
    assert kernel_calls == [3, 3, 3]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, linear_cpu.SMALL_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_c_kernel_matches_torch_in_whole_and_partial_row_blocks(rows, threads, with_bias, kernel_calls):
    """O = 301 (odd: the last output column alone) and D = 133 (a tail past the 16-lane vectors); the weight is large
    enough for the kernel (not left to BLAS as a cache-resident one)."""
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 133, generator=g), torch.randn(301, 133, generator=g)
    bias = torch.randn(301, generator=g) if with_bias else None
    out = on_threads(threads, linear_cpu.linear_cpu, x, weight, bias)
    torch.testing.assert_close(out.double(), reference(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert kernel_calls == [rows]


def test_c_kernel_reads_a_column_slice_of_a_weight_in_place(kernel_calls):
    """A tensor-parallel rank's o_proj is a view of columns: rows `stride(0)` apart, each dense."""
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(256, 512, generator=g)
    weight, x = whole[:, 256:], torch.randn(3, 2, 256, generator=g)
    out = linear_cpu.linear_cpu(x, weight)
    assert out.shape == (3, 2, 256)
    torch.testing.assert_close(out.double(), reference(x, weight, None), rtol=1e-5, atol=1e-4)
    assert kernel_calls == [6]


@pytest.fixture
def onednn_calls(monkeypatch):
    """Row counts of the calls that reached oneDNN's GEMM (chosen over MKL whatever this CPU's vendor)."""
    if gemm_onednn.unavailable():
        pytest.skip(gemm_onednn.unavailable())
    monkeypatch.setattr(gemm_onednn, "blas_preferred", lambda: False)
    calls = []
    gemm = gemm_onednn._onednn_linear
    monkeypatch.setattr(gemm_onednn, "_onednn_linear", lambda x, *args: calls.append(x.shape[0]) or gemm(x, *args))
    return calls


def test_many_rows_go_to_onednn_and_small_weights_stay_with_blas(kernel_calls, onednn_calls):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 256, generator=g)
    many = torch.randn(linear_cpu.SMALL_ROWS + 1, 256, generator=g)
    torch.testing.assert_close(linear_cpu.linear_cpu(many, weight).double(), reference(many, weight, None),
                               rtol=1e-5, atol=1e-4)
    router = torch.randn(16, 512, generator=g)  # 32 KiB: cache-resident, BLAS's call is shorter
    x = torch.randn(2, 512, generator=g)
    torch.testing.assert_close(linear_cpu.linear_cpu(x, router), F.linear(x, router))
    assert linear_cpu.linear_cpu(torch.empty(0, 256), weight).shape == (0, 256)
    assert kernel_calls == [] and onednn_calls == [linear_cpu.SMALL_ROWS + 1]


@pytest.mark.parametrize("threads", [1, 2])
def test_onednn_gemm_matches_float64_on_strided_operands_with_rows_independent_of_the_call(threads, onednn_calls):
    """A column slice of a weight (a tensor-parallel o_proj), a strided x, a bias; every row of a part of the batch
    equals the same row of the whole batch bit for bit (outputs may not depend on batch composition)."""
    g = torch.Generator().manual_seed(threads)
    whole, bias = torch.randn(301, 266, generator=g), torch.randn(301, generator=g)
    weight, x = whole[:, 133:], torch.randn(97, 266, generator=g)[:, ::2]
    out = on_threads(threads, gemm_onednn.linear, x, weight, bias)
    torch.testing.assert_close(out.double(), reference(x, weight, bias), rtol=1e-5, atol=1e-4)
    for rows in (17, 40, 96):
        assert torch.equal(on_threads(threads, gemm_onednn.linear, x[:rows], weight, bias), out[:rows])
    assert onednn_calls == [97, 17, 40, 96]


def test_gemms_go_to_mkl_on_intel_cpus_only(monkeypatch):
    """MKL (F.linear, bit for bit) where torch's BLAS is MKL and the CPU is Intel's; oneDNN on AMD's, or without MKL."""

    if gemm_onednn.unavailable():
        pytest.skip(gemm_onednn.unavailable())
    calls = []
    gemm = gemm_onednn._onednn_linear
    monkeypatch.setattr(gemm_onednn, "_onednn_linear", lambda x, *args: calls.append(x.shape[0]) or gemm(x, *args))
    x, weight = torch.randn(40, 64), torch.randn(48, 64)
    cases = (("GenuineIntel", True, True), ("AuthenticAMD", True, False), ("GenuineIntel", False, False))
    try:
        for vendor, mkl, preferred in cases:
            monkeypatch.setattr(gemm_onednn, "this_vendor", lambda vendor=vendor: vendor)
            monkeypatch.setattr(torch.backends.mkl, "is_available", lambda mkl=mkl: mkl)
            gemm_onednn.blas_preferred.cache_clear()
            calls.clear()
            out = gemm_onednn.linear(x, weight)
            assert gemm_onednn.blas_preferred() is preferred and calls == ([] if preferred else [40])
            if preferred:
                assert torch.equal(out, F.linear(x, weight))
            else:
                torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    finally:
        gemm_onednn.blas_preferred.cache_clear()  # the next caller asks this machine again


def test_cpu_vendor_is_read_from_cpuinfo():
    from batchgen.kernels.cpu_identity import first_processor

    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\nvendor_id\t: other\n"
    assert first_processor(text)["vendor_id"] == "AuthenticAMD" and first_processor("") == {}


def test_onednn_gemm_falls_back_to_torch_where_torch_has_no_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    gemm_onednn.unavailable.cache_clear()
    try:
        assert gemm_onednn.unavailable() == "this torch is built without oneDNN (mkldnn)"
        monkeypatch.setattr(gemm_onednn, "_onednn_linear", lambda *args: pytest.fail("oneDNN called"))
        x, weight = torch.randn(20, 8), torch.randn(4, 8)
        assert torch.equal(gemm_onednn.linear(x, weight), F.linear(x, weight))
    finally:
        gemm_onednn.unavailable.cache_clear()  # the next caller checks this torch again


def test_a_weight_of_another_dtype_is_refused_by_torch_not_read_by_the_kernel(kernel_calls):
    x, weight = torch.randn(2, 256), torch.randn(256, 256, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="dtype"):
        linear_cpu.linear_cpu(x, weight)
    with pytest.raises(RuntimeError, match="dtype"):
        linear_cpu.linear_cpu(x, weight.float(), torch.zeros(256, dtype=torch.float64))
    assert kernel_calls == []


def test_ops_linear_checks_shapes_and_picks_the_c_kernel_on_cpu():
    with pytest.raises(ValueError, match=r"linear: x \[2, 5\] does not match weight \[3, 4\] in D"):
        ops.linear(torch.randn(2, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"linear: bias must be \[3\], got \[4\]"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))
    expected = "torch" if linear_cpu.unavailable() else "cpu_c"
    assert registry.resolve("linear", "cpu", torch.float32)[0] == expected
    assert registry.resolve("linear", "cpu", torch.float16)[0] == "torch"  # C kernel: fp32 only


def test_engine_projections_run_on_the_kernel_with_transformers_greedy_tokens(tmp_path, kernel_calls, onednn_calls):
    """A Mixtral wide enough that its projections take the C kernel (hidden 256: 256 KiB q_proj) decodes transformers'
    own greedy tokens; its decode steps really called the kernel and its prefill (29 rows) oneDNN."""
    from tiny_models import hf_greedy_batch, prompts, save_tiny_checkpoint

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine, Request, SamplingParams

    hf_model = save_tiny_checkpoint("mixtral", tmp_path, hidden_size=256, intermediate_size=128)
    loaded = load_model(str(tmp_path))
    batch = prompts(lengths=(3, 9, 17))
    expected = hf_greedy_batch(hf_model, batch, 12)
    requests = [Request(f"r{i}", p, sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                for i, p in enumerate(batch)]
    results = Engine(loaded, kv_budget_bytes=8 << 20).generate(requests)
    assert [r.outputs[0].token_ids for r in results] == expected
    assert 3 in kernel_calls  # decode steps of the three sequences
    assert 29 in onednn_calls  # the prefill's projections


def test_an_input_of_another_dtype_is_refused_as_f_linear_refuses_it():
    """Called directly (ops dispatches by the input's dtype), the kernel read a float64 input's bytes as floats."""
    with pytest.raises(RuntimeError, match="same dtype"):
        linear_cpu.linear_cpu(torch.randn(3, 130, dtype=torch.float64), torch.randn(200, 130))
