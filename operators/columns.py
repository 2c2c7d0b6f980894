"""The column contract of every operator: what a row may hold, what comes back, and the bad-row errors.

Input, one per row, the first non-null of: `prompt_token_ids` (list of ints), `messages` (chat
turns `{role, content}`, rendered with the tokenizer's chat template), `prompt` (text; UTF-8 bytes
are decoded). Optional `sampling_params`: a struct/dict (or a JSON object string) merged over the
operator's defaults. Null fields of a struct count as unset. Optional, for `messages` rows (vLLM's chat
parameters, engine/chat.py): `chat_template_kwargs` (a struct/dict or JSON object string of template
variables, e.g. {"enable_thinking": false}), `add_generation_prompt` and `continue_final_message` (bool).

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.engine import InvalidRequestError, RequestNormalizer, Result, SamplingParams
from batchgen.engine.chat import CHAT_OPTION_FIELDS, ChatOptions
from batchgen.engine.request_normalizer import plain, sampling_params
from batchgen.operators.blocks import Undecodable

log = logging.getLogger(__name__)

PROMPT, MESSAGES, PROMPT_TOKEN_IDS = "prompt", "messages", "prompt_token_ids"
SAMPLING_PARAMS = "sampling_params"
PROMPT_COLUMNS = (PROMPT_TOKEN_IDS, MESSAGES, PROMPT)
INPUT_COLUMNS = (*PROMPT_COLUMNS, SAMPLING_PARAMS, *CHAT_OPTION_FIELDS)  # what RowParser reads of a row
ERROR = "error"
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens",
                  "finish_reason", "completion_time_s", ERROR)


class InputColumnsError(ValueError):
    """The dataset has no prompt column, or has a column an output would overwrite; raised before any
    inference."""


def check_input_columns(names: Sequence[str], where: str = "the input") -> None:
    """Fail fast when no row could ever hold a prompt, or when outputs would overwrite inputs."""
    if not any(c in names for c in PROMPT_COLUMNS):
        raise InputColumnsError(f"{where} has no prompt column: expected one of {list(PROMPT_COLUMNS)}, "
                                 f"found columns {list(names)}")
    clash = [c for c in OUTPUT_COLUMNS if c in names]
    if clash:
        raise InputColumnsError(f"{where} already has output column(s) {clash}; rename or drop them")


def lists_outputs(list_outputs: Any, defaults: SamplingParams) -> bool:
    """The output schema's mode: lists (a row's samples) as `list_outputs` asks, or where it is None when the
    sampling defaults ask for n > 1. ValueError naming a value that is not a bool ("false" was read as true), or
    false beside such defaults (every row would be an error)."""
    if list_outputs is None:
        return defaults.n > 1
    if not isinstance(list_outputs, bool):
        raise ValueError(f"list_outputs must be true, false or null, got {list_outputs!r}")
    if defaults.n > 1 and not list_outputs:
        raise ValueError(f"sampling n={defaults.n} needs list outputs; drop list_outputs=False")
    return list_outputs


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
    """One input row -> prompt token ids and sampling params, or the error text for that row.

    The checks are the engine's own (RequestNormalizer); this class only knows the column names and
    the output-schema rule that n > 1 needs list outputs.
    """

    def __init__(self, normalizer: RequestNormalizer, defaults: SamplingParams, list_outputs: bool) -> None:
        self.normalizer = normalizer
        self.defaults = defaults
        self.list_outputs = list_outputs

    def parse(self, row: dict[str, Any]) -> ParsedRow | str:
        # the sampling parameters, and the one prompt column used (the first given): another one's bytes do not matter
        prompt = next((name for name in PROMPT_COLUMNS if row.get(name) is not None), None)  # in precedence order
        for name in (SAMPLING_PARAMS, *CHAT_OPTION_FIELDS, prompt):
            if name is not None and isinstance(row.get(name), Undecodable):
                return f"{name}: undecodable text, not valid UTF-8 ({row[name].reason})"
        try:
            sampling = sampling_params(row.get(SAMPLING_PARAMS), self.defaults)
            if sampling.n > 1 and not self.list_outputs:
                raise InvalidRequestError(f"sampling_params: n={sampling.n} needs list outputs; build the operator "
                                          "with list_outputs=True or a default n > 1")
            chat = ChatOptions.from_values(*(plain(row.get(name), name) for name in CHAT_OPTION_FIELDS))
            ids = self.normalizer.prompt_ids(prompt_token_ids=row.get(PROMPT_TOKEN_IDS), messages=row.get(MESSAGES),
                                             prompt=row.get(PROMPT), chat=chat)
            return ParsedRow(ids, sampling)  # the engine checks the length, and the row keeps its token count
        except InvalidRequestError as exc:
            return str(exc)
        except Exception as exc:  # not a check's error but a fault reading this row: it fails alone, the job goes on
            log.exception("a row could not be read")
            return f"the row could not be read: {exc!r}"


@dataclass
class RowOutcome:
    """What one row gets back: a finished Result or an error (with the prompt length when known)."""

    result: Result | None = None
    error: str | None = None
    num_prompt_tokens: int | None = None


def report_finished(progress: Any, outcomes: list[RowOutcome], row_indexes: list[int | None]) -> None:
    """Tell a progress actor (`add_finished(row_indexes, tokens)`, fire and forget) about rows leaving an engine:
    their input positions (None for a row without one) and each one's generated tokens."""
    if progress is not None:
        tokens = [sum(len(c.token_ids) for c in o.result.outputs) if o.result is not None else 0 for o in outcomes]
        progress.add_finished.remote(row_indexes, tokens)


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
