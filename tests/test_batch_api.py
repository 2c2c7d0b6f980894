"""The Batch API end to end: real servers on 127.0.0.1 driven by the official openai client.

The main server runs in this process, built from `batchgen serve` arguments over the same engine loop
the references come from (the model loads once); the S3 one is a `batchgen serve` subprocess, so
the command itself, an API key and a kill -9 restart are tested too.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pandas as pd
import pyarrow as pa
import pytest
import uvicorn
from pipeline_helpers import stop_string

from batchgen.engine import Completion, Engine, EngineLoad, EngineLoop, Request, Result, SamplingParams
from batchgen.operators import BatchGen
from batchgen.pipelines.cli import build_parser
from batchgen.pipelines.openai_batch.serve_cli import create_serve_app, open_store

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]"
                 "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}{% endif %}")
PROMPTS = ["the quick brown fox", "once upon a time", "hello world", "batch inference on a budget"]
SERVED = "tiny-served"
API_KEY = "sk-test-0123456789"
KV = {"kv_budget_bytes": 32 << 20, "host_kv_budget_bytes": 128 << 20}  # small: several engines run at once
ENGINE_ARGS = ["--engine", json.dumps(KV)]
SERVE_CMD = [sys.executable, "-m", "batchgen.pipelines.cli", "serve"]
_ids = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `batchgen serve` on 127.0.0.1 started with `args`."""

    args: list[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)


class InProcessServer(Server):
    """The server `batchgen serve ARGS` builds, run by uvicorn on a thread over an engine loop already running."""

    def __init__(self, args: list[str], loop: EngineLoop) -> None:
        self.args = args
        parsed = build_parser().parse_args(["serve", *args])
        app = create_serve_app(parsed, loop, open_store(parsed))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    def start(self, timeout: float = 60) -> InProcessServer:
        self._thread.start()
        deadline = time.time() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the in-process server did not come up")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


class ServeProcess(Server):
    """A `batchgen serve` subprocess; its log lands in `log_path`."""

    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args, self.env = args, {**os.environ, **(env or {})}
        self.log_path = workdir / f"server-{_free_port()}.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, timeout: float = 120) -> ServeProcess:
        self.port = _free_port()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*SERVE_CMD, *self.args, *ENGINE_ARGS, "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_moe_dir) -> Path:
    return Path(tiny_moe_dir)


@pytest.fixture(scope="module")
def batch_gen(model_dir) -> BatchGen:
    """The Parquet pipeline's engine stage (what `batchgen run --mode single` runs in each actor); its
    engine loop also computes every reference output and serves the in-process server."""
    op = BatchGen(str(model_dir), **KV)
    yield op
    op.loop.close()


@pytest.fixture(scope="module")
def loop(batch_gen) -> EngineLoop:
    return batch_gen.loop


@pytest.fixture(scope="module")
def engine(batch_gen) -> Engine:
    return batch_gen.engine  # read-only use (tokenizer, limits): the loop's thread owns it


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(batch_gen, model_dir, template_file, tmp_path_factory):
    work = tmp_path_factory.mktemp("server")
    srv = InProcessServer(["--model", str(model_dir), "--storage", str(work / "storage"),
                           "--served-model-name", SERVED, "--chat-template", str(template_file),
                           "--allow-custom-completion-window", "--max-in-flight", "4",
                           "--max-upload-bytes", "65536", "--sampling-params", '{"max_tokens": 3}'],
                          batch_gen.loop).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


# ---- helpers ---------------------------------------------------------------------------------------


def _jsonl(lines: list[dict | str]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _line(custom_id: str, body: dict, url: str = "/v1/completions", model: str = SERVED) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": model, **body}}


def _submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/completions", window: str = "24h",
            metadata: dict | None = None):
    upload = client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window=window,
                                 metadata=metadata)


def _wait(client: openai.OpenAI, batch_id: str, until=None, timeout: float = 120):
    """Poll until the batch is terminal (or `until(batch)` holds); every status seen is checked valid."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch) if until else batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} stuck in {batch.status}: {batch.request_counts}")


def _read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _counts(batch) -> tuple[int, int, int]:
    return batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed


def _greedy(loop: EngineLoop, prompts: list, max_tokens: int, **sampling) -> list[Completion]:
    """The engine's own greedy output for `prompts` (text or token ids), the reference for the server."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    requests = [Request(f"ref{next(_ids)}", prompt=p, sampling=params) if isinstance(p, str) else
                Request(f"ref{next(_ids)}", prompt_token_ids=p, sampling=params) for p in prompts]

    futures = loop.submit([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i]))
    results = [f.result(timeout=120) for f in futures]
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.outputs[0] for r in results]


def _chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- tests -----------------------------------------------------------------------------------------


