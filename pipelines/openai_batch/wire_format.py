"""The OpenAI wire format: batch input lines in, engine requests out, and back to response objects.

Checks that need only the file (JSON, custom_id, method, url, model) run when a batch is created and
fail the whole batch with line numbers; checks on the body run when the line executes, so one bad
request lands in the error file while the others complete. The body checks on the prompt and the
sampling values are the engine's own (engine/request_normalizer.py): an OpenAI line and a Parquet row
with the same bad content get the same error text.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from batchgen.engine.chat import CHAT_OPTION_FIELDS, ChatOptions
from batchgen.engine.request import Completion, Request, Result, TokenLogprob
from batchgen.engine.request_normalizer import RequestNormalizer, sampling_params
from batchgen.engine.sampling_params import InvalidRequestError, SamplingParams

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
MAX_REPORTED_ERRORS = 100

# Body fields copied one to one into SamplingParams (from top_k on, vLLM extensions).
_SAMPLING_FIELDS = ("temperature", "top_p", "n", "seed", "stop", "frequency_penalty", "presence_penalty", "logit_bias",
                    "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "repetition_penalty",
                    "structured_outputs", "bad_words")
# Fields accepted and ignored: they change nothing about what is generated.
_IGNORED_FIELDS = ("model", "user", "store", "metadata", "service_tier", "stream_options",
                   "parallel_tool_calls")
# Fields accepted only at their neutral value: anything else would silently change the output.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # "auto" with no tools (the only way tools pass here) calls none
    "modalities": (None, ["text"]),
    "echo": (None, False),
    "suffix": (None, ""),
}
_CHAT_ONLY = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
              "modalities", "parallel_tool_calls", "store", "metadata", "service_tier", *CHAT_OPTION_FIELDS)
_COMPLETIONS_ONLY = ("prompt", "echo", "suffix", "best_of")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """The body of an OpenAI error response."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class BatchLine:
    """One validated input line; `index` is its position among the requests (0-based)."""

    index: int
    line_number: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class ParsedInput:
    lines: list[BatchLine]
    errors: list[dict[str, Any]]  # OpenAI batch error objects: code, message, param, line


