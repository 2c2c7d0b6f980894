"""Parquet in and out of a job, keyed by each row's position in the input (`row_index`).

Reading numbers every row by its place in the input (files sorted by path, then row groups, then
rows), from the Parquet footers alone, so the numbering is the same in every run. Writing puts each
contiguous run of row indices into one file named after it, `part-<first>-<last>.parquet`, with
the rows sorted: files sorted by name are the input order, whichever task wrote them and in which
run. A file appears under its final name only once complete (written under a temporary name, then
moved), and a rewritten range lands on the same name.

That makes the output its own checkpoint. A restarted job scans the output folder: every complete
part file is a range of rows that is done; the reader skips those rows and the new files cover
only the gaps. Ray Data's CheckpointConfig records ids in a side store after each write, so a
crash between the data write and that record redoes (and writes twice) the rows in between; here
there is no second record to disagree with.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import posixpath
import re
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data import Datasink
from ray.data.block import Block, BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from batchgen.connectors.io import StorageError, filesystem, list_files

ROW_INDEX = "row_index"
_PART = re.compile(r"^part-(\d{12})-(\d{12})\.parquet$")
MAX_READ_TASKS = 200  # as Ray Data's read_op_min_num_blocks: more read tasks only add scheduling
FOOTER_READERS = 16  # input files whose footers are read at once when a job starts


@dataclass(frozen=True)
class RangeSet:
    """Sorted, disjoint inclusive ranges of row indices."""

    starts: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()

    @classmethod
    def of(cls, ranges: Iterable[tuple[int, int]]) -> RangeSet:
        merged: list[list[int]] = []
        for first, last in sorted(ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        return cls(tuple(m[0] for m in merged), tuple(m[1] for m in merged))

    @property
    def count(self) -> int:
        return sum(e - s + 1 for s, e in zip(self.starts, self.ends))

    def covers(self, first: int, last: int) -> bool:
        i = bisect.bisect_right(self.starts, first) - 1
        return i >= 0 and self.ends[i] >= last

    def mask(self, indices: np.ndarray) -> np.ndarray:
        """True where an index is in the set."""
        if not self.starts:
            return np.zeros(len(indices), dtype=bool)
        i = np.searchsorted(np.asarray(self.starts), indices, side="right") - 1
        return (i >= 0) & (indices <= np.asarray(self.ends)[np.maximum(i, 0)])


@dataclass(frozen=True)
class _Fragment:
    path: str
    row_group: int
    first_row: int  # row index of the row group's first row
    num_rows: int
    size_bytes: int


class IndexedParquetSource(Datasource):
    """Parquet files as a Ray dataset with a `row_index` column, skipping rows in `skip` (settable
    until the dataset runs: a resumed job sets it from the output's part files)."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None, skip: RangeSet = RangeSet(),
                 rows_per_block: int = 256) -> None:
        super().__init__()
        self.uri = uri
        self.fs, listed = list_files(uri, ".parquet", storage_options)
        files = list(listed)
        self.skip = skip
        self.rows_per_block = rows_per_block
        self.fragments: list[_Fragment] = []
        self.schema: pa.Schema | None = None
        next_row = 0
        # the footers read FOOTER_READERS at a time, in file order (an object store answers each in tens of ms:
        # one at a time, 100,000 small files took over an hour before the first row was read)
        with ThreadPoolExecutor(max_workers=max(1, min(FOOTER_READERS, len(files)))) as readers:
            metadata = list(readers.map(self._metadata, files))
        for path, meta in zip(files, metadata):
            schema = plain_schema(meta.schema.to_arrow_schema())
            if self.schema is None:
                self.schema = schema
            elif sorted(schema.names) != sorted(self.schema.names):  # (in any order: read in the first's)
                raise StorageError(f"input file {path!r} has columns {schema.names}, but {files[0]!r} has "
                                   f"{self.schema.names}; every input file needs the same columns")
            else:  # one type for every file's column, which every block is cast to: the job's part files share
                # a schema (a column null-typed in one file and strings in another, or structs whose rows set
                # different fields, would otherwise make part files that do not read back as one table)
                try:
                    self.schema = pa.unify_schemas([self.schema, schema], promote_options="permissive")
                except (pa.ArrowTypeError, pa.ArrowInvalid) as exc:
                    raise StorageError(f"input file {path!r} has column types that do not combine with those "
                                       f"of the files before it: {exc}") from None
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                self.fragments.append(_Fragment(path, g, next_row, group.num_rows, group.total_byte_size))
                next_row += group.num_rows
        for path, meta in zip(files, metadata):
            _check_values_fit(path, meta, self.schema)
        if ROW_INDEX in self.schema.names:
            raise StorageError(f"input {uri!r} already has a '{ROW_INDEX}' column; the job reserves it")
        self.num_rows = next_row
        # what a resumed job checks its input against: each file's name, size and rows (an edited or swapped file
        # with the same total of rows would otherwise pair old outputs with new prompts)
        rows_of = {path: 0 for path in files}
        for fragment in self.fragments:
            rows_of[fragment.path] += fragment.num_rows
        listing = [(posixpath.basename(path), listed[path].size, rows_of[path]) for path in files]
        self.digest = _digest(listing)
        # and their versions (ETag, mtime: `ListedFile`): a file edited in place keeps its size and rows as often as
        # not (one character of a prompt changed); a record key of its own, so that outputs recorded before it resume
        self.versions_digest = _digest([(posixpath.basename(path), listed[path].version) for path in files])

    def _metadata(self, path: str) -> pq.FileMetaData:
        try:
            with self.fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata
        except Exception as exc:
            raise StorageError(f"input file {path!r} is not readable Parquet: {exc}") from exc

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def estimate_inmemory_data_size(self) -> int:
        return sum(f.size_bytes for f in self.fragments)

    def read_dataset(self, **ray_remote_args: Any) -> ray.data.Dataset:
        """This source as a dataset of blocks of at most `rows_per_block` rows, however many rows it reads.

        Ray Data joins what a read task yields into blocks of up to 128 MiB and splits each task's output
        into k pieces, k picked from the block count it wants for the input's size (about 1 MiB each, at
        most 200 in all): left to it, blocks grow with the input (12,500 short rows each at 50,000 rows,
        33,000 at 400,000), and every engine task, write task and part file with them. Read tasks of at
        most `task_rows` rows and ceil(task_rows / rows_per_block) blocks asked per task keep them small.
        """
        groups, task_rows = self._plan()
        blocks = len(groups) * math.ceil(task_rows / self.rows_per_block)
        return ray.data.read_datasource(self, override_num_blocks=max(1, blocks), **ray_remote_args)

    def _plan(self) -> tuple[list[list[_Fragment]], int]:
        """The fragments still to read, packed in input order into read tasks of at most `task_rows` rows:
        the largest fragment's rows, or more when that would make over MAX_READ_TASKS tasks."""
        todo = [f for f in self.fragments if not self.skip.covers(f.first_row, f.first_row + f.num_rows - 1)
                and f.num_rows > 0]
        task_rows = max(self.rows_per_block, max((f.num_rows for f in todo), default=0),
                        math.ceil(sum(f.num_rows for f in todo) / MAX_READ_TASKS))
        groups: list[list[_Fragment]] = []
        rows = 0
        for fragment in todo:
            if groups and rows + fragment.num_rows <= task_rows:
                groups[-1].append(fragment)
                rows += fragment.num_rows
            else:
                groups.append([fragment])
                rows = fragment.num_rows
        return groups, task_rows

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """The planned read tasks (`parallelism`, Ray Data's wish, is left aside: see read_dataset)."""
        schema = self.schema.append(pa.field(ROW_INDEX, pa.int64()))
        tasks = []
        for fragments in self._plan()[0]:
            rows = sum(f.num_rows for f in fragments)
            meta = BlockMetadata(num_rows=rows, size_bytes=sum(f.size_bytes for f in fragments),
                                 exec_stats=None, input_files=tuple(dict.fromkeys(f.path for f in fragments)))
            read = _reader(self.fs, fragments, self.skip, self.rows_per_block, self.schema)
            tasks.append(ReadTask(read, meta, schema=schema, per_task_row_limit=per_task_row_limit))
        return tasks


