"""What a user sent -> what the engine runs, with one set of checks and one error text for every entry point.

A Parquet row, an OpenAI batch line and a Python `Request` all hold a prompt in one of three forms
(token ids, chat turns, text) plus sampling values. Each front end only maps its own container
(Arrow structs, JSON bodies) onto these forms; the checks, the tokenization and the error messages
live here, so the same bad prompt fails the same way wherever it comes from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from batchgen.engine.chat import DEFAULT_CHAT, ChatOptions, check_chat_template, render_chat
from batchgen.engine.sampling_params import INT64, InvalidRequestError, SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestNormalizer:
    """Tokenizes and checks prompts and sampling values for one model.

    `vocab_size` and `max_model_len` may be unknown (a tokenize-only stage has no weights); the
    engine, which knows both, runs the same checks again before admitting a prompt.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, max_model_len: int | None = None,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        if chat_template is not None:
            check_chat_template(chat_template)
        self.chat_template = chat_template

    def with_chat_template(self, chat_template: str | None) -> RequestNormalizer:
        """This normalizer, rendering messages with `chat_template` (None: the tokenizer's own)."""
        return RequestNormalizer(self.tokenizer, self.vocab_size, self.max_model_len, chat_template)

    def prompt_ids(self, *, prompt_token_ids: Any = None, messages: Any = None, prompt: Any = None,
                   chat: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """The first given of token ids, chat turns (rendered as `chat` says), text, as checked token ids."""
        given = next((name for name, value in (("prompt_token_ids", prompt_token_ids), ("messages", messages),
                                               ("prompt", prompt)) if value is not None), None)
        if given is None:
            raise InvalidRequestError("missing prompt: give prompt text, messages or prompt_token_ids")
        if given != "messages" and not chat.is_default:
            raise InvalidRequestError("add_generation_prompt, continue_final_message and chat_template_kwargs apply "
                                      f"to messages; this prompt is given as {given}")
        if given == "prompt_token_ids":
            ids = self._token_ids(prompt_token_ids)
        elif given == "messages":
            ids = self._in_vocabulary(render_chat(self.tokenizer, chat_turns(messages), self.chat_template, chat),
                                      given)
        else:
            ids = self._in_vocabulary(self._encode(text_value(prompt, "prompt")), given)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        return ids

    def _in_vocabulary(self, ids: list[int], given: str) -> list[int]:
        """Ids the tokenizer gave, checked against the model's vocabulary: a tokenizer with more tokens than the
        embedding table (an added token the checkpoint has no row for) failed the whole step's forward."""
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            token = next(t for t in ids if t >= self.vocab_size)
            raise InvalidRequestError(f"{given}: the tokenizer gives token {token}, outside the model's vocabulary "
                                      f"[0, {self.vocab_size})")
        return ids

    def check_length(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """A prompt must leave room for at least one generated token inside the context, and hold at most the
        request's max_prompt_tokens."""
        if sampling.max_prompt_tokens is not None and num_prompt_tokens > sampling.max_prompt_tokens:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens, over the limit of "
                                      f"{sampling.max_prompt_tokens} (max_prompt_tokens)")
        if self.max_model_len is not None and num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens, over the limit of "
                                      f"{self.max_model_len - 1} (context length {self.max_model_len})")

    def check_vocabulary(self, sampling: SamplingParams) -> None:
        """Token ids a request's sampling names (logit_bias, stop_token_ids) must be in the vocabulary."""
        if self.vocab_size is None or not (sampling.logit_bias or sampling.stop_token_ids):
            return
        for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("stop_token_ids", sampling.stop_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name}: token {bad[0]} is outside the vocabulary "
                                          f"[0, {self.vocab_size})")

    def _token_ids(self, value: Any) -> list[int]:
        # without a vocabulary (a tokenize stage), ids the split pipeline's 64-bit columns can carry
        upper = self.vocab_size if self.vocab_size is not None else INT64.stop
        if type(value) is list and value and set(map(type, value)) == {int}:  # the common case, in C passes
            if min(value) >= 0 and max(value) < upper:
                return list(value)
        value = plain(value, "prompt_token_ids")
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise InvalidRequestError(f"prompt_token_ids: expected a list of integers, got {describe(value)}")
        bad = [t for t in value if not 0 <= t < upper]
        if bad:
            where = f"[0, {upper})" if self.vocab_size is not None else "of 64-bit ids [0, 2**63)"
            raise InvalidRequestError(f"prompt_token_ids: token {bad[0]} is outside the vocabulary {where}")
        return value

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt is empty")
        if self.tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; give prompt_token_ids")
        return list(self.tokenizer.encode(text))


