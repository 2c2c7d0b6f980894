"""Batch plumbing shared by the operators: read columns from, and add columns to, any Ray batch format.

A batch becomes a block the way Ray itself would turn a UDF's return value into one: Arrow when
its columns have one type each, pandas when some column mixes types (a `prompt` column holding a
number in one row). Output columns are built as typed Arrow arrays either way, so every block of a
job agrees on the output schema (an all-null `error` column is still a string column).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa
from ray.data.block import BlockAccessor

Block = pa.Table | pd.DataFrame


def to_block(batch: Any) -> Block:
    if isinstance(batch, (pa.Table, pd.DataFrame)):
        return batch
    return BlockAccessor.batch_to_block(batch)


def num_rows(block: Block) -> int:
    return block.num_rows if isinstance(block, pa.Table) else len(block)


def names(block: Block) -> list[str]:
    return block.column_names if isinstance(block, pa.Table) else [str(c) for c in block.columns]


def column_values(block: Block, name: str) -> list:
    """A column as Python values (null -> None); all None when the block lacks it."""
    if name not in names(block):
        return [None] * num_rows(block)
    if isinstance(block, pa.Table):
        column = block.column(name)
        try:
            return column.to_pylist()
        except UnicodeDecodeError:  # text holding bytes that are not UTF-8 (Parquet does not check them): row by row
            return [_value_or_undecodable(column, i) for i in range(len(column))]
    return [None if _is_null(v) else v for v in block[name].tolist()]


def arrow_column(block: Block, name: str) -> pa.ChunkedArray:
    """A column as Arrow arrays, without converting its values (an Arrow-backed pandas column gives
    back its own arrays)."""
    if isinstance(block, pa.Table):
        return block.column(name)
    values = pa.array(block[name].array)
    return values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])


def rows(block: Block, wanted: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each row's values of the columns in `wanted` that the block has."""
    present = [n for n in wanted if n in names(block)]
    columns = [column_values(block, n) for n in present]
    return [dict(zip(present, values)) for values in zip(*columns)] if present else [{}] * num_rows(block)


def with_columns(block: Block, columns: dict[str, pa.Array]) -> Block:
    """`block` with each column replaced (same position) or appended."""
    if isinstance(block, pd.DataFrame):
        return block.assign(**{n: pd.arrays.ArrowExtensionArray(a) for n, a in columns.items()})
    for name, values in columns.items():
        if name in block.column_names:
            block = block.set_column(block.column_names.index(name), name, values)
        else:
            block = block.append_column(name, values)
    return block


def without_columns(block: Block, dropped: tuple[str, ...]) -> Block:
    present = [n for n in dropped if n in names(block)]
    return block.drop_columns(present) if isinstance(block, pa.Table) else block.drop(columns=present)


def _is_null(value: Any) -> bool:
    """pandas turns nulls into None, NaN or NA depending on the column's dtype."""
    return value is None or value is pd.NA or (isinstance(value, float) and value != value)


@dataclass(frozen=True)
class Undecodable:
    """A value (a prompt, a `messages` list, a `sampling_params` struct) holding text that is not UTF-8: its row's
    error (columns.RowParser)."""

    reason: str


def _value_or_undecodable(column: pa.ChunkedArray, index: int) -> Any:
    try:
        return column[index].as_py()
    except UnicodeDecodeError as exc:
        return Undecodable(f"{exc.reason} at byte {exc.start}")
