"""Decode steps replayed from recordings of their forward (engine/decode_graphs.py): transformers' greedy tokens
whatever is replayed, counters equal to an engine that runs every step eagerly, refusals that fall back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tiny_models import hf_greedy, prompts, save_tiny_checkpoint

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams, decode_graphs
from batchgen.kernels import attention_cpu, capture, moe_cpu, ops, registry

COUNTERS = ("moe_calls", "mean_expert_batch", "expert_histogram", "max_ffn_tokens", "decode_steps", "generated_tokens")


@pytest.fixture(autouse=True)
def _c_kernels():
    if attention_cpu.unavailable() or moe_cpu.unavailable():
        pytest.skip(attention_cpu.unavailable() or moe_cpu.unavailable())


def _requests(vocab_size: int, max_tokens: tuple[int, ...]) -> list[Request]:
    batch = prompts(vocab_size=vocab_size, lengths=tuple(5 + 3 * i for i in range(len(max_tokens))))
    return [Request(f"r{i}", prompt_token_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=n,
                                                                          ignore_eos=True))
            for i, (p, n) in enumerate(zip(batch, max_tokens))]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "llama", "deepseek_v3"])
def test_replayed_steps_give_transformers_greedy_tokens_and_the_eager_engines_counters(arch, tmp_path):
    """Four sequences finishing one after another: batches of 4, 3, 2 and 1 each repeat, pages of 4 tokens carry the
    page tables through several recorded widths."""
    hf = save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (6, 12, 20, 30))
    engines, tokens = {}, {}
    for flag in (True, False):
        engines[flag] = Engine(loaded, page_size=4, decode_graphs=flag)
    for flag in (True, False):  # both built first: each step's routing counts for the engine stepping, not the newest
        tokens[flag] = [r.outputs[0].token_ids for r in engines[flag].generate(requests)]
    expected = [hf_greedy(hf, r.prompt_token_ids, r.sampling.max_tokens) for r in requests]
    assert tokens[True] == expected and tokens[False] == expected
    replayed, eager = engines[True].metrics(), engines[False].metrics()
    # every batch size is recorded, and most steps replay (a new shape costs an eager step and a recorded one)
    assert replayed["decode_graph_captures"] >= 4, replayed
    assert replayed["decode_graph_replays"] >= replayed["decode_steps"] // 2, replayed
    assert replayed["decode_graph_refusals"] == 0
    assert eager["decode_graph_captures"] == eager["decode_graph_replays"] == 0
    assert {k: replayed[k] for k in COUNTERS} == {k: eager[k] for k in COUNTERS}


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_recorder_that_runs_the_step_once_before_recording_it_replays_each_steps_positions(arch, tmp_path,
                                                                                             monkeypatch):
    """The CUDA recorder runs the step eagerly, then captures it: the rotary tables the first run cached on the
    step's context were read by the capture, not computed, so every replay rotated by the captured step's positions
    (shown here with the CPU recorder behind the same first run: there is no GPU)."""
    recorder = decode_graphs.RECORDERS["cpu"]

    def run_then_record(fn, rows, size, device):
        fn()
        return recorder(fn, rows, size, device)

    monkeypatch.setitem(decode_graphs.RECORDERS, "cpu", run_then_record)
    hf = save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (6, 12, 20, 30))
    engine = Engine(loaded, page_size=4)
    tokens = [r.outputs[0].token_ids for r in engine.generate(requests)]
    assert tokens == [hf_greedy(hf, r.prompt_token_ids, r.sampling.max_tokens) for r in requests]
    assert engine.metrics()["decode_graph_replays"] > 0


@pytest.mark.parametrize("arch", ["mixtral", "llama"])
def test_larger_batches_replay_padded_to_a_recorded_size(arch, tmp_path, monkeypatch):
    """21 sequences finishing in three waves (21, 19, 17 decoding): each batch is padded to 24 rows with copies of
    its first sequence, recorded once and replayed at every size; the padding rows write no KV, attend to one key and
    join no expert; transformers' greedy tokens, and counters equal to an eager engine's (the padding's routing and
    rows not counted)."""
    replays, seen = [], {"slots": [], "seq_lens": [], "ids": []}  # the tensors the recording's last calls took
    replay = capture.Recording.replay

    def replay_and_read(self, rows=None):
        replay(self, rows)
        replays.append((rows, self.rows, *(seen[name][-1].tolist() if seen[name] else None for name in seen)))

    monkeypatch.setattr(capture.Recording, "replay", replay_and_read)
    write_kv, attention = ops.write_kv, ops.paged_decode_attention
    monkeypatch.setattr(ops, "write_kv", lambda k, v, k_cache, v_cache, slots: seen["slots"].append(slots)
                        or write_kv(k, v, k_cache, v_cache, slots))
    monkeypatch.setattr(ops, "paged_decode_attention", lambda q, k, v, table, lens, scale: seen["seq_lens"].append(lens)
                        or attention(q, k, v, table, lens, scale))
    def seeing_ids(moe):
        return lambda x, w1, w2, weights, ids: seen["ids"].append(ids) or moe(x, w1, w2, weights, ids)

    for name in ("fused_moe", "fused_moe_packed"):
        monkeypatch.setattr(ops, name, seeing_ids(getattr(ops, name)))
    hf = save_tiny_checkpoint(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (5, 5, 7, 7) + (10,) * 17)
    engines, tokens = {}, {}
    for flag in (True, False):
        engines[flag] = Engine(loaded, page_size=4, decode_graphs=flag)
        tokens[flag] = [r.outputs[0].token_ids for r in engines[flag].generate(requests)]
    expected = [hf_greedy(hf, r.prompt_token_ids, r.sampling.max_tokens) for r in requests]
    assert tokens[True] == expected and tokens[False] == expected
    replayed, eager = engines[True].metrics(), engines[False].metrics()
    assert {rows for rows, *_ in replays} >= {21, 19, 17} and {recorded for _, recorded, *_ in replays} == {24}
    # each replay's values in the recording's last KV write, attention and MoE call: the padding writes no KV,
    # attends to one key and routes to no expert (an id < 0)
    for rows, _, slots, seq_lens, ids in replays:
        assert len(slots) == 24 and slots[rows:] == [-1] * (24 - rows) and min(slots[:rows]) >= 0
        assert seq_lens[rows:] == [1] * (24 - rows) and min(seq_lens[:rows]) > 1
        if arch == "mixtral":
            assert all(min(row) < 0 for row in ids[rows:]) and min(map(min, ids[:rows])) >= 0, ids
    assert (arch == "mixtral") == bool(seen["ids"])
    assert replayed["decode_graph_refusals"] == 0, replayed
    assert {k: replayed[k] for k in COUNTERS} == {k: eager[k] for k in COUNTERS}


def test_a_batch_whose_forward_reads_values_back_runs_eagerly_and_is_not_recorded_again(tmp_path, monkeypatch):
    """With the MoE kernel's row limit at 2, a step of twenty tokens leaves experts to the GEMM path, whose per-expert
    calls need the rows' counts read back to the host: the recording is refused once, and that batch size is not
    tried again. (Experts 36 wide: the packed kernel, which reads nothing back, does not take them.)"""
    monkeypatch.setattr(moe_cpu, "SMALL_ROWS", 2)
    hf = save_tiny_checkpoint("mixtral", tmp_path, intermediate_size=36)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (8,) * 20)
    engine = Engine(loaded, page_size=4)
    tokens = [r.outputs[0].token_ids for r in engine.generate(requests)]
    assert tokens == [hf_greedy(hf, r.prompt_token_ids, 8) for r in requests]
    metrics = engine.metrics()
    assert metrics["decode_graph_refusals"] == 1 and metrics["decode_graph_replays"] == 0, metrics


def test_recordings_stay_within_their_memory_and_one_past_it_alone_is_not_kept(tmp_path, monkeypatch):
    """Recordings hold a step's activations and logits: with room for the two-row recording but not the four-row one
    (the batches of 4 and 3 sequences are both padded to 4 rows), that size is refused once and not tried again, the
    kept recordings stay within the room (the two-row one dropped when the one-row one comes), and the tokens are
    transformers' either way."""
    hf = save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (6, 12, 20, 30))
    expected = [hf_greedy(hf, r.prompt_token_ids, r.sampling.max_tokens) for r in requests]
    held = []
    forward = decode_graphs.DecodeGraphs.forward
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "forward",
                        lambda self, *a, **k: (forward(self, *a, **k), held.append(self.held_bytes()))[0])
    sizes = {}
    for limit in (1 << 30, None):
        if limit is None:
            limit = (sizes[2] + sizes[4]) // 2
        monkeypatch.setattr(decode_graphs, "MAX_BYTES", limit)
        engine = Engine(loaded, page_size=4)
        assert [r.outputs[0].token_ids for r in engine.generate(requests)] == expected
        graphs = engine.runner.graphs._graphs
        sizes = sizes or {key[0]: graph.recording.nbytes for key, graph in graphs.items()}
        assert max(held) <= limit
        held.clear()
    metrics = engine.metrics()
    assert sorted(sizes) == [1, 2, 4] and sizes[1] < sizes[2] < sizes[4] and sizes[1] + sizes[2] > limit, sizes
    assert metrics["decode_graph_refusals"] == 1 and metrics["decode_graph_replays"] > 0, metrics
    assert [key[0] for key in graphs] == [1]


