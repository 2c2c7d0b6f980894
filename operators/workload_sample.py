"""A job's workload as the planner sees it: the prompt lengths and output budgets of its input's first rows."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.connectors.io import list_files
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.planner import WorkloadShape
from batchgen.engine.request_normalizer import RequestNormalizer
from batchgen.engine.sampling_params import SamplingParams
from batchgen.operators.blocks import rows
from batchgen.operators.columns import INPUT_COLUMNS, RowParser

SAMPLED_ROWS = 2048  # input rows read to learn the workload's prompt and output lengths


class NoPromptToPlanFor(ValueError):
    """None of the sampled rows has a prompt the model can take (each such row gets its error when the job runs)."""


def input_workload(uri: str, loaded: LoadedModel, defaults: SamplingParams, storage_options: dict[str, Any],
                   chat_template: str | None = None) -> WorkloadShape:
    """The prompt lengths and max_tokens of the input's first rows, parsed as the pipeline parses them
    (rows it would reject are left out)."""
    fs, files = list_files(uri, ".parquet", storage_options)  # the files the job reads, in its order
    normalizer = RequestNormalizer(loaded.tokenizer, loaded.model.vocab_size, loaded.max_model_len, chat_template)
    parser = RowParser(normalizer, defaults, list_outputs=True)
    prompts, outputs, samples = [], [], []
    for file in files:
        with fs.open(file, "rb") as f:
            reader = pq.ParquetFile(f)
            names = [c for c in INPUT_COLUMNS if c in reader.schema_arrow.names]
            # the first rows only, of the columns parsed: not a multi-gigabyte file whole in the planning worker
            for batch in reader.iter_batches(batch_size=256, columns=names):
                for row in rows(pa.Table.from_batches([batch]), INPUT_COLUMNS):  # (text that is not UTF-8: the
                    # row's error, as in the job)
                    parsed = parser.parse(row)
                    if not isinstance(parsed, str):
                        prompts.append(len(parsed.prompt_token_ids))
                        outputs.append(parsed.sampling.max_tokens)
                        samples.append(parsed.sampling.n)
                if len(prompts) >= SAMPLED_ROWS:
                    break
        if len(prompts) >= SAMPLED_ROWS:
            break
    if not prompts:
        raise NoPromptToPlanFor(f"no row of {uri} has a prompt the model can take: nothing to plan for")
    return WorkloadShape(tuple(prompts[:SAMPLED_ROWS]), tuple(outputs[:SAMPLED_ROWS]), tuple(samples[:SAMPLED_ROWS]))