def parse_batch_input(data: bytes, endpoint: str, served_model: str, max_requests: int) -> ParsedInput:
    """Validate a .jsonl batch file; every problem is reported with its 1-based line number."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}

    def fail(line_number: int | None, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line_number})

    for line_number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        problem = _check_line(raw, endpoint, served_model, seen, line_number)
        if problem is not None:
            fail(line_number, *problem)
            continue
        entry = json.loads(raw)
        seen[entry["custom_id"]] = line_number
        lines.append(BatchLine(len(lines), line_number, entry["custom_id"], entry["body"]))
    if not lines and not errors:
        fail(None, "empty_file", "the input file contains no requests")
    if len(lines) > max_requests:
        fail(None, "too_many_requests", f"the input file has {len(lines)} requests; this server accepts at "
             f"most {max_requests} per batch")
    if len(errors) > MAX_REPORTED_ERRORS:
        hidden = len(errors) - MAX_REPORTED_ERRORS
        errors = errors[:MAX_REPORTED_ERRORS]
        fail(None, "too_many_errors", f"{hidden} more errors not shown")
    return ParsedInput(lines, errors)


def _check_line(raw: bytes, endpoint: str, served_model: str, seen: dict[str, int],
                line_number: int) -> tuple[str, str, str | None] | None:
    """(code, message, param) for the first problem of one input line, or None when it is valid."""
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSON or UTF-8 errors, an integer too long to convert, nesting
        return "invalid_json_line", f"line {line_number} is not valid JSON: {exc}", None
    if not isinstance(entry, dict):
        return "invalid_json_line", f"line {line_number} is not a JSON object", None
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", f"line {line_number}: 'custom_id' must be a non-empty string", "custom_id"
    if custom_id in seen:
        return ("duplicate_custom_id", f"line {line_number}: custom_id {custom_id!r} already used on line "
                f"{seen[custom_id]}", "custom_id")
    if entry.get("method") != "POST":
        return ("invalid_method", f"line {line_number}: 'method' must be 'POST', got {entry.get('method')!r}",
                "method")
    if entry.get("url") != endpoint:
        return ("invalid_url", f"line {line_number}: 'url' must be the batch endpoint {endpoint!r}, got "
                f"{entry.get('url')!r}", "url")
    body = entry.get("body")
    if not isinstance(body, dict):
        return "invalid_body", f"line {line_number}: 'body' must be a JSON object", "body"
    if body.get("model") != served_model:
        return ("model_not_found", f"line {line_number}: model {body.get('model')!r} is not served here; "
                f"this server serves {served_model!r}", "body.model")
    return None


@dataclass
class LineRequest:
    """A request line as the engine runs it: prompt token ids and sampling values (`sampling`), and the
    values the line set itself (`own_sampling`, checked and normalised; the defaults fill in the rest)."""

    prompt_token_ids: list[int]
    own_sampling: dict[str, Any]
    sampling: SamplingParams


class RequestBuilder:
    """Turns a line's body into an engine Request, applying the server's default sampling values.

    Only the OpenAI mapping lives here (field names, which fields an endpoint takes, the values this
    server cannot honour); the prompt and the sampling values are checked by the engine's own
    RequestNormalizer and `sampling_params`, so a bad line fails with the same text as a Parquet row.
    """

    def __init__(self, endpoint: str, normalizer: RequestNormalizer, default_sampling: dict[str, Any]) -> None:
        self.endpoint = endpoint
        self.normalizer = normalizer  # carries the server's --chat-template
        self.defaults = sampling_params(default_sampling)
        self.default_max_tokens = default_sampling.get("max_tokens") is not None

    def build(self, request_id: str, body: dict[str, Any]) -> Request:
        """Raises InvalidRequestError naming the offending field."""
        line = self.resolve(body)
        return Request(request_id, prompt_token_ids=line.prompt_token_ids, sampling=line.sampling)

    def resolve(self, body: dict[str, Any]) -> LineRequest:
        """Every check `build` runs, keeping apart what the line set itself from the server's defaults (a
        Ray job takes the former per row and the latter as its defaults). Raises InvalidRequestError."""
        chat = self.endpoint == CHAT_ENDPOINT
        _check_fields(body, chat)
        values = {key: body.get(key) for key in _SAMPLING_FIELDS}
        values["max_tokens"] = _max_tokens(body, chat)
        values["logprobs"] = _logprobs(body, chat)
        if values["logprobs"] is not None and self.normalizer.tokenizer is None:  # its tokens' text is the answer's
            raise InvalidRequestError("logprobs needs the model's tokenizer (each token's text); this model has none")
        structured = _response_format(body.get("response_format"))
        if structured is not None:
            if values["structured_outputs"] is not None:
                raise InvalidRequestError("give one of 'response_format' and 'structured_outputs', not both")
            values["structured_outputs"] = structured
        options = ChatOptions.from_values(*(body.get(name) for name in CHAT_OPTION_FIELDS))
        prompt_ids = self.normalizer.prompt_ids(**_prompt(body, chat), chat=options)
        room = self.normalizer.max_model_len - len(prompt_ids)
        wanted = values["max_tokens"]
        # a prompt that fits with too many tokens asked for: OpenAI's and vLLM's 400 (a prompt that does not fit is
        # the engine's own error)
        if room > 0 and isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > room:
            raise InvalidRequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {wanted}. This model's maximum context "
                f"length is {self.normalizer.max_model_len} tokens and your request has {len(prompt_ids)} input "
                f"tokens ({wanted} > {self.normalizer.max_model_len} - {len(prompt_ids)})")
        if chat and values["max_tokens"] is None and not self.default_max_tokens:
            values["max_tokens"] = max(1, room)
        sampling = sampling_params(values, self.defaults)
        best_of = body.get("best_of")
        if best_of is not None and best_of != sampling.n:  # n as it resolved: a null n is the default
            raise InvalidRequestError("unsupported parameter 'best_of': only best_of equal to n is supported")
        own = {k: v for k, v in sampling.to_dict().items() if values.get(k) is not None}
        return LineRequest(prompt_ids, own, sampling)


def _check_fields(body: dict[str, Any], chat: bool) -> None:
    """A parameter set to null is unset, whatever it is (as OpenAI takes it: a client serialising its request model
    writes every optional field, `"reasoning_effort": null` included)."""
    wrong_endpoint = _COMPLETIONS_ONLY if chat else _CHAT_ONLY
    for key, value in body.items():
        if value is None:
            continue
        if key in wrong_endpoint:
            where = COMPLETIONS_ENDPOINT if chat else CHAT_ENDPOINT
            raise InvalidRequestError(f"parameter '{key}' belongs to {where}, not this batch's endpoint")
        if key in _NEUTRAL_VALUES and value not in _NEUTRAL_VALUES[key]:
            neutral = _NEUTRAL_VALUES[key][1]
            raise InvalidRequestError(f"unsupported parameter '{key}': only {neutral!r} is supported")
        known = (key in _SAMPLING_FIELDS or key in _IGNORED_FIELDS or key in _NEUTRAL_VALUES
                 or key in CHAT_OPTION_FIELDS
                 or key in ("messages", "prompt", "max_tokens", "max_completion_tokens", "logprobs",
                            "top_logprobs", "best_of", "response_format"))
        if not known:
            raise InvalidRequestError(f"unrecognized request parameter '{key}'")


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as structured_outputs: text -> None, json_object -> any JSON object,
    json_schema -> its schema (enforced whether or not `strict` is set, as vLLM does)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequestError("invalid 'response_format': type 'json_schema' needs "
                                      "'json_schema': {'name': ..., 'schema': {...}}")
        return {"json": spec["schema"]}
    raise InvalidRequestError(f"invalid 'response_format': 'type' must be 'text', 'json_object' or 'json_schema', "
                              f"got {kind!r}")


def _max_tokens(body: dict[str, Any], chat: bool) -> Any:
    value = body.get("max_completion_tokens") if chat else None
    return body.get("max_tokens") if value is None else value


def _logprobs(body: dict[str, Any], chat: bool) -> Any:
    """Chat asks with logprobs: bool + top_logprobs: int; completions with logprobs: int."""
    if not chat:
        return body.get("logprobs")
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise InvalidRequestError(f"invalid 'logprobs': must be a boolean, got {wanted!r}")
    if top is not None and not wanted:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs': true")
    return (0 if top is None else top) if wanted else None


def _prompt(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The RequestNormalizer argument for the body's prompt: chat `messages`, or the completions `prompt`
    (text or token ids, as OpenAI accepts, a one-element list of either too)."""
    name = "messages" if chat else "prompt"
    value = body.get(name)
    if value is None:
        raise InvalidRequestError(f"missing required parameter '{name}'")
    if chat:
        return {"messages": value}
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if not isinstance(value, list):
        return {"prompt": value}
    if any(isinstance(t, (str, list)) for t in value):
        raise InvalidRequestError("prompt: one prompt per request line; a list of prompts is not supported")
    return {"prompt_token_ids": value}