def sampling_params(values: Any, defaults: SamplingParams | None = None) -> SamplingParams:
    """Sampling values (a mapping, a JSON object string, or None) over `defaults`; null fields are unset."""
    if isinstance(values, str):
        try:
            values = json.loads(values)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, an integer too long to convert, nesting
            raise InvalidRequestError(f"sampling_params: not a JSON object: {exc}") from None
    if values is not None and not isinstance(values, Mapping):
        raise InvalidRequestError(f"sampling_params: expected a struct or JSON object, got {type(values).__name__}")
    return SamplingParams.from_dict({k: plain(v, k) for k, v in (values or {}).items()}, defaults)


def chat_turns(messages: Any) -> list[dict[str, str]]:
    """Chat messages as [{role, content}] text turns (OpenAI's content parts joined; developer -> system), with a
    message's `name`, a tool message's `tool_call_id` and an assistant message's reasoning (`reasoning` or
    `reasoning_content`, given to the template under both names: thinking models' templates print it in their
    think block) kept for the template, as vLLM passes them."""
    messages = plain(messages, "messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"messages: expected a non-empty list of {{role, content}}, got {describe(messages)}")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}]: expected an object with 'role' in {list(CHAT_ROLES)}")
        if message.get("tool_calls") or message.get("function_call"):
            raise InvalidRequestError(f"messages[{i}]: tool calls are not supported")
        role = "system" if message["role"] == "developer" else message["role"]
        turn = {"role": role, "content": _message_text(message.get("content"), i, role)}
        for key in TURN_FIELDS:
            if message.get(key) is not None:
                turn[key] = text_value(message[key], f"messages[{i}].{key}")
        given = next((key for key in REASONING_FIELDS if message.get(key) is not None), None)
        if given is not None and role == "assistant":
            turn["reasoning"] = turn["reasoning_content"] = text_value(message[given], f"messages[{i}].{given}")
        turns.append(turn)
    return turns


TURN_FIELDS = ("name", "tool_call_id")  # a message's fields besides role and content that reach the chat template
REASONING_FIELDS = ("reasoning", "reasoning_content")  # an assistant message's thinking, under either name


def _message_text(content: Any, i: int, role: str) -> str:
    if content is None and role == "assistant":  # OpenAI allows an assistant turn without content
        return ""
    if not isinstance(content, list):
        return text_value(content, f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(text for text in texts if text)  # empty parts left out, as vLLM joins them


def text_value(value: Any, field: str) -> str:
    """Text, or UTF-8 bytes decoded; anything else (or undecodable text) names the field."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"{field}: undecodable text, not valid UTF-8 ({exc.reason} at byte "
                                      f"{exc.start})") from None
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}: expected text, got {describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{field}: undecodable text ({exc.reason} at character {exc.start})") from None
    return value


def plain(value: Any, field: str = "value", depth: int = 0) -> Any:
    """numpy values (what Ray's default batch format hands over) as plain Python ones. A value nested deeper than
    MAX_NESTING lists and objects is refused, naming `field` (the checks after this recurse through it)."""
    if depth > MAX_NESTING:
        raise InvalidRequestError(f"{field}: nested deeper than {MAX_NESTING} levels")
    if isinstance(value, np.ndarray):
        return [plain(v, field, depth + 1) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v, field, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN_SCALARS for v in value):  # a token list: nothing inside to convert
            return list(value)
        return [plain(v, field, depth + 1) for v in value]
    return value


MAX_NESTING = 100  # lists and objects: a 40-level JSON schema of objects is 80
_PLAIN_SCALARS = frozenset({int, float, str, bool, type(None)})


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