def test_a_chat_template_option_is_the_template_itself_or_a_file_that_exists(template_file, tmp_path):
    """A real template is long: tested as a path first, one over 255 characters without a slash raised ENAMETOOLONG
    and failed the server; a mistyped path became the template, every chat prompt its text."""
    from batchgen.pipelines.cli_args import chat_template_text

    inline = "{% for m in messages %}" + "{{ m['content'] }}" * 40 + "{% endfor %}"
    assert len(inline) > 255 and chat_template_text(inline) == inline
    assert chat_template_text(str(template_file)) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"--chat-template '.*missing\.jinja' is no template .* and no file"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_a_chat_template_that_does_not_compile_stops_serve_before_the_model_loads(tmp_path, capsys):
    from batchgen.pipelines.cli import main

    code = main(["serve", "--model", str(tmp_path / "absent"), "--storage", str(tmp_path / "s"),
                 "--chat-template", "{% for m in messages %}{{ m['content'] }"])
    # a bad command line (exit 2); the model's absence would be the error had it been loaded first
    assert code == 2
    assert "batchgen serve: error: chat_template does not compile: unexpected '}'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--sampling-params", '{"temperature": -1}'], "invalid sampling parameter 'temperature'"),
    (["--engine", '{"max_num_seqs": 0}'], "max_num_seqs"),
    (["--ray-job", '{"concurrency": 2}'], "--ray-job apply to the other backend; this server runs --backend engine"),
    (["--ray-address", "auto"], "--ray-address apply to the other backend"),
    (["--backend", "ray", "--max-in-flight", "8"], "--max-in-flight apply to the other backend; this server runs "
                                                   "--backend ray"),
])
def test_serve_refuses_bad_values_and_the_other_backends_options_as_a_bad_command_line(tmp_path, capsys, flags,
                                                                                      message):
    """A bad value exited with status 1 (as an unusable model does), and an option of the other backend was
    ignored without a word (run refuses another mode's options)."""
    from batchgen.pipelines.cli import main

    code = main(["serve", "--model", str(tmp_path / "absent"), "--storage", str(tmp_path / "s"), *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_the_api_key_defaults_to_the_environments(monkeypatch):
    from batchgen.pipelines.cli import build_parser

    monkeypatch.setenv("BATCHGEN_API_KEY", "from-env")
    parse = lambda *extra: build_parser().parse_args(["serve", "--model", "m", "--storage", "s", *extra])  # noqa: E731
    assert parse().api_key == "from-env" and parse("--api-key", "given").api_key == "given"
    monkeypatch.delenv("BATCHGEN_API_KEY")
    assert parse().api_key is None


@pytest.mark.parametrize("flag", ["--max-in-flight", "--max-batch-requests", "--max-upload-bytes"])
def test_serve_limits_below_one_are_a_bad_command_line(flag, capsys):
    """--max-in-flight 0 admitted no request: every batch stayed in_progress until it expired; --max-batch-requests 0
    failed every batch."""
    from batchgen.pipelines.cli import build_parser

    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--model", "m", "--storage", "s", flag, value])
        assert exit_.value.code == 2 and f"expected an integer >= 1, got {value}" in capsys.readouterr().err


def test_serve_defaults_are_the_models_generation_config_under_sampling_params(tmp_path):
    """vLLM's server applies the sampling defaults a checkpoint's generation_config.json recommends (Qwen3's
    temperature 0.6, top_p 0.95, top_k 20) to the fields a request leaves out; they were never read.
    --generation-config vllm leaves them out, as vLLM's does."""
    from tiny_models import save_tiny_checkpoint
    from transformers import GenerationConfig

    from batchgen.pipelines.cli import build_parser
    from batchgen.pipelines.openai_batch.serve_cli import serve_sampling_defaults

    save_tiny_checkpoint("llama", tmp_path)

    def defaults(*flags):
        return serve_sampling_defaults(build_parser().parse_args(["serve", "--model", str(tmp_path), "--storage",
                                                                  str(tmp_path / "store"), *flags]))

    assert defaults() == {}  # transformers' own generation defaults recommend nothing
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=7, eos_token_id=2,
                     num_beams=1).save_pretrained(tmp_path)
    assert defaults() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert defaults("--sampling-params", '{"temperature": 0, "seed": 3}') == {
        "temperature": 0, "top_p": 0.95, "top_k": 20, "max_tokens": 7, "seed": 3}
    assert defaults("--generation-config", "vllm") == {}


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_past_tcps_is_a_bad_command_line(port, capsys):
    """The server loaded the model, then failed to bind with a traceback."""
    from batchgen.pipelines.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--model", "m", "--storage", "s", "--port", port])
    assert exit_.value.code == 2 and "expected a port number in [0, 65535]" in capsys.readouterr().err


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == [SERVED]
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_completions_batch_matches_engine(client, engine, loop):
    token_prompt = engine.tokenizer.encode("a list of token ids")
    lines = [_line(f"req-{i}", {"prompt": p, "max_tokens": 6, "temperature": 0})
             for i, p in enumerate(PROMPTS)]
    lines.append(_line("tokens", {"prompt": token_prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}))
    expected = _greedy(loop, [*PROMPTS, token_prompt], max_tokens=6)
    stop_word = stop_string(expected[0].text)
    lines.append(_line("stop", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stop": [stop_word]}))
    created = _submit(client, lines, metadata={"job": "nightly"})
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    assert created.expires_at - created.created_at == 24 * 3600
    batch = _wait(client, created.id)

    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 6 and batch.request_counts.completed == 6
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.failed_at is batch.cancelled_at is batch.expired_at is None
    out = _read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]  # input order
    for entry, reference in zip(out, expected):
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        body = entry["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == SERVED
        assert body["choices"][0]["text"] == reference.text
        assert body["choices"][0]["finish_reason"] == reference.finish_reason
        usage = body["usage"]
        assert usage["completion_tokens"] == len(reference.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stopped = out[-1]["response"]["body"]["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == expected[0].text[:expected[0].text.index(stop_word)]
    tokens_body = out[-2]["response"]["body"]
    assert tokens_body["usage"]["prompt_tokens"] == len(token_prompt)
    logprobs = tokens_body["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == tokens_body["choices"][0]["text"]
    assert len(logprobs["tokens"]) == tokens_body["usage"]["completion_tokens"]
    assert all(1 <= len(top) <= 2 and lp <= 0 for top, lp in zip(logprobs["top_logprobs"],
                                                            logprobs["token_logprobs"]))
    assert all(top[token] == lp for top, token, lp in zip(logprobs["top_logprobs"], logprobs["tokens"],
                                                         logprobs["token_logprobs"]))  # greedy: the likeliest
    assert batch.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)


def test_penalties_and_logit_bias_reach_the_engine(client, engine, loop):
    """OpenAI's logit_bias (string token ids), frequency_penalty and presence_penalty, and vLLM's
    repetition_penalty, give what the engine gives for the same sampling params."""
    steering = [{"logit_bias": {"11": 100}}, {"frequency_penalty": 1.5, "presence_penalty": 0.5},
                {"repetition_penalty": 3.0}]
    lines = [_line(f"s{i}", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, **extra})
             for i, extra in enumerate(steering)]
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch.errors
    texts = [x["response"]["body"]["choices"][0]["text"] for x in _read_lines(client, batch.output_file_id)]
    expected = [_greedy(loop, [PROMPTS[0]], max_tokens=8, **extra)[0].text for extra in steering]
    assert texts == expected
    assert expected[0] == engine.tokenizer.decode([11] * 8, skip_special_tokens=True)
    assert expected[1] != _greedy(loop, [PROMPTS[0]], max_tokens=8)[0].text  # the penalties changed the output


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Ann", "Bo"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_response_format_gives_json_that_follows_the_schema(client, engine, loop):
    """OpenAI's response_format (json_schema, json_object) on chat lines, vLLM's structured_outputs on
    completions lines, greedy and seeded; a schema that does not compile fails its line alone."""
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": p} for p in PROMPTS]
    lines = [_line(f"s{i}", {"messages": [m], "max_tokens": 200, "temperature": t, "seed": i, "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, **strict}}}, url=chat)
             for i, (m, t, strict) in enumerate(zip(messages, (0, 0, 1.0, 1.0), ({"strict": True}, {}) * 2))]
    lines.append(_line("object", {"messages": messages[:1], "max_tokens": 200, "temperature": 0,
                                  "response_format": {"type": "json_object"}}, url=chat))
    lines.append(_line("bad-schema", {"messages": messages[:1], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, url=chat))
    lines.append(_line("bad-type", {"messages": messages[:1], "response_format": {"type": "xml"}}, url=chat))
    batch = _wait(client, _submit(client, lines, endpoint=chat).id)
    assert _counts(batch) == (7, 5, 2), batch.errors
    out = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in _read_lines(client, batch.output_file_id)}
    for i in range(4):
        assert out[f"s{i}"]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out[f"s{i}"]["message"]["content"]), PERSON)
    reference = _greedy(loop, [_chat_ids(engine, messages[:1])], max_tokens=200,
                        structured_outputs={"json": PERSON})[0]
    assert out["s0"]["message"]["content"] == reference.text
    if out["object"]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["object"]["message"]["content"]), dict)
    assert out["object"]["message"]["content"].startswith("{")
    errors = {x["custom_id"]: x["response"]["body"]["error"]["message"]
              for x in _read_lines(client, batch.error_file_id)}
    assert 'does not compile: Unsupported type "strnig"' in errors["bad-schema"]
    assert "'type' must be 'text', 'json_object' or 'json_schema', got 'xml'" in errors["bad-type"]

    regex = {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
    lines = [_line(f"r{i}", {"prompt": p, "max_tokens": 20, "temperature": 1.0, "seed": i, **regex})
             for i, p in enumerate(PROMPTS)]
    batch = _wait(client, _submit(client, lines).id)
    texts = [x["response"]["body"]["choices"][0]["text"] for x in _read_lines(client, batch.output_file_id)]
    assert len(texts) == len(PROMPTS) and all(re.fullmatch("[0-9]{3}-[a-z]{2}", t) for t in texts), texts


def test_greedy_output_equals_batchgen_run(client, batch_gen):
    """The Parquet pipeline's engine stage (BatchGen: parse rows, generate, output columns, as `batchgen run
    --mode single --max-tokens 6 --temperature 0` runs it per block) and the Batch API agree."""
    table = pa.table({"prompt": PROMPTS, "sampling_params": [{"max_tokens": 6, "temperature": 0.0}] * 4})
    rows = asyncio.run(batch_gen(table)).to_pylist()
    assert all(r["error"] is None for r in rows), rows
    lines = [_line(f"p{i}", {"prompt": p, "max_tokens": 6, "temperature": 0}) for i, p in enumerate(PROMPTS)]
    out = _read_lines(client, _wait(client, _submit(client, lines).id).output_file_id)
    assert [x["response"]["body"]["choices"][0]["text"] for x in out] == [r["generated_text"] for r in rows]
    assert [x["response"]["body"]["usage"]["completion_tokens"] for x in out] == \
        [r["num_generated_tokens"] for r in rows]
    assert [x["response"]["body"]["choices"][0]["finish_reason"] for x in out] == [r["finish_reason"] for r in rows]
    assert [x["response"]["body"]["usage"]["prompt_tokens"] for x in out] == [r["num_prompt_tokens"] for r in rows]


def test_chat_batch(client, engine, loop):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    conversations.append([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "hi there"}]}])
    lines = [_line(f"chat-{i}", {"messages": m, "max_completion_tokens": 5, "temperature": 0},
                   url="/v1/chat/completions") for i, m in enumerate(conversations)]
    for cid in ("sampled", "sampled-again"):  # seeded: the same samples twice
        lines.append(_line(cid, {"messages": conversations[0], "max_tokens": 5, "n": 2, "seed": 7,
                                 "temperature": 1.0, "logprobs": True, "top_logprobs": 3},
                           url="/v1/chat/completions"))
    lines.append(_line("image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, url="/v1/chat/completions"))
    batch = _wait(client, _submit(client, lines, endpoint="/v1/chat/completions").id)

    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
    out = _read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["chat-0", "chat-1", "chat-2", "sampled", "sampled-again"]
    prompts = [_chat_ids(engine, [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                                   else m["content"][0]["text"]} for m in conv]) for conv in conversations]
    expected = _greedy(loop, prompts, max_tokens=5)
    for entry, reference, prompt in zip(out, expected, prompts):
        body = entry["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": reference.text, "refusal": None}
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == len(reference.token_ids)
    sampled = out[3]["response"]["body"]
    assert [c["index"] for c in sampled["choices"]] == [0, 1]
    again = out[4]["response"]["body"]["choices"]
    assert [c["message"] for c in sampled["choices"]] == [c["message"] for c in again]
    assert sampled["choices"][0]["message"] != sampled["choices"][1]["message"]
    for choice in sampled["choices"]:
        content = choice["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == choice["message"]["content"]
        assert all(len(t["top_logprobs"]) == 3 and t["bytes"] == list(t["token"].encode()) for t in content)
    errors = _read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["image"]
    assert errors[0]["response"]["status_code"] == 400
    assert "only text parts" in errors[0]["response"]["body"]["error"]["message"]


def test_chat_template_parameters_reach_the_template(client, engine, loop):
    """vLLM's chat_template_kwargs, continue_final_message and add_generation_prompt on chat lines; a bad one fails
    its line alone."""
    turns = [{"role": "user", "content": PROMPTS[0]}]
    open_answer = [*turns, {"role": "assistant", "content": "It jumps"}]
    lines = [_line("no-think", {"messages": turns, "max_tokens": 4, "temperature": 0,
                                "chat_template_kwargs": {"enable_thinking": False}}, url="/v1/chat/completions"),
             _line("continue", {"messages": open_answer, "max_tokens": 4, "temperature": 0,
                                "continue_final_message": True, "add_generation_prompt": False},
                   url="/v1/chat/completions"),
             _line("both", {"messages": open_answer, "continue_final_message": True, "add_generation_prompt": True},
                   url="/v1/chat/completions"),
             _line("reserved", {"messages": turns, "chat_template_kwargs": {"tools": []}}, url="/v1/chat/completions")]
    batch = _wait(client, _submit(client, lines, endpoint="/v1/chat/completions").id)
    assert _counts(batch) == (4, 2, 2)
    texts = [f"[user] {PROMPTS[0]}\n[assistant] /no_think", f"[user] {PROMPTS[0]}\n[assistant] It jumps"]
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    expected = _greedy(loop, prompts, max_tokens=4)
    out = _read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["no-think", "continue"]
    for entry, reference, prompt in zip(out, expected, prompts):
        body = entry["response"]["body"]
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["choices"][0]["message"]["content"] == reference.text
    errors = {e["custom_id"]: e["response"]["body"]["error"]["message"]
              for e in _read_lines(client, batch.error_file_id)}
    assert "cannot both be true" in errors["both"]
    assert "'tools' is an argument of the rendering itself" in errors["reserved"]
    from batchgen.engine.errors import InvalidRequestError
    from batchgen.pipelines.openai_batch.wire_format import _check_fields

    with pytest.raises(InvalidRequestError, match="'chat_template_kwargs' belongs to /v1/chat/completions"):
        _check_fields({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}, chat=False)


def test_null_parameters_are_unset_whatever_they_are():
    """A line written from a typed request model carries every optional field: `"reasoning_effort": null` and the
    like were refused as unrecognized, `tool_choice: "auto"` without tools as unsupported."""
    from batchgen.engine.errors import InvalidRequestError
    from batchgen.pipelines.openai_batch.wire_format import _check_fields

    body = {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": None, "prediction": None,
            "functions": None, "function_call": None, "prompt": None, "tool_choice": "auto", "tools": None}
    _check_fields(body, chat=True)
    with pytest.raises(InvalidRequestError, match="unrecognized request parameter 'reasoning_effort'"):
        _check_fields({**body, "reasoning_effort": "high"}, chat=True)


def test_best_of_is_compared_with_n_as_it_resolves(engine):
    """A client writing every optional field sends `"n": null` beside `best_of`: it was compared with None."""
    from batchgen.engine import RequestNormalizer
    from batchgen.engine.errors import InvalidRequestError
    from batchgen.pipelines.openai_batch.wire_format import RequestBuilder

    builder = RequestBuilder("/v1/completions", RequestNormalizer(None, engine.model.vocab_size, 64), {})
    line = {"model": SERVED, "prompt": [3, 4]}
    assert builder.build("r", {**line, "best_of": 1, "n": None}).sampling.n == 1
    assert builder.build("r", {**line, "best_of": 2, "n": 2}).sampling.n == 2
    with pytest.raises(InvalidRequestError, match="only best_of equal to n is supported"):
        builder.build("r", {**line, "best_of": 2, "n": None})


def test_logprobs_on_a_model_without_a_tokenizer_are_refused_per_line(engine):
    """The line ran and its result could not be written (its tokens' text needs the tokenizer)."""
    from batchgen.engine import RequestNormalizer
    from batchgen.engine.errors import InvalidRequestError
    from batchgen.pipelines.openai_batch.wire_format import RequestBuilder

    builder = RequestBuilder("/v1/completions", RequestNormalizer(None, engine.model.vocab_size, 64), {})
    assert builder.build("r", {"model": SERVED, "prompt": [3, 4]}).prompt_token_ids == [3, 4]
    with pytest.raises(InvalidRequestError, match="logprobs needs the model's tokenizer"):
        builder.build("r", {"model": SERVED, "prompt": [3, 4], "logprobs": 1})


def test_per_request_errors_go_to_error_file(client, engine):
    too_long = [5] * (engine.max_model_len + 3)
    bad = {
        "bad-temperature": ({"prompt": "x", "temperature": -1}, "temperature"),
        "too-long": ({"prompt": too_long, "max_tokens": 2}, "prompt has"),
        # the prompt fits, the tokens asked for do not: a 400 (OpenAI, vLLM), not a completion cut at the context
        "over-context": ({"prompt": [5] * (engine.max_model_len - 3), "max_tokens": 4},
                         "'max_tokens' or 'max_completion_tokens' is too large: 4. This model's maximum context length "
                         f"is {engine.max_model_len} tokens and your request has {engine.max_model_len - 3} input "
                         f"tokens (4 > {engine.max_model_len} - {engine.max_model_len - 3})"),
        "logit-bias": ({"prompt": "x", "logit_bias": {"5": 300}}, "logit_bias': bias 300"),
        "bias-outside-vocab": ({"prompt": "x", "logit_bias": {str(engine.normalizer.vocab_size): 1}},
                               "logit_bias: token"),
        "bad-prompt": ({"prompt": {"text": "x"}}, "prompt: expected text, got dict"),
        "no-prompt": ({"max_tokens": 2}, "missing required parameter 'prompt'"),
        "two-prompts": ({"prompt": ["x", "y"]}, "one prompt per request line"),
        "empty-prompt": ({"prompt": ""}, "prompt is empty"),
        "outside-vocab": ({"prompt": [1, engine.normalizer.vocab_size]}, "outside the vocabulary"),
        "nan-temperature": ({"prompt": "x", "temperature": float("nan")}, "'temperature': must be a finite"),
        "unknown-field": ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        "chat-field": ({"prompt": "x", "messages": []}, "messages"),
        "bad-max-tokens": ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        # parses as JSON, then would overflow the stack of the checks that recurse through it (the runner's thread)
        "deep-stop": ({"prompt": "x", "stop": _nested(400)}, "stop: nested deeper than 100 levels"),
        "deep-schema": ({"prompt": "x", "structured_outputs": {"json": _deep_schema(200)}},
                        "structured_outputs: nested deeper than 100 levels"),
    }
    lines = [_line("ok-1", {"prompt": "hello", "ignore_eos": True})]  # max_tokens from --sampling-params
    lines += [_line(cid, body) for cid, (body, _) in bad.items()]
    lines.append(_line("ok-2", {"prompt": "world", "max_tokens": 5, "ignore_eos": True}))
    batch = _wait(client, _submit(client, lines).id)

    assert batch.status == "completed"
    assert _counts(batch) == (len(bad) + 2, 2, len(bad))
    out = _read_lines(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["ok-1", "ok-2"]
    assert [x["response"]["body"]["usage"]["completion_tokens"] for x in out] == [3, 5]
    errors = _read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == list(bad)
    for entry in errors:
        assert entry["response"]["status_code"] == 400 and entry["error"] is None
        message = entry["response"]["body"]["error"]["message"]
        assert bad[entry["custom_id"]][1] in message, message


def test_bad_line_and_bad_parquet_row_get_the_same_error(client, engine, batch_gen):
    """One request path: the OpenAI mapping hands the prompt and sampling values to the engine's own checks."""
    too_long = [5] * (engine.max_model_len + 3)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    cases = [  # (endpoint, request body, the same content as a Parquet row)
        ("/v1/completions", {"prompt": [1, engine.normalizer.vocab_size]},
         {"prompt_token_ids": [1, engine.normalizer.vocab_size]}),
        ("/v1/completions", {"prompt": "x", "temperature": -1},
         {"prompt": "x", "sampling_params": {"temperature": -1}}),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, {"prompt": "x", "sampling_params": {"top_p": 0}}),
        ("/v1/completions", {"prompt": too_long, "max_tokens": 2},
         {"prompt_token_ids": too_long, "sampling_params": {"max_tokens": 2}}),
        ("/v1/completions", {"prompt": ""}, {"prompt": ""}),
        ("/v1/chat/completions", {"messages": image}, {"messages": image}),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
         {"messages": [{"role": "robot", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
         {"messages": [{"role": "user", "content": None}]}),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}]},
         {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}]}),
    ]
    row_errors = asyncio.run(batch_gen(pd.DataFrame([row for _, _, row in cases])))["error"].tolist()
    line_errors = []
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        lines = [_line(f"case-{i}", body, url=url) for i, (url, body, _) in enumerate(cases) if url == endpoint]
        batch = _wait(client, _submit(client, lines, endpoint=endpoint).id)
        assert _counts(batch) == (len(lines), 0, len(lines))
        line_errors += [e["response"]["body"]["error"]["message"] for e in _read_lines(client, batch.error_file_id)]
    assert all(row_errors) and line_errors == row_errors