def response_body(endpoint: str, result: Result, model: str, tokenizer: Any) -> dict[str, Any]:
    """A chat.completion or text_completion object for a finished request."""
    completion_tokens = sum(len(c.token_ids) for c in result.outputs)
    usage = {"prompt_tokens": len(result.prompt_token_ids), "completion_tokens": completion_tokens,
             "total_tokens": len(result.prompt_token_ids) + completion_tokens}
    created = int(time.time())
    if endpoint == CHAT_ENDPOINT:
        choices = [_chat_choice(c, tokenizer) for c in result.outputs]
        return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage, "system_fingerprint": None, "service_tier": None}
    choices = [_text_choice(c, tokenizer) for c in result.outputs]
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage, "system_fingerprint": None}


def _chat_choice(c: Completion, tokenizer: Any) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None:
        content = [{**_chat_token(piece, lp.logprob), "top_logprobs": [_chat_token(p, v) for p, v in top]}
                   for piece, lp, top in _token_pieces(c.logprobs, tokenizer)]
        logprobs = {"content": content, "refusal": None}
    message = {"role": "assistant", "content": c.text, "refusal": None}
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}


def _chat_token(piece: str, logprob: float) -> dict[str, Any]:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def _text_choice(c: Completion, tokenizer: Any) -> dict[str, Any]:
    logprobs = None
    if c.logprobs is not None:
        pieces = list(_token_pieces(c.logprobs, tokenizer))
        tokens = [piece for piece, _, _ in pieces]
        logprobs = {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp, _ in pieces],
                    "top_logprobs": [_top_by_text(piece, lp.logprob, top) for piece, lp, top in pieces],
                    "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}
    return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def _top_by_text(piece: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, float]:
    """A completions token's alternatives by text, the sampled token's among them (OpenAI: "the API will always
    return the logprob of the sampled token, so there may be up to logprobs+1 elements"); where two tokens read the
    same (partial characters read ""), the likelier one's."""
    alternatives: dict[str, float] = {}
    for text, value in sorted([*top, (piece, logprob)], key=lambda item: -item[1]):
        alternatives.setdefault(text, value)
    return alternatives


