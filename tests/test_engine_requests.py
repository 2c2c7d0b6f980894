"""Per-request behaviour: bad input fails alone, sampling options do what they say."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter

import pytest
import torch

from batchgen.connectors.checkpoint import load_model
from batchgen.engine import Engine, InvalidRequestError, Request, SamplingParams, stop_checker
from batchgen.engine.chat import render_chat
from batchgen.engine.reference import ReferenceRunner
from batchgen.engine.sampler import _filtered_probs, adjust_logits
from batchgen.engine.sequence import Sequence
from batchgen.engine.stop_checker import finish_reason, output_text


@pytest.fixture(scope="module")
def demo():
    return load_model("tiny-moe")


@pytest.fixture()
def engine(demo):
    return Engine(demo, page_size=16)


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **overrides})


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens"), ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("temperature", -0.5, "temperature"), ("logprobs", 50, "logprobs"), ("n", 0, "'n'"),
    ("min_tokens", 40, "min_tokens"), ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", float("nan"), "presence_penalty"), ("repetition_penalty", 0, "repetition_penalty"),
    ("logit_bias", {"x": 1}, "token id 'x'"), ("logit_bias", [3, 4], "bad entry 3"), ("best_of", 2, "unknown"),
    ("max_tokens", 2.5, "max_tokens"), ("seed", 1.5, "seed"),  # integral floats (3.0) are integers, these are not
    ("temperature", 10**400, "temperature"), ("logit_bias", {"3": 10**400}, "bias 1000"),  # past a float: no overflow
    ("logit_bias", {"²": 1}, "token id '²'"),  # a digit int() refuses
    # the sampler's float32 tensors: inf there (uniform draws, NaN beside min_tokens), or a penalty of 0 or inf
    ("temperature", 1e39, "temperature"), ("repetition_penalty", 1e-50, "repetition_penalty"),
    ("repetition_penalty", 1e50, "repetition_penalty"),
])
def test_invalid_sampling_fields_are_named(field, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict({field: value})


def test_bad_prompts_fail_alone_and_name_the_problem(engine, demo):
    good = Request("good", prompt="the quick brown fox", sampling=greedy())
    at_limit = Request("at_limit", prompt_token_ids=[5] * 10, sampling=greedy(max_prompt_tokens=10))
    bad = [
        Request("empty", prompt="", sampling=greedy()),
        Request("too_long", prompt_token_ids=[5] * demo.max_model_len, sampling=greedy()),
        Request("out_of_vocab", prompt_token_ids=[3, demo.model.vocab_size + 7], sampling=greedy()),
        Request("not_text", prompt=123, sampling=greedy()),
        Request("over_limit", prompt_token_ids=[5] * 20, sampling=greedy(max_prompt_tokens=10)),
    ]
    results = {r.request_id: r for r in engine.generate([bad[0], good, at_limit, *bad[1:]])}
    assert results["good"].error is None and len(results["good"].outputs[0].token_ids) == 12
    assert results["at_limit"].error is None  # at most max_prompt_tokens: that many is allowed
    assert "prompt is empty" in results["empty"].error
    assert f"{demo.max_model_len} tokens" in results["too_long"].error
    assert "outside the vocabulary" in results["out_of_vocab"].error
    assert "expected text" in results["not_text"].error
    assert "prompt has 20 tokens, over the limit of 10 (max_prompt_tokens)" in results["over_limit"].error
    assert engine.metrics()["failed_requests"] == 5


def test_a_duplicate_id_in_one_generate_call_fails_in_its_own_place(engine):
    """The duplicate's error came back first and the original's result then took both places."""
    [alone] = engine.generate([Request("x", prompt="one two", sampling=greedy())])
    first, second = engine.generate([Request("x", prompt="one two", sampling=greedy()),
                                     Request("x", prompt="three four", sampling=greedy())])
    assert first.error is None and first.outputs[0].token_ids == alone.outputs[0].token_ids
    assert second.error == "duplicate request_id 'x': an earlier request of this call has it"


def test_text_prompt_is_tokenized_and_detokenized(engine, demo):
    [result] = engine.generate([Request("t", prompt="the quick brown fox", sampling=greedy())])
    ids = demo.tokenizer.encode("the quick brown fox")
    assert result.prompt_token_ids == ids
    assert result.outputs[0].token_ids == ReferenceRunner(demo.model).generate([ids], max_new_tokens=12)[0]
    assert result.outputs[0].text == demo.tokenizer.decode(result.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_token_ids_stop_strings_and_eos(engine, demo):
    [base] = engine.generate([Request("b", prompt="one two three", sampling=greedy(max_tokens=12))])
    tokens = base.outputs[0].token_ids
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    [by_id] = engine.generate([Request("i", prompt="one two three", sampling=greedy(stop_token_ids=[stop_id]))])
    assert by_id.outputs[0].token_ids == tokens[: first + 1] and by_id.outputs[0].finish_reason == "stop"
    # the stop token's own text is left out, as vLLM leaves it out (it was kept)
    assert by_id.outputs[0].text == demo.tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert demo.tokenizer.decode([stop_id], skip_special_tokens=True)
    word = demo.tokenizer.decode([tokens[5]], skip_special_tokens=True).strip()
    [by_text] = engine.generate([Request("s", prompt="one two three", sampling=greedy(stop=[word]))])
    text = base.outputs[0].text
    assert by_text.outputs[0].finish_reason == "stop"
    assert by_text.outputs[0].text == text[: text.index(word)]
    # eos: a model whose eos is a token it generates greedily here stops right after that token, unless told not to
    eos = tokens[6]
    first_eos = tokens.index(eos)
    assert first_eos + 1 < len(tokens)  # so stopping there really cuts the output short
    eos_engine = Engine(dataclasses.replace(demo, eos_token_ids=(eos,)), page_size=16)
    [eos_stop, eos_ignored] = eos_engine.generate([
        Request("e", prompt_token_ids=base.prompt_token_ids, sampling=greedy(ignore_eos=False)),
        Request("x", prompt_token_ids=base.prompt_token_ids, sampling=greedy(ignore_eos=True))])
    assert eos_stop.outputs[0].token_ids == tokens[: first_eos + 1] and eos_stop.outputs[0].finish_reason == "stop"
    assert eos_ignored.outputs[0].token_ids == tokens and eos_ignored.outputs[0].finish_reason == "length"


def test_tiny_temperatures_are_greedy_and_top_k_minus_one_disables_top_k(engine):
    """vLLM's conventions: logits divided by 1e-38 overflow (the softmax of infs is NaN, its argmax a low id)."""
    prompt = [5, 6, 7, 8]
    [want] = engine.generate([Request("g", prompt_token_ids=prompt, sampling=greedy())])
    tiny = [Request(f"t{i}", prompt_token_ids=prompt, sampling=SamplingParams(
        temperature=t, max_tokens=12, ignore_eos=True, seed=i)) for i, t in enumerate((1e-38, 1e-6))]
    assert [r.outputs[0].token_ids for r in engine.generate(tiny)] == [want.outputs[0].token_ids] * 2
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams.from_dict({"top_k": -1}).to_dict()["top_k"] == 0
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=-2)