def test_a_backend_forced_midway_drops_the_recordings(tmp_path):
    """Steps replayed on the C attention kernel, then the torch backend forced: it runs (a stale recording would
    keep calling the C kernel), refusing recordings of its own (it reads the lengths back to the host)."""
    hf = save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (30, 30))
    engine = Engine(loaded, page_size=4)
    for request in requests:
        engine.add_request(request)
    results = []
    while engine.metrics()["decode_graph_replays"] < 5:
        results += engine.step()
    registry.reset_usage()
    with registry.use_backend("paged_decode_attention", "torch"):
        while engine.has_unfinished():
            results += engine.step()
        counts = registry.usage_counts()
    assert counts.get(("paged_decode_attention", "torch"), 0) > 0, counts
    assert counts.get(("paged_decode_attention", "cpu_c"), 0) == 0, counts
    by_id = {r.request_id: r.outputs[0].token_ids for r in results}
    assert [by_id[r.request_id] for r in requests] == [hf_greedy(hf, r.prompt_token_ids, 30) for r in requests]
    assert engine.metrics()["decode_graph_refusals"] == 1


def test_a_step_run_with_another_thread_count_is_recorded_anew(tmp_path):
    """Recordings hold the kernels' thread counts: when thread lending changed torch's, replays kept computing with
    the count they were recorded at (on a peer's cores after it took its threads back)."""
    hf = save_tiny_checkpoint("mixtral", tmp_path)
    loaded = load_model(str(tmp_path))
    requests = _requests(loaded.model.vocab_size, (40, 40))
    before = torch.get_num_threads()
    engine = Engine(loaded, page_size=64)  # one page a sequence throughout: every step of the same shape
    for request in requests:
        engine.add_request(request)
    results = []
    try:
        torch.set_num_threads(1)
        while engine.metrics()["decode_graph_replays"] < 5:
            results += engine.step()
        captures = engine.metrics()["decode_graph_captures"]
        torch.set_num_threads(2)
        while engine.has_unfinished():
            results += engine.step()
    finally:
        torch.set_num_threads(before)
    assert engine.metrics()["decode_graph_captures"] > captures
    by_id = {r.request_id: r.outputs[0].token_ids for r in results}
    assert [by_id[r.request_id] for r in requests] == [hf_greedy(hf, r.prompt_token_ids, 40) for r in requests]


_FIRST_RECORDING = """
import sys
from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, Request, SamplingParams
loaded = load_model(sys.argv[1])
sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
engine = Engine(loaded, page_size=4)
engine.generate([Request(f"r{i}", prompt_token_ids=[3 + i, 5, 7], sampling=sampling) for i in range(3)])
print(engine.metrics()["decode_graph_captures"], "torch._dynamo" in sys.modules)
"""


def test_a_process_records_its_first_step_without_importing_torch_dynamo(tmp_path):
    """A dispatch mode's first call would import torch._dynamo (1.6-1.7 s, once a process: an engine actor's first
    recorded step) to keep torch.compile out of it; the recorder opts out. A fresh interpreter, as an actor is."""
    save_tiny_checkpoint("mixtral", tmp_path)
    done = subprocess.run([sys.executable, "-c", _FIRST_RECORDING, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "BATCHGEN_PLAN": "0"})
    assert done.returncode == 0, done.stderr
    captures, dynamo = done.stdout.split()
    assert int(captures) > 0 and dynamo == "False", done.stdout