def _token_pieces(logprobs: list[TokenLogprob], tokenizer: Any, context: int = 4):
    """(text the token adds, its logprob, [(alternative's text, logprob)]) per generated token.

    A token decoded alone loses its leading space in SentencePiece-style tokenizers, so each piece
    is what it adds after the few tokens before it. A character whose UTF-8 bytes span several byte tokens (CJK,
    emoji, accents) is the piece of the token completing it, the tokens before adding "" (a partial character
    decodes to U+FFFD, which is no text of the output: each token showed one, the character itself was lost).
    The pieces then concatenate to the text, and their bytes to its bytes. An alternative's text is what it adds
    with the tokens still waiting for their character ("" where it leaves one unfinished too).
    """
    ids = [lp.token_id for lp in logprobs]
    unit = 0  # the first token whose text is not out yet
    for i, lp in enumerate(logprobs):
        before = ids[max(0, unit - context):unit]
        prefix = tokenizer.decode(before, skip_special_tokens=True)
        waiting = ids[unit:i]

        def piece(token_id: int, before=before, prefix=prefix, waiting=waiting) -> str:
            return tokenizer.decode([*before, *waiting, token_id], skip_special_tokens=True)[len(prefix):]

        def shown(text: str, last: bool = i + 1 == len(ids)) -> str:  # a character going on in the next token: ""
            return "" if text.endswith("\ufffd") and not last else text

        text = shown(piece(lp.token_id))
        yield text, lp, [(shown(piece(t)), v) for t, v in lp.top.items()]
        if text or i + 1 == len(ids):
            unit = i + 1


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": new_id("req_"), "body": body}, "error": None}


def request_error_line(custom_id: str, message: str, param: str | None = None, status_code: int = 400,
                       type_: str = "invalid_request_error") -> dict[str, Any]:
    """A line the API rejected (HTTP 400) or failed (500), written to the error file."""
    body = error_object(message, type_, param=param)
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": new_id("req_"), "body": body}, "error": None}


_UNFINISHED = {"batch_expired": "This request could not be executed before the completion window expired.",
               "batch_cancelled": "This request was not executed because the batch was cancelled."}


def unfinished_line(custom_id: str, code: str | None, message: str | None = None) -> dict[str, Any]:
    """A line that never ran because its batch expired (batch_expired), was cancelled (batch_cancelled) or failed
    (the failure's code and `message`, which may be empty: an exception without one)."""
    why = message or _UNFINISHED.get(code) or f"This request was not executed: the batch stopped ({code})."
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": why}}


_WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def completion_window_seconds(window: Any, allow_custom: bool) -> int:
    """'24h' as OpenAI accepts; with allow_custom any '<n>s|m|h|d' (short windows make expiry testable)."""
    if window == "24h" or (allow_custom and isinstance(window, str) and _WINDOW.match(window)):
        match = _WINDOW.match(window)
        return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    allowed = "'24h' or '<n>s|m|h|d'" if allow_custom else "'24h'"
    raise InvalidRequestError(f"invalid 'completion_window' {window!r}: must be {allowed}")