def test_a_row_without_top_k_or_top_p_keeps_its_whole_distribution_beside_rows_that_set_them():
    """A row with top_k 0 and top_p 1 goes through the sort and cumsum when another row of the step uses top-k;
    a dominant token's probability rounds to 1.0 in float32 there, and every tail token fell at top_p 1."""
    logits = torch.linspace(0.0, -1.0, 1000).repeat(2, 1)  # distinct: no ties at the k-th
    logits[:, 0] = 30.0  # p0 = 1.0 in float32; each other token under 1e-13
    rows = [Sequence(i, f"r{i}", 0, [1], SamplingParams(temperature=1.0, top_k=k), frozenset(), i)
            for i, k in enumerate((5, 0))]
    probs = _filtered_probs(logits, rows)
    assert torch.equal(probs[1], torch.softmax(logits[1], dim=-1))  # the batch does not change this row's draw
    assert int((probs[0] > 0).sum()) == 5


def test_min_p_applies_before_top_p_and_top_k_keeps_ties():
    """vLLM's sampler runs min-p before top-k and top-p, so top-p's mass is over what min-p kept: probabilities
    [.506, .307, .186, ...] at min_p 0.25 keep three tokens, renormalised [.506, .307, .186] / .999, and top_p 0.75
    then keeps two (min-p last kept all three). top-k keeps every token tied with the k-th (vLLM masks the logits
    below the k-th value; transformers too): ranks kept only k."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.3, -0.5, -1.0, 0.0, -3.0], [10.0, 9.5, 9.5, 9.5, 7.0, 0.0, 0.0, 0.0]])
    rows = [Sequence(0, "p", 0, [1], SamplingParams(temperature=1.0, min_p=0.25, top_p=0.75), frozenset(), 0),
            Sequence(1, "k", 0, [1], SamplingParams(temperature=1.0, top_k=2), frozenset(), 1)]
    probs = _filtered_probs(logits, rows)
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    assert probs[1].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_top_p_applies_to_what_top_k_kept_renormalised():
    """top_k 2 then top_p 0.6 over [0.5, 0.3, 0.2]: the kept pair renormalised is [0.625, 0.375], so the first token
    alone reaches 0.6 (vLLM, transformers); measured over the whole distribution both stayed."""
    logits = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    rows = [Sequence(i, f"r{i}", 0, [1], SamplingParams(temperature=1.0, top_k=k, top_p=0.6), frozenset(), i)
            for i, k in enumerate((2, 0))]
    probs = _filtered_probs(logits, rows)
    assert probs[0].tolist() == pytest.approx([0.5, 0.0, 0.0])
    assert probs[1].tolist() == pytest.approx([0.5, 0.3, 0.0])  # without top-k: 0.5 alone is short of 0.6


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p 1e-300 is 0 in float32, and every token's mass before it (0 for the first) reached it: every token was
    dropped and the row drew token 0 at every step. The most likely token always stays (as for top_p 1e-30)."""
    logits = torch.tensor([[0.1, 2.0, 0.3], [0.1, 2.0, 0.3]])
    rows = [Sequence(i, f"r{i}", 0, [1], SamplingParams(temperature=1.0, top_p=p), frozenset(), i)
            for i, p in enumerate((1e-300, 1e-30))]
    probs = _filtered_probs(logits, rows)
    assert probs[0].nonzero().flatten().tolist() == probs[1].nonzero().flatten().tolist() == [1]


