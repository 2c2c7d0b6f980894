"""CPU stage: rows -> request ids, prompt token ids and resolved sampling params, bad rows -> `error`.

Loads only the tokenizer (no weights), so it scales on CPU nodes apart from the engine stages.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pyarrow as pa

from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.engine import RequestNormalizer, SamplingParams
from batchgen.operators import stage_columns as sc
from batchgen.operators.blocks import Block, names, rows, to_block, with_columns
from batchgen.operators.columns import ERROR, INPUT_COLUMNS, RowParser, check_input_columns, lists_outputs


class Tokenize:
    def __init__(self, model: str, sampling_params: dict[str, Any] | None = None, *,
                 storage_options: dict[str, Any] | None = None, list_outputs: bool | None = None,
                 chat_template: str | None = None) -> None:
        defaults = SamplingParams.from_dict(sampling_params)
        list_outputs = lists_outputs(list_outputs, defaults)
        # no weights here, so no vocabulary or context checks: the prefill engine runs those
        self.parser = RowParser(RequestNormalizer(load_tokenizer(model, storage_options), chat_template=chat_template),
                                defaults, list_outputs)
        self._ids = (f"{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())

    def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        check_input_columns(names(block), "a batch given to Tokenize")  # as `batchgen run` checks its input
        request_ids, ids, sampling, errors = [], [], [], []
        for row in rows(block, INPUT_COLUMNS):
            parsed = self.parser.parse(row)
            bad = isinstance(parsed, str)
            request_ids.append(None if bad else next(self._ids))
            ids.append(None if bad else parsed.prompt_token_ids)
            sampling.append(None if bad else parsed.sampling)
            errors.append(parsed if bad else None)
        return with_columns(block, {**sc.tokenized_columns(request_ids, ids, sampling),
                                    ERROR: pa.array(errors, type=pa.string())})