def _reader(fs, fragments: list[_Fragment], skip: RangeSet, rows_per_block: int, schema: pa.Schema):
    """Decodes one block at a time, not a row group at a time: a row group (pyarrow writes up to a
    million rows per group by default) may hold far more rows than a read worker should hold. Every block has
    `schema`: its columns in that order and of those types, whatever its file has."""

    def read() -> Iterator[Block]:
        for frag in fragments:
            first = frag.first_row
            with fs.open(frag.path, "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=rows_per_block, row_groups=[frag.row_group]):
                    index = np.arange(first, first + batch.num_rows, dtype=np.int64)
                    first += batch.num_rows
                    table = plain_columns(pa.Table.from_batches([batch]).select(schema.names))
                    if not table.schema.equals(schema):
                        try:
                            table = table.cast(schema)
                        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:  # (no statistics to check)
                            raise StorageError(f"input file {frag.path!r}, row group {frag.row_group}: {_UNFIT} "
                                               f"({exc})") from None
                    table = table.append_column(ROW_INDEX, pa.array(index))
                    keep = ~skip.mask(index)
                    if not keep.all():
                        table = table.filter(pa.array(keep))
                    if table.num_rows:
                        yield table

    return read


_UNFIT = ("its values do not fit the type the input files' column types combine to; write the column with "
          "one type in every file")


def _digest(listing: list) -> str:
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:24]


