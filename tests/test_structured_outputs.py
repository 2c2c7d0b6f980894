"""Structured outputs in the engine: every output follows its JSON schema, regex, choice list or grammar,
on random-weight models of two architectures, greedy and sampled, whatever the batch, evictions or the
prefill/decode split; a spec that cannot compile fails its row alone."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import jsonschema
import pyarrow as pa
import pytest
import torch
from tiny_models import TOKENIZER_VOCAB, kv_bytes_per_token, save_tiny_checkpoint, tiny_tokenizer

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, InvalidRequestError, PrefillExporter, Request, SamplingParams
from batchgen.engine.grammar import MAX_JSON_WHITESPACE, GrammarBackend, mask_logits
from batchgen.engine.request_normalizer import sampling_params
from batchgen.engine.structured_outputs import StructuredOutputs
from batchgen.operators import stage_columns as sc

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "not sure"]
GRAMMAR = 'root ::= "(" num (op num){0,3} ")"\nop ::= "+" | "*"\nnum ::= [1-9] [0-9]{0,2}'
GRAMMAR_TEXT = re.compile(r"\([1-9][0-9]{0,2}([+*][1-9][0-9]{0,2}){0,3}\)")
SPECS = {
    "json": StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=tuple(CHOICES)),
    "grammar": StructuredOutputs(grammar=GRAMMAR),
}
PROMPTS = ["Tell me about the old river.", "Write a poem about a cat.", "What would you do?",
           "Give 3 ideas for a game about the moon.", "Describe a day on the farm with your friend."]


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return GRAMMAR_TEXT.fullmatch(text) is not None


@pytest.fixture(scope="module", params=["mixtral", "qwen3"])
def model(request, tmp_path_factory):
    """The tiny-moe preset (Mixtral) and a tiny Qwen3 saved with a byte-level BPE tokenizer."""
    if request.param == "mixtral":
        return load_model("tiny-moe")
    directory = tmp_path_factory.mktemp("qwen3")
    save_tiny_checkpoint("qwen3", directory, vocab_size=TOKENIZER_VOCAB, eos_token_id=2)
    tiny_tokenizer().save_pretrained(directory)
    return load_model(directory)


def requests(sampling: dict, n: int = 1, max_tokens: int = 200) -> list[Request]:
    return [Request(f"{kind}-{i}", prompt=prompt,
                    sampling=SamplingParams(max_tokens=max_tokens, n=n, seed=i, structured_outputs=spec, **sampling))
            for kind, spec in SPECS.items() for i, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("sampling,n", [({"temperature": 0.0}, 1), ({"temperature": 1.0, "top_p": 0.95}, 2)],
                         ids=["greedy", "sampled"])
def test_every_output_follows_its_spec(model, sampling, n):
    engine = Engine(model, page_size=16)
    results = engine.generate(requests(sampling, n))
    for result in results:
        assert result.error is None, result.error
        kind = result.request_id.split("-")[0]
        assert len(result.outputs) == n
        for out in result.outputs:
            assert out.finish_reason == "stop", (result.request_id, out.text)
            assert follows(kind, out.text), (result.request_id, out.text)
            assert out.token_ids[-1] in engine.eos_token_ids  # the grammar ended on the end token
    assert engine.grammars.compilations == len(SPECS)  # compiled once per spec, shared by every row


def test_compiled_grammars_kept_are_bounded_the_least_recently_used_dropped(model, monkeypatch):
    """A batch whose every line has its own json_schema kept one compiled grammar per line for good."""
    from batchgen.engine import grammar

    monkeypatch.setattr(grammar, "KEPT_GRAMMARS", 2)
    backend = Engine(model, page_size=16).grammars
    specs = [StructuredOutputs(regex=f"[a-z]{{{i}}}") for i in (1, 2, 3)]
    for spec in (specs[0], specs[1], specs[0], specs[2]):  # specs[1] is the least recently used when [2] comes
        backend.compile(spec)
    assert backend.compilations == 3 and len(backend._compiled) == 2
    backend.compile(specs[0])
    assert backend.compilations == 3  # kept
    backend.compile(specs[1])
    assert backend.compilations == 4  # dropped, compiled again


def test_json_whitespace_is_free_but_capped(model):
    """Without disable_any_whitespace the JSON may hold whitespace between tokens, at most
    MAX_JSON_WHITESPACE characters per gap: a random model cannot spend max_tokens on blank lines."""
    spec = StructuredOutputs(json_object=True)
    batch = [Request(str(i), prompt=p, sampling=SamplingParams(max_tokens=48, temperature=0.7, seed=i,
                                                             structured_outputs=spec)) for i, p in enumerate(PROMPTS)]
    texts = [r.outputs[0] for r in Engine(model, page_size=16).generate(batch)]
    gaps = [len(m) for out in texts for m in re.findall(r"[ \t\r\n]+", out.text)]
    assert gaps and max(gaps) <= MAX_JSON_WHITESPACE
    assert all(out.text.startswith("{") for out in texts)
    for out in texts:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_grammar_mask_forbids_exactly_what_the_matcher_rejects(model):
    """The batched mask against a one-token-at-a-time reference: accept each token, roll it back."""
    engine = Engine(model, page_size=16)
    vocab = model.model.vocab_size
    grammars = engine.grammars
    matchers = [grammars.matcher(StructuredOutputs(json=SCHEMA)), None, grammars.matcher(SPECS["regex"])]
    for token in model.tokenizer.encode('{"name": "Al', add_special_tokens=False):
        assert matchers[0].accept_token(token)
    logits = torch.zeros(3, vocab)
    mask_logits(logits, matchers)
    assert bool((logits[1] == 0).all())
    for row in (0, 2):
        allowed = []
        for token in range(vocab):
            if matchers[row].accept_token(token):
                matchers[row].rollback(1)
                allowed.append(token)
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == allowed
        assert 0 < len(allowed) < vocab


def test_greedy_structured_outputs_do_not_depend_on_batch_or_evictions(model):
    """Each request alone, against all together in a KV budget that forces YIELD and restore."""
    batch = requests({"temperature": 0.0}, max_tokens=40)
    single = Engine(model, page_size=16)
    alone = {r.request_id: single.generate([r])[0].outputs[0].token_ids for r in batch[::4]}
    engine = Engine(model, page_size=4, kv_budget_bytes=kv_bytes_per_token(model) * 4 * 40, stream_host_kv=True)
    results = engine.generate(batch)
    assert all(r.error is None for r in results), results[0].error
    together = {r.request_id: r.outputs[0].token_ids for r in results}
    assert engine.metrics()["yields"] > 0
    assert {k: together[k] for k in alone} == alone


def test_prefill_and_decode_engines_give_what_one_engine_gives(model):
    """Disaggregated: the prefill engine draws the first token under the mask, the decode engine rebuilds
    the matcher from it; seeded sampling continues with the same tokens."""
    batch = requests({"temperature": 0.8}, n=2)
    expected = {r.request_id: [o.token_ids for o in r.outputs] for r in Engine(model, page_size=16).generate(batch)}
    exported = PrefillExporter(Engine(model, page_size=16)).prefill(batch)
    decode = Engine(model, page_size=16)
    for prefilled in exported.outputs:
        decode.add_prefilled(prefilled)
    got = {}
    while decode.has_unfinished():
        got.update({r.request_id: [o.token_ids for o in r.outputs] for r in decode.step()})
    assert got == expected


def test_bad_specs_fail_their_row_alone(model):
    choice = SamplingParams(temperature=0, structured_outputs=SPECS["choice"])
    good = Request("good", prompt=PROMPTS[0], sampling=choice)
    bad = {
        "regex": StructuredOutputs(regex="(ab"),
        "type": StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strnig"}}}),
        "rule": StructuredOutputs(grammar="root ::= missing"),
    }
    rows = [Request(k, prompt=PROMPTS[1], sampling=SamplingParams(structured_outputs=s)) for k, s in bad.items()]
    results = {r.request_id: r for r in Engine(model, page_size=16).generate([rows[0], good, *rows[1:]])}
    assert results["good"].error is None and results["good"].outputs[0].text in CHOICES
    assert "regex does not compile: Regex parsing error" in results["regex"].error
    assert 'json does not compile: Unsupported type "strnig"' in results["type"].error
    assert 'grammar does not compile' in results["rule"].error and '"missing" is not defined' in results["rule"].error


def test_logprobs_of_a_structured_row_are_over_what_its_grammar_allows(model):
    """vLLM masks the logits with the grammar before its sampler, so its raw logprobs are over the tokens the grammar
    allows: a forced token about 0, alternatives only allowed ones. They were the unmasked model's: a forced token
    at -8, and top alternatives the grammar forbade (no use for classifying with a choice and its logprobs)."""
    spec = StructuredOutputs(choice=("positive", "negative"))
    [result] = Engine(model, page_size=16).generate([Request("c", prompt="The review was", sampling=SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=3, structured_outputs=spec))])
    entries = result.outputs[0].logprobs
    assert result.outputs[0].text in ("positive", "negative") and entries
    matcher = GrammarBackend(model.tokenizer, model.model.vocab_size, [model.tokenizer.eos_token_id]).matcher(spec)
    forced = 0
    for entry in entries:
        logits = torch.zeros(1, model.model.vocab_size)
        mask_logits(logits, [matcher])
        allowed = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
        assert entry.token_id in allowed and set(entry.top) <= allowed and len(entry.top) == min(3, len(allowed))
        if len(allowed) == 1:
            forced += 1
            assert entry.logprob == pytest.approx(0.0, abs=1e-6)
        assert matcher.accept_token(entry.token_id)
    assert forced  # a choice of two words has steps with one token left


def test_a_grammar_whose_every_token_is_banned_fails_its_request_alone():
    """A choice of "z" with bad_words ["z"]: the tiny-moe tokenizer spells "z" one way, so the grammar's mask and
    the ban leave no token. The request fails with the reason; the engine and the other request go on (the
    engine raised, failing every request). A regex that matches nothing fails the same way, without blaming
    bad_words it never had."""
    engine = Engine(load_model("tiny-moe"), page_size=16)
    dead_end = SamplingParams(max_tokens=8, temperature=0.0, n=2, structured_outputs=StructuredOutputs(choice=("z",)),
                              bad_words=["z"])
    nothing = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(regex=r"[^\s\S]"))
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    [failed, unmatched, ok] = engine.generate([Request("z", prompt="What would you do?", sampling=dead_end),
                                               Request("none", prompt="What would you do?", sampling=nothing),
                                               Request("ok", prompt="What would you do?", sampling=plain)])
    assert failed.error == ("structured_outputs: after 0 tokens no token the grammar allows was left to sample "
                            "(bad_words banned every one)") and not failed.outputs
    assert unmatched.error == ("structured_outputs: after 0 tokens no token the grammar allows was left to sample "
                               "(the grammar allows none here)") and not unmatched.outputs
    assert ok.ok and len(ok.outputs[0].token_ids) == 5
    assert engine.metrics()["failed_requests"] == 2 and not engine.has_unfinished()


@pytest.mark.parametrize("value,message", [
    ({}, "set exactly one of"), ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"json": "{x"}, "'json' is not valid JSON"), ({"choice": []}, "'choice' must be a non-empty list"),
    ({"regex": "a", "color": 1}, "unknown field 'color'"), ("a+", "expected an object"),
])
def test_malformed_specs_are_named(value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(structured_outputs=value)


def test_a_struct_of_nulls_is_no_structured_output():
    """A Parquet row's structured_outputs struct whose every field is null (or false), as some writers store an unset
    struct, was refused ("set exactly one of ...; got none"): null fields of a struct count as unset."""
    nulls = {"json": None, "regex": None, "choice": None, "grammar": None, "json_object": False,
             "disable_any_whitespace": None}
    assert sampling_params({"structured_outputs": nulls, "max_tokens": 3}).structured_outputs is None
    table = pa.table({"sampling_params": [{"structured_outputs": nulls}, {"structured_outputs": {**nulls,
                                                                                              "regex": "a+"}}]})
    specs = [sampling_params(row["sampling_params"]).structured_outputs for row in table.to_pylist()]
    assert specs[0] is None and specs[1].regex == "a+"
    with pytest.raises(InvalidRequestError, match="set exactly one of .*; got none"):  # an option and no kind
        SamplingParams(structured_outputs={**nulls, "disable_any_whitespace": True})


def test_a_struct_of_nulls_over_job_defaults_leaves_them_as_a_null_struct_does():
    """from_dict counted a struct of nulls as a change: it dropped the job's default spec and its min_tokens, so a
    row's output depended on how its writer stored "unset"."""
    nulls = {"json": None, "regex": None, "choice": None, "grammar": None, "json_object": False,
             "disable_any_whitespace": None}
    for defaults in (SamplingParams(min_tokens=5, max_tokens=10), SamplingParams(structured_outputs={"regex": "a+"})):
        for unset in (None, nulls):
            assert SamplingParams.from_dict({"structured_outputs": unset, "temperature": 0.5}, defaults) == \
                dataclasses.replace(defaults, temperature=0.5)


