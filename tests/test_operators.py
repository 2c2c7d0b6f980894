"""The operators called directly (no Ray Data): column contract, bad rows, n > 1, the split stages."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import threading
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pipeline_helpers import ENGINE, SAMPLING, engine_outputs, stop_string, workload
from tiny_models import kv_bytes_per_token

from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.engine import EngineLoop, Request, SamplingParams
from batchgen.engine.reference import ReferenceRunner
from batchgen.operators import BatchGen, Decode, Prefill, Tokenize
from batchgen.operators import stage_columns as sc
from batchgen.operators.batch_gen import numbered_request_id
from batchgen.operators.columns import OUTPUT_COLUMNS, output_schema
from batchgen.operators.engine_factory import load_engine

MAX_MODEL_LEN = 256


def call(op, batch):
    result = op(batch)
    return asyncio.run(result) if asyncio.iscoroutine(result) else result


@pytest.fixture(scope="module")
def batchgen(tiny_moe_dir):
    return BatchGen(tiny_moe_dir, SAMPLING, max_model_len=MAX_MODEL_LEN, **ENGINE)


@pytest.fixture(scope="module")
def prompts():
    return workload(6)


@pytest.fixture(scope="module")
def expected(tiny_moe_dir, prompts):
    return engine_outputs(tiny_moe_dir, prompts)


def test_batchgen_matches_engine_and_reference_runner(tiny_moe_dir, batchgen, prompts, expected):
    table = pa.table({"id": list(range(len(prompts))), "prompt": prompts})
    out = call(batchgen, table)
    assert out.column_names == ["id", "prompt", *OUTPUT_COLUMNS]
    assert out.column("id").to_pylist() == list(range(len(prompts)))
    assert out.schema.field("generated_token_ids").type == output_schema(False).field("generated_token_ids").type
    assert out.column("generated_token_ids").to_pylist() == expected
    assert out.column("error").to_pylist() == [None] * len(prompts)
    assert out.column("num_generated_tokens").to_pylist() == [SAMPLING["max_tokens"]] * len(prompts)
    assert out.column("finish_reason").to_pylist() == ["length"] * len(prompts)
    assert all(t > 0 for t in out.column("completion_time_s").to_pylist())
    tokenizer = load_tokenizer(tiny_moe_dir)
    assert out.column("generated_text").to_pylist() == [tokenizer.decode(ids, skip_special_tokens=True)
                                                         for ids in expected]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    assert out.column("num_prompt_tokens").to_pylist() == [len(p) for p in prompt_ids]
    reference = ReferenceRunner(load_model(tiny_moe_dir).model).generate(prompt_ids, SAMPLING["max_tokens"])
    assert reference == expected


def test_messages_and_token_ids_are_the_same_prompt_as_text(tiny_moe_dir, batchgen):
    tokenizer = load_tokenizer(tiny_moe_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    out = call(batchgen, pa.table({"messages": [messages, None], "prompt_token_ids": [None, ids]}))
    generated = out.column("generated_token_ids").to_pylist()
    assert out.column("error").to_pylist() == [None, None]
    assert out.column("num_prompt_tokens").to_pylist() == [len(ids), len(ids)]
    assert generated[0] == generated[1]
    # the default batch format (dict of numpy arrays) gives the same rows
    numpy_batch = {"messages": pd.Series([messages], dtype=object).to_numpy()}
    assert call(batchgen, numpy_batch).column("generated_token_ids").to_pylist() == generated[:1]


def test_a_row_continues_its_open_final_message_as_its_column_says(tiny_moe_dir, batchgen):
    """The chat-option columns reach each row's rendering (tests/test_chat_options.py has the rest), in Ray's
    default numpy batches too: a numpy bool is a bool."""
    tokenizer = load_tokenizer(tiny_moe_dir)
    messages = [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "The sea"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer.encode(rendered[:rendered.rindex("The sea") + len("The sea")], add_special_tokens=False)
    table = pa.table({"messages": [messages, None, messages], "prompt_token_ids": [None, ids, None],
                      "continue_final_message": [True, None, False]})
    out = call(batchgen, table)
    generated = out.column("generated_token_ids").to_pylist()
    assert out.column("error").to_pylist() == [None, None, None]
    assert out.column("num_prompt_tokens").to_pylist()[:2] == [len(ids), len(ids)]
    assert generated[0] == generated[1] and out.column("num_prompt_tokens").to_pylist()[2] != len(ids)
    numpy_batch = {"messages": pd.Series([messages], dtype=object).to_numpy(),
                   "continue_final_message": np.array([True])}
    assert call(batchgen, numpy_batch).column("generated_token_ids").to_pylist() == generated[:1]


def test_a_chat_template_that_does_not_compile_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="chat_template does not compile"):  # not: the model is absent
        BatchGen(str(tmp_path / "absent"), SAMPLING, chat_template="{% if messages %}{{ messages }}")


def test_a_jobs_chat_template_renders_messages_rows_in_each_operator_and_the_planners_sample(tiny_moe_dir, tmp_path):
    """BatchGen (single mode), Tokenize (disaggregated) and the planner's sample of the input all render with it."""
    from batchgen.operators import workload_sample

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<reply>{% endif %}")
    table = pa.table({"messages": [[{"role": "user", "content": "Tell me about the sea."}]]})
    want = load_tokenizer(tiny_moe_dir).encode("<user>Tell me about the sea.<reply>", add_special_tokens=False)
    op = BatchGen(tiny_moe_dir, SAMPLING, chat_template=template, max_model_len=MAX_MODEL_LEN, **ENGINE)
    out = call(op, table)
    assert out.column("num_prompt_tokens").to_pylist() == [len(want)]
    assert out.column("generated_token_ids").to_pylist() == engine_outputs(tiny_moe_dir, [want])
    assert call(Tokenize(tiny_moe_dir, SAMPLING, chat_template=template), table).column(sc.PROMPT_IDS).to_pylist() \
        == [want]
    pq.write_table(table, tmp_path / "a.parquet")
    shape = workload_sample.input_workload(str(tmp_path), load_model(tiny_moe_dir), SamplingParams(max_tokens=7), {},
                                           template)
    assert shape.prompt_lens == (len(want),)