def test_a_line_no_check_foresaw_fails_alone_and_the_batch_completes(client, monkeypatch):
    """Values past a float's range, a digit int() refuses, and a fault of ours building one line: before, the
    first two escaped the line's checks as OverflowError / ValueError and the batch never left `finalizing`."""
    from batchgen.pipelines.openai_batch import wire_format

    build = wire_format.RequestBuilder.build

    def faulty(self, request_id, body):
        if body.get("prompt") == "fault":
            raise RuntimeError("a fault of ours")
        return build(self, request_id, body)

    monkeypatch.setattr(wire_format.RequestBuilder, "build", faulty)
    lines = [_line("ok-1", {"prompt": "x", "max_tokens": 2}),
             _line("huge", {"prompt": "x", "max_tokens": 2, "temperature": 10**400}),
             _line("digit", {"prompt": "x", "max_tokens": 2, "logit_bias": {"²": 1}}),
             _line("fault", {"prompt": "fault", "max_tokens": 2}),
             _line("ok-2", {"prompt": "y", "max_tokens": 2})]
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "completed" and _counts(batch) == (5, 2, 3)
    assert [x["custom_id"] for x in _read_lines(client, batch.output_file_id)] == ["ok-1", "ok-2"]
    errors = {e["custom_id"]: e["response"] for e in _read_lines(client, batch.error_file_id)}
    assert "temperature" in errors["huge"]["body"]["error"]["message"] and errors["huge"]["status_code"] == 400
    assert "logit_bias" in errors["digit"]["body"]["error"]["message"]
    assert errors["fault"]["status_code"] == 500 and "a fault of ours" in errors["fault"]["body"]["error"]["message"]