def test_a_tokenizer_with_named_chat_templates_renders_its_default(demo):
    """Some checkpoints ship a list of {name, template}; transformers makes it a dict and applies "default" (a dict
    passed back as the template was refused: every chat request failed)."""
    tokenizer = copy.deepcopy(demo.tokenizer)
    turns = [{"role": "user", "content": "Tell me a story."}]
    want = render_chat(tokenizer, turns)
    tokenizer.chat_template = {"default": tokenizer.chat_template, "tool_use": "{{ 'tools' }}"}
    assert render_chat(tokenizer, turns) == want
    assert render_chat(tokenizer, turns, chat_template="{{ 'x' }}") == tokenizer.encode("x", add_special_tokens=False)


def test_a_messages_name_and_tool_call_id_reach_the_chat_template(demo):
    """Only role and content were kept: a template that writes the speaker's name, or needs a tool message's call
    id, rendered without them (or rejected the messages)."""
    from batchgen.engine import RequestNormalizer

    template = ("{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}: {{ m.content }}"
                "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}")
    normalizer = RequestNormalizer(demo.tokenizer, demo.model.vocab_size, 4096, chat_template=template)
    messages = [{"role": "user", "name": "bob", "content": "hi"},
                {"role": "tool", "tool_call_id": "call_7", "content": "42", "name": None}]
    want = "user(bob): hi\ntool: 42 [call_7]\n"
    assert normalizer.prompt_ids(messages=messages) == demo.tokenizer.encode(want, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.name: expected text"):
        normalizer.prompt_ids(messages=[{"role": "user", "name": 3, "content": "hi"}])


def test_an_assistants_reasoning_reaches_the_template_and_empty_content_parts_are_left_out(demo):
    """vLLM gives an assistant message's `reasoning` (or `reasoning_content`) to the template under both names, which
    thinking models' templates print in their think block: it was dropped. Empty text parts are left out of the
    joined content, as vLLM joins them (["a", "", "b"] gave "a\n\nb")."""
    from batchgen.engine import RequestNormalizer

    template = ("{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }}{{ '\n' }}{% endfor %}")
    normalizer = RequestNormalizer(demo.tokenizer, demo.model.vocab_size, 4096, chat_template=template)
    parts = [{"type": "text", "text": t} for t in ("a", "", "b")]
    for key in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": parts}, {"role": "assistant", key: "two plus two", "content": "4"},
                    {"role": "user", "content": "and 3 + 3?"}]
        want = "user: a\nb\nassistant: <think>two plus two</think>4\nuser: and 3 + 3?\n"
        assert normalizer.prompt_ids(messages=messages) == demo.tokenizer.encode(want, add_special_tokens=False)