def test_per_row_integer_overrides_survive_rays_default_numpy_batches(batchgen, prompts, expected):
    """Ray's default batch format makes floats of an integer struct field that is null in some row of the batch
    (3.0): every override was refused as not an integer."""
    from ray.data.block import BlockAccessor

    overrides = pa.array([{"max_tokens": 3, "seed": 7}, {"max_tokens": None, "seed": None}],
                         type=pa.struct([("max_tokens", pa.int64()), ("seed", pa.int64())]))
    table = pa.table({"prompt": prompts[:2], "sampling_params": overrides})
    batch = BlockAccessor.for_block(table).to_batch_format("numpy")
    assert batch["sampling_params"][0]["max_tokens"] == 3.0 and isinstance(batch["sampling_params"][0]["max_tokens"],
                                                                           float)
    out = call(batchgen, batch)
    assert out.column("error").to_pylist() == [None, None]
    assert out.column("generated_token_ids").to_pylist() == [expected[0][:3], expected[1]]


def test_a_batch_with_an_output_column_is_refused_not_overwritten(tiny_moe_dir, batchgen, prompts):
    """`batchgen run` refused such an input up front; map_batches(BatchGen) replaced the user's column silently."""
    table = pa.table({"prompt": prompts[:2], "finish_reason": ["mine", "mine"]})
    with pytest.raises(ValueError, match=r"a batch given to BatchGen already has output column\(s\) "
                                         r"\['finish_reason'\]; rename or drop them"):
        call(batchgen, table)
    with pytest.raises(ValueError, match=r"a batch given to Tokenize already has output column\(s\) \['error'\]"):
        Tokenize(tiny_moe_dir, SAMPLING)(pa.table({"prompt": prompts[:1], "error": ["x"]}))


