"""The column contract of every operator: what a row may hold, what comes back, and the bad-row errors.

Input, one per row, the first non-null of: `prompt_token_ids` (list of ints), `messages` (chat
turns `{role, content}`, rendered with the tokenizer's chat template), `prompt` (text; UTF-8 bytes
are decoded). Optional `sampling_params`: a struct/dict (or a JSON object string) merged over the
operator's defaults. Null fields of a struct count as unset.

Output, added to every input column:
  generated_text        string          | list<string>
  generated_token_ids   list<int64>     | list<list<int64>>
  num_prompt_tokens     int64
  num_generated_tokens  int64           | list<int64>
  finish_reason         string          | list<string>      ("stop" or "length")
  completion_time_s     float64         (row reaching the engine -> its last sample finished)
  error                 string          (null when the row is fine; then the others are null)
The right-hand types ("list mode", one entry per sample) are used when the operator's default
`n` is above 1 or `list_outputs=True`; a job's schema is then the same for every row whatever its
own `n`. In scalar mode a row asking for n > 1 gets an error instead of a different schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.engine import InvalidRequestError, Result, SamplingParams
from batchgen.engine.chat import render_chat

PROMPT, MESSAGES, PROMPT_TOKEN_IDS = "prompt", "messages", "prompt_token_ids"
SAMPLING_PARAMS = "sampling_params"
PROMPT_COLUMNS = (PROMPT_TOKEN_IDS, MESSAGES, PROMPT)
ERROR = "error"
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                  "finish_reason", "completion_time_s", ERROR)


class MissingColumnError(ValueError):
    """The dataset has none of the prompt columns; raised before any inference."""


def check_input_columns(names: Sequence[str], where: str = "the input") -> None:
    """Fail fast when no row could ever hold a prompt, or when outputs would overwrite inputs."""
    if not any(c in names for c in PROMPT_COLUMNS):
        raise MissingColumnError(f"{where} has no prompt column: expected one of {list(PROMPT_COLUMNS)}, "
                                 f"found columns {list(names)}")
    clash = [c for c in OUTPUT_COLUMNS if c in names]
    if clash:
        raise MissingColumnError(f"{where} already has output column(s) {clash}; rename or drop them")


def output_schema(list_outputs: bool) -> pa.Schema:
    def maybe_list(t: pa.DataType) -> pa.DataType:
        return pa.list_(t) if list_outputs else t

    return pa.schema([
        ("generated_text", maybe_list(pa.string())),
        ("generated_token_ids", maybe_list(pa.list_(pa.int64()))),
        ("num_prompt_tokens", pa.int64()),
        ("num_generated_tokens", maybe_list(pa.int64())),
        ("finish_reason", maybe_list(pa.string())),
        ("completion_time_s", pa.float64()),
        (ERROR, pa.string()),
    ])


@dataclass
class ParsedRow:
    prompt_token_ids: list[int]
    sampling: SamplingParams


class RowParser:
    """Turns one input row into prompt token ids and sampling params, or an error string."""

    def __init__(self, tokenizer: Any, defaults: SamplingParams, list_outputs: bool) -> None:
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.list_outputs = list_outputs

    def parse(self, row: dict[str, Any]) -> ParsedRow | str:
        try:
            sampling = self._sampling(row.get(SAMPLING_PARAMS))
            return ParsedRow(self._prompt_ids(row), sampling)
        except InvalidRequestError as exc:
            return str(exc)

    def _sampling(self, value: Any) -> SamplingParams:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"sampling_params: not a JSON object: {exc}") from None
        if value is not None and not isinstance(value, dict):
            raise InvalidRequestError(f"sampling_params: expected a struct or JSON object, "
                                      f"got {type(value).__name__}")
        values = {k: _plain(v) for k, v in (value or {}).items() if v is not None}
        params = SamplingParams.from_dict(values, self.defaults)
        if params.n > 1 and not self.list_outputs:
            raise InvalidRequestError(f"sampling_params: n={params.n} needs list outputs; build the operator "
                                      "with list_outputs=True or a default n > 1")
        return params

    def _prompt_ids(self, row: dict[str, Any]) -> list[int]:
        ids, messages, text = (row.get(c) for c in PROMPT_COLUMNS)
        if ids is not None:
            return _token_ids(ids)
        if messages is not None:
            return self._render_chat(messages)
        if text is not None:
            return self._encode(_text(text, PROMPT))
        present = [c for c in PROMPT_COLUMNS if c in row]
        raise InvalidRequestError(f"missing prompt: the row has no value in {present}")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; give prompt_token_ids")
        return list(self.tokenizer.encode(text))

    def _render_chat(self, messages: Any) -> list[int]:
        messages = _plain(messages)
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(f"messages: expected a non-empty list of {{role, content}}, "
                                      f"got {type(messages).__name__}")
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"messages[{i}]: expected a struct with a string 'role'")
            content = _text(message.get("content"), f"messages[{i}].content")
            turns.append({"role": message["role"], "content": content})
        return render_chat(self.tokenizer, turns)


def _token_ids(value: Any) -> list[int]:
    value = _plain(value)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"prompt_token_ids: expected a list of integers, got {_describe(value)}")
    if not value:
        raise InvalidRequestError("prompt_token_ids: empty")
    negative = [t for t in value if t < 0]
    if negative:
        raise InvalidRequestError(f"prompt_token_ids: token {negative[0]} is negative")
    return value


def _text(value: Any, field: str) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"{field}: undecodable text, not valid UTF-8 ({exc.reason} at byte "
                                      f"{exc.start})") from None
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}: expected text, got {_describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{field}: undecodable text ({exc.reason} at character "
                                  f"{exc.start})") from None
    return value


def _plain(value: Any) -> Any:
    """numpy values (what Ray's default batch format hands over) as plain Python ones."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


@dataclass
class RowOutcome:
    """What one row gets back: a finished Result or an error (with the prompt length when known)."""

    result: Result | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None


def output_columns(outcomes: list[RowOutcome], list_outputs: bool) -> dict[str, pa.Array]:
    """The output columns for a batch, typed by `output_schema` so every block agrees."""
    cols: dict[str, list] = {name: [] for name in OUTPUT_COLUMNS}
    for o in outcomes:
        r = o.result
        error = o.error if o.error is not None else (r.error if r is not None else "no result")
        if error is not None:
            prompt_tokens = o.num_prompt_tokens if o.num_prompt_tokens is not None else (
                len(r.prompt_token_ids) if r is not None and r.prompt_token_ids else None)
            values = [None, None, prompt_tokens, None, None, None, error]
        else:
            one = (lambda xs: xs) if list_outputs else (lambda xs: xs[0])
            samples = r.outputs
            values = [one([c.text for c in samples]), one([c.token_ids for c in samples]),
                      len(r.prompt_token_ids), one([len(c.token_ids) for c in samples]),
                      one([c.finish_reason for c in samples]), r.completion_time, None]
        for name, value in zip(OUTPUT_COLUMNS, values):
            cols[name].append(value)
    schema = output_schema(list_outputs)
    return {name: pa.array(cols[name], type=schema.field(name).type) for name in OUTPUT_COLUMNS}