def test_a_line_that_never_ran_says_why_whatever_stopped_its_batch():
    """An engine failure whose exception had no message (a bare assert) raised KeyError on every round: the batch
    stayed in `finalizing` for good."""
    from batchgen.pipelines.openai_batch.wire_format import unfinished_line

    assert unfinished_line("a", "batch_cancelled")["error"]["message"] == (
        "This request was not executed because the batch was cancelled.")
    assert unfinished_line("a", "engine_error", "")["error"] == {
        "code": "engine_error", "message": "This request was not executed: the batch stopped (engine_error)."}


def test_invalid_input_fails_validation_with_line_numbers(client):
    good = _line("a", {"prompt": "x"})
    lines = [
        '{"custom_id": ',  # 1: malformed JSON
        "[1, 2]",  # 2: not an object
        {**good, "custom_id": None},  # 3: missing custom_id
        good,  # 4: fine
        good,  # 5: duplicate custom_id
        {**good, "custom_id": "b", "method": "GET"},  # 6
        {**good, "custom_id": "c", "url": "/v1/embeddings"},  # 7
        {**good, "custom_id": "d", "body": {"model": "gpt-4o", "prompt": "x"}},  # 8
        "",  # 9: blank lines are skipped
        {**good, "custom_id": "e", "body": "not an object"},  # 10
        '{"custom_id": "f", "body": ' + "[" * 5000 + "]" * 5000 + "}",  # 11: deeper than json's recursion
        '{"custom_id": "g", "body": ' + "7" * 5000 + "}",  # 12: an integer past Python's digit limit
    ]
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert batch.output_file_id is None and batch.request_counts.total == 0
    found = [(e.line, e.code) for e in batch.errors.data]
    assert found == [(1, "invalid_json_line"), (2, "invalid_json_line"), (3, "missing_custom_id"),
                     (5, "duplicate_custom_id"), (6, "invalid_method"), (7, "invalid_url"),
                     (8, "model_not_found"), (10, "invalid_body"), (11, "invalid_json_line"),
                     (12, "invalid_json_line")]
    assert "line 4" in batch.errors.data[3].message and "'tiny-served'" in batch.errors.data[6].message

    empty = _wait(client, _submit(client, ["", ""]).id)
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"


