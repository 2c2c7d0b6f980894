"""kernels/capture.py: a recorded function's C kernel calls and torch ops replayed on new input values, and what a
recording refuses."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import capture, linear_cpu, norm_cpu, ops, write_kv_cpu


def _require_c(*modules):
    for module in modules:
        if module.unavailable():
            pytest.skip(module.unavailable())


def _block(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A C norm, a torch residual add, a C projection (its weight over linear_cpu's size floor), a torch silu."""
    h = x + ops.rms_norm(x, norm, 1e-6)
    return torch.nn.functional.silu(ops.linear(h, weight))


def test_replay_repeats_kernels_and_torch_ops_on_new_inputs():
    _require_c(norm_cpu, linear_cpu)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g)
    norm, weight = torch.rand(256, generator=g) + 0.5, torch.randn(192, 256, generator=g) / 16
    with capture.record() as recording:
        out = _block(x, norm, weight)
    assert recording.kernel_calls == 2 and recording.torch_ops == 2  # the add and the silu; views are not replayed
    for seed in (1, 2):
        fresh = torch.randn(3, 256, generator=torch.Generator().manual_seed(seed))
        x.copy_(fresh)
        recording.replay()
        torch.testing.assert_close(out, _block(fresh, norm, weight), rtol=0, atol=0)


@pytest.mark.parametrize("read", [
    pytest.param(lambda x: int(x.sum()), id="int"),
    pytest.param(lambda x: x.max().item(), id="item"),
    pytest.param(lambda x: capture.read_back(x), id="read_back"),
    pytest.param(lambda x: x[x > 0], id="boolean_index"),
    pytest.param(lambda x: torch.nonzero(x), id="nonzero"),
])
@pytest.mark.parametrize("capturing", [capture.record, capture.collect_effects], ids=["record", "cuda_graph"])
def test_values_read_back_to_the_host_refuse_the_recording(read, capturing):
    """Both captures: a CPU recording, and the effects kept while a CUDA graph captures (whose capture cannot wait for
    the device), which names the op instead of failing inside CUDA."""
    x = torch.randn(4)
    with pytest.raises(capture.CaptureRefused, match="host|depends on the input's values"):
        with capturing():
            read(x + 1)
    assert not capture.recording()
    with capturing():  # the thread records again once the refused capture is left
        x + 1


def test_effects_run_once_when_recorded_then_on_every_replay_with_copies():
    seen: list[torch.Tensor] = []
    x = torch.zeros(2)
    with capture.record() as recording:
        y = x * 2
        capture.effect(seen.append, y)
        assert seen == []  # deferred until the recording completes
    assert [t.tolist() for t in seen] == [[0.0, 0.0]]
    x.copy_(torch.tensor([1.0, 3.0]))
    recording.replay()
    assert [t.tolist() for t in seen] == [[0.0, 0.0], [2.0, 6.0]]
    assert all(t.data_ptr() != y.data_ptr() for t in seen)  # copies: the next replay overwrites y


def test_a_replay_on_fewer_real_rows_gives_effects_those_rows_and_their_count():
    """A recording of 4 rows (3 real when recorded) replayed with only 2 real (the rest padding): an effect's tensor
    of 4 rows comes narrowed to 2, a count of 4 as 2; a tensor of another length and another int pass as they are."""
    seen = []
    x = torch.arange(8.0).reshape(4, 2)
    with capture.record(rows=4, real_rows=3) as recording:
        capture.effect(lambda *args: seen.append(args), x * 1, 4, 7, torch.ones(3))
    assert seen[0][0].shape[0] == 3 and seen[0][1:3] == (3, 7)  # the recorded run's own real rows
    x.copy_(-x)
    recording.replay(rows=2)
    (rows, count, other, ones), = seen[1:]
    assert rows.tolist() == [[0.0, -1.0], [-2.0, -3.0]] and (count, other, ones.shape[0]) == (2, 7, 3)
    recording.replay(rows=4)
    assert seen[-1][0].shape[0] == 4 and seen[-1][1] == 4


def test_a_recorded_function_masks_the_rows_each_replay_pads():
    """`padding()` marks the rows past the real ones, in the recorded run and in each replay (marked before its
    calls run), so a recorded in-place mask follows every replay's real rows; None outside a recording."""
    ids = torch.arange(8).reshape(4, 2)
    assert capture.padding() is None
    with capture.record(rows=4, real_rows=3) as recording:
        masked = ids * 1
        masked.masked_fill_(capture.padding(), -1)
    assert masked.tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1]]
    recording.replay(rows=2)
    assert masked.tolist() == [[0, 1], [2, 3], [-1, -1], [-1, -1]]
    recording.replay(rows=4)
    assert masked.tolist() == ids.tolist()
    with capture.record() as unpadded:  # no row count: nothing to mask
        assert capture.padding() is None
    assert unpadded.padding is None


def test_a_recording_counts_the_memory_it_holds_of_its_own():
    """What its ops allocated or computed, once per storage: not its inputs, views or in-place results."""
    x = torch.zeros(1000)
    with capture.record() as recording:
        y = x * 2  # computed: 4,000 bytes
        y[:10].add_(1)  # a view, written in place: nothing new
        torch.empty(250)  # allocated: 1,000 bytes
    assert recording.nbytes == 5000


def test_a_refused_recording_leaves_no_effect():
    seen: list[int] = []
    with pytest.raises(capture.CaptureRefused):
        with capture.record():
            capture.effect(seen.append, 1)
            capture.read_back(torch.ones(1))
    assert seen == []


def test_a_kernel_reporting_another_status_on_replay_diverges():
    """write_kv reports the first slot past the cache: recorded in range, replayed past it."""
    _require_c(write_kv_cpu)
    k = torch.randn(2, 2, 8)
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([1, 6])
    with capture.record() as recording:
        ops.write_kv(k, k, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache.flatten(0, 1)[[1, 6]], k)
    slots.copy_(torch.tensor([2, 99]))
    with pytest.raises(capture.ReplayDiverged, match="returned 1, recorded -1"):
        recording.replay()


def test_in_place_ops_replay_in_place():
    x, acc = torch.ones(3), torch.zeros(3)
    with capture.record() as recording:
        acc.add_(x)
    recording.replay()
    recording.replay()
    assert acc.tolist() == [3.0, 3.0, 3.0]


def test_a_cuda_graph_capture_keeps_its_effects_for_after_each_replay():
    """collect_effects (what kernels/cuda_graph.py captures under): the effects inside are kept, not run, and run
    narrowed to a replay's real rows; nothing else is recorded; only `record` is a capture that replays calls (which
    is what refuses Triton's kernels: a CUDA graph sees them)."""
    seen = []
    x = torch.arange(8.0).reshape(4, 2)
    with capture.collect_effects(rows=4) as kept:
        assert capture.recording() and not capture.recording_calls()
        capture.effect(lambda *args: seen.append(args), x * 1, 4)
    assert seen == [] and kept.calls == [] and kept.tensors == []
    kept.run_effects(3)
    (rows, count), = seen
    assert rows.shape[0] == 3 and count == 3
    with capture.record():
        assert capture.recording_calls()
