"""The engine on a GPU (run with `-m gpu` on a CUDA host): with a KV budget far below the batch's, sequences move
between the device's KV pool and the host KV store (copies in both directions) and host-resident ones decode on their
pinned host pages in place (a view of them in the GPU's address space) or through the staging pool; decode steps
replay CUDA graphs (GQA and MLA models). Greedy tokens must equal the reference runner's on the same device."""

import pytest
import torch
from tiny_models import kv_bytes_per_token, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
from batchgen.engine.host_view import device_view, host_pages_in_place, streams_host_kv
from batchgen.engine.kv_pool import KVPool, PoolGeometry
from batchgen.engine.models.context import KVSpec
from batchgen.engine.reference import ReferenceRunner
from batchgen.kernels import capture, cuda_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_a_device_view_is_the_pinned_host_memory_itself():
    """Kernels read what the host wrote and the host reads what kernels wrote, in every KV dtype (bfloat16 goes
    through bytes); a pool's view on the GPU is its pinned pages."""
    assert host_pages_in_place(torch.device("cuda")) is None
    assert streams_host_kv(None, "cuda") is False
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        host = torch.arange(2 * 3 * 5, dtype=dtype).view(2, 3, 5).pin_memory()
        view = device_view(host, torch.device("cuda"))
        assert view.is_cuda and view.dtype == dtype and view.shape == host.shape
        torch.testing.assert_close(view.sum(dim=2).cpu(), host.sum(dim=2))
        view[1, 2].fill_(7)
        torch.cuda.synchronize()
        assert host[1, 2].tolist() == [7] * 5 and host[0, 0, 1].item() == 1
    empty = device_view(torch.zeros(0, 3, 5).pin_memory(), torch.device("cuda"))  # (never reports pinned)
    assert empty.is_cuda and empty.shape == (0, 3, 5)
    pool = KVPool(PoolGeometry(KVSpec(2, 1, 4, 4), 4, torch.bfloat16), 3, torch.device("cpu"), pin=True)
    seen = pool.viewed_from(torch.device("cuda"))
    assert seen.k.data_ptr() == pool.k.data_ptr() and seen.v.is_cuda


@pytest.mark.parametrize("mode,stream_host_kv", [("coroutine", None), ("coroutine", True), ("lockstep", None)])
def test_evictions_through_the_host_kv_store_keep_greedy_tokens_on_cuda(mode, stream_host_kv, tmp_path):
    save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path), device="cuda")
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 9, 17, 5, 30, 12, 21, 8))
    expected = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=MAX_TOKENS)
    budget = kv_bytes_per_token(loaded) * 4 * 32  # 32 pages of 4 tokens for 8 sequences of up to 46
    engine = Engine(loaded, mode=mode, page_size=4, kv_budget_bytes=budget, b_attn=3, b_moe=16,
                    stream_host_kv=stream_host_kv)
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p, sampling=GREEDY) for i, p in enumerate(batch)])
    assert [r.error for r in results] == [None] * len(batch)
    got = {r.request_id: r.outputs[0].token_ids for r in results}
    assert [got[f"r{i}"] for i in range(len(batch))] == expected
    metrics = engine.metrics()
    assert metrics["yields"] > 0 and metrics["bytes_moved"] > 0
    if mode == "lockstep":  # preempted sequences wait in host pages and come back to the device
        assert metrics["restores"] > 0
    else:  # yielded sequences decode from host pages: in place by default, else through the staging pool
        assert metrics["staged_decode_batches"] > 0
        assert engine.kv.stream_host is metrics["host_kv_streamed"] is bool(stream_host_kv)
        assert (engine.kv.stage.num_pages > 0) is bool(stream_host_kv)
        # either way the kernels address the host pool's pinned pages themselves (the staging pool gathers from them)
        view = engine.kv.host_for_kernels
        assert view.k.is_cuda and view.k.data_ptr() == engine.kv.host.k.data_ptr()


COUNTERS = ("moe_calls", "mean_expert_batch", "expert_histogram", "max_ffn_tokens", "decode_steps", "generated_tokens")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])  # GQA, and MLA's latent KV
def test_decode_steps_replayed_from_cuda_graphs_give_the_reference_tokens_and_the_eager_counters(arch, tmp_path):
    """21 sequences finishing in waves (21, 19, 17 decoding, padded to 24 rows), then a tail of one: every batch size
    is captured once as a CUDA graph and replayed; tokens and counters equal an engine that runs every step eagerly."""
    save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path), device="cuda")
    max_tokens = (5, 5, 7, 7) + (10,) * 16 + (24,)
    batch = prompts(vocab_size=loaded.model.vocab_size, lengths=tuple(5 + 3 * i for i in range(len(max_tokens))))
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=n,
                                                                              ignore_eos=True))
                for i, (p, n) in enumerate(zip(batch, max_tokens))]
    longest = ReferenceRunner(loaded.model).generate(batch, max_new_tokens=max(max_tokens))
    expected = [tokens[:n] for tokens, n in zip(longest, max_tokens)]
    engines, tokens = {}, {}
    for flag in (True, False):  # one after the other: the model feeds its routing counts to the newest engine
        engines[flag] = Engine(loaded, page_size=4, decode_graphs=flag)
        tokens[flag] = [r.outputs[0].token_ids for r in engines[flag].generate(requests)]
    assert tokens[True] == expected and tokens[False] == expected
    graphed, eager = engines[True].metrics(), engines[False].metrics()
    assert graphed["decode_graph_refusals"] == 0, graphed
    assert graphed["decode_graph_captures"] >= 2 and graphed["decode_graph_replays"] >= 10, graphed
    assert {k: graphed[k] for k in COUNTERS} == {k: eager[k] for k in COUNTERS}


def test_a_warm_up_refused_mid_way_is_ordered_before_the_eager_run_that_replaces_it():
    """cuda_graph.record warms up on a side stream; a refusal there leaves the kernels it queued before running. The
    caller then runs the step eagerly on its own stream, which must not overtake them (they write the same pages)."""
    written = torch.zeros(1, device="cuda")

    def refused() -> torch.Tensor:
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time queued ahead of the write
        written.fill_(1.0)
        raise capture.CaptureRefused("a value read back")

    with pytest.raises(capture.CaptureRefused):
        cuda_graph.record(refused, None, None, torch.device("cuda"))
    seen = written.clone()  # on the caller's stream, queued at once
    assert seen.item() == 1.0


def test_a_process_granted_part_of_a_gpu_sees_only_its_share_free():
    """Engine actors granted half a GPU each sized their KV pools from all of its free memory (prepare_engine_process
    now sets the per-process memory fraction, which available_memory_bytes honours)."""
    from batchgen.engine.kv_budget import available_memory_bytes

    device = torch.device("cuda")
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    free, total = torch.cuda.mem_get_info(device)
    try:
        torch.cuda.set_per_process_memory_fraction(0.25, device)
        assert available_memory_bytes(device) == min(free, int(0.25 * total) - torch.cuda.memory_reserved(device))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert available_memory_bytes(device) == min(free, total - torch.cuda.memory_reserved(device))
    del held


def test_a_tied_head_saved_apart_loads_onto_the_gpu(tmp_path):
    """The tied head's check compared the CUDA parameter with the tensor as read, on the host: torch refuses two
    tensors on different devices, so a checkpoint saving both equal heads did not load on a GPU."""
    from safetensors.torch import load_file, save_file

    save_tiny_checkpoint("mixtral", tmp_path, tie_word_embeddings=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    embeddings = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embeddings.clone()}, path, metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), device="cuda")
    assert torch.equal(loaded.model.lm_head.weight.cpu(), embeddings)
