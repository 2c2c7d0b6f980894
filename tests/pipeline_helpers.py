"""Shared by the operator, pipeline, S3 and CLI tests: workload, input files, expected outputs."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.connectors.demo_data import demo_prompts
from batchgen.engine import Request, SamplingParams
from batchgen.operators.engine_factory import load_engine

# greedy and a fixed length: comparable token for token with the engine alone and the reference runner
SAMPLING = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
ENGINE = {"kv_budget_bytes": 32 << 20, "host_kv_budget_bytes": 32 << 20}


def workload(n: int, seed: int = 3) -> list[str]:
    """Demo prompts, the longest first sentences only, so a whole test run stays a few seconds of compute."""
    return [p[:400] for p in demo_prompts(n, seed=seed)]


def write_input(uri: str, prompts: list[str], files: int = 3, row_group_size: int = 3,
                storage_options: dict | None = None) -> None:
    """`prompts` split over `files` Parquet files (small row groups: many blocks), plus an `id` column."""
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    per_file = -(-len(prompts) // files)
    for f in range(files):
        chunk = list(range(f * per_file, min(len(prompts), (f + 1) * per_file)))
        table = pa.table({"id": chunk, "prompt": [prompts[i] for i in chunk]})
        with fs.open(f"{root}/part-{f}.parquet", "wb") as out:
            pq.write_table(table, out, row_group_size=row_group_size)


def read_output(uri: str, storage_options: dict | None = None) -> pa.Table:
    """A job's output: its part files in name order, which must be input order."""
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    fs.invalidate_cache(root)
    parts = sorted(p for p in fs.ls(root, detail=False) if Path(p).name.startswith("part-"))
    tables = []
    for path in parts:
        with fs.open(path, "rb") as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables)


def engine_outputs(model: str, prompts: list[str] | list[list[int]], sampling: dict = SAMPLING) -> list[list[int]]:
    """What the engine alone generates for `prompts`, texts or token ids (the ground truth of the Ray runs)."""
    engine = load_engine(model, **ENGINE)
    params = SamplingParams.from_dict(sampling)
    results = engine.generate([Request(str(i), **({"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}),
                                       sampling=params) for i, p in enumerate(prompts)])
    assert all(r.error is None for r in results)
    return [r.outputs[0].token_ids for r in results]


def stop_string(text: str) -> str:
    """Two characters from the second half of a generated `text` (none of them a replacement character
    of a partly decoded byte sequence): a stop string that cuts that text part-way."""
    return next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i : i + 2])