def test_bad_rows_get_an_error_and_the_batch_carries_on(tiny_moe_dir, batchgen, prompts, expected):
    sampling = pa.array([None, None, None, None, {"temperature": -1.0, "max_tokens": None},
                         {"temperature": None, "max_tokens": 0}, None],
                        pa.struct([("temperature", pa.float64()), ("max_tokens", pa.int64())]))
    table = pa.table({
        "prompt": pa.array([prompts[0].encode(), None, b"\xff\xfe caf\xc3", None, b"Tell me", b"Tell me",
                            prompts[1].encode()], pa.binary()),
        "prompt_token_ids": pa.array([None, None, None, [5] * (MAX_MODEL_LEN + 10), None, None, None],
                                     pa.list_(pa.int64())),
        "sampling_params": sampling,
    })
    out = call(batchgen, table).to_pylist()
    errors = [row["error"] for row in out]
    assert errors[0] is None and errors[6] is None
    assert [out[0]["generated_token_ids"], out[6]["generated_token_ids"]] == expected[:2]
    assert "missing prompt" in errors[1]
    assert "prompt: undecodable text, not valid UTF-8" in errors[2]
    assert "over the limit" in errors[3] and out[3]["num_prompt_tokens"] == MAX_MODEL_LEN + 10
    assert "invalid sampling parameter 'temperature'" in errors[4]
    assert "invalid sampling parameter 'max_tokens'" in errors[5]
    for row in out[1:6]:
        assert row["generated_text"] is None and row["generated_token_ids"] is None


def test_wrong_types_are_row_errors(batchgen, prompts, expected):
    # a column mixing types only exists outside Arrow: Ray hands such a batch over as pandas
    mixed = pd.DataFrame({"prompt": [prompts[0], 42, ["a", "list"]],
                          "sampling_params": [None, None, json.dumps({"temprature": 0})]})
    out = call(batchgen, mixed)
    assert isinstance(out, pd.DataFrame)
    assert pd.isna(out["error"].iloc[0])
    assert list(out["generated_token_ids"].iloc[0]) == expected[0]
    assert "prompt: expected text, got int 42" in out["error"].iloc[1]
    assert "unknown sampling parameter 'temprature'" in out["error"].iloc[2]
    typed = pa.table({"prompt_token_ids": pa.array([["1", "2"]], pa.list_(pa.string())),
                      "messages": pa.array([None], pa.list_(pa.struct([("role", pa.string())])))})
    assert "prompt_token_ids: expected a list of integers" in call(batchgen, typed).column("error")[0].as_py()
    no_content = pa.table({"messages": [[{"role": "user", "content": None}]]})
    assert "messages[0].content: expected text" in call(batchgen, no_content).column("error")[0].as_py()
    # a text column holding bytes that are not UTF-8 (Parquet files keep them): that row's error, the batch goes
    # on (it failed the whole batch, and every rerun of the job at the same row)
    text = (prompts[0] + "\n").encode() + b"\xff\xfe"
    offsets = pa.array([0, len(prompts[0].encode()), len(text)], pa.int32()).buffers()[1]
    undecodable = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(text)])
    out = call(batchgen, pa.table({"prompt": undecodable}))
    assert out.column("error")[0].as_py() is None and out.column("generated_token_ids")[0].as_py() == expected[0]
    assert "prompt: undecodable text, not valid UTF-8" in out.column("error")[1].as_py()
    contents = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(text)])
    turns = pa.StructArray.from_arrays([pa.array(["user", "user"]), contents], names=["role", "content"])
    messages = pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), turns)  # one turn a row, the 2nd undecodable
    out = call(batchgen, pa.table({"messages": messages}))
    assert out.column("error")[0].as_py() is None
    assert "messages: undecodable text, not valid UTF-8" in out.column("error")[1].as_py()
    # token ids win over text: a row's unused prompt text is not its error
    ids = [batchgen.engine.normalizer.prompt_ids(prompt=p) for p in prompts[:2]]
    out = call(batchgen, pa.table({"prompt_token_ids": ids, "prompt": undecodable}))
    assert out.column("error").to_pylist() == [None, None]
    assert out.column("generated_token_ids")[0].as_py() == expected[0]