def _check_values_fit(path: str, meta: pq.FileMetaData, schema: pa.Schema) -> None:
    """Refuse, before any row is read, a file whose values the combined `schema` cannot hold, by its footer's
    statistics: an int64 past 2^53 in a column another file has as double (NaNs) would otherwise fail a read task
    mid-job. Columns without statistics are checked as each block is cast (`_reader`)."""
    own = plain_schema(meta.schema.to_arrow_schema())
    for j in range(meta.num_columns):
        name = meta.schema.column(j).path
        leaf = _leaf_types(name.split("."), own, schema)
        if leaf is None or leaf[0] == leaf[1]:
            continue
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(j).statistics
            if stats is None or not stats.has_min_max:
                continue
            try:
                bounds = pa.array([stats.min, stats.max], leaf[0])
            except (TypeError, ValueError, pa.ArrowException):  # statistics pyarrow gives in another form: left to
                continue  # the read
            try:
                bounds.cast(leaf[1])
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise StorageError(f"input file {path!r}, column {name!r} ({leaf[0]}; {leaf[1]} across the input "
                                   f"files, values {stats.min} to {stats.max}): {_UNFIT} ({exc})") from None


def _leaf_types(parts: list[str], own: pa.Schema, combined: pa.Schema) -> tuple[pa.DataType, pa.DataType] | None:
    """The types of a Parquet leaf column (its dotted path's parts) in a file's schema and the combined one, through
    structs and lists; None where the path leads elsewhere (a map's keys, say: such columns are checked as cast)."""
    if parts[0] not in own.names or parts[0] not in combined.names:
        return None
    a, b = own.field(parts[0]).type, combined.field(parts[0]).type
    rest = parts[1:]
    while rest:
        if pa.types.is_struct(a) and pa.types.is_struct(b) and a.get_field_index(rest[0]) >= 0 \
                and b.get_field_index(rest[0]) >= 0:
            a, b, rest = a.field(rest[0]).type, b.field(rest[0]).type, rest[1:]
        elif _is_list(a) and _is_list(b) and len(rest) >= 2 and rest[0] == "list":
            a, b, rest = a.value_type, b.value_type, rest[2:]  # list.element (or list.item)
        else:
            return None
    return a, b


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with each dictionary-encoded column as its values' type: what the reader hands on (a pandas
    category in one input file and plain strings in another are one column of strings)."""
    return pa.schema([pa.field(f.name, f.type.value_type, f.nullable, f.metadata)
                      if pa.types.is_dictionary(f.type) else f for f in schema], metadata=schema.metadata)


def plain_columns(table: pa.Table) -> pa.Table:
    """`table` with its dictionary-encoded columns decoded (plain_schema)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(f.type.value_type))
    return table


@dataclass(frozen=True)
class PartFile:
    path: str
    first: int
    last: int


def part_name(first: int, last: int) -> str:
    return f"part-{first:012d}-{last:012d}.parquet"


def recover_output_parts(uri: str, storage_options: dict[str, Any] | None = None) -> list[PartFile]:
    """The complete part files under `uri`, sorted, after DELETING the leftovers of a crashed run.

    Removed: temporary files, files whose footer is not Parquet's or whose row count disagrees with
    their name, and files overlapping one kept before them (their rows get redone). A file that cannot be
    read raises (OSError) and nothing after it is removed.
    """
    fs, path = filesystem(uri, storage_options)
    kept: list[PartFile] = []
    for entry in _listing(fs, path):
        name = posixpath.basename(entry)
        if name.startswith(".part-") and name.endswith(".tmp"):
            fs.rm(entry)
            continue
        part = _part_file(entry)
        if part is None:
            continue
        if not _complete(fs, part) or (kept and part.first <= kept[-1].last):
            fs.rm(entry)
            continue
        kept.append(part)
    return kept