@pytest.mark.parametrize("schema", [False, True])
def test_a_boolean_json_schema_is_a_schema(schema):
    """`{"json": false}` (the schema no value satisfies) counted as an unset field: the row ran unconstrained; `true`
    was refused as not a schema, though its JSON text was taken."""
    spec = SamplingParams(structured_outputs={"json": schema}).structured_outputs
    assert spec.json == json.dumps(schema) and spec.kind == "json"


UNENFORCED = [  # a schema the backend compiles, an output breaking it, and the refusal's words
    ({"not": {"type": "string"}}, '"abc"', "'not' (at /)"),
    ({"if": {"type": "string"}, "then": {"maxLength": 1}}, '"abcd"', "'if' (at /)"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
      "required": ["tags"]}, '{"tags": [1, 1]}', "'uniqueItems' (at /properties/tags)"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "'contains' (at /)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "'dependentRequired' (at /)"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, '"abcdef"', "'allOf' of 2 subschemas (at /; only the first"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, '{"a": 1}',
     "'required' naming 'b' outside 'properties' (at /)"),
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.5}}, "required": ["price"]},
     '{"price": 0.3}', "'multipleOf' on a number (at /properties/price; the backend compiles it for integers only)"),
    ({"type": "string", "format": "regex"}, '"("', "format 'regex' (at /)"),
    ({"type": "string", "format": "idn-email"}, '"x"', "format 'idn-email' (at /)"),
    # where one keyword of an object is compiled, the others beside it are dropped
    ({"anyOf": [{"type": "integer"}], "type": "string"}, "11", "'type' beside 'anyOf' (at /; only the 'anyOf' is"),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "1", "'type' beside 'allOf' (at /"),
    ({"$ref": "#/$defs/x", "maximum": 3, "$defs": {"x": {"type": "integer"}}}, "5", "'maximum' beside '$ref' (at /"),
    ({"type": "integer", "enum": [1, 2], "minimum": 2}, "1", "'minimum' beside 'enum' (at /; only the 'enum' is"),
    ({"const": 3, "minimum": 5}, "3", "'minimum' beside 'const' (at /"),
    ({"type": "integer", "enum": [1, "a"]}, '"a"', "'type' beside 'enum' (at /"),
    ({"type": "string", "format": "date", "pattern": "^1"}, '"2020-01-01"', "'pattern' beside 'format' (at /"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"},
      "patternProperties": {"^x": {"type": "boolean"}}}, '{"x": "s"}',
     "'patternProperties' beside an 'additionalProperties' schema (at /"),
]