def test_n_samples_come_back_as_one_list_per_sample(tiny_moe_dir, batchgen, prompts):
    sampled = BatchGen(tiny_moe_dir, {"n": 2, "temperature": 0.9, "seed": 7, "max_tokens": 5, "ignore_eos": True},
                       **ENGINE)
    out = call(sampled, pa.table({"prompt": prompts[:2], "sampling_params": [None, {"n": 1}]}))
    assert out.schema.equals(pa.schema([("prompt", pa.string()), ("sampling_params", pa.struct([("n", pa.int64())])),
                                        *output_schema(True)]))
    rows = out.to_pylist()
    assert [len(r["generated_text"]) for r in rows] == [2, 1]
    assert rows[0]["num_generated_tokens"] == [5, 5]
    assert rows[0]["generated_token_ids"][0] != rows[0]["generated_token_ids"][1]
    # a scalar-mode operator refuses n > 1 for the row instead of changing the schema
    scalar = call(batchgen, pa.table({"prompt": prompts[:1], "sampling_params": [{"n": 3}]}))
    assert "needs list outputs" in scalar.column("error")[0].as_py()


@pytest.mark.parametrize("stage", ["BatchGen", "Tokenize"])
@pytest.mark.parametrize("sampling,list_outputs,named", [
    ({}, "false", "list_outputs must be true, false or null, got 'false'"),  # bool("false"): list outputs
    ({"n": 2}, False, "sampling n=2 needs list outputs; drop list_outputs=False"),  # every row an error
])
def test_stage_constructors_refuse_an_output_mode_they_cannot_honour(tiny_moe_dir, stage, sampling, list_outputs,
                                                                    named):
    import batchgen.operators as operators

    with pytest.raises(ValueError, match=re.escape(named)):
        getattr(operators, stage)(tiny_moe_dir, sampling, list_outputs=list_outputs)


@pytest.fixture(scope="module")
def split_stages(tiny_moe_dir):
    options = {"max_model_len": MAX_MODEL_LEN, **ENGINE}
    return Tokenize(tiny_moe_dir, SAMPLING), Prefill(tiny_moe_dir, **options), Decode(tiny_moe_dir, **options)


def test_tokenize_gives_integers_past_64_bits_a_row_error_and_takes_null_struct_fields_as_unset(tiny_moe_dir, prompts):
    """A seed or prompt token id of 2**64 - 1 passed the checks of a stage without a vocabulary and failed the
    whole batch in the stage's 64-bit columns; a struct field only another row sets (null in this one) was an
    unknown parameter for every row of the file."""
    big = 2**64 - 1
    params = pa.array([{"seed": big, "best_of": None}, None, {"seed": 7, "best_of": None},
                       {"seed": None, "best_of": 2}], pa.struct([("seed", pa.uint64()), ("best_of", pa.int64())]))
    table = pa.table({"prompt": [prompts[0], None, prompts[1], prompts[2]],
                      "prompt_token_ids": pa.array([None, [3, big], None, None], pa.list_(pa.uint64())),
                      "sampling_params": params})
    out = call(Tokenize(tiny_moe_dir, SAMPLING), table)
    errors = out.column("error").to_pylist()
    assert "'seed': 18446744073709551615 does not fit a 64-bit integer" in errors[0]
    assert "token 18446744073709551615 is outside" in errors[1]
    assert errors[2] is None and out.column(sc.SAMPLING)[2].as_py()["seed"] == 7
    assert "unknown sampling parameter 'best_of'" in errors[3]


