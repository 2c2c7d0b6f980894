"""MIGRATE between engines: a request exported mid-decode (or still waiting) and imported into another
engine finishes with the tokens it would have had on the first, greedy or seeded, with structured
outputs, penalties, bad words, n > 1 and samples that finished before the move."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tiny_models import kv_bytes_per_token

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, EngineLoad, EngineLoop, InvalidRequestError, Request, SamplingParams
from batchgen.engine.parallel.partition import partition_pages
from batchgen.engine.sequence import KVLocation, Phase

PROMPTS = ["Tell me about the old river.", "Write a poem about a cat.", "What would you do?",
           "Give 3 ideas for a game about the moon.", "Describe a day on the farm with your friend.",
           "List 4 things you can see from the quiet hill."]


@pytest.fixture(scope="module")
def demo():
    return load_model("tiny-moe")


def workload() -> list[Request]:
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.9, seed=11, n=3, logprobs=2),
        dict(temperature=0.7, seed=5, structured_outputs={"regex": "[a-z]{3,9}( [a-z]{3,9}){2,4}"}),
        dict(temperature=0.0, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.3, bad_words=["the"]),
        dict(temperature=1.0, seed=3, n=4, structured_outputs={"choice": ["yes", "no", "not sure at all, sorry"]}),
        dict(temperature=0.8, seed=2, stop=["e"]),
    ]
    return [Request(str(i), prompt=p, sampling=SamplingParams(max_tokens=24, **kind))
            for i, (p, kind) in enumerate(zip(PROMPTS, kinds))]


def admitted(loop: EngineLoop) -> None:
    """Wait until the loop's engine has taken every request submitted so far: a command queued behind them (an
    export of nothing) has run, and the load is recounted after each command. A poll of `load` for the full count
    could miss it for good: short requests finish, and a running engine recounts its load every 50 ms."""
    assert loop.export(0).result(timeout=60) == []


class Remote:
    """A balancer actor's method, called in process: `await method.remote(*args)`."""

    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