def test_samples_of_one_seeded_request_never_share_a_step_seed():
    """Sample i at step s + 7919 drew sample i + 1's numbers at step s: n > 1 outputs past 7,919 tokens correlated."""
    samples = [Sequence(i, "r", i, [1], SamplingParams(seed=7, n=4), frozenset(), i) for i in range(4)]
    seeds = [s.rng_seed(step) for s in samples for step in range(20_000)]
    assert len(set(seeds)) == len(seeds)
    other = Sequence(9, "q", 0, [1], SamplingParams(seed=8), frozenset(), 9)
    assert other.rng_seed(0) not in seeds


class ByteTokenizer:
    """Token id = one UTF-8 byte (a byte-level BPE's fallback): a CJK character or an emoji is 3-4 tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop", ["你", "b你", "🙂", "你c"])
def test_a_stop_string_ending_in_a_character_split_over_tokens_stops_on_its_last_byte(stop):
    text = "ab你c🙂d"
    seq = Sequence(0, "r", 0, [1], SamplingParams(stop=[stop], max_tokens=64), frozenset(), 0)
    reasons = []
    for byte in text.encode():
        seq.generated.append(byte)
        reasons.append(finish_reason(seq, ByteTokenizer(), max_model_len=128))
        if reasons[-1]:
            break
    end = len((text[: text.index(stop) + len(stop)]).encode())
    assert reasons == [None] * (end - 1) + ["stop"]  # on the stop's last byte, not later ("length" before the fix)
    assert output_text(seq, ByteTokenizer()) == text[: text.index(stop)]


def test_an_output_cut_by_max_tokens_mid_character_ends_before_that_character():
    """vLLM holds back the bytes of a character not yet complete: the text ended in U+FFFD."""
    seq = Sequence(0, "r", 0, [1], SamplingParams(max_tokens=3), frozenset(), 0)
    seq.generated = list("ab你".encode()[:3])  # a, b and the first of 你's three bytes
    assert finish_reason(seq, ByteTokenizer(), max_model_len=128) == "length"
    assert output_text(seq, ByteTokenizer()) == "ab"


def test_a_sentencepiece_outputs_first_word_keeps_its_leading_space(demo):
    """A Metaspace decoder drops the space of the first token it decodes: the output decoded alone read "Paris."
    after "The capital is" where vLLM, decoding behind the prompt's last tokens, gives " Paris." (and a stop string
    " Paris" could never match)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581The": 1, "\u2581capital": 2, "\u2581is": 3, "\u2581Paris": 4, ".": 5,
             "\u2581one": 6, "\u2581two": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([4, 5]) == "Paris."
    assert not stop_checker._decodes_alone(tokenizer) and stop_checker._decodes_alone(demo.tokenizer)  # byte-level
    seq = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(max_tokens=8, stop=[" Paris"]), frozenset(), 0)
    seq.generated = [4, 5]
    assert output_text(seq, tokenizer) == " Paris."
    seq.generated = [4]
    assert finish_reason(seq, tokenizer, max_model_len=64) == "stop" and output_text(seq, tokenizer) == ""