def test_create_batch_rejects_bad_arguments(client):
    upload = client.files.create(file=("in.jsonl", _jsonl([_line("a", {"prompt": "x"})])), purpose="batch")
    cases = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "soon"}, "completion_window"),
        ({"input_file_id": "file-" + "0" * 24}, "input_file_id"),
        ({"input_file_id": "../batchgen_batches.sqlite"}, "input_file_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for override, param in cases:
        args = {"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h",
                **override}
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(**args)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    # a lone surrogate, valid JSON no response can hold (the openai client cannot even send it): before, the batch was
    # created, its own response failed (500), and so did every list of batches after it
    body = json.dumps({"input_file_id": upload.id, "endpoint": "/v1/completions", "completion_window": "24h",
                       "metadata": {"k": "\ud800"}})  # (json writes it as the escape \\ud800)
    response = httpx.post(f"{client.base_url}batches", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "metadata", response.text
    assert httpx.get(f"{client.base_url}batches").status_code == 200


def test_files_api_and_path_traversal(server, client):
    data = _jsonl([_line("a", {"prompt": "x"})])
    uploads = [client.files.create(file=(f"f{i}.jsonl", data), purpose="batch") for i in range(3)]
    got = client.files.retrieve(uploads[0].id)
    assert (got.filename, got.bytes, got.purpose) == ("f0.jsonl", len(data), "batch")
    assert client.files.content(uploads[1].id).content == data
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == [uploads[2].id, uploads[1].id] and page.has_more
    assert uploads[0].id in [f.id for f in client.files.list(limit=2, after=uploads[1].id).data]
    assert client.files.delete(uploads[2].id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploads[2].id)

    db = Path(server.args[server.args.index("--storage") + 1]) / "batchgen_batches.sqlite"
    assert db.exists()
    for path in ["..%2Fbatchgen_batches.sqlite", "..%2F..%2Fstorage%2Fbatchgen_batches.sqlite",
                 "%2e%2e", "..", "file-..%2F..%2Fbatchgen_batches.sqlite", "%2Fetc%2Fpasswd",
                 "file-" + "0" * 24]:
        for suffix in ("", "/content"):
            response = httpx.get(f"{server.url}/v1/files/{path}{suffix}")
            assert response.status_code == 404, (path, response.text)
            assert b"SQLite" not in response.content and b"root:" not in response.content
        assert httpx.delete(f"{server.url}/v1/files/{path}").status_code == 404
    assert httpx.get(f"{server.url}/v1/files/../batchgen_batches.sqlite").status_code == 404
    assert db.exists()


def test_upload_over_limit_gets_413(client):
    row = json.dumps(_line("x", {"prompt": "y" * 1000})) + "\n"
    slightly_over = (row * 80).encode()  # ~85 KB: caught after parsing (limit 64 KiB + framing slack)
    far_over = (row * 400).encode()  # ~420 KB: cut off while streaming
    for data in (slightly_over, far_over):
        with pytest.raises(openai.APIStatusError) as err:
            client.files.create(file=("big.jsonl", data), purpose="batch")
        assert err.value.status_code == 413
    assert client.files.create(file=("small.jsonl", row.encode()), purpose="batch").bytes == len(row)


def test_list_batches_pagination(client):
    ids = [_submit(client, ["not json"]).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=2)]  # auto-pagination over `after`
    assert every[:3] == ids[::-1] and len(every) == len(set(every))
    raw = httpx.get(f"{client.base_url}batches", params={"limit": 2}).json()
    assert raw["first_id"] == ids[2] and raw["last_id"] == ids[1] and raw["has_more"] is True
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)
    for batch_id in ids:
        _wait(client, batch_id)


def _long_lines(n: int, tokens: int) -> list[dict]:
    return [_line(f"long-{i}", {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                                "ignore_eos": True}) for i in range(n)]


def _check_partial(client, batch, lines, code: str) -> None:
    """Every custom_id exactly once: successes in the output file, the rest as `code` in the error file."""
    out = _read_lines(client, batch.output_file_id)
    errors = _read_lines(client, batch.error_file_id)
    counts = batch.request_counts
    assert 0 < counts.completed < counts.total == len(lines)
    assert len(out) == counts.completed and counts.failed == len(errors) == counts.total - counts.completed
    assert all(e["error"]["code"] == code and e["response"] is None for e in errors)
    ids = [x["custom_id"] for x in out + errors]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)
    order = [x["custom_id"] for x in lines]
    assert [x["custom_id"] for x in out] == [c for c in order if c in {x["custom_id"] for x in out}]