def test_split_stages_give_what_batchgen_gives(batchgen, split_stages, prompts):
    tokenize, prefill, decode = split_stages
    stop_word = stop_string(call(batchgen, pa.table({"prompt": prompts[2:3]})).column("generated_text")[0].as_py())
    table = pa.table({
        "prompt": [*prompts[:3], None, prompts[3]],
        "prompt_token_ids": [None, None, None, None, [5] * (MAX_MODEL_LEN + 1)],
        "sampling_params": [None, {"logit_bias": {"11": 100.0}}, {"stop": [stop_word]}, None, None],
    })
    direct = call(batchgen, table)
    assert direct.column("generated_token_ids")[1].as_py() == [11] * SAMPLING["max_tokens"]
    tokenized = call(tokenize, table)
    assert tokenized.schema.field(sc.SAMPLING).type == sc.SAMPLING_TYPE  # typed, not JSON text
    prefilled = call(prefill, tokenized)
    geometry = prefill.exporter.engine.kv.geometry
    lengths = [len(ids) if ids else 0 for ids in prefilled.column(sc.PROMPT_IDS).to_pylist()]
    kv_sizes = [len(v) for v in prefilled.column(sc.KV).to_pylist()]
    assert kv_sizes == [geometry.packed_nbytes(n) if i in (0, 1, 2) else 0 for i, n in enumerate(lengths)]
    moved = decode.engine.kv.bytes_moved
    out = call(decode, prefilled)
    assert decode.engine.kv.bytes_moved - moved == sum(kv_sizes)  # decode adopted the KV, recomputed nothing
    assert out.column_names == direct.column_names
    assert "over the limit" in out.column("error")[4].as_py()
    for name in ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                 "finish_reason", "error"):
        assert out.column(name).to_pylist() == direct.column(name).to_pylist(), name
    assert out.column("finish_reason")[2].as_py() == "stop"
    assert stop_word not in out.column("generated_text")[2].as_py()


def test_stages_with_kv_pools_too_small_for_their_batch_recompute_and_give_the_same_tokens(tiny_moe_dir, prompts,
                                                                                             expected):
    """10 device and 3 host pages of 16 tokens for six prompts of up to 95 tokens: Decode adopts prefilled prompts
    no pool has room for by prefilling them again, and both engines preempt by recompute; the engines used to fail
    every row of the batch on a full host pool."""
    token = kv_bytes_per_token(load_model(tiny_moe_dir))
    small = {"max_model_len": MAX_MODEL_LEN, "page_size": 16, "kv_budget_bytes": token * 16 * 10,
             "host_kv_budget_bytes": token * 16 * 3}
    tokenize, prefill = Tokenize(tiny_moe_dir, SAMPLING), Prefill(tiny_moe_dir, max_model_len=MAX_MODEL_LEN)
    decode, batchgen = Decode(tiny_moe_dir, **small), BatchGen(tiny_moe_dir, SAMPLING, **small)
    split = call(decode, call(prefill, call(tokenize, pa.table({"prompt": prompts}))))
    direct = call(batchgen, pa.table({"prompt": prompts}))
    for out in (split, direct):
        assert out.column("error").to_pylist() == [None] * len(prompts)
        assert out.column("generated_token_ids").to_pylist() == expected
    assert decode.engine.metrics()["handoff_prefills"] > 0
    assert decode.engine.metrics()["recomputes"] > 0 and batchgen.engine.metrics()["recomputes"] > 0


def test_the_planners_sample_reads_the_jobs_files_and_only_their_first_rows(tiny_moe_dir, tmp_path, monkeypatch):
    """It listed hidden files the job skips (a broken Spark leftover failed planning) and read whole files."""
    from batchgen.operators import workload_sample

    monkeypatch.setattr(workload_sample, "SAMPLED_ROWS", 5)
    (tmp_path / "_temporary").mkdir()
    (tmp_path / "_temporary" / "part-0.parquet").write_bytes(b"PAR1 torn")
    pq.write_table(pa.table({"prompt": ["one two", "three", None, "four five six"] * 3}), tmp_path / "a.parquet",
                   row_group_size=4)
    shape = workload_sample.input_workload(str(tmp_path), load_model(tiny_moe_dir),
                                           SamplingParams(max_tokens=7), {})
    assert len(shape.prompt_lens) == 5 and shape.output_lens == (7,) * 5  # the None rows left out