def test_min_tokens_suppresses_stopping_and_max_tokens_sets_length(engine):
    [base] = engine.generate([Request("b", prompt="one two three", sampling=greedy())])
    stop_id = base.outputs[0].token_ids[1]
    [held] = engine.generate([Request("m", prompt="one two three",
                                      sampling=greedy(stop_token_ids=[stop_id], min_tokens=6, max_tokens=6))])
    assert len(held.outputs[0].token_ids) == 6 and held.outputs[0].finish_reason == "length"
    assert stop_id not in held.outputs[0].token_ids[:5]


def test_logprobs_report_the_chosen_token_and_top_alternatives(engine):
    [result] = engine.generate([Request("l", prompt="a b c", sampling=greedy(logprobs=3, max_tokens=5))])
    entries = result.outputs[0].logprobs
    assert len(entries) == 5
    for token, entry in zip(result.outputs[0].token_ids, entries):
        assert entry.token_id == token and len(entry.top) == 3
        assert max(entry.top.values()) == pytest.approx(entry.logprob)  # greedy picks the most likely token
        assert entry.logprob <= 0


def test_logprobs_are_the_models_own_whatever_bias_shapes_the_pick(engine):
    """vLLM's default (raw logprobs): a token forced by a +100 bias reported about 0."""
    [plain] = engine.generate([Request("p", prompt="a b c", sampling=greedy(logprobs=5, max_tokens=1))])
    model = plain.outputs[0].logprobs[0].top
    second = sorted(model, key=model.get)[-2]
    [forced] = engine.generate([Request("f", prompt="a b c", sampling=greedy(
        logprobs=5, max_tokens=1, logit_bias={second: 100.0}))])
    entry = forced.outputs[0].logprobs[0]
    assert entry.token_id == second and entry.logprob == pytest.approx(model[second])
    assert entry.top == pytest.approx(model)


def test_top_k_one_equals_greedy_and_sampling_varies_without_seed(engine):
    [base] = engine.generate([Request("g", prompt="a b c", sampling=greedy())])
    [top1] = engine.generate([Request("k", prompt="a b c", sampling=greedy(temperature=1.0, top_k=1))])
    assert top1.outputs[0].token_ids == base.outputs[0].token_ids
    params = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, n=4, seed=None)
    [sampled] = engine.generate([Request("n", prompt="a b c", sampling=params)])
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1


def test_generate_refuses_an_engine_with_requests_running(engine):
    """Before, their Results finished inside the call: KeyError for one of another id, and a request of the same id
    got the earlier one's tokens."""
    engine.add_request(Request("earlier", [5, 6, 7], sampling=greedy(max_tokens=4)))
    with pytest.raises(RuntimeError, match="requests added before are still running"):
        engine.generate([Request("later", [5, 6, 7], sampling=greedy(max_tokens=4))])
    assert [r.request_id for r in engine.stream([])] == ["earlier"]


def test_stop_strings_without_a_tokenizer_are_refused_not_ignored(demo):
    engine = Engine(dataclasses.replace(demo, tokenizer=None), page_size=16)
    [result] = engine.generate([Request("s", [5, 6, 7], sampling=greedy(max_tokens=4, stop=["a"]))])
    assert result.error == ("stop strings need the model's tokenizer; this model has none (stop_token_ids take token "
                            "ids)")


def test_a_refill_threshold_of_zero_refills_once_no_sequence_decodes(demo):
    """Coroutine mode refills when the decoding sequences fall under threshold x max_num_seqs: 0 never did, and
    the prompts past the first max_num_seqs waited for good."""
    engine = Engine(demo, page_size=16, max_num_seqs=2, refill_threshold=0.0)
    results = engine.generate([Request(f"r{i}", [5, 6, 7 + i], sampling=greedy(max_tokens=3)) for i in range(5)])
    assert [len(r.outputs[0].token_ids) for r in results] == [3] * 5 and engine.metrics()["peak_active"] == 2