def written_parts(uri: str, storage_options: dict[str, Any] | None = None) -> list[PartFile]:
    """The part files under `uri` by name, sorted, checking and deleting nothing: safe to call while a job
    is writing there, since a part file appears under its name only once complete."""
    fs, path = filesystem(uri, storage_options)
    return [part for part in map(_part_file, _listing(fs, path)) if part is not None]


def _listing(fs, path: str) -> list[str]:
    fs.invalidate_cache(path)  # object-store listings are cached per filesystem instance
    return sorted(fs.ls(path, detail=False)) if fs.exists(path) else []


def _part_file(entry: str) -> PartFile | None:
    match = _PART.match(posixpath.basename(entry))
    return None if match is None else PartFile(entry, int(match.group(1)), int(match.group(2)))


def _complete(fs, part: PartFile) -> bool:
    """Whether the file is a whole part file: its footer is read first, then parsed in memory, so a read that
    fails (a network error, expired credentials) raises, while a file that is not Parquet or whose footer is torn
    is incomplete (deleting a finished file for a failed read would redo its rows and fail the job's last check)."""
    with fs.open(part.path, "rb") as f:
        size = f.size
        if size < 12:
            return False
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or length + 12 > size:
            return False
        f.seek(size - 8 - length)
        footer = f.read(length)
    try:
        metadata = pq.ParquetFile(pa.BufferReader(b"PAR1" + footer + tail)).metadata
    except (pa.ArrowInvalid, OSError):  # (OSError: pyarrow's for a footer it cannot deserialize, read in memory)
        return False
    return metadata.num_rows == part.last - part.first + 1


class OrderedParquetSink(Datasink[list[str]]):
    """Writes each contiguous run of `row_index` to its own `part-<first>-<last>.parquet`."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None,
                 rows_per_file: int | None = None,
                 on_written: Callable[[pa.Table], None] | None = None) -> None:
        self.fs, self.path = filesystem(uri, storage_options)
        self.rows_per_file = rows_per_file
        self.on_written = on_written  # called in the write task with each committed file's rows

    @property
    def min_rows_per_write(self) -> int | None:
        return self.rows_per_file

    def on_write_start(self, *args: Any, **kwargs: Any) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def write(self, blocks: Iterable[Block], ctx: Any) -> list[str]:
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return []
        table = pa.concat_tables(tables, promote_options="permissive").sort_by(ROW_INDEX)
        index = table.column(ROW_INDEX).to_numpy()
        breaks = np.flatnonzero(np.diff(index) != 1) + 1
        written = []
        for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), len(index)]):
            name = part_name(int(index[start]), int(index[stop - 1]))
            part = table.slice(start, stop - start)
            written.append(self._commit(part, name))
            if self.on_written is not None:
                self.on_written(part)
        return written

    def _commit(self, table: pa.Table, name: str) -> str:
        final = posixpath.join(self.path, name)
        temporary = posixpath.join(self.path, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        with self.fs.open(temporary, "wb") as f:
            pq.write_table(table, f)
        self.fs.mv(temporary, final)
        return final


def read_parquet_indexed(uri: str, storage_options: dict[str, Any] | None = None, *, rows_per_block: int = 256,
                         resume_from: str | None = None) -> ray.data.Dataset:
    """`ray.data.read_parquet` for jobs whose output must keep the input order without `preserve_order`:
    every row carries its input position in `row_index`. With `resume_from` (the output of an earlier
    run of the same job) rows already written there are not read again."""
    source = IndexedParquetSource(uri, storage_options, rows_per_block=rows_per_block)
    if resume_from is not None:
        source.skip = RangeSet.of((p.first, p.last) for p in recover_output_parts(resume_from, storage_options))
    return source.read_dataset()


def write_parquet_ordered(ds: ray.data.Dataset, uri: str, storage_options: dict[str, Any] | None = None, *,
                          rows_per_file: int | None = None) -> None:
    """Write a dataset read with `read_parquet_indexed` as part files named by row range: read back in
    file-name order (as `ray.data.read_parquet` lists them), the rows are in input order, whatever order
    the blocks finished in."""
    ds.write_datasink(OrderedParquetSink(uri, storage_options, rows_per_file))