def test_the_planners_sample_leaves_out_text_that_is_not_utf8_as_the_job_does(tiny_moe_dir, tmp_path):
    """Parquet does not check that strings are UTF-8; the job gives such a row its error, but the planner's sample
    decoded its batch whole and one such prompt failed planning (`--engine-actors`, `batchgen plan`)."""
    from batchgen.operators import workload_sample

    text = pa.array([b"one two", b"\xff\xfe bad", b"three"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": text}), tmp_path / "a.parquet")
    shape = workload_sample.input_workload(str(tmp_path), load_model(tiny_moe_dir), SamplingParams(max_tokens=7), {})
    assert len(shape.prompt_lens) == 2 and shape.output_lens == (7, 7)


def test_decode_in_scalar_mode_refuses_rows_of_several_samples(split_stages, prompts):
    """Tokenize with a default n > 1 lists its samples; a Decode left in scalar mode kept the first sample of each row
    and dropped the others, silently."""
    _, prefill, decode = split_stages
    sampled = {**SAMPLING, "n": 2, "temperature": 0.9, "seed": 3}
    prefilled = call(prefill, call(Tokenize(decode.engine.loaded.uri, sampled), pa.table({"prompt": prompts[:2]})))
    out = call(decode, prefilled)
    assert out.column("error").to_pylist() == ["sampling_params: n=2 needs list outputs; build Decode with "
                                               "list_outputs=True (as Tokenize decided for this job)"] * 2
    assert out.column("generated_token_ids").to_pylist() == [None, None]


def test_split_stages_send_a_shared_prefix_once_a_batch(batchgen, split_stages, prompts):
    """Rows sharing a long prefix: the first row's KV carries it, the others only what follows its whole
    pages (`KV_START`); decode rebuilds them from its page cache and gives what BatchGen gives."""
    tokenize, prefill, decode = split_stages
    shared = " ".join(prompts)[:600]
    table = pa.table({"prompt": [f"{shared} Question {i}: {p[:40]}" for i, p in enumerate(prompts[:4])]})
    direct = call(batchgen, table)
    prefilled = call(prefill, call(tokenize, table))
    starts = prefilled.column(sc.KV_START).to_pylist()
    page = prefill.exporter.engine.kv.page_size
    assert starts[0] == 0 and all(s >= page for s in starts[1:]), starts
    geometry = prefill.exporter.engine.kv.geometry
    lengths = [len(ids) for ids in prefilled.column(sc.PROMPT_IDS).to_pylist()]
    assert [len(v) for v in prefilled.column(sc.KV).to_pylist()] == [
        geometry.packed_nbytes(n - s) for n, s in zip(lengths, starts)]
    out = call(decode, prefilled)
    assert out.column("generated_token_ids").to_pylist() == direct.column("generated_token_ids").to_pylist()
    assert out.column("error").to_pylist() == [None] * 4


def test_prefill_columns_survive_the_object_store_and_slicing_without_copies(split_stages, prompts, expected):
    tokenize, prefill, decode = split_stages
    prefilled = call(prefill, call(tokenize, pa.table({"prompt": prompts[:4]})))
    # what Ray does to a block between stages: serialise it out of band, then hand out slices
    buffers = []
    data = pickle.dumps(prefilled, protocol=5, buffer_callback=buffers.append)
    stored = pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])  # store memory
    tail = stored.slice(1)
    views = sc.prefilled(tail)
    kv_data = tail.column(sc.KV).chunks[0].buffers()[2]
    assert all(v.kv.data_ptr() - kv_data.address < kv_data.size for v in views)  # views, not copies
    assert [v.request.prompt_token_ids for v in views] == tail.column(sc.PROMPT_IDS).to_pylist()
    out = call(decode, tail)
    assert out.column("generated_token_ids").to_pylist() == expected[1:4]


def test_decode_rejects_kv_from_an_engine_of_another_dtype_per_row(tiny_moe_dir, split_stages, prompts):
    """Also of a dtype of the same size (bf16 KV adopted by an fp16 engine: the byte count alone passed it, and the
    tokens after the first were garbage)."""
    tokenize, prefill, _ = split_stages
    rows = call(tokenize, pa.table({"prompt": prompts[:2]}))
    bf16 = {**ENGINE, "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16"}
    half = Decode(tiny_moe_dir, **bf16)
    errors = call(half, call(prefill, rows)).column("error").to_pylist()
    assert all("the prefilled KV is torch.float32" in e and "torch.bfloat16" in e for e in errors), errors
    fp16 = Decode(tiny_moe_dir, **{**bf16, "dtype": "float16"})
    errors = call(fp16, call(Prefill(tiny_moe_dir, **bf16), rows)).column("error").to_pylist()
    assert all("the prefilled KV is torch.bfloat16" in e and "torch.float16" in e for e in errors), errors