def test_cancel_running_batch(client):
    lines = _long_lines(40, tokens=24)
    created = _submit(client, lines)
    _wait(client, created.id, until=lambda b: b.status == "in_progress" and b.request_counts.completed >= 2)
    cancelled = client.batches.cancel(created.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at is not None
    batch = _wait(client, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    _check_partial(client, batch, lines, "batch_cancelled")
    assert client.batches.cancel(created.id).status == "cancelled"

    done = _wait(client, _submit(client, [_line("a", {"prompt": "x", "max_tokens": 2})]).id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(done.id)


def test_completion_window_expires_unfinished_requests(client):
    # the first requests in flight take one token, so some finish inside the window (as short as 1 s: the
    # timestamps are whole seconds) however loaded the machine; the long ones cannot all finish in it
    quick = [_line(f"quick-{i}", {"prompt": PROMPTS[i], "max_tokens": 1}) for i in range(4)]
    lines = quick + _long_lines(128, tokens=64)
    created = _submit(client, lines, window="2s")
    assert created.expires_at - created.created_at == 2
    batch = _wait(client, created.id)
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    _check_partial(client, batch, lines, "batch_expired")


class _BrokenEngine:
    """Finishes the first request it takes, then raises at its next step (a lost device, say)."""

    def __init__(self, normalizer) -> None:
        self.normalizer, self.taken, self.stepped = normalizer, [], False

    def add_request(self, request: Request) -> None:
        self.taken.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.taken)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.taken), 0, 0.0)

    def step(self):
        if self.stepped:
            raise RuntimeError("device lost")
        self.stepped = True
        first = self.taken.pop(0)
        return [Result(first.request_id, [5, 6], outputs=[Completion(0, [7, 8], "done", "length")])]

    def abort(self, request_id: str) -> bool:
        return False