@pytest.mark.parametrize("schema,breaking,named", UNENFORCED)
def test_a_schema_the_backend_does_not_enforce_is_refused_by_name(model, schema, breaking, named):
    """xgrammar compiles these and drops the constraint: its matcher takes an output that breaks it (the control,
    a spec built past the check), so the rows got outputs off their spec without an error."""
    unchecked = object.__new__(StructuredOutputs)  # the spec as it was accepted before the check
    for field, value in {**StructuredOutputs(regex="a").to_dict(), "regex": None, "json": json.dumps(schema)}.items():
        object.__setattr__(unchecked, field, value)
    matcher = GrammarBackend(model.tokenizer, model.model.vocab_size, [model.tokenizer.eos_token_id]).matcher(unchecked)
    tokens = model.tokenizer.encode(breaking, add_special_tokens=False) + [model.tokenizer.eos_token_id]
    assert all(matcher.accept_token(t) for t in tokens)  # the backend admits the breaking output
    with pytest.raises(InvalidRequestError, match=re.escape(f"the schema uses {named}") + r".*which the grammar "
                                                  r"backend does not enforce: outputs would not follow it"):
        SamplingParams(structured_outputs={"json": schema})


def test_schemas_of_what_the_backend_enforces_pass_the_check():
    """Pydantic-style schemas: nested objects through $defs and $ref, optional fields as anyOf with null, one-element
    allOf, enums, bounds, patterns, lengths, oneOf unions."""
    person = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                "required": ["kind"]}},
              "type": "object",
              "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0},
                             "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]+@[a-z]+$"}, {"type": "null"}]},
                             "pet": {"allOf": [{"$ref": "#/$defs/Pet"}]},
                             "id": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
                             "not": {"type": "boolean"},  # a property named like a keyword is a name
                             # annotations beside what is compiled; a type every listed value has
                             "home": {"$ref": "#/$defs/Pet", "description": "where it lives", "title": "Home"},
                             "nick": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                             "mood": {"type": "string", "enum": ["calm", "busy"]},
                             "score": {"type": ["number", "null"], "const": 1.0}, "step": {"type": "integer",
                                                                                          "multipleOf": 5},
                             "when": {"type": "string", "format": "date-time"},
                             "tag": {"type": "string", "format": "x-custom"},  # an undefined format annotates
                             # pydantic's HttpUrl and constr(min_length, pattern): lengths the backend drops, let pass
                             "url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
                             "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2}},
              "required": ["name", "age", "not"]}
    assert SamplingParams(structured_outputs={"json": person}).structured_outputs is not None