def test_engine_loop_fails_every_waiting_batch_when_the_engine_raises(tiny_moe_dir):
    engine = load_engine(tiny_moe_dir, **ENGINE)
    loop = EngineLoop(lambda: engine)

    def broken_step():
        raise MemoryError("device out of memory")

    engine.step = broken_step
    request = Request("boom", [1, 2, 3], sampling=SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="the engine failed: MemoryError"):
        asyncio.run(loop.run(["boom"], lambda engine, i: engine.add_request(request)))
    with pytest.raises(RuntimeError, match="the engine failed"):
        asyncio.run(loop.run(["next"], lambda engine, i: None))


def test_a_duplicate_request_id_fails_alone_and_the_request_running_under_it_finishes(tiny_moe_dir, prompts,
                                                                                       expected):
    engine = load_engine(tiny_moe_dir, **ENGINE)
    loop = EngineLoop(lambda: engine)
    params = SamplingParams.from_dict(SAMPLING)
    first = [Request("a", prompt=prompts[0], sampling=params)]
    again = [Request("a", prompt=prompts[1], sampling=params), Request("b", prompt=prompts[1], sampling=params),
             Request("b", prompt=prompts[2], sampling=params)]

    submitted = threading.Event()  # the engine thread adds "a" once the second submission is queued behind it

    def add_first(engine, i):
        submitted.wait(10)
        engine.add_request(first[i])

    running = loop.submit(["a"], add_first)
    later = loop.submit([r.request_id for r in again], lambda engine, i: engine.add_request(again[i]))
    submitted.set()  # both commands run before the next step: "a" is running when the second comes
    [a], [a_again, b, b_again] = [[f.result(timeout=60) for f in fs] for fs in (running, later)]
    loop.close()
    assert a.ok and a.outputs[0].token_ids == expected[0]  # before: its future was replaced, it never returned
    assert a_again.error == "duplicate request_id 'a': a request with this id is already running"
    assert b.ok and b.outputs[0].token_ids == expected[1]
    assert b_again.error == "duplicate request_id 'b': a request with this id is already running"
    assert engine.metrics()["failed_requests"] == 0  # the duplicates never reached the engine


def test_concurrent_batches_share_one_engine(tiny_moe_dir, prompts, expected):
    op = BatchGen(tiny_moe_dir, SAMPLING, **ENGINE)
    tables = [pa.table({"prompt": prompts[i:i + 2]}) for i in (0, 2, 4)]

    async def in_flight():
        return await asyncio.gather(*(op(t) for t in tables))

    outs = asyncio.run(in_flight())
    assert [ids for out in outs for ids in out.column("generated_token_ids").to_pylist()] == expected
    assert op.engine.metrics()["peak_active"] > 2, "the batches ran one after another, not in one engine"


def test_a_datasets_own_row_index_need_not_be_unique(tiny_moe_dir, batchgen, prompts, expected):
    """BatchGen keys a numbered row's request by its `row_index` (so a task run again finds its checkpoint); a
    dataset's own column of that name, repeating a number within a batch or across batches in flight on one actor,
    failed the second row as a duplicate request, and on an actor holding a request moved from another, under that
    number, gave the second row the first one's output. A row of the same number and content is the same request."""
    numbers = [5, 5, 7, 7, 5, 5]

    async def in_flight():
        return await asyncio.gather(*(batchgen(pa.table({"row_index": numbers[i:i + 3], "prompt": prompts[i:i + 3]}))
                                      for i in (0, 3)))

    outs = asyncio.run(in_flight())
    assert [e for out in outs for e in out.column("error").to_pylist()] == [None] * 6
    assert [ids for out in outs for ids in out.column("generated_token_ids").to_pylist()] == expected

    moved = load_engine(tiny_moe_dir, **ENGINE)  # row 9 of another block, moved here from its actor: still running
    long = batchgen.parser.parse({"prompt": prompts[0], "sampling_params": {"max_tokens": 120, "ignore_eos": True}})
    rid = numbered_request_id(9, long)
    moved.add_request(Request(rid, long.prompt_token_ids, sampling=long.sampling))
    adopted = []
    batchgen.loop.adopt([moved.export_request(rid)], adopted.append).result()
    other = call(batchgen, pa.table({"row_index": [9], "prompt": [prompts[1]]}))  # another row numbered 9
    assert other.column("generated_token_ids").to_pylist() == [expected[1]]
    assert other.column("error").to_pylist() == [None]
    while not adopted:  # the moved request ends apart, with its own tokens
        time.sleep(0.01)
    assert len(adopted[0].outputs[0].token_ids) == 120


