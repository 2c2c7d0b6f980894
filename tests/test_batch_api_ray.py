"""The Batch API's Ray backend end to end: `batchgen serve --backend ray` (each batch a `batchgen run` job on
the session's Ray runtime), driven by the official openai client and checked line for line against the
engine backend serving the same lines.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from test_batch_api import (
    CHAT_TEMPLATE,
    KV,
    PROMPTS,
    SERVED,
    InProcessServer,
    _check_partial,
    _counts,
    _greedy,
    _line,
    _read_lines,
    _submit,
    _wait,
)

from batchgen.engine import EngineLoop
from batchgen.operators.engine_factory import load_engine
from batchgen.pipelines.openai_batch.ray_backend import NO_LOGPROBS
from batchgen.pipelines.openai_batch.store import BatchStore

pytestmark = pytest.mark.slow  # end to end on a Ray runtime

CHAT = "/v1/chat/completions"
# one engine actor taking two-row blocks: several part files per batch, so progress shows mid-batch
RAY_JOB = {"mode": "single", "concurrency": 1, "batch_size": 2, "rows_per_block": 2}


def _chat(custom_id: str, body: dict) -> dict:
    return _line(custom_id, body, url=CHAT)


@pytest.fixture(scope="module")
def loop(tiny_moe_dir):
    loop = EngineLoop(lambda: load_engine(tiny_moe_dir, **KV))
    yield loop
    loop.close()


def _args(model_dir: str, storage: Path, *extra: str) -> list[str]:
    """The same `serve` options for both backends (defaults: 4 new tokens)."""
    return ["--model", model_dir, "--storage", str(storage), "--served-model-name", SERVED,
            "--chat-template", CHAT_TEMPLATE, "--sampling-params", '{"max_tokens": 4}', "--engine", json.dumps(KV),
            *extra]


@pytest.fixture(scope="module")
def engine_server(tiny_moe_dir, loop, tmp_path_factory):
    srv = InProcessServer(_args(tiny_moe_dir, tmp_path_factory.mktemp("engine") / "storage"), loop).start()
    yield srv
    srv.stop()


def _ray_server(model_dir: str, storage: Path) -> InProcessServer:
    args = _args(model_dir, storage, "--backend", "ray", "--ray-job", json.dumps(RAY_JOB))
    return InProcessServer(args, None).start()


@pytest.fixture(scope="module")
def ray_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray") / "storage"


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tiny_moe_dir, ray_storage):
    srv = _ray_server(tiny_moe_dir, ray_storage)
    yield srv
    srv.stop()


def _comparable(entry: dict) -> dict:
    """An output or error line without what differs on every run (ids, timestamps)."""
    response = entry["response"]
    if response is None:
        return {"custom_id": entry["custom_id"], "error": entry["error"]}
    body = {k: v for k, v in response["body"].items() if k not in ("id", "created")}
    return {"custom_id": entry["custom_id"], "status": response["status_code"], "body": body}


def test_chat_batch_matches_the_engine_backend(engine_server, ray_server):
    too_long = " ".join(["word"] * 5000)  # past the 4096-token context: the engine refuses it inside the job
    lines = [
        _chat("greedy-0", {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 5, "temperature": 0}),
        _chat("bad-temperature", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
        _chat("greedy-1", {"messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}],
                           "max_completion_tokens": 6, "temperature": 0}),
        _chat("default-max-tokens", {"messages": [{"role": "user", "content": PROMPTS[2]}], "temperature": 0}),
        _chat("too-long", {"messages": [{"role": "user", "content": too_long}], "max_tokens": 2}),
        _chat("sampled", {"messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 5, "n": 2,
                          "seed": 7, "temperature": 1.0}),
        _chat("logprobs", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}),
        _chat("steered", {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 5, "temperature": 0,
                          "logit_bias": {"11": 5}, "frequency_penalty": 1.0}),
    ]
    batches, output, errors = {}, {}, {}
    for name, srv in (("engine", engine_server), ("ray", ray_server)):
        client = srv.client()
        batches[name] = _wait(client, _submit(client, lines, endpoint=CHAT).id, timeout=300)
        output[name] = _read_lines(client, batches[name].output_file_id)
        errors[name] = _read_lines(client, batches[name].error_file_id)

    batch = batches["ray"]
    assert batch.status == "completed", batch.errors
    assert _counts(batch) == (8, 5, 3) and _counts(batches["engine"]) == (8, 6, 2)  # Ray refuses logprobs
    assert [x["custom_id"] for x in output["ray"]] == ["greedy-0", "greedy-1", "default-max-tokens", "sampled",
                                                       "steered"]
    engine_out = [_comparable(x) for x in output["engine"] if x["custom_id"] != "logprobs"]
    assert [_comparable(x) for x in output["ray"]] == engine_out  # greedy text, seeded samples, usage: all equal
    assert output["ray"][2]["response"]["body"]["usage"]["completion_tokens"] == 4  # the server's default
    assert len(output["ray"][3]["response"]["body"]["choices"]) == 2
    logprobs_prompt = next(x for x in output["engine"] if x["custom_id"] == "logprobs")["response"]["body"][
        "usage"]["prompt_tokens"]
    assert batch.usage.input_tokens == batches["engine"].usage.input_tokens - logprobs_prompt

    assert [x["custom_id"] for x in errors["ray"]] == ["bad-temperature", "too-long", "logprobs"]
    assert [_comparable(x) for x in errors["ray"][:2]] == [_comparable(x) for x in errors["engine"]]
    messages = [x["response"]["body"]["error"]["message"] for x in errors["ray"]]
    assert "temperature" in messages[0] and "prompt has" in messages[1]  # the latter found by the job's engine
    assert messages[2] == NO_LOGPROBS
    assert not (Path(ray_server.args[ray_server.args.index("--storage") + 1]) / "jobs" / batch.id).exists()


def test_cancel_stops_the_job_and_keeps_finished_rows(ray_server):
    client = ray_server.client()
    # enough rows that the job is still running when the cancel arrives after the first two
    lines = [_line(f"long-{i}", {"prompt": PROMPTS[i % 4], "max_tokens": 32, "temperature": 0,
                                     "ignore_eos": True}) for i in range(48)]
    created = _submit(client, lines)
    running = _wait(client, created.id, until=lambda b: b.request_counts.completed >= 2, timeout=300)
    assert running.status == "in_progress"  # request_counts move while the job runs
    assert client.batches.cancel(created.id).status == "cancelling"
    batch = _wait(client, created.id)
    assert batch.status == "cancelled"
    _check_partial(client, batch, lines, "batch_cancelled")

    after = _wait(client, _submit(client, [_line("after", {"prompt": "x", "max_tokens": 2})]).id, timeout=300)
    assert after.status == "completed" and _counts(after) == (1, 1, 0)  # the next batch gets a fresh job


def test_restart_resumes_the_job_from_its_output(ray_server, ray_storage, tiny_moe_dir, loop, caplog):
    client = ray_server.client()
    # enough rows that the first results come well before the last (the stop below must find the job running)
    lines = [_line(f"r-{i}", {"prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": 8, "temperature": 0,
                                  "ignore_eos": True}) for i in range(48)]
    created = _submit(client, lines)
    running = _wait(client, created.id, until=lambda b: b.request_counts.completed >= 2, timeout=300)
    ray_server.stop()  # shuts the job down; the batch stays in_progress
    assert BatchStore(str(ray_storage)).get_batch(created.id).status == "in_progress"

    with caplog.at_level(logging.INFO, logger="batchgen.pipelines.openai_batch.ray_backend"):
        restarted = _ray_server(tiny_moe_dir, ray_storage)
        try:
            client = restarted.client()
            batch = _wait(client, created.id, timeout=300)
            out = _read_lines(client, batch.output_file_id)
        finally:
            restarted.stop()
    assert batch.status == "completed" and _counts(batch) == (48, 48, 0)
    resumed = [r.getMessage() for r in caplog.records if "its job resumes with" in r.getMessage()]
    assert len(resumed) == 1 and int(resumed[0].split("with ")[1].split()[0]) >= running.request_counts.completed
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]  # every line once, in order
    expected = _greedy(loop, [x["body"]["prompt"] for x in lines], max_tokens=8, ignore_eos=True)
    assert [x["response"]["body"]["choices"][0]["text"] for x in out] == [c.text for c in expected]


def test_a_job_that_fails_fails_its_batch_and_keeps_the_finished_rows(ray_cluster, tiny_moe_dir, tmp_path,
                                                                       monkeypatch):
    """The job raises mid-run (a node lost, storage gone): the batch ends failed with code job_failed, the rows the
    job finished in its output file, every other line once in the error file with that code; the next batch runs."""
    from batchgen.pipelines.openai_batch import ray_backend
    from batchgen.pipelines.pipeline import JobError

    real = ray_backend.execute_job

    def failing(plan, on_progress, poll_s):
        def progress(p):
            on_progress(p)
            if p.rows >= 2:
                raise JobError("the job lost its node")
        return real(plan, on_progress=progress, poll_s=poll_s)

    monkeypatch.setattr(ray_backend, "execute_job", failing)
    server = _ray_server(tiny_moe_dir, tmp_path / "storage")  # its own: the module's is stopped by a restart test
    try:
        client = server.client()
        lines = [_line(f"f-{i}", {"prompt": PROMPTS[i % 4], "max_tokens": 32, "temperature": 0, "ignore_eos": True})
                 for i in range(48)]
        batch = _wait(client, _submit(client, lines).id, timeout=300)
        assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["job_failed"]
        assert "the job lost its node" in batch.errors.data[0].message
        _check_partial(client, batch, lines, "job_failed")
        monkeypatch.setattr(ray_backend, "execute_job", real)
        after = _wait(client, _submit(client, [_line("after", {"prompt": "x", "max_tokens": 2})]).id, timeout=300)
        assert after.status == "completed" and _counts(after) == (1, 1, 0)
    finally:
        server.stop()