def test_a_default_min_tokens_does_not_apply_to_a_structured_row():
    """A job's or server's default min_tokens made every structured row fail, though none of them set it."""
    defaults = SamplingParams(min_tokens=5, max_tokens=20)
    row = SamplingParams.from_dict({"structured_outputs": {"choice": ["a", "b"]}}, defaults)
    assert (row.min_tokens, row.max_tokens) == (0, 20)
    with pytest.raises(InvalidRequestError, match="min_tokens"):  # set by the row itself: refused
        SamplingParams.from_dict({"structured_outputs": {"choice": ["a"]}, "min_tokens": 3}, defaults)


def test_min_tokens_is_refused_with_structured_outputs():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def test_max_tokens_and_stop_strings_cut_structured_outputs(model):
    engine = Engine(model, page_size=16)
    cut = Request("cut", prompt=PROMPTS[0],
                  sampling=SamplingParams(temperature=0, max_tokens=2, structured_outputs={"regex": "[a-z]{40}"}))
    stop = Request("stop", prompt=PROMPTS[0],
                   sampling=SamplingParams(temperature=0, stop=["@"], structured_outputs={"regex": REGEX}))
    results = {r.request_id: r.outputs[0] for r in engine.generate([cut, stop])}
    assert results["cut"].finish_reason == "length" and len(results["cut"].token_ids) == 2
    assert re.fullmatch("[a-z]+", results["cut"].text)
    assert results["stop"].finish_reason == "stop" and re.fullmatch("[a-z]{2,6}", results["stop"].text)


