"""Host pages a device attends on in place (engine/host_view.py): what each device may do, the refusals, and the
engine's choice between attending in place and streaming through the staging pool. On a GPU the views themselves
are tested in tests/test_engine_gpu.py."""

import pytest
import torch
from tiny_models import kv_bytes_per_token, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.engine.host_view import device_view, host_pages_in_place, streams_host_kv
from batchgen.engine.kv_pool import KVPool, PoolGeometry
from batchgen.engine.models.context import KVSpec
from batchgen.engine.reference import ReferenceRunner


def test_a_setting_wins_and_unset_only_a_device_that_cannot_read_host_pages_streams_them():
    for setting in (True, False):
        assert streams_host_kv(setting, "cpu") is setting and streams_host_kv(setting, "cuda") is setting
    assert streams_host_kv(None, "cpu") is False  # host pages are the CPU's own memory
    assert streams_host_kv(None, "mps") is True
    if not torch.cuda.is_available():  # a plan for a GPU made elsewhere: pinned memory is in its address space
        assert streams_host_kv(None, "cuda") is False
    assert host_pages_in_place(torch.device("cpu")) is None
    assert "no device view of host memory on meta" in host_pages_in_place(torch.device("meta"))


def test_device_views_refuse_what_a_gpu_cannot_address():
    with pytest.raises(ValueError, match="for a CUDA device, not cpu"):
        device_view(torch.zeros(4), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"needs pinned host memory .* this \(2, 3\) torch.float32 tensor is pageable"):
        device_view(torch.zeros(2, 3), torch.device("cuda"))


def test_a_pool_is_its_own_view_on_its_own_device():
    pool = KVPool(PoolGeometry(KVSpec(2, 1, 4, 4), 4, torch.float32), 3, torch.device("cpu"))
    assert pool.viewed_from(torch.device("cpu")) is pool


def test_a_cpu_engine_attends_on_host_pages_in_place_unless_told_to_stream(tmp_path):
    """The default attends in place (no staging pool); stream_host_kv true streams through one; both give the
    reference's greedy tokens while sequences decode from host pages."""
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 9, 17, 5, 30, 12, 21, 8))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=12)
    budget = kv_bytes_per_token(loaded) * 4 * 32  # 32 pages of 4 tokens for 8 sequences of up to 42
    tokens = {}
    for setting in (None, True):
        engine = Engine(loaded, page_size=4, kv_budget_bytes=budget, b_attn=3, b_moe=16, stream_host_kv=setting)
        assert engine.kv.stream_host is bool(setting)
        assert engine.kv.host_for_kernels is engine.kv.host  # a CPU's host pool is its own memory
        assert (engine.kv.stage.num_pages > 0) is bool(setting)
        results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=greedy) for i, p in enumerate(batch)])
        tokens[setting] = [r.outputs[0].token_ids for r in results]
        metrics = engine.metrics()
        assert metrics["yields"] > 0 and metrics["peak_suspended"] > 0, metrics
        assert metrics["host_kv_streamed"] is bool(setting)
        if setting:  # the staging pool's own decode batches (in place, host sequences join the resident ones)
            assert metrics["staged_decode_batches"] > 0, metrics
    assert tokens[None] == tokens[True] == expected
