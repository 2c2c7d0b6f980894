"""The columns that carry a row between the split stages: tokenize -> prefill -> decode -> detokenize.

All are dropped by the detokenize stage; `error` is the user-facing column, set by whichever stage
first finds the row bad, after which later stages pass the row through untouched.
"""

from __future__ import annotations

import json

import pyarrow as pa

from batchgen.engine import SamplingParams

PROMPT_IDS = "__batchgen_prompt_ids"  # list<int64>: the prompt as the engine sees it
SAMPLING = "__batchgen_sampling"  # string: the row's resolved SamplingParams as JSON
KV_REF = "__batchgen_kv_ref"  # string: where prefill put the row's KV (a hand-off store ref)
GENERATED_IDS = "__batchgen_generated_ids"  # list<list<int64>>: one list per sample
FINISH_REASONS = "__batchgen_finish_reasons"  # list<string>
TEXT_ENDS = "__batchgen_text_ends"  # list<int64>: where a stop string cut each sample's text (null: no cut)
COMPLETION_S = "__batchgen_completion_s"  # float64: first engine admission -> last sample done

ALL = (PROMPT_IDS, SAMPLING, KV_REF, GENERATED_IDS, FINISH_REASONS, TEXT_ENDS, COMPLETION_S)
TYPES = {
    PROMPT_IDS: pa.list_(pa.int64()),
    SAMPLING: pa.string(),
    KV_REF: pa.string(),
    GENERATED_IDS: pa.list_(pa.list_(pa.int64())),
    FINISH_REASONS: pa.list_(pa.string()),
    TEXT_ENDS: pa.list_(pa.int64()),
    COMPLETION_S: pa.float64(),
}


def column(name: str, values: list) -> pa.Array:
    return pa.array(values, type=TYPES[name])


def sampling_to_json(params: SamplingParams) -> str:
    return json.dumps(params.to_dict())


def sampling_from_json(text: str) -> SamplingParams:
    return SamplingParams.from_dict(json.loads(text))