def test_model_without_tokenizer_refuses_structured_rows(model):
    engine = Engine(model, page_size=16)
    engine.tokenizer = None
    result = engine.generate([Request("r", prompt_token_ids=[5, 6], sampling=SamplingParams(
        structured_outputs={"regex": "a"}))])[0]
    assert "needs the model's tokenizer" in result.error


def test_specs_travel_between_stages_as_an_arrow_struct():
    params = [SamplingParams(structured_outputs=spec) for spec in SPECS.values()] + [SamplingParams()]
    columns = sc.tokenized_columns([str(i) for i in range(len(params))], [[1]] * len(params), params)
    assert [r.sampling for r in sc.requests(pa.table(columns))] == params


def test_choices_with_characters_past_u_ffff_come_out_whole(model):
    """An emoji choice was written into the grammar as two surrogate escapes, each read as a character of its own:
    it never matched, and the output was bytes of no choice (empty once decoded)."""
    choices = ["good \U0001F44D", "bad \U0001F44E", "fine"]
    results = Engine(model, page_size=16).generate([Request(str(i), prompt=p, sampling=SamplingParams(
        max_tokens=24, temperature=1.0, seed=i, structured_outputs={"choice": choices}))
        for i, p in enumerate(PROMPTS * 2)])
    texts = [r.outputs[0].text for r in results]
    assert set(texts) <= set(choices) and any(ord(t[-1]) > 0xFFFF for t in texts), texts


def test_a_special_token_past_the_models_vocabulary_is_left_out_of_the_grammar(model):
    """A tokenizer whose added special token lies past the model's vocabulary (embeddings never resized) raised an
    IndexError building the grammar backend, which failed the engine at its first structured request."""
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    extra = tokenizer.convert_tokens_to_ids("<|extra|>")
    vocab = model.model.vocab_size
    assert extra >= vocab or len(tokenizer) > vocab
    backend = GrammarBackend(tokenizer, min(vocab, extra), [model.tokenizer.eos_token_id])
    assert backend.compile(SPECS["choice"]) is not None


def test_backend_without_end_token_names_it(model):
    backend = GrammarBackend(model.tokenizer, model.model.vocab_size, [])
    with pytest.raises(InvalidRequestError, match="no end-of-sequence token"):
        backend.compile(SPECS["regex"])
