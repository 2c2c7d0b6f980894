"""vLLM's chat parameters (chat_template_kwargs, continue_final_message, add_generation_prompt): the checks, what
reaches the template, and the engine's and the row parser's use of them."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import ChatOptions, Engine, InvalidRequestError, Request, RequestNormalizer, SamplingParams
from batchgen.engine.chat import check_chat_template
from batchgen.operators.blocks import rows
from batchgen.operators.columns import INPUT_COLUMNS, RowParser
from batchgen.pipelines.pipeline import JobConfig, JobError

# the chat template of a model with a thinking switch (Qwen3's idea, in a few lines)
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]"
            "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}{% endif %}")
TURNS = [{"role": "user", "content": "tell me a story"}]
OPEN_ANSWER = [*TURNS, {"role": "assistant", "content": "Once upon"}]


@pytest.fixture(scope="module")
def demo():
    return load_model("tiny-moe")


@pytest.fixture(scope="module")
def normalizer(demo):
    return RequestNormalizer(demo.tokenizer, demo.model.vocab_size, 4096, chat_template=TEMPLATE)


def ids(demo, text: str) -> list[int]:
    return demo.tokenizer.encode(text, add_special_tokens=False)


def test_template_variables_and_an_open_final_message_reach_the_template(demo, normalizer):
    assert normalizer.prompt_ids(messages=TURNS) == ids(demo, "[user] tell me a story\n[assistant]")
    no_think = ChatOptions.from_values(template_kwargs={"enable_thinking": False, "unused": None})
    assert normalizer.prompt_ids(messages=TURNS, chat=no_think) == ids(demo, "[user] tell me a story\n[assistant] "
                                                                             "/no_think")
    as_json = ChatOptions.from_values(template_kwargs='{"enable_thinking": false}')
    assert as_json == no_think and as_json.template_kwargs == {"enable_thinking": False}
    continuing = ChatOptions.from_values(continue_final_message=True)  # the generation prompt then defaults off
    assert (continuing.add_generation_prompt, continuing.continue_final_message) == (False, True)
    assert normalizer.prompt_ids(messages=OPEN_ANSWER, chat=continuing) == ids(
        demo, "[user] tell me a story\n[assistant] Once upon")  # no newline after the open turn
    closed = ChatOptions.from_values(add_generation_prompt=False)
    assert normalizer.prompt_ids(messages=TURNS, chat=closed) == ids(demo, "[user] tell me a story\n")


@pytest.mark.parametrize(("values", "message"), [
    (dict(add_generation_prompt=True, continue_final_message=True), "cannot both be true"),
    (dict(continue_final_message="yes"), "continue_final_message: expected true or false, got str 'yes'"),
    (dict(add_generation_prompt=1), "add_generation_prompt: expected true or false, got int 1"),
    (dict(template_kwargs=["enable_thinking"]), "chat_template_kwargs: expected an object of template variables, "
                                                "got list"),
    (dict(template_kwargs="{not json"), "chat_template_kwargs: not a JSON object"),
    (dict(template_kwargs={"tools": []}), "'tools' is an argument of the rendering itself"),
    (dict(template_kwargs={"self": 1}), "chat_template_kwargs: 'self' is an argument of the rendering itself"),
    (dict(template_kwargs={"add_generation_prompt": False}), "set 'add_generation_prompt' on the request"),
    (dict(template_kwargs={"two words": 1}), "'two words' is not a template variable name"),
])
def test_bad_chat_options_are_named(values, message):
    with pytest.raises(InvalidRequestError, match=message):
        ChatOptions.from_values(**values)


def test_chat_options_made_directly_are_checked_too():
    """Request(chat_options=ChatOptions(...)) in Python: the same checks as from_values."""
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        ChatOptions(continue_final_message=True)  # the generation prompt's default is not resolved here
    with pytest.raises(InvalidRequestError, match="'tools' is an argument of the rendering itself"):
        ChatOptions(template_kwargs={"tools": []})
    assert ChatOptions(False, True).continue_final_message


def test_chat_options_apply_to_messages_only_and_a_rejecting_template_is_named(demo, normalizer):
    continuing = ChatOptions.from_values(continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="apply to messages; this prompt is given as prompt$"):
        normalizer.prompt_ids(prompt="hello", chat=continuing)
    with pytest.raises(InvalidRequestError, match="given as prompt_token_ids"):
        normalizer.prompt_ids(prompt_token_ids=[1, 2], messages=TURNS, chat=continuing)
    with pytest.raises(InvalidRequestError, match="missing prompt"):
        normalizer.prompt_ids(chat=continuing)
    users_only = RequestNormalizer(demo.tokenizer, chat_template="{% for m in messages %}{% if m['role'] == 'user' %}"
                                                                 "{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="the chat template rejected them: .*final message does not appear"):
        users_only.prompt_ids(messages=OPEN_ANSWER, chat=continuing)  # nothing left of the turn to continue


@pytest.mark.parametrize("template, message", [
    (None, "must be the template's text, got None"),
    ("", "must be the template's text, got ''"),
    ("templates/qwen3.jinja", r"'templates/qwen3.jinja' holds no Jinja tag .* \(a file's path\? give the file's"),
    ("{% for m in messages %}{{ m['content'] }", r"does not compile: unexpected '}' \(line 1\)"),
    ("{{ messages | nosuchfilter }}", "does not compile: No filter named 'nosuchfilter'"),
])
def test_a_chat_template_that_cannot_render_is_refused_before_any_row(demo, template, message):
    """Before, a job took any non-empty text: a syntax error failed every messages row, and a file's path given for
    the template rendered every conversation to that path. Refused where a job's template first arrives (the job's
    config, the row normalizer its operators and the Batch API build), naming the fault."""
    with pytest.raises(ValueError, match=message):
        check_chat_template(template)
    if template is not None:  # (None is the tokenizer's own template, for a job and a normalizer)
        with pytest.raises(JobError, match=message):
            JobConfig(model="m", input="in", output="out", chat_template=template).validate()
        with pytest.raises(ValueError, match=message):
            RequestNormalizer(demo.tokenizer, chat_template=template)
    check_chat_template(TEMPLATE)  # a template that renders passes


def test_a_row_no_check_foresaw_fails_alone(normalizer, monkeypatch):
    """A value past a float's range in a row's sampling_params text failed the whole map task (an OverflowError);
    now the checks name it, and a fault no check foresaw (here: the normalizer's, patched) fails its row alone."""
    parser = RowParser(normalizer, SamplingParams(max_tokens=4), list_outputs=False)
    table = pa.table({"prompt": ["fine", "huge", "fault"],
                      "sampling_params": [None, '{"temperature": 1' + "0" * 400 + "}", None]})
    prompt_ids = RequestNormalizer.prompt_ids

    def faulty(self, **values):
        if values.get("prompt") == "fault":
            raise RuntimeError("a fault of ours")
        return prompt_ids(self, **values)

    monkeypatch.setattr(RequestNormalizer, "prompt_ids", faulty)
    parsed = [parser.parse(row) for row in rows(table, INPUT_COLUMNS)]
    assert not isinstance(parsed[0], str)  # the row beside them is read
    assert isinstance(parsed[1], str) and "temperature" in parsed[1]
    assert parsed[2] == "the row could not be read: RuntimeError('a fault of ours')"


def test_the_engine_continues_an_open_final_message(demo):
    """The model's own template (tiny-moe's ends each turn with eos): continued, the answer's prefix is the prompt's
    end, with no eos and no new assistant header after it; the engine generates what the same ids give."""
    tokenizer = demo.tokenizer
    engine = Engine(demo, page_size=16)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    full = tokenizer.apply_chat_template(OPEN_ANSWER, tokenize=False)
    open_text = full[:full.rindex("Once upon") + len("Once upon")]
    want = tokenizer.encode(open_text, add_special_tokens=False)
    continuing = ChatOptions.from_values(continue_final_message=True)
    results = engine.generate([Request("chat", messages=OPEN_ANSWER, sampling=sampling, chat_options=continuing),
                               Request("ids", prompt_token_ids=want, sampling=sampling),
                               Request("default", messages=OPEN_ANSWER, sampling=sampling)])
    assert all(r.ok for r in results), [r.error for r in results]
    assert results[0].prompt_token_ids == want
    assert results[0].outputs[0].token_ids == results[1].outputs[0].token_ids
    assert results[2].prompt_token_ids != want  # closed turn and a generation prompt by default
    bad = engine.generate([Request("bad", prompt="hi", sampling=sampling, chat_options=continuing)])[0]
    assert "apply to messages" in bad.error


def test_rows_carry_chat_options_as_columns_and_a_bad_one_fails_its_row_alone(demo, normalizer):
    """Struct fields another row set arrive null here (unset); a JSON object's text works as a struct does."""
    parser = RowParser(normalizer, SamplingParams(max_tokens=4), list_outputs=False)
    table = pa.table({
        "messages": [TURNS, TURNS, OPEN_ANSWER, TURNS, None],
        "prompt": [None, None, None, None, "plain text"],
        "chat_template_kwargs": [{"enable_thinking": False, "style": None}, None, None,
                                 {"enable_thinking": None, "style": "short"}, None],
        "continue_final_message": [None, None, True, True, None],
        "add_generation_prompt": [None, None, None, True, None],
    })
    parsed = [parser.parse(row) for row in rows(table, INPUT_COLUMNS)]
    assert [p.prompt_token_ids for p in parsed[:3]] == [
        ids(demo, "[user] tell me a story\n[assistant] /no_think"), ids(demo, "[user] tell me a story\n[assistant]"),
        ids(demo, "[user] tell me a story\n[assistant] Once upon")]
    assert parsed[3] == ("add_generation_prompt and continue_final_message cannot both be true: one opens a new "
                         "assistant turn, the other continues the last message")
    assert not isinstance(parsed[4], str)  # a text row without chat options is fine beside them
    as_text = pa.table({"messages": [TURNS], "chat_template_kwargs": [json.dumps({"enable_thinking": False})]})
    assert parser.parse(rows(as_text, INPUT_COLUMNS)[0]).prompt_token_ids == parsed[0].prompt_token_ids
    on_text = pa.table({"prompt": ["hello"], "add_generation_prompt": [False]})
    assert parser.parse(rows(on_text, INPUT_COLUMNS)[0]) == ("add_generation_prompt, continue_final_message and "
                                                             "chat_template_kwargs apply to messages; this prompt "
                                                             "is given as prompt")
