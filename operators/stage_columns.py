"""The typed columns that carry a row between the split stages: tokenize -> prefill -> decode.

Each value travels once, in an Arrow type of its own: the request id and prompt ids from tokenize,
the resolved sampling params as a struct, and from prefill the prompt's KV as one binary value per
row (past the prefix pages an earlier row of the batch carries: a shared prefix travels once a batch)
laid over the prefill batch's single host buffer (no copy here; Ray writes the block into its
object store when the task returns, and the decode stage reads it back without a copy). The KV rides
in the block, so it lives exactly as long as the block: the driver owns a task's output blocks, so
it outlives the prefill actor, and Ray recomputes a lost block from its lineage.

The decode stage drops them all; `error` is the user-facing column, set by whichever stage first
finds the row bad, after which later stages pass the row through untouched.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from batchgen.engine.request import Request, TokenLogprob
from batchgen.engine.sampling_params import SamplingParams
from batchgen.engine.structured_outputs import StructuredOutputs
from batchgen.operators.blocks import Block, arrow_column, column_values

if TYPE_CHECKING:  # torch and the engine runtime load only in the engine stages, not in tokenize
    import torch

    from batchgen.engine import PrefillBatch, PrefillOutput

REQUEST_ID = "__batchgen_request_id"  # string: the engines' id for the row
PROMPT_IDS = "__batchgen_prompt_ids"  # list<int64>: the prompt as the engine sees it
SAMPLING = "__batchgen_sampling"  # struct: the row's resolved SamplingParams
KV = "__batchgen_kv"  # large_binary: the prompt's packed KV (empty where the row has an error)
KV_START = "__batchgen_kv_start"  # int64: the first prompt token in KV (the prefix before it: an earlier row's)
FIRST_TOKENS = "__batchgen_first_tokens"  # list<int64>: each sample's first token
FIRST_LOGPROBS = "__batchgen_first_logprobs"  # list<struct>: each sample's first logprob entry, or null
SUBMITTED_AT = "__batchgen_submitted_at"  # float64: when the prefill engine admitted the row
KV_LAYOUT = "__batchgen_kv_layout"  # string: what the KV is (dtype, layers, heads, head dims), checked by decode

_ARROW_OF_ANNOTATION = {
    "int": pa.int64(), "int | None": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str | None": pa.string(),
    "tuple[str, ...]": pa.list_(pa.string()), "tuple[str, ...] | None": pa.list_(pa.string()),
    "tuple[int, ...]": pa.list_(pa.int64()), "tuple[tuple[int, float], ...]": pa.map_(pa.int64(), pa.float64()),
}


def _struct_of(cls: type) -> pa.StructType:
    return pa.struct([(f.name, _ARROW_OF_ANNOTATION[f.type]) for f in dataclasses.fields(cls)])


_ARROW_OF_ANNOTATION["StructuredOutputs | None"] = _struct_of(StructuredOutputs)
SAMPLING_TYPE = _struct_of(SamplingParams)
LOGPROB_TYPE = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()),
                          ("top", pa.map_(pa.int64(), pa.float64()))])

ALL = (REQUEST_ID, PROMPT_IDS, SAMPLING, KV, KV_START, FIRST_TOKENS, FIRST_LOGPROBS, SUBMITTED_AT, KV_LAYOUT)


def tokenized_columns(request_ids: list[str | None], prompt_ids: list[list[int] | None],
                      sampling: list[SamplingParams | None]) -> dict[str, pa.Array]:
    return {REQUEST_ID: pa.array(request_ids, pa.string()),
            PROMPT_IDS: pa.array(prompt_ids, pa.list_(pa.int64())),
            SAMPLING: pa.array([None if s is None else s.to_dict() for s in sampling], SAMPLING_TYPE)}


def requests(block: Block) -> list[Request | None]:
    """Each row's engine request, None where tokenize found the row bad."""
    return [None if rid is None else Request(rid, ids, sampling=SamplingParams.from_dict(params))
            for rid, ids, params in zip(column_values(block, REQUEST_ID), column_values(block, PROMPT_IDS),
                                        column_values(block, SAMPLING))]


def prefill_columns(outputs: list[PrefillOutput | None], batch: PrefillBatch) -> dict[str, pa.Array]:
    """Per row its prefill output (None: no KV, the row has an error), `batch` the exporter's buffer that
    holds every output's KV in row order. The KV column is a view of that buffer."""
    sizes = [0 if o is None else o.kv.numel() for o in outputs]
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] != batch.kv_buffer.numel():
        raise ValueError(f"the rows' KV ({offsets[-1]} bytes) is not the batch buffer ({batch.kv_buffer.numel()})")
    kv = pa.Array.from_buffers(pa.large_binary(), len(sizes),
                               [None, pa.py_buffer(offsets), pa.py_buffer(batch.kv_buffer.numpy())])
    return {
        KV: kv,
        KV_START: pa.array([None if o is None else o.kv_start for o in outputs], pa.int64()),
        FIRST_TOKENS: pa.array([None if o is None else o.first_token_ids for o in outputs], pa.list_(pa.int64())),
        FIRST_LOGPROBS: pa.array([None if o is None else [None if lp is None else dataclasses.asdict(lp)
                                                          for lp in o.first_logprobs] for o in outputs],
                                 pa.list_(LOGPROB_TYPE)),
        SUBMITTED_AT: pa.array([None if o is None else o.submitted_at for o in outputs], pa.float64()),
        KV_LAYOUT: pa.array([None if o is None else o.kv_layout for o in outputs], pa.string()),
    }


def prefilled(block: Block) -> list[PrefillOutput | None]:
    """Each row's prefill output, its KV a view of the block's buffer; None where the row has no KV."""
    from batchgen.engine import PrefillOutput

    kv = _binary_views(arrow_column(block, KV))
    out: list[PrefillOutput | None] = []
    for request, packed, start, first, logprobs, submitted, layout in zip(
            requests(block), kv, column_values(block, KV_START), column_values(block, FIRST_TOKENS),
            column_values(block, FIRST_LOGPROBS), column_values(block, SUBMITTED_AT), column_values(block, KV_LAYOUT)):
        if request is None or first is None:
            out.append(None)
            continue
        out.append(PrefillOutput(request, packed, first, [_logprob(lp) for lp in logprobs], submitted, start, layout))
    return out


def prompt_lengths(block: Block) -> list[int | None]:
    return [None if ids is None else len(ids) for ids in column_values(block, PROMPT_IDS)]


def _binary_views(column: pa.ChunkedArray) -> list[torch.Tensor]:
    """Every value of a large_binary column as a uint8 tensor over Arrow's buffer (no copy)."""
    import torch

    out = []
    for chunk in column.chunks:
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
        raw = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
        with warnings.catch_warnings():  # a read-only object-store buffer: the engine only reads it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
        out.extend(data[int(start) : int(end)] for start, end in zip(offsets[:-1], offsets[1:]))
    return out


def _logprob(value: dict | None) -> TokenLogprob | None:
    if value is None:
        return None
    return TokenLogprob(value["token_id"], value["logprob"], dict(value["top"]))