def test_abort_drops_a_request_and_frees_its_kv(engine):
    engine.add_request(Request("keep", prompt="a b", sampling=greedy()))
    engine.add_request(Request("drop", prompt="c d", sampling=greedy(max_tokens=200)))
    engine.step()
    free_before = engine.kv.device.free_pages
    assert engine.abort("drop") and not engine.abort("drop")
    assert engine.kv.device.free_pages > free_before
    finished = [r.request_id for r in engine.stream([])]
    assert finished == ["keep"]


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("min_p", float("inf")), ("stop", 5), ("stop", {"a": 1}), ("stop_token_ids", [1.5]), ("stop_token_ids", 3),
    ("ignore_eos", "false"), ("ignore_eos", 1),  # a "false" string was truthy: every row ran to max_tokens
])
def test_non_finite_and_wrongly_typed_sampling_values_are_rejected_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=f"invalid sampling parameter '{field}'"):
        SamplingParams.from_dict({field: value})


def reference_adjust(row: torch.Tensor, prompt: list[int], generated: list[int], params: SamplingParams,
                     bad_word_ids=()):
    """Plain per-token loops, in the sampler's documented order."""
    out = row.clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        for token in set(prompt) | set(generated):
            out[token] = out[token] / p if out[token] > 0 else out[token] * p
    for token, count in Counter(generated).items():
        out[token] -= params.presence_penalty + params.frequency_penalty * count
    for ids in bad_word_ids:
        if len(generated) >= len(ids) - 1 and all(generated[len(generated) - len(ids) + 1 + j] == ids[j]
                                                  for j in range(len(ids) - 1)):
            out[ids[-1]] = float("-inf")
    return out


def test_penalties_and_logit_bias_match_a_plain_reference_on_the_same_logits():
    rng = random.Random(0)
    vocab = 50
    options = [{}, {"presence_penalty": 1.5}, {"frequency_penalty": -0.7}, {"repetition_penalty": 1.3},
               {"repetition_penalty": 0.8, "presence_penalty": -2, "frequency_penalty": 2},
               {"logit_bias": {"3": 100, 7: -4.5}, "frequency_penalty": 0.4}, {"bad_words": ["x"]}]
    seqs = []
    for i, option in enumerate(options * 3):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        generated = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        # bad words as the engine tokenizes them: one-token words, and words the output is one token from
        bad = ((5,), (*generated[-2:], 9), (1, 2, 3)) if "bad_words" in option else ()
        seq = Sequence(seq_id=i, request_id=str(i), sample_index=0, prompt_ids=prompt,
                       sampling=SamplingParams.from_dict(option), eos_token_ids=frozenset(), arrival=i,
                       generated=generated, bad_word_ids=bad)
        seqs.append(seq)
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(1)) * 3
    got = adjust_logits(logits, seqs)
    want = torch.stack([reference_adjust(logits[i], s.prompt_ids, s.generated, s.sampling, s.bad_word_ids)
                        for i, s in enumerate(seqs)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(got, logits)


def test_logit_bias_and_penalties_steer_greedy_decoding(engine, demo):
    prompt = ReferenceRunner(demo.model).generate([[5, 6, 7]], 1)[0]  # any prompt; its first greedy token
    forced = Request("forced", prompt_token_ids=[5, 6, 7], sampling=greedy(max_tokens=6, logit_bias={"11": 100}))
    plain = Request("plain", prompt_token_ids=[5, 6, 7], sampling=greedy(max_tokens=12))
    no_repeat = Request("no-repeat", prompt_token_ids=[5, 6, 7], sampling=greedy(max_tokens=12, presence_penalty=2,
                                                                                repetition_penalty=5.0))
    out = {r.request_id: r.outputs[0].token_ids for r in engine.generate([forced, plain, no_repeat])}
    assert out["forced"] == [11] * 6
    assert out["plain"][0] == prompt[0]
    assert len(set(out["plain"])) < len(out["plain"])  # the random tiny model repeats itself greedily...
    assert len(set(out["no-repeat"])) == len(out["no-repeat"])  # ...but not under these penalties


def test_bad_words_ban_the_token_that_would_complete_them(engine, demo):
    """Greedy text, then the same request with its own words banned: none of them appears, alone or after a
    space, and the ban matches a plain check of every step's allowed tokens."""
    plain = engine.generate([Request("plain", prompt="Tell me about the river.", sampling=greedy(max_tokens=16))])
    text = plain[0].outputs[0].text
    words = sorted({w for w in text.split() if len(w) > 2})[:3]
    assert words, text
    banned = engine.generate([Request("banned", prompt="Tell me about the river.",
                                      sampling=greedy(max_tokens=16, bad_words=words))])[0].outputs[0]
    tokenizer = demo.tokenizer
    sequences = {tuple(tokenizer.encode(t, add_special_tokens=False)) for w in words for t in (w, " " + w)}
    ids = banned.token_ids
    for seq in sequences:  # no window of the output is a bad word's token sequence
        assert not any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1)), (seq, ids)
    assert banned.token_ids != plain[0].outputs[0].token_ids


