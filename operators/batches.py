"""Batch plumbing shared by the operators: any Ray batch format in, an Arrow table out."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from ray.data.block import BlockAccessor


def as_table(batch: Any) -> pa.Table:
    """A batch in whatever format map_batches handed over (pyarrow, pandas, dict of numpy) as Arrow."""
    if isinstance(batch, pa.Table):
        return batch
    return BlockAccessor.for_block(BlockAccessor.batch_to_block(batch)).to_arrow()


def column_values(table: pa.Table, name: str) -> list:
    """A column as Python values; all None when the table lacks it."""
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def rows(table: pa.Table, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each row's values of the columns in `names` that the table has."""
    present = [n for n in names if n in table.column_names]
    columns = [table.column(n).to_pylist() for n in present]
    return [dict(zip(present, values)) for values in zip(*columns)] if present else [{}] * table.num_rows


def with_columns(table: pa.Table, columns: dict[str, pa.Array]) -> pa.Table:
    """`table` with each column replaced (same position) or appended."""
    for name, values in columns.items():
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, values)
        else:
            table = table.append_column(name, values)
    return table
