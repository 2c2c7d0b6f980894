"""CPU stage: rows -> prompt token ids and resolved sampling params, bad rows -> `error`.

Loads only the tokenizer (no weights), so it scales on CPU nodes apart from the engine stages.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.engine import RequestNormalizer, SamplingParams
from batchgen.operators import stage_columns as sc
from batchgen.operators.blocks import Block, rows, to_block, with_columns
from batchgen.operators.columns import ERROR, PROMPT_COLUMNS, SAMPLING_PARAMS, RowParser


class Tokenize:
    def __init__(self, model: str, sampling_params: dict[str, Any] | None = None, *,
                 storage_options: dict[str, Any] | None = None, list_outputs: bool | None = None) -> None:
        defaults = SamplingParams.from_dict(sampling_params)
        list_outputs = defaults.n > 1 if list_outputs is None else bool(list_outputs)
        # no weights here, so no vocabulary or context checks: the prefill engine runs those
        self.parser = RowParser(RequestNormalizer(load_tokenizer(model, storage_options)), defaults, list_outputs)

    def __call__(self, batch: Any) -> Block:
        block = to_block(batch)
        ids, sampling, errors = [], [], []
        for row in rows(block, (*PROMPT_COLUMNS, SAMPLING_PARAMS)):
            parsed = self.parser.parse(row)
            bad = isinstance(parsed, str)
            ids.append(None if bad else parsed.prompt_token_ids)
            sampling.append(None if bad else sc.sampling_to_json(parsed.sampling))
            errors.append(parsed if bad else None)
        return with_columns(block, {sc.PROMPT_IDS: sc.column(sc.PROMPT_IDS, ids),
                                    sc.SAMPLING: sc.column(sc.SAMPLING, sampling),
                                    ERROR: pa.array(errors, type=pa.string())})