def test_engine_loop_admits_twice_the_engines_batch_by_default(tiny_moe_dir):
    loop = EngineLoop(lambda: load_engine(tiny_moe_dir, **{**ENGINE, "max_num_seqs": 3}))
    try:
        assert loop.max_outstanding == 6  # one set running, one set waiting
    finally:
        loop.close()


def test_a_run_cancelled_while_it_waits_for_room_gives_the_room_back(tiny_moe_dir):
    """The thread waiting for room reserved it anyway after the caller gave up (a timeout): those slots were never
    released, and once they added up to the bound every later run waited for good."""
    loop = EngineLoop(lambda: load_engine(tiny_moe_dir, **ENGINE), max_outstanding=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def batch(tag: str, n: int):
        requests = [Request(f"{tag}{i}", prompt_token_ids=[5, 6, 7], sampling=params) for i in range(n)]
        return [r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i])

    async def scenario():
        holding = asyncio.create_task(loop.run(*batch("a", 2)))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.run(*batch("b", 2)), 0.01)  # no room while "a" runs: it gives up
        await holding
        return await asyncio.wait_for(loop.run(*batch("c", 1)), 60)

    try:
        [late] = asyncio.run(scenario())
        assert late.ok and loop._outstanding == 0
    finally:
        loop.close()


def test_engine_loop_admission_applies_back_pressure(tiny_moe_dir, prompts, expected):
    engine = load_engine(tiny_moe_dir, **ENGINE)
    loop = EngineLoop(lambda: engine, max_outstanding=2)
    params = SamplingParams.from_dict(SAMPLING)
    in_engine = []  # requests the engine held (unfinished) each time a batch was admitted

    def admitter(batch):
        def add(engine, i):
            engine.add_request(batch[i])
            if i == len(batch) - 1:
                in_engine.append(len(engine._requests))
        return add

    batches = [[Request(f"r{i + j}", prompt=prompts[i + j], sampling=params) for j in range(2)] for i in (0, 2, 4)]

    async def in_flight():
        return await asyncio.gather(*(loop.run([r.request_id for r in b], admitter(b)) for b in batches))

    results = asyncio.run(in_flight())
    assert [r.outputs[0].token_ids for batch in results for r in batch] == expected
    assert len(in_engine) == 3 and max(in_engine) <= 2, in_engine  # each batch waited for the one before
    loop.close()


@pytest.mark.parametrize("cpus,threads", [(1.5, 2), (0.5, 1), (4.0, 4)])
def test_engine_actors_compute_with_the_cpus_they_were_granted_at_normal_priority(ray_cluster, cpus, threads):
    import gc
    import os

    import ray

    from batchgen.operators.engine_actor import prepare_engine_process

    @ray.remote
    class Probe:
        def before(self):
            return torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0), gc.get_freeze_count()

        def prepare(self):
            return (prepare_engine_process(), torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0),
                    gc.get_freeze_count())

    probe = Probe.options(num_cpus=cpus).remote()
    ray_threads, ray_niceness, frozen = ray.get(probe.before.remote())
    assert ray_niceness > 0 and frozen == 0  # Ray starts workers below normal priority, the heap unfrozen
    threads = min(threads, os.cpu_count())  # never more threads than the machine has cores
    *settings, frozen = ray.get(probe.prepare.remote())
    assert settings == [threads, threads, 0]
    assert frozen > 10_000  # the imports' objects (torch alone leaves tens of thousands)
    ray.kill(probe)
