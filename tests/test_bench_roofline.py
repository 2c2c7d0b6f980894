"""bench/roofline.py's measured peaks: the C streaming read, which prices every bound's memory time, must read every
element once (a loop that skipped some would report a faster read and a looser bound); the GEMM runs in the
systems' dtype."""

import pytest
import torch
from bench_helpers import import_bench


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4096 + 17, 1_000_003])
def test_read_sum_adds_every_element(monkeypatch, n):
    roofline = import_bench(monkeypatch, "roofline")
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5  # positive: no cancellation
    assert roofline.read_sum(x) == pytest.approx(x.double().sum().item(), rel=1e-5, abs=1e-6)


def test_read_sum_refuses_what_it_cannot_stream(monkeypatch):
    roofline = import_bench(monkeypatch, "roofline")
    with pytest.raises(ValueError, match="dense float32 CPU tensor, got torch.float64"):
        roofline.read_sum(torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        roofline.read_sum(torch.ones(8, 2)[:, 0])


def test_the_gemm_peak_is_measured_in_the_systems_dtype(monkeypatch):
    """bct --dtype bfloat16 priced its compute at a float32 GEMM's rate (on a GPU's tensor cores several times
    slower than bfloat16's): its bounds were not bounds."""
    roofline = import_bench(monkeypatch, "roofline")
    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(a.dtype) or mm(a, b))
    peaks = roofline.measure_peaks(gemm_size=64, stream_mib=1, repeats=1, dtype=torch.bfloat16)
    assert set(seen) == {torch.bfloat16} and peaks.matmul_flops > 0


def test_a_step_without_logits_reads_no_lm_head(monkeypatch):
    roofline = import_bench(monkeypatch, "roofline")
    shape = roofline.MoEShape(vocab=100, hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, experts=4, top_k=2,
                              intermediate=16, dtype_bytes=4)
    chunk = roofline.StepShape(prompt_tokens=10, prompt_attended=55)
    done = roofline.StepShape(prompt_tokens=10, prompt_attended=55, prompts_completed=1)
    (_, without), (_, with_head) = roofline.step_cost(shape, chunk), roofline.step_cost(shape, done)
    assert with_head - without == 100 * 8 * 4  # the head's weights, read only when a row needs its logits


@pytest.mark.gpu
def test_the_gpu_gemm_peak_is_not_launch_bound(monkeypatch):
    """One 2048-cube bfloat16 GEMM a timing measured an H100's tensor cores at about half their rate (a launch and a
    synchronisation take about as long as the GEMM): every compute-bound step's bound was twice too loose. The peak
    must come within 15 % of the rate CUDA events time on the device's own clock."""
    roofline = import_bench(monkeypatch, "roofline")
    device = torch.device("cuda")
    peaks = roofline.measure_peaks(device=device, stream_mib=64, dtype=torch.bfloat16)
    size, calls = 8192, 20
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.mm(a, b)
    start.record()
    for _ in range(calls):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    events_rate = calls * 2 * size**3 / (start.elapsed_time(end) / 1e3)
    assert peaks.matmul_flops >= 0.85 * events_rate, (peaks.matmul_flops, events_rate)