def test_engine_failure_fails_every_batch_keeping_what_finished(engine, tmp_path):
    """The failed batch's finished line is in its output file and the other in its error file with the failure
    (both were lost, and request_counts did not add up)."""
    from fastapi.testclient import TestClient

    loop = EngineLoop(lambda: _BrokenEngine(engine.normalizer), max_outstanding=64)
    args = build_parser().parse_args(["serve", "--model", "broken", "--storage", str(tmp_path / "storage"),
                                      "--generation-config", "vllm"])  # no checkpoint to read one from
    app = create_serve_app(args, loop, open_store(args))
    with TestClient(app) as http:
        def run_batch(custom_ids: str) -> dict:
            lines = [_line(custom_id, {"prompt": "x"}, model="broken") for custom_id in custom_ids]
            upload = http.post("/v1/files", files={"file": ("in.jsonl", _jsonl(lines))},
                               data={"purpose": "batch"}).json()
            batch = http.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                   "completion_window": "24h"}).json()
            deadline = time.time() + 30
            while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.time() < deadline:
                time.sleep(0.05)
                batch = http.get(f"/v1/batches/{batch['id']}").json()
            return batch

        def read(file_id: str) -> list[dict]:
            return [json.loads(line) for line in http.get(f"/v1/files/{file_id}/content").text.splitlines()]

        running = run_batch("ab")  # fails while in progress, after its first line finished
        assert running["status"] == "failed" and running["in_progress_at"] is not None
        [error] = running["errors"]["data"]
        assert error["code"] == "engine_error" and "device lost" in error["message"], error
        assert running["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        [done] = read(running["output_file_id"])
        assert done["custom_id"] == "a" and done["response"]["body"]["choices"][0]["text"] == "done"
        [lost] = read(running["error_file_id"])
        assert lost["custom_id"] == "b" and lost["error"]["code"] == "engine_error"
        assert "device lost" in lost["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["message"]
        later = run_batch("c")  # fails at validation
        assert later["status"] == "failed" and later["in_progress_at"] is None
        assert later["errors"]["data"][0]["code"] == "engine_error"
    loop.close()


def test_a_cancelled_batch_past_its_window_ends_cancelled_and_a_drained_one_is_not_expired(loop, tmp_path):
    """A batch being cancelled when its window passed ended expired, its lines batch_expired; one whose every
    request had finished when the window passed (before the runner looked) ended expired with nothing unfinished."""
    from batchgen.pipelines.openai_batch.backend import BackendConfig
    from batchgen.pipelines.openai_batch.runner import BatchRunner, RunningBatch
    from batchgen.pipelines.openai_batch.store import BatchStore

    store = BatchStore(str(tmp_path / "storage"), None, None)
    runner = BatchRunner(loop, store, BackendConfig(served_model=SERVED))
    cancelling, drained = (store.create_batch("/v1/completions", "file-x", "24h", -1, None) for _ in range(2))
    store.set_status(cancelling.id, "cancelling")
    assert runner._stop_code(RunningBatch(cancelling, [])) == "batch_cancelled"
    done = RunningBatch(drained, [])  # nothing pending, nothing in flight
    runner._active.append(done)
    runner._apply_stops()
    assert done.stop_code is None
    store.set_status(drained.id, "in_progress")  # and as the Ray backend finalizes it, its stop code set
    runner._finalize(RunningBatch(store.get_batch(drained.id), [], "batch_expired"))
    assert store.get_batch(drained.id).status == "completed"


def test_a_running_batch_whose_input_no_longer_validates_on_restart_keeps_what_finished(loop, tmp_path):
    """Resumed after a restart whose input check now fails (a changed --served-model-name, an unreadable file), it
    used to end failed with no files and its finished requests lost."""
    from batchgen.pipelines.openai_batch.backend import BackendConfig
    from batchgen.pipelines.openai_batch.runner import BatchRunner
    from batchgen.pipelines.openai_batch.store import BatchStore, ResultRow

    store = BatchStore(str(tmp_path / "storage"), None, None)
    record = store.create_batch("/v1/completions", "file-" + "0" * 24, "24h", 3600, None)
    store.set_status(record.id, "in_progress", total=2)
    store.add_results(record.id, [ResultRow(0, True, {"custom_id": "a", "response": {"status_code": 200}}, 3, 4)])
    BatchRunner(loop, store, BackendConfig(served_model=SERVED))._resume(store.get_batch(record.id))
    batch = store.get_batch(record.id)
    assert (batch.status, batch.total, batch.completed, batch.failed) == ("failed", 2, 1, 1)
    assert batch.errors[0]["code"] == "input_file_unreadable"
    assert [json.loads(line)["custom_id"] for line in store.read_file(batch.output_file_id).splitlines()] == ["a"]


def _runner_and_store(loop, tmp_path):
    from batchgen.pipelines.openai_batch.backend import BackendConfig
    from batchgen.pipelines.openai_batch.runner import BatchRunner
    from batchgen.pipelines.openai_batch.store import BatchStore

    store = BatchStore(str(tmp_path / "storage"), None, None)
    return BatchRunner(loop, store, BackendConfig(served_model=SERVED)), store


def _running(store, bodies: list[dict]):
    from batchgen.pipelines.openai_batch.runner import RunningBatch
    from batchgen.pipelines.openai_batch.wire_format import BatchLine

    record = store.create_batch("/v1/completions", "file-x", "24h", 3600, None)
    store.set_status(record.id, "in_progress", total=len(bodies))
    lines = [BatchLine(i, i + 1, f"{record.id[-4:]}-{i}", {"model": SERVED, **body}) for i, body in enumerate(bodies)]
    return RunningBatch(store.get_batch(record.id), lines, pending=collections.deque(range(len(lines))))


def test_a_result_that_cannot_be_written_fails_its_own_line_not_the_round(loop, tmp_path, monkeypatch):
    """An error turning one result into its line (a logprobs request on a model without a tokenizer) left the
    round: every result taken that round was lost and their batches never finished."""
    runner, store = _runner_and_store(loop, tmp_path)
    batch = _running(store, [{"prompt": "x"}])

    def unwritable(*args):
        raise AttributeError("'NoneType' object has no attribute 'decode'")

    monkeypatch.setattr("batchgen.pipelines.openai_batch.backend.response_body", unwritable)
    row = runner._result_row(batch, 0, Result("r", [5], outputs=[Completion(0, [7], "t", "length")]))
    line = json.loads(row.line) if isinstance(row.line, str) else row.line
    assert not row.ok and line["response"]["status_code"] == 500
    assert "could not be written: 'NoneType'" in line["response"]["body"]["error"]["message"]


def test_refused_lines_of_every_batch_are_kept_when_storing_one_batchs_fails(loop, tmp_path):
    """Storing the first batch's refused lines failed: the second batch's were neither stored nor put back, so it
    drained with lines that had no result and its finalize raised every round from then on."""
    runner, store = _runner_and_store(loop, tmp_path)
    first, second = (_running(store, [{"prompt": "x", "temperature": -1}]) for _ in range(2))
    runner._active += [first, second]
    add_results, failed = store.add_results, []

    def first_fails_once(batch_id, rows):
        if batch_id == first.id and not failed:
            failed.append(batch_id)
            raise OSError("disk full")
        return add_results(batch_id, rows)

    store.add_results = first_fails_once
    with pytest.raises(OSError, match="disk full"):
        runner._fill()
    runner._fill()
    assert failed and not first.pending and not second.pending
    assert [len(store.results(b.id)) for b in (first, second)] == [1, 1]


def test_a_finalize_that_fails_leaves_no_file_behind(loop, tmp_path, monkeypatch):
    """Each try (the runner retries every round) wrote a new output and error file that nothing registered."""
    runner, store = _runner_and_store(loop, tmp_path)
    batch = _running(store, [{"prompt": "x"}])
    blobs = lambda: sorted(p.name for p in (tmp_path / "storage").rglob("*") if p.is_file() and "file-" in p.name)
    before = blobs()

    def torn():
        yield "{}"
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        store.finalize(batch.id, "completed", iter(["{}"]), torn(), unfinished=0)
    monkeypatch.setattr(store, "_insert_file", lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        store.finalize(batch.id, "completed", iter(["{}"]), iter(["{}"]), unfinished=0)
    assert blobs() == before and store.get_batch(batch.id).status == "in_progress"


def test_a_request_finishing_after_its_batch_failed_stays_out_of_it(loop, tmp_path):
    """The engine failed with a request in flight: its batch was finalized failed with the line in its error file,
    then the request's result arrived and was counted in the finalized batch too (completed + failed > total)."""
    from batchgen.engine.request_future import RequestFuture

    runner, store = _runner_and_store(loop, tmp_path)
    batch = _running(store, [{"prompt": "x"}, {"prompt": "y"}])
    batch.pending.clear()
    request_id = f"{batch.id}:0"
    runner._owner[request_id], batch.in_flight = (batch, 0), {0}
    runner._active.append(batch)
    runner.failure = "device lost"
    runner._fail_active()
    future = RequestFuture()
    future.set_result(Result(request_id, [5], outputs=[Completion(0, [7], "late", "length")]))
    runner._settle(request_id, future)
    runner._record()
    record = store.get_batch(batch.id)
    assert (record.status, record.completed, record.failed) == ("failed", 0, 2)
    assert store.results(batch.id) == {} and runner._owner == {}


@pytest.mark.parametrize("ending", ["failed", "expired"])
def test_a_cancel_is_accepted_only_while_the_batch_can_still_end_cancelled(loop, tmp_path, ending):
    """A cancel that came after the runner read the status but before it wrote the final one was answered
    "cancelling", and the batch then ended failed (or expired) all the same."""
    runner, store = _runner_and_store(loop, tmp_path)
    batch = _running(store, [{"prompt": "x"}])
    finalize, accepted = store.finalize, []

    def cancel_then_finalize(*args, **kwargs):  # the HTTP cancel, just before the final status is written
        accepted.append(store.set_status(batch.id, "cancelling", only_from=("validating", "in_progress")))
        return finalize(*args, **kwargs)

    store.finalize = cancel_then_finalize
    if ending == "failed":
        runner._fail(batch, [{"code": "engine_error", "message": "device lost", "param": None, "line": None}])
    else:
        batch.stop_code = "batch_expired"
        runner._finalize(batch)
    assert accepted == [False] and store.get_batch(batch.id).status == ending


def test_storage_errors_while_recording_and_finalizing_are_retried_not_fatal(loop, model_dir, tmp_path, caplog):
    """The runner thread died on them: the batch stayed finalizing and every later batch waited forever (and a
    failed record of results lost them)."""
    from fastapi.testclient import TestClient

    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--served-model-name", SERVED,
                                      "--storage", str(tmp_path / "storage")])
    store = open_store(args)
    failures: list[str] = []

    def flaky(name, error: Exception | None = None):
        method = getattr(store, name)

        def call(*a, **k):
            if name not in failures:
                failures.append(name)
                raise error or OSError("disk full")
            return method(*a, **k)
        return call

    store.finalize, store.add_results = flaky("finalize"), flaky("add_results")
    # SQLite's own error, not an OSError, when the check of a new batch moves it in_progress: it ran after the
    # server's response, and a failure there left the batch validating for good
    store.set_status = flaky("set_status", sqlite3.OperationalError("database or disk is full"))
    with TestClient(create_serve_app(args, loop, store)) as http:
        ids = []
        for custom_id in "ab":  # the second batch runs after the first one's failed finalize
            upload = http.post("/v1/files", files={"file": ("in.jsonl", _jsonl([_line(custom_id, {
                "prompt": "x", "max_tokens": 2})]))}, data={"purpose": "batch"}).json()
            ids.append(http.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/completions",
                                                      "completion_window": "24h"}).json()["id"])
        deadline = time.time() + 60
        while time.time() < deadline and any(http.get(f"/v1/batches/{i}").json()["status"] != "completed"
                                             for i in ids):
            time.sleep(0.05)
        assert [http.get(f"/v1/batches/{i}").json()["request_counts"]["completed"] for i in ids] == [1, 1]
    assert sorted(failures) == ["add_results", "finalize", "set_status"] and "a round failed; retrying" in caplog.text
    assert "its check failed; retrying" in caplog.text