def exported_after_one_step(demo, prompt: str, max_tokens: int):
    """(the Result of greedy request "r" run in place, "r" exported from another engine after its first step)."""
    request = Request("r", prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
    [expected] = Engine(demo, page_size=16).generate([request])
    source = Engine(demo, page_size=16)
    source.add_request(request)
    source.step()
    return expected, source.export_request("r")


def agent_without_thread(monkeypatch, balancer, loop: EngineLoop):
    """A BalancingAgent of an actor's last call, done with its own rows, whose exchanges the test runs one at a
    time (no thread of its own, no Ray runtime)."""
    from batchgen.operators import balancing

    class NoThread:
        def __init__(self, target, args, **kwargs):
            args[0].close()

        def start(self):
            pass

    monkeypatch.setattr(balancing, "threading", SimpleNamespace(Thread=NoThread, Lock=threading.Lock))
    monkeypatch.setattr(balancing.ray, "get_runtime_context", lambda: SimpleNamespace(get_actor_id=lambda: "a"))
    monkeypatch.setattr(balancing, "incarnation", lambda actor_id: ("ALIVE", 0))
    agent = balancing.BalancingAgent(balancer, loop)
    agent._serving = 1
    return agent


def by_id(results) -> dict:
    assert all(r.error is None for r in results), [r.error for r in results]
    return {r.request_id: [(o.token_ids, o.text, o.finish_reason,
                            None if o.logprobs is None else [lp.token_id for lp in o.logprobs])
                           for o in r.outputs] for r in results}


def drain(engine: Engine) -> list:
    out = []
    while engine.has_unfinished():
        out.extend(engine.step())
    return out


@pytest.mark.parametrize("steps", [0, 3, 9], ids=["waiting", "early", "late"])
def test_a_moved_request_finishes_as_if_it_had_stayed(demo, steps):
    expected = by_id(Engine(demo, page_size=16).generate(workload()))
    source, target = Engine(demo, page_size=16, max_prefill_tokens=16), Engine(demo, page_size=16)
    for request in workload():
        source.add_request(request)
    finished = []
    for _ in range(steps):
        finished.extend(source.step())
    moved = [m for m in (source.export_request(r.request_id) for r in workload()) if m is not None]
    assert moved, "nothing was movable"
    for migrated in moved:
        target.import_request(migrated)
    results = by_id(finished + drain(source) + drain(target))
    assert results == expected
    assert source.metrics()["migrated_out"] == target.metrics()["migrated_in"] == len(moved)
    if steps:
        assert any(m.samples for m in moved) and sum(m.kv_bytes for m in moved) > 0
    else:
        assert all(not m.samples for m in moved)  # still waiting: the prompt alone travels


def test_a_moved_samples_decoded_tokens_are_not_cached_as_a_prompt_prefix(demo):
    """The importing engine indexed the pages of the sample's generated tokens, KV its source had decoded: a later
    prompt sharing them took that KV instead of computing it, as it would had the sample not moved."""
    request = Request("r", prompt=" ".join(PROMPTS), sampling=SamplingParams(max_tokens=64, temperature=0.0,
                                                                              ignore_eos=True))
    source = Engine(demo, page_size=16)
    source.add_request(request)
    for _ in range(40):
        source.step()
    migrated = source.export_request("r")
    prompt, generated = migrated.request.prompt_token_ids, migrated.samples[0].generated
    assert len(prompt) >= 16 and len(generated) >= 32
    target = Engine(demo, page_size=16)
    target.import_request(migrated)
    tokens = prompt + generated
    cached = target.kv.pool(KVLocation.DEVICE).cache.match(tokens, 16, len(tokens) // 16)
    assert len(cached) == len(prompt) // 16  # the prompt's whole pages, which its source prefilled


def test_a_sample_finished_before_the_move_keeps_its_output(demo):
    request = workload()[4]  # n = 4 over a choice list: the short choices finish first
    expected = by_id(Engine(demo, page_size=16).generate([request]))
    source, target = Engine(demo, page_size=16), Engine(demo, page_size=16)
    source.add_request(request)
    moved = None
    while moved is None:
        source.step()
        state_done = [s for s in source._requests["4"].samples if s.finish_reason is not None]
        if state_done and len(state_done) < 4:
            moved = source.export_request("4")
    assert any(s.finish_reason for s in moved.samples) and any(s.kv is not None for s in moved.samples)
    target.import_request(moved)
    assert by_id(drain(target)) == expected
    assert not source.has_unfinished()


def test_a_request_whose_sample_failed_before_the_move_fails_after_it(demo):
    """A sample whose grammar was left no token (bad_words banned each one) fails its request once every sample is
    done; moved or restored from a checkpoint before that, the request came back as a success with the failed
    sample's output among the others."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=4, n=2, structured_outputs={"choice": ["yes", "no"]})
    source, target = Engine(demo, page_size=16), Engine(demo, page_size=16)
    source.add_request(Request("r", prompt=PROMPTS[0], sampling=params))
    source.step()  # prefilled: both samples decode
    failing = source._requests["r"].samples[1]
    refused = source.tokenizer.encode("zebra", add_special_tokens=False)[0]  # no choice starts so
    assert source._accept_token(failing, refused)  # as the engine takes a token the grammar refuses
    source.scheduler.remove(failing)
    moved = source.export_request("r")
    assert moved.error is not None and [s.finish_reason for s in moved.samples] == [None, "error"]
    target.import_request(moved)
    [result] = drain(target)
    assert result.outputs == [] and "no token the grammar allows" in result.error


def test_a_request_mid_prefill_is_not_movable_and_bad_imports_are_refused(demo):
    source = Engine(demo, page_size=16, max_prefill_tokens=4)  # chunked: the prompt takes several steps
    source.add_request(Request("long", prompt=PROMPTS[4], sampling=SamplingParams(max_tokens=4)))
    source.step()
    assert source.export_request("long") is None and source.export_request("missing") is None
    source.step()
    while source.scheduler.prefilling is not None:
        source.step()
    migrated = source.export_request("long")
    target = Engine(demo, page_size=16)
    target.import_request(migrated)
    with pytest.raises(InvalidRequestError, match="duplicate request_id"):
        target.import_request(migrated)
    other = Engine(load_model("tiny-moe", dtype="bfloat16"))
    with pytest.raises(InvalidRequestError, match=r"the migrated KV is torch.float32 .*, this engine's is torch."
                                                  r"bfloat16 .* \(the two engines must run the same model and KV"):
        other.import_request(migrated)
    with pytest.raises(InvalidRequestError, match="does not fit this engine"):  # no layout given: the sizes differ
        other.import_request(replace(migrated, kv_layout=""))


def test_migrated_samples_that_could_not_have_come_from_this_model_are_refused_before_anything_changes(demo):
    """A generated token past the vocabulary crashed the target's next step (every request of its engine with it);
    KV of the wrong length for the sample's tokens, or a sample left unfinished at max_tokens, decoded on silently
    (other tokens; one token past max_tokens)."""
    source = Engine(demo, page_size=16)
    source.add_request(Request("m", prompt=PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=8,
                                                                             ignore_eos=True)))
    for _ in range(4):
        source.step()
    snapshot = source.snapshot_request("m")
    [sample] = snapshot.samples
    assert sample.finish_reason is None and len(sample.generated) >= 2
    vocab, geometry = demo.model.vocab_size, source.kv.geometry
    shorter = sample.kv_len - 1
    k, v = geometry.packed_views(sample.kv, sample.kv_len)
    cases = [
        (replace(sample, generated=[*sample.generated[:-1], vocab]),
         f"migrated sample 0's generated tokens: token {vocab} is outside the vocabulary [0, {vocab})"),
        (replace(sample, kv=torch.cat([k[:, :shorter].reshape(-1).view(torch.uint8),
                                       v[:, :shorter].reshape(-1).view(torch.uint8)]), kv_len=shorter),
         f"migrated sample 0's KV holds {shorter} tokens, not its prompt's"),
        (replace(sample, generated=sample.generated * 8), "migrated sample 0 is unfinished with"),
    ]
    target = Engine(demo, page_size=16)
    for bad, named in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(named)):
            target.import_request(replace(snapshot, samples=[bad]))
        assert not target.has_unfinished()
    target.import_request(snapshot)  # the sample as it was continues as it would have
    alone = Engine(demo, page_size=16).generate([Request("m", prompt=PROMPTS[0], sampling=SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True))])
    assert [r.outputs[0].token_ids for r in target.stream([])] == [alone[0].outputs[0].token_ids]


def test_a_request_migrated_from_another_models_engine_of_as_many_kv_bytes_is_refused(tmp_path):
    """4 layers of 1 KV head hold as many bytes a token as 2 layers of 2: only the sizes were checked, and the KV
    decoded into other tokens. A moved request carries its engine's KV layout now, as a prefill hand-off does."""
    from tiny_models import prompts, save_tiny_checkpoint

    save_tiny_checkpoint("mixtral", tmp_path / "a", num_hidden_layers=2, num_key_value_heads=2)
    save_tiny_checkpoint("mixtral", tmp_path / "c", num_hidden_layers=4, num_key_value_heads=1)
    first, other = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "c"))
    assert kv_bytes_per_token(first) == kv_bytes_per_token(other)
    source = Engine(first, page_size=4)
    source.add_request(Request("m", prompt_token_ids=prompts(vocab_size=first.model.vocab_size, lengths=(9,))[0],
                               sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    for _ in range(3):
        source.step()
    moved = source.export_request("m")
    target = Engine(other, page_size=4)
    with pytest.raises(InvalidRequestError, match=re.escape(f"the migrated KV is {source.kv.geometry.layout}, this "
                                                            f"engine's is {target.kv.geometry.layout}")):
        target.import_request(moved)
    Engine(first, page_size=4).import_request(moved)  # its own model's engine takes it


@pytest.mark.parametrize("mode", ["coroutine", "lockstep"])
def test_samples_preempted_by_recompute_finish_as_unconstrained_and_move_without_kv(demo, mode):
    """Device and host pools too small to keep every sequence: samples are preempted by recompute (KV dropped,
    prefilled again over prompt and generated tokens) with this workload's seeded n > 1 samples, structured
    outputs, penalties, bad words, stops and logprobs finishing as in an engine with room for all; a request
    moved while a sample waits for its recompute travels without that sample's KV and finishes the same."""
    expected = by_id(Engine(demo, page_size=16).generate(workload()))
    page = kv_bytes_per_token(demo) * 16
    small = dict(mode=mode, page_size=16, kv_budget_bytes=page * 8, host_kv_budget_bytes=page * 2)
    engine = Engine(demo, **small)
    assert by_id(engine.generate(workload())) == expected
    assert engine.metrics()["recomputes"] > 0
    source, target = Engine(demo, **small), Engine(demo, page_size=16)
    for request in workload():
        source.add_request(request)
    finished = []
    while not any(s.recomputing for s in source.scheduler.waiting):
        finished.extend(source.step())
    rid = next(s.request_id for s in source.scheduler.waiting if s.recomputing)
    moved = source.export_request(rid)
    assert any(s.kv is None and s.kv_len == 0 and s.generated and s.finish_reason is None for s in moved.samples)
    target.import_request(moved)
    assert by_id(finished + drain(source) + drain(target)) == expected


def test_only_a_request_whose_every_sample_decodes_is_exported_as_a_straggler(demo):
    """A PARTITION's engine would prefill a waiting sample, and one ended part-way through that prefill could not
    give the request back: such a request stays where it is."""
    page = kv_bytes_per_token(demo) * 16
    engine = Engine(demo, page_size=16, kv_budget_bytes=page * 8, host_kv_budget_bytes=page * 2)
    for request in workload():
        engine.add_request(request)
    assert engine.export_straggler("0") is None and engine.export_straggler("missing") is None  # waiting prompts
    while not any(s.recomputing for s in engine.scheduler.waiting):
        engine.step()
    waiting = next(s.request_id for s in engine.scheduler.waiting if s.recomputing)
    assert engine.export_straggler(waiting) is None and waiting in engine._requests
    decoding = next(rid for rid in (s.request_id for s in engine.scheduler.running.values()) if all(
        s.phase in (Phase.DECODE, Phase.SUSPENDED, Phase.FINISHED) for s in engine._requests[rid].samples))
    assert engine.export_straggler(decoding).request.request_id == decoding and decoding not in engine._requests


def test_a_checkpoint_of_a_suspended_request_continues_elsewhere_as_the_request_does_here(demo):
    """Engine.snapshot_request copies a request held in host pages and leaves it running: both the source
    and an engine that imports the copy finish it with the expected tokens."""
    expected = by_id(Engine(demo, page_size=4).generate(workload()))
    budget = kv_bytes_per_token(demo) * 4 * 12  # 12 pages of 4 tokens: most requests wait in host pages
    source = Engine(demo, page_size=4, kv_budget_bytes=budget, b_attn=2)
    for request in workload():
        source.add_request(request)
    finished, snapshots = [], {}
    while not snapshots:
        finished.extend(source.step())
        suspended = source.suspended_requests()
        assert source.movable_requests(10**9)[: len(source.scheduler.waiting)] == [
            s.request_id for s in source.scheduler.waiting]  # waiting prompts first, oldest first
        snapshots = {rid: source.snapshot_request(rid) for rid in suspended}
    assert all(s.samples and all(x.kv is not None or x.finish_reason for x in s.samples) for s in snapshots.values())
    load = source.load()
    assert load.requests == len(source._requests) and load.tokens > 0
    results = by_id(finished + drain(source))
    assert results == expected
    target = Engine(demo, page_size=4)
    for snapshot in snapshots.values():
        target.import_request(snapshot)
    assert by_id(drain(target)) == {rid: expected[rid] for rid in snapshots}


def test_engine_loops_move_requests_and_their_results_return_to_the_owner(demo):
    """EngineLoop.export / adopt / resolve, as two engine actors' agents use them: the owner's call returns
    every Result, moved or not, exactly as one engine would have produced it; a request lost with its
    holder runs again on its owner."""
    expected = by_id(Engine(demo, page_size=16).generate(workload()))
    owner, holder = (EngineLoop(lambda: Engine(demo, page_size=16)) for _ in range(2))
    requests = workload()
    moved_ids: list[str] = []

    added = threading.Event()

    def add(engine, i):
        engine.add_request(requests[i])
        if i == len(requests) - 1:
            added.set()  # all admitted (`run` submits after a hop to a thread: no command can be queued behind it)

    async def main():
        call = asyncio.ensure_future(owner.run([r.request_id for r in requests], add))
        assert await asyncio.to_thread(added.wait, 60)
        moved = await asyncio.wrap_future(owner.export(100))  # output tokens' worth: 2 to 5 of the 6 requests
        # (<=: the owner's engine keeps stepping meanwhile, and a short request may have finished already)
        assert 1 < len(moved) < len(requests) and owner.load.requests <= len(requests) - len(moved)
        moved_ids.extend(m.request.request_id for m in moved)
        kept, lost = moved[:-1], moved[-1]
        back: list = []
        await asyncio.wrap_future(holder.adopt(kept, back.append))
        while len(back) < len(kept):
            await asyncio.sleep(0.01)
        owner.resolve(back)
        owner.rerun({lost.request.request_id: None})  # its holder "died": recomputed from its prompt
        return await call

    try:
        results = asyncio.run(main())
    finally:
        owner.close()
        holder.close()
    assert by_id(results) == expected
    assert owner.engine.metrics()["migrated_out"] == len(moved_ids)
    assert holder.engine.metrics()["migrated_in"] == len(moved_ids) - 1


def test_a_request_moved_again_to_the_loop_already_running_it_runs_once(demo):
    """Its owner died after moving it; the owner's task, rerun on another actor, moved it to the same holder again:
    the holder refused it as a duplicate id and that error became the row (its real Result then dropped)."""
    expected = by_id(Engine(demo, page_size=16).generate(workload()[:1]))
    first_owner, rerun_owner, holder = (EngineLoop(lambda: Engine(demo, page_size=16)) for _ in range(3))
    requests = workload()[:2]  # (an engine never moves its every request)
    delivered: list = []
    try:
        exported = {}
        for owner, tag in ((first_owner, "first"), (rerun_owner, "rerun")):
            owner.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
            # queued behind the submission, before any step (a poll for the load could come after both requests
            # finished): the oldest waiting prompt, request "0"
            [exported[tag]] = owner.export(24).result(timeout=60)
            assert exported[tag].request.request_id == "0"
        # the second arrives while the holder runs the first (queued together: the first cannot finish between)
        adopted = [holder.adopt([exported[tag]], lambda result, tag=tag: delivered.append((tag, result)))
                   for tag in ("first", "rerun")]
        for future in adopted:
            future.result()
        deadline = time.time() + 60
        while not delivered and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a second delivery would come now
    finally:
        for loop in (first_owner, rerun_owner, holder):
            loop.close()
    assert [tag for tag, _ in delivered] == ["rerun"] and by_id([delivered[0][1]]) == expected


def test_requests_moved_to_a_loop_whose_engine_failed_come_back_as_errors(demo):
    """Its adopt command was skipped and nobody got a Result: the actor holding them, and the job, waited for
    good."""
    source = Engine(demo, page_size=16)
    for request in workload()[:2]:
        source.add_request(request)
    source.step()
    moved = source.export_request("0")
    broken = EngineLoop(lambda: Engine(demo, page_size=16))
    try:
        [failed] = broken.submit(["x"], lambda engine, i: (_ for _ in ()).throw(RuntimeError("device lost")))
        with pytest.raises(RuntimeError, match="device lost"):
            failed.result(timeout=30)
        back: list = []
        with pytest.raises(RuntimeError, match="the engine failed"):
            broken.adopt([moved], back.append).result()
    finally:
        broken.close()
    assert [(r.request_id, "device lost" in r.error) for r in back] == [("0", True)]


def test_requests_exported_for_a_move_that_could_not_be_sent_continue_on_their_owner(demo, monkeypatch):
    """The balancing exchange exported them, then failed to hand them over (the object store, the balancer): they
    were held by nobody and their rows never finished."""
    from batchgen.operators import balancing

    class Balancer:
        report = Remote(lambda *args: (100, "taker"))  # move 100 output tokens' worth to another actor

        def _send(*args):
            raise ConnectionError("the balancer is unreachable")

        send = Remote(_send)

    monkeypatch.setattr(balancing.ray, "put", lambda value: value)
    expected = by_id(Engine(demo, page_size=16).generate(workload()))
    loop = EngineLoop(lambda: Engine(demo, page_size=16))
    agent = object.__new__(balancing.BalancingAgent)  # its exchange alone, without Ray or its thread
    agent.balancer, agent.loop, agent.name, agent.actor = Balancer(), loop, "owner", ("actor", 0)
    agent._lock, agent._serving, agent._copied_bytes, agent._copy_s = threading.Lock(), 1, 0, 0.0
    requests = workload()
    try:
        futures = loop.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
        admitted(loop)
        with pytest.raises(ConnectionError):
            asyncio.run(agent._exchange())
        results = [future.result(timeout=120) for future in futures]
    finally:
        loop.close()
    assert by_id(results) == expected


def test_a_request_moved_here_twice_is_held_once_and_the_actors_last_call_ends(demo, monkeypatch):
    """Moved here, then (its owner died and its task ran again elsewhere) moved here again: the loop runs it once
    and gives one Result, but the agent counted two held requests, and its actor's last call stayed for good."""
    # 160 tokens: still running here when the second exchange comes (24 finished first now and then: no second move)
    expected, moved = exported_after_one_step(demo, PROMPTS[0], 160)

    async def fetched():
        return moved

    takes, delivered = [[("r", [fetched()])], [("r", [fetched()])]], []

    class Balancer:
        report = Remote(lambda *args: (0, None))
        take = Remote(lambda name, received: takes.pop(0) if takes else [])
        deliver = Remote(lambda name, results: delivered.extend(results))
        collect = Remote(lambda name, received: ([], {}))
        has_surplus = Remote(lambda name: False)
        done = Remote(lambda ids: None)
        checkpoint_period = Remote(lambda: 2.0)

    loop = EngineLoop(lambda: Engine(demo, page_size=16))
    try:
        agent = agent_without_thread(monkeypatch, Balancer(), loop)
        asyncio.run(agent._exchange())
        asyncio.run(agent._exchange())  # the same request again, while it runs here
        deadline = time.monotonic() + 120
        while not delivered and time.monotonic() < deadline:
            asyncio.run(agent._exchange())
            time.sleep(0.05)
        asyncio.run(asyncio.wait_for(agent._linger(), 30))
    finally:
        loop.close()
    assert [r.outputs[0].token_ids for r in delivered] == [expected.outputs[0].token_ids]


def test_a_moved_request_and_its_result_survive_answers_lost_on_their_way(demo, monkeypatch):
    """A balancer call can run and its answer be lost (Ray's ActorUnavailableError): the moved request `take`
    handed out, or the Result `deliver` passed on (the agent had let go of it), was lost, and its owner waited for
    good; the agent also stopped balancing for the rest of the job."""
    import ray

    from batchgen.operators.work_balancer import WorkBalancer

    expected, moved = exported_after_one_step(demo, PROMPTS[1], 16)

    class Ref:  # an object ref: awaitable as often as it is fetched
        def __await__(self):
            return asyncio.sleep(0, moved).__await__()

    balancer, lost = WorkBalancer(low_water=4, partition_below=0), []

    def answer_lost_once(method):
        def call(*args):
            value = method(*args)
            if value != [] and method.__name__ not in lost:
                lost.append(method.__name__)
                raise ray.exceptions.ActorUnavailableError("the connection was reset", None)
            return value
        return Remote(call)

    fake = SimpleNamespace(**{name: Remote(getattr(balancer, name)) for name in (
        "report", "unreachable", "collect", "done", "has_surplus", "report_costs", "checkpoint", "checkpoint_period")})
    fake.take, fake.deliver = answer_lost_once(balancer.take), answer_lost_once(balancer.deliver)
    loop = EngineLoop(lambda: Engine(demo, page_size=16))
    try:
        agent = agent_without_thread(monkeypatch, fake, loop)
        asyncio.run(agent._exchange())  # known to the balancer
        balancer.report("owner", ("owner-actor", 0), EngineLoad(1, 10, 0.0), True)
        balancer.send("owner", agent.name, [("r", [Ref()])], 0, 16)
        deadline, failures = time.monotonic() + 120, 0
        while not balancer._workers["owner"].results or agent._holding:  # until the Result is back, let go of
            assert time.monotonic() < deadline
            try:
                asyncio.run(agent._exchange())
            except ray.exceptions.ActorUnavailableError:
                failures += 1
            time.sleep(0.05)
        asyncio.run(asyncio.wait_for(agent._linger(), 30))
    finally:
        loop.close()
    assert lost == ["take", "deliver"] and failures == 2
    results, _ = balancer.collect("owner")
    assert [r.outputs[0].token_ids for r in results] == [expected.outputs[0].token_ids]


def test_an_aborted_request_running_elsewhere_does_not_run_again_when_its_holder_dies(demo):
    owner = EngineLoop(lambda: Engine(demo, page_size=16))
    requests = workload()
    futures = owner.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
    try:
        admitted(owner)
        moved = [m.request.request_id for m in owner.export(100).result(timeout=60)]
        assert moved
        owner.abort(moved[:1])
        owner.rerun(dict.fromkeys(moved))  # the holder died: the others run here again from their prompts
        done = [f.result(timeout=120) for f, r in zip(futures, requests) if r.request_id != moved[0]]
    finally:
        owner.close()
    assert all(r.ok for r in done) and futures[[r.request_id for r in requests].index(moved[0])].cancelled()
    assert owner.engine.metrics()["finished_requests"] == len(requests) - 1  # not the aborted one


def test_an_adopted_request_aborted_ends_with_an_error_to_its_owner_and_its_id_runs_again(demo):
    """Before, the abort left the adoption behind: the owner never heard of the request, and the same id
    submitted here again was attached to a request that no longer ran (its future never resolved)."""
    owner, holder = (EngineLoop(lambda: Engine(demo, page_size=16)) for _ in range(2))
    requests = [Request(f"r{i}", [5, 6, 7, i + 8], sampling=SamplingParams(max_tokens=300, ignore_eos=True))
                for i in range(6)]
    try:
        owner.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
        admitted(owner)
        moved = owner.export(300).result(timeout=60)
        rid = moved[0].request.request_id
        told = []
        holder.adopt(moved[:1], told.append).result(timeout=60)
        holder.abort([rid])
        [again] = holder.submit([rid], lambda engine, i: engine.add_request(moved[0].request))
        result = again.result(timeout=120)
    finally:
        owner.close()
        holder.close()
    assert [(r.request_id, r.error) for r in told] == [(rid, "aborted on the engine that ran it")]
    assert result.ok and len(result.outputs[0].token_ids) == 300 and not holder.runs_for_another(rid)


def test_a_task_run_again_where_its_moved_request_runs_gets_that_requests_result(demo):
    """Ray Data reruns a dead actor's task; on the actor that adopted one of its requests the row is the running
    request, not a duplicate: its Result reaches both the adopter's callback and the rerun task."""
    expected = by_id(Engine(demo, page_size=16).generate(workload()))
    owner, holder = (EngineLoop(lambda: Engine(demo, page_size=16)) for _ in range(2))
    requests = workload()
    owner.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
    try:
        admitted(owner)
        moved = owner.export(100).result(timeout=60)
        rid, back, gate = moved[0].request.request_id, [], threading.Event()

        def never(engine, i):
            raise AssertionError("the running request was added again")

        # the holder's engine thread waits until the adoption and the rerun's submission are both queued: the
        # request is still running when the rerun comes
        holder.submit(["gate"], lambda engine, i: gate.wait(10))
        adopted = holder.adopt(moved, back.append)
        seen = []  # what a Decode task asks before checking its rows (on the engine thread here: no race)
        holder.submit(["probe"], lambda engine, i: seen.append(holder.runs_for_another(rid)))
        [again] = holder.submit([rid], never)
        gate.set()
        adopted.result(timeout=60)
        result = again.result(timeout=120)
    finally:
        owner.close()
        holder.close()
    assert seen == [True] and by_id([result]) == {rid: expected[rid]}
    assert [r.request_id for r in back if r.request_id == rid] == [rid]
    assert holder.engine.metrics()["migrated_in"] == len(moved)


@pytest.mark.parametrize("n", [1, 2])
def test_a_straggler_in_its_last_page_lands_on_the_device_of_the_engine_a_partition_sizes_for_it(demo, n):
    """PARTITION's engine on every rank is sized for the one request; a straggler moved there in the last page of
    its length used to find no room beside the import's reserve and went to the engine's one host page."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=n)
    request = Request("s", prompt_token_ids=list(range(5, 29)), sampling=params)  # 24 + 40 tokens: 4 pages of 16
    want = by_id(Engine(demo, page_size=16).generate([request]))
    source = Engine(demo, page_size=16)
    source.add_request(request)
    while source.metrics()["generated_tokens"] < 38 * n:
        source.step()
    migrated = source.export_request("s")
    geometry = source.kv.geometry
    pages = partition_pages(geometry.pages_for(64), n, source.kv.reserve_pages)
    target = Engine(demo, page_size=16, kv_budget_bytes=pages * geometry.page_bytes,
                    host_kv_budget_bytes=geometry.page_bytes, stream_host_kv=False, prefix_caching=False)
    target.import_request(migrated)
    assert len(target.scheduler.running) == n and not target.scheduler.suspended
    assert by_id(drain(target)) == want


def test_a_request_moved_to_a_process_with_another_clock_keeps_its_completion_time(demo, monkeypatch):
    """Stamps are perf_counter, which counts from an origin of its own in each machine's processes: a request moved
    (or prefilled) on one node and finished on another reported the difference of two clocks as its completion
    time. They cross as wall-clock time now."""
    from batchgen.engine import PrefillExporter

    request = Request("r", prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=8, temperature=0.0))
    source, prefill = Engine(demo, page_size=16), Engine(demo, page_size=16)
    source.add_request(request)
    for _ in range(3):
        source.step()
    migrated = source.export_request("r")
    [prefilled] = PrefillExporter(prefill).prefill([request]).outputs
    clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 1e6)  # the other machine's origin
    for arrive in (lambda engine: engine.import_request(migrated), lambda engine: engine.add_prefilled(prefilled)):
        target = Engine(demo, page_size=16)
        arrive(target)
        [result] = drain(target)
        assert result.error is None and 0 < result.completion_time < 60, result.completion_time