def test_bad_words_must_be_words():
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=["ok", " "])
    assert SamplingParams(bad_words="river").bad_words == ("river",)


@pytest.fixture
def over_vocabulary(tmp_path):
    """A model of 256 tokens beside a tokenizer of 512."""
    from tiny_models import save_tiny_checkpoint, tiny_tokenizer

    save_tiny_checkpoint("llama", tmp_path)
    tiny_tokenizer(512).save_pretrained(tmp_path)
    return load_model(str(tmp_path))


def test_a_tokenizer_larger_than_the_models_vocabulary_fails_the_row_not_the_step(over_vocabulary):
    """Only prompt_token_ids were checked against the vocabulary: text or messages the tokenizer turned into an id
    past the embedding table (a tokenizer of 512 tokens beside a model of 256) failed the step's forward, and every
    request in it with an IndexError."""
    loaded = over_vocabulary
    text = 'hello world json {"a": 1}'
    over = next(t for t in loaded.tokenizer.encode(text) if t >= 256)
    ok = Request("ok", prompt_token_ids=[1, 2, 3], sampling=greedy(max_tokens=3))
    results = {r.request_id: r for r in Engine(loaded, page_size=4).generate([
        ok, Request("text", prompt=text, sampling=greedy(max_tokens=3)),
        Request("chat", messages=[{"role": "user", "content": text}], sampling=greedy(max_tokens=3))])}
    assert results["ok"].error is None
    assert results["ok"].outputs[0].token_ids == ReferenceRunner(loaded.model).generate([[1, 2, 3]], 3)[0]
    for name, given in (("text", "prompt"), ("chat", "messages")):
        assert results[name].error == (f"{given}: the tokenizer gives token {over}, outside the model's vocabulary "
                                       "[0, 256)")


def test_a_bad_word_spelt_past_the_models_vocabulary_bans_only_what_can_be_generated(over_vocabulary):
    """A bad word whose tokens included one past the embedding table banned that id in the logits: an IndexError
    that failed the step and every request in it. Such a spelling can never be generated, so it needs no ban; the
    other bad words are still banned."""
    loaded, prompt = over_vocabulary, [1, 2, 3]
    assert max(loaded.tokenizer.encode(" t", add_special_tokens=False)) >= 256
    reference = ReferenceRunner(loaded.model).generate([prompt], 12)[0]
    first = loaded.tokenizer.decode([reference[0]])  # the reference's first token, as a bad word of one token
    assert loaded.tokenizer.encode(first, add_special_tokens=False) == [reference[0]]
    results = {r.request_id: r for r in Engine(loaded, page_size=4).generate([
        Request("ok", prompt_token_ids=prompt, sampling=greedy(max_tokens=12)),
        Request("bw", prompt_token_ids=prompt, sampling=greedy(max_tokens=12, bad_words=["t", first]))])}
    assert results["ok"].error is None and results["ok"].outputs[0].token_ids == reference
    banned = results["bw"].outputs[0].token_ids
    assert results["bw"].error is None and len(banned) == 12 and banned[0] != reference[0]