# ---- auth, s3 storage, restart ---------------------------------------------------------------------


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            httpx.get(endpoint, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    return proc, endpoint


def _start_s3_server(model_dir: Path, work: Path) -> ServeProcess:
    """API key on, files in S3 (moto), SQLite in a local state dir; the restart test kills and restarts it."""
    import s3fs

    moto, endpoint = _start_moto()
    try:
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        s3fs.S3FileSystem(**options).mkdir("batches")
        srv = ServeProcess(work, ["--model", str(model_dir), "--storage", "s3://batches/api", "--state-dir",
                                  str(work / "state"), "--storage-options", json.dumps(options), "--api-key",
                                  API_KEY, "--max-in-flight", "2"]).start()
    except BaseException:
        moto.terminate()
        raise
    srv.fs, srv.state_dir, srv.moto = s3fs.S3FileSystem(**options), work / "state", moto
    return srv


@pytest.fixture(scope="module", autouse=True)
def s3_server_starting(request, model_dir, tmp_path_factory):
    """When a selected test of this module uses `s3_server`, start it on a thread as the module begins: its
    start-up (moto, a second process loading the model) then overlaps the in-process tests."""
    if not any("s3_server" in item.fixturenames for item in request.session.items
               if getattr(item, "module", None) is request.module):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(_start_s3_server, model_dir, tmp_path_factory.mktemp("s3-server"))
        yield starting
        if starting.exception() is None:
            srv = starting.result()
            srv.stop()
            srv.moto.terminate()
            srv.moto.wait(10)


@pytest.fixture(scope="module")
def s3_server(s3_server_starting) -> ServeProcess:
    return s3_server_starting.result(timeout=300)


def test_api_key_and_s3_storage(s3_server, model_dir):
    srv = s3_server
    assert httpx.get(f"{srv.url}/health").status_code == 200  # no auth on /health
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong-key").models.list()
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        raw = httpx.get(f"{srv.url}/v1/batches", headers=headers)
        assert raw.status_code == 401 and raw.json()["error"]["code"] == "invalid_api_key"
    upload = httpx.post(f"{srv.url}/v1/files", files={"file": ("a", b"x")}, data={"purpose": "batch"})
    assert upload.status_code == 401

    client = srv.client(API_KEY)
    assert [m.id for m in client.models.list()] == [model_dir.name]  # last path component of --model
    lines = [_line("s3-a", {"prompt": "hello", "max_tokens": 3}, model=model_dir.name),
             _line("s3-b", {"prompt": "x", "n": 0}, model=model_dir.name)]
    with pytest.raises(openai.BadRequestError):  # only '24h' without --allow-custom-completion-window
        _submit(client, lines, window="5s")
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "completed" and batch.request_counts.failed == 1
    assert [x["custom_id"] for x in _read_lines(client, batch.output_file_id)] == ["s3-a"]
    assert "'n'" in _read_lines(client, batch.error_file_id)[0]["response"]["body"]["error"]["message"]
    srv.fs.invalidate_cache()
    stored = {p.rsplit("/", 1)[-1] for p in srv.fs.ls("batches/api/files")}
    assert {batch.input_file_id, batch.output_file_id, batch.error_file_id} <= stored
    assert (srv.state_dir / "batchgen_batches.sqlite").exists()


def test_restart_resumes_without_losing_or_repeating(s3_server, model_dir, loop):
    srv, model = s3_server, model_dir.name
    client = srv.client(API_KEY)
    early = [_line("early", {"prompt": "x", "max_tokens": 2}, model=model)]
    finished = _wait(client, _submit(client, early).id)
    finished_output = client.files.content(finished.output_file_id).content
    lines = [_line(f"r-{i}", {"prompt": f"{PROMPTS[i % 4]} {i}", "max_tokens": 8, "temperature": 0,
                              "ignore_eos": True}, model=model) for i in range(20)]
    created = _submit(client, lines)
    running = _wait(client, created.id, until=lambda b: b.request_counts.completed >= 4)
    srv.kill()
    srv.start()
    client = srv.client(API_KEY)
    assert client.batches.retrieve(finished.id).status == "completed"  # finished batches stay readable
    assert client.files.content(finished.output_file_id).content == finished_output
    batch = _wait(client, created.id)
    out = _read_lines(client, batch.output_file_id)

    assert running.status == "in_progress"
    assert batch.status == "completed"
    assert _counts(batch) == (20, 20, 0)
    resumed = re.search(rf"resuming batch {created.id}: (\d+) of 20 requests left", srv.log())
    assert resumed is not None, srv.log()
    assert int(resumed.group(1)) <= 20 - running.request_counts.completed  # finished requests not redone
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    expected = _greedy(loop, [x["body"]["prompt"] for x in lines], max_tokens=8, ignore_eos=True)
    assert [x["response"]["body"]["choices"][0]["text"] for x in out] == [c.text for c in expected]


def _nested(depth: int) -> list:
    """An empty list inside `depth` lists."""
    value = []
    for _ in range(depth):
        value = [value]
    return value


def _deep_schema(depth: int) -> dict:
    """A JSON schema of objects `depth` deep."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_logprobs_of_characters_spanning_several_byte_tokens_keep_the_characters():
    """Each token's piece was what decoding it added after the tokens before: a character whose UTF-8 bytes span
    several byte tokens gave U+FFFD for its first token and "" for the rest, so logprobs' tokens and bytes lost every
    CJK, emoji or accented character (and completions' text_offset counted the replacements)."""
    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine.request import Completion, TokenLogprob
    from batchgen.pipelines.openai_batch.wire_format import _chat_choice, _text_choice

    tokenizer = load_model("tiny-moe").tokenizer
    text = "日本語 ok, naïve café 🙂!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # characters over several tokens
    completion = Completion(index=0, token_ids=ids, text=text, finish_reason="length",
                            logprobs=[TokenLogprob(t, -0.25, {t: -0.25}) for t in ids])
    content = _chat_choice(completion, tokenizer)["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == text and "\ufffd" not in text
    assert bytes(b for entry in content for b in entry["bytes"]) == text.encode("utf-8")
    assert [entry["top_logprobs"][0]["token"] for entry in content] == [entry["token"] for entry in content]
    completions = _text_choice(completion, tokenizer)["logprobs"]
    assert "".join(completions["tokens"]) == text
    assert [text[offset:].startswith(token) for token, offset in zip(completions["tokens"],
                                                                      completions["text_offset"])] == [True] * len(ids)


def test_completions_top_logprobs_hold_the_sampled_token_and_the_likelier_of_tokens_reading_the_same():
    """OpenAI's completions return the sampled token's logprob among the alternatives (up to logprobs + 1): a token
    a bias forced from outside the top was missing, and of two alternatives reading "" (partial characters) the less
    likely one was kept."""
    from batchgen.pipelines.openai_batch.wire_format import _top_by_text

    top = _top_by_text("escri", -8.44, [("=", -4.73), ("", -5.0), ("", -6.0)])
    assert top == {"=": -4.73, "": -5.0, "escri": -8.44} and list(top) == ["=", "", "escri"]
    assert _top_by_text("=", -4.73, [("=", -4.73), ("a", -5.0)]) == {"=": -4.73, "a": -5.0}
