"""Row-indexed Parquet in and out: numbering, skipping written rows, part files, crash leftovers."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.connectors.indexed_parquet import (
    ROW_INDEX,
    IndexedParquetSource,
    OrderedParquetSink,
    RangeSet,
    part_name,
    read_parquet_indexed,
    recover_output_parts,
    write_parquet_ordered,
)
from batchgen.connectors.io import ListedFile, StorageError, listed_file


def test_range_set_merges_and_masks():
    done = RangeSet.of([(10, 19), (0, 4), (5, 6), (30, 30)])
    assert (done.starts, done.ends, done.count) == ((0, 10, 30), (6, 19, 30), 18)
    assert done.covers(11, 19) and not done.covers(6, 10)
    assert done.mask(np.array([0, 6, 7, 9, 10, 29, 30, 31])).tolist() == [1, 1, 0, 0, 1, 0, 1, 0]


def test_source_numbers_rows_across_files_and_skips_written_ones(tmp_path):
    for f, rows in enumerate((5, 4)):
        start = 0 if f == 0 else 5
        pq.write_table(pa.table({"v": list(range(start, start + rows))}), tmp_path / f"f{f}.parquet",
                       row_group_size=2)
    (tmp_path / "_SUCCESS").write_text("")
    source = IndexedParquetSource(str(tmp_path), rows_per_block=3)
    assert source.num_rows == 9 and source.columns == ["v"]
    source.skip = RangeSet.of([(0, 1), (3, 6)])  # row group [0, 1] is skipped whole, others in part
    tasks = source.get_read_tasks(parallelism=2)
    blocks = [block for task in tasks for block in task()]
    table = pa.concat_tables(blocks)
    assert table.column(ROW_INDEX).to_pylist() == [2, 7, 8]
    assert table.column("v").to_pylist() == [2, 7, 8]
    assert all(b.num_rows <= 3 for b in blocks)


def test_the_input_is_globbed_any_case_read_in_one_column_order_and_digested(tmp_path):
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), tmp_path / "f0.parquet")
    pq.write_table(pa.table({"b": ["z"], "a": [3]}), tmp_path / "f1.PARQUET")  # its columns in another order
    pq.write_table(pa.table({"a": [9], "b": ["q"]}), tmp_path / "g.parquet")
    source = IndexedParquetSource(str(tmp_path / "f*"))  # a glob: g.parquet left out
    assert source.num_rows == 3 and source.columns == ["a", "b"]
    (tmp_path / "day-1").mkdir()
    pq.write_table(pa.table({"a": [4], "b": ["w"]}), tmp_path / "day-1" / "x.parquet")
    (tmp_path / "day-1" / "_temporary").mkdir()
    (tmp_path / "day-1" / "_temporary" / "y.parquet").write_bytes(b"torn")
    assert IndexedParquetSource(str(tmp_path / "d*")).num_rows == 1  # a folder matched is read whole
    blocks = [block for task in source.get_read_tasks(parallelism=1) for block in task()]
    assert all(block.column_names == ["a", "b", ROW_INDEX] for block in blocks)
    assert pa.concat_tables(blocks).column("b").to_pylist() == ["x", "y", "z"]
    digest = source.digest
    assert IndexedParquetSource(str(tmp_path / "f*")).digest == digest
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "a longer prompt"]}), tmp_path / "f0.parquet")  # same rows
    assert IndexedParquetSource(str(tmp_path / "f*")).digest != digest


def test_a_file_rewritten_in_place_at_the_same_size_and_rows_changes_the_versions_digest(tmp_path):
    """One character of a prompt changed keeps a file's size and rows: the digest of names, sizes and rows alone let
    a rerun pair the old outputs with the new prompts. The listing's version (here the modification time; an ETag
    on S3) is digested too."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["hello there"]}), path)
    before = IndexedParquetSource(str(path))
    assert IndexedParquetSource(str(path)).versions_digest == before.versions_digest
    size = path.stat().st_size
    pq.write_table(pa.table({"prompt": ["jello there"]}), path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a later write, a coarse clock
    after = IndexedParquetSource(str(path))
    assert path.stat().st_size == size and after.digest == before.digest
    assert after.versions_digest != before.versions_digest


def test_a_listings_version_is_the_object_stores_etag_else_the_modification_time():
    assert listed_file({"size": 5, "ETag": '"abc"', "LastModified": "t"}) == ListedFile(5, '"abc"')
    assert listed_file({"size": 5, "mtime": 1.5}) == ListedFile(5, "1.5")
    assert listed_file({"size": None}) == ListedFile(0, "")


def test_a_globs_wildcards_skip_hidden_folders_unless_the_pattern_names_them(tmp_path):
    """A folder matched by a wildcard was read whole, and `**` read every file, without looking at the folders'
    names: a Spark writer's _temporary/ attempt beside the data was read as input (its rows twice)."""
    from batchgen.connectors.io import list_files

    for name in ("a.parquet", "_temporary/0/b.parquet", ".hidden/c.parquet", "sub/d.parquet", "sub/_x.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"PAR1")

    def listed(pattern):
        return sorted(p.removeprefix(str(tmp_path) + "/") for p in list_files(str(tmp_path / pattern), ".parquet")[1])

    assert listed("*") == listed("**/*.parquet") == ["a.parquet", "sub/d.parquet"]
    assert listed("*/*.parquet") == ["sub/d.parquet"]
    assert listed("*/_*.parquet") == ["sub/_x.parquet"]  # the pattern chooses them
    assert listed("_temporary/*/*.parquet") == ["_temporary/0/b.parquet"]  # named before the wildcards


def test_a_dictionary_column_in_one_file_and_plain_strings_in_another_read_as_one_column(tmp_path):
    """A pandas category column in one input file: its blocks and the other file's met in a write task, whose
    concatenation failed mid-job without naming either file."""
    pq.write_table(pa.table({"prompt": pa.array(["x", "y", "x"]).dictionary_encode()}), tmp_path / "f0.parquet")
    pq.write_table(pa.table({"prompt": pa.array(["z"], pa.large_string())}), tmp_path / "f1.parquet")
    source = IndexedParquetSource(str(tmp_path))
    assert source.schema.field("prompt").type == pa.large_string()  # what both files' strings fit in
    blocks = [block for task in source.get_read_tasks(parallelism=1) for block in task()]
    assert pa.concat_tables(blocks, promote_options="permissive").column("prompt").to_pylist() == ["x", "y", "x", "z"]
    pq.write_table(pa.table({"prompt": [7]}), tmp_path / "f2.parquet")  # numbers: no common type with text
    with pytest.raises(StorageError, match=r"input file '.*f2\.parquet' has column types that do not combine with "
                                           r"those of the files before it"):
        IndexedParquetSource(str(tmp_path))


def test_every_block_has_the_type_all_input_files_combine_to_so_the_part_files_read_back_as_one_table(tmp_path):
    """Each block kept its own file's types: a column null-typed in one file (all nulls, as pandas writes them)
    and strings in another, or struct rows setting different fields, made part files that did not read back
    together (an error, or a struct field silently dropped); a third file whose type combined with the first
    file's but not the second's passed the check and failed the job in a write task."""
    pq.write_table(pa.table({"note": pa.array([None], pa.null()), "sampling_params": [{"temperature": 0.5}]}),
                   tmp_path / "f0.parquet")
    pq.write_table(pa.table({"note": ["x"], "sampling_params": [{"max_tokens": 7}]}), tmp_path / "f1.parquet")
    source = IndexedParquetSource(str(tmp_path))
    assert source.schema.field("note").type == pa.string()
    blocks = [block for task in source.get_read_tasks(parallelism=1) for block in task()]
    assert all(block.schema.equals(source.schema.append(pa.field(ROW_INDEX, pa.int64()))) for block in blocks)
    out = tmp_path / "out"
    sink = OrderedParquetSink(str(out))
    sink.on_write_start()
    for block in blocks:  # one write task per block: a part file each
        sink.write([block], None)
    back = pq.read_table(out)
    assert back.column("sampling_params").to_pylist() == [{"temperature": 0.5, "max_tokens": None},
                                                           {"temperature": None, "max_tokens": 7}]
    assert back.column("note").to_pylist() == [None, "x"]
    pq.write_table(pa.table({"note": [3], "sampling_params": [{"top_k": 2}]}), tmp_path / "f2.parquet")
    with pytest.raises(StorageError, match=r"'.*f2\.parquet' has column types that do not combine"):
        IndexedParquetSource(str(tmp_path))


@pytest.mark.parametrize("column, big, fraction", [
    ("id", 2**53 + 1, float("nan")),
    ("sampling_params", {"seed": 2**60}, {"seed": 0.5}),
    ("labels", [2**60], [0.5]),
])
def test_values_the_combined_column_type_cannot_hold_are_refused_before_any_row_is_read(tmp_path, column, big,
                                                                                      fraction):
    """An int64 column in one file and a double one in another (pandas writes NaNs so) combine to double, and every
    block was cast to it in its read task: a value past 2^53 failed the task mid-job with Arrow's message alone. The
    footers' statistics now refuse it when the job starts, naming the file and column (nested ones too); values in
    range read as the combined type; a file without statistics fails its read task with the same words."""
    pq.write_table(pa.table({"prompt": ["a"], column: [big]}), tmp_path / "f0.parquet")
    pq.write_table(pa.table({"prompt": ["b"], column: [fraction]}), tmp_path / "f1.parquet")
    with pytest.raises(StorageError, match=rf"input file '.*f0\.parquet', column '{column}[.a-z]*' \(int64; double "
                                           r"across the input files, values \d+ to \d+\): its values do not fit the "
                                           r"type the input files' column types combine to; write the column with one "
                                           r"type in every file \(Integer value \d+ not in range"):
        IndexedParquetSource(str(tmp_path))
    pq.write_table(pa.table({"prompt": ["a"], column: [big]}), tmp_path / "f0.parquet", write_statistics=False)
    source = IndexedParquetSource(str(tmp_path))
    with pytest.raises(StorageError, match=r"input file '.*f0\.parquet', row group 0: its values do not fit the type"):
        [block for task in source.get_read_tasks(parallelism=1) for block in task()]
    small = 2**53 if column == "id" else {"seed": 2**53} if column == "sampling_params" else [2**53]
    pq.write_table(pa.table({"prompt": ["a"], column: [small]}), tmp_path / "f0.parquet")
    blocks = [block for task in IndexedParquetSource(str(tmp_path)).get_read_tasks(parallelism=1) for block in task()]
    values = pa.concat_tables(blocks).column(column).to_pylist()
    assert values[0] == (float(2**53) if column == "id" else {"seed": float(2**53)} if column == "sampling_params"
                         else [float(2**53)])


def test_statistics_pyarrow_gives_as_raw_bytes_leave_the_check_to_the_read(tmp_path):
    """A float16 column's footer statistics come back as bytes, which no array of its type is built from: taken for a
    value that does not fit, a float16 file beside a float32 one was refused."""
    pq.write_table(pa.table({"prompt": ["a"], "score": pa.array([1.5], pa.float16())}), tmp_path / "f0.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "score": pa.array([2.5], pa.float32())}), tmp_path / "f1.parquet")
    source = IndexedParquetSource(str(tmp_path))
    blocks = [block for task in source.get_read_tasks(parallelism=1) for block in task()]
    assert pa.concat_tables(blocks).column("score").to_pylist() == [1.5, 2.5]


def test_other_data_files_beside_the_parquet_ones_are_an_error_naming_them(tmp_path):
    """They were left out silently: a job over the folder reported complete without their rows."""
    pq.write_table(pa.table({"a": [1]}), tmp_path / "f0.parquet")
    (tmp_path / "more.jsonl").write_text('{"a": 2}\n')
    (tmp_path / "README.md").write_text("not data")
    with pytest.raises(StorageError, match=r"other data files .*more\.jsonl"):
        IndexedParquetSource(str(tmp_path))


def test_sink_writes_contiguous_runs_and_scan_drops_crash_leftovers(tmp_path):
    sink = OrderedParquetSink(str(tmp_path))
    block = pa.table({ROW_INDEX: [7, 3, 4, 8, 5], "x": ["h", "d", "e", "i", "f"]})
    written = sink.write([block], None)
    assert [p.rsplit("/", 1)[-1] for p in written] == [part_name(3, 5), part_name(7, 8)]
    assert pq.read_table(tmp_path / part_name(3, 5)).column("x").to_pylist() == ["d", "e", "f"]
    (tmp_path / f".{part_name(9, 9)}.abc.tmp").write_bytes(b"half")  # a write cut short
    (tmp_path / part_name(10, 11)).write_bytes(b"PAR1 truncated")  # unreadable footer
    pq.write_table(pa.table({ROW_INDEX: [4, 5]}), tmp_path / part_name(4, 5))  # overlaps 3-5: a race
    pq.write_table(pa.table({ROW_INDEX: [12]}), tmp_path / part_name(12, 13))  # row count != name
    (tmp_path / part_name(14, 14)).write_bytes(b"")  # empty
    whole = (tmp_path / part_name(3, 5)).read_bytes()
    length = int.from_bytes(whole[-8:-4], "little")  # the footer's bytes scrambled, its length and magic kept
    torn = whole[: -8 - length] + bytes(b ^ 0x5A for b in whole[-8 - length : -8]) + whole[-8:]
    (tmp_path / part_name(15, 17)).write_bytes(torn)
    parts = recover_output_parts(str(tmp_path))
    assert [(p.first, p.last) for p in parts] == [(3, 5), (7, 8)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [part_name(3, 5), part_name(7, 8)]


def test_a_part_file_that_cannot_be_read_now_is_not_deleted(tmp_path, monkeypatch):
    """A finished part file whose read failed for a moment (an object store's 503, a timeout) was deleted as a
    crash leftover: its rows were redone, and the job's closing check failed it."""
    import fsspec

    OrderedParquetSink(str(tmp_path)).write([pa.table({ROW_INDEX: [0, 1]})], None)
    local = fsspec.filesystem("file")
    opened = local.open

    def unreachable(path, *args, **kwargs):
        if path.endswith(".parquet"):
            raise OSError("503 Slow Down")
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(local, "open", unreachable)
    with pytest.raises(OSError, match="503"):
        recover_output_parts(str(tmp_path))
    monkeypatch.undo()
    assert [(p.first, p.last) for p in recover_output_parts(str(tmp_path))] == [(0, 1)]


def test_raw_ray_data_job_keeps_input_order_without_preserve_order(ray_cluster, tmp_path):
    import ray

    def slower_for_earlier_rows(batch: pa.Table) -> pa.Table:
        """Blocks of earlier rows take longer, so blocks finish in roughly reverse input order."""
        import time

        import pyarrow.compute as pc

        time.sleep(0.05 * (3 - int(batch.column("row_index")[0].as_py()) // 10))
        return batch.append_column("doubled", pc.multiply(batch.column("v"), 2))

    assert not ray.data.DataContext.get_current().execution_options.preserve_order
    source, out = tmp_path / "in", tmp_path / "out"
    source.mkdir()
    for f in range(3):
        values = list(range(f * 10, f * 10 + 10))
        pq.write_table(pa.table({"v": values}), source / f"in-{f}.parquet", row_group_size=5)
    ds = read_parquet_indexed(str(source), rows_per_block=5)
    ds = ds.map_batches(slower_for_earlier_rows, batch_size=5, batch_format="pyarrow", num_cpus=0.25)
    write_parquet_ordered(ds, str(out))
    table = pa.concat_tables(pq.read_table(part) for part in sorted(out.glob("part-*.parquet")))
    assert table.column("v").to_pylist() == list(range(30))
    assert table.column("doubled").to_pylist() == [2 * v for v in range(30)]
    # a second run resumes from the output: nothing left to read
    assert read_parquet_indexed(str(source), resume_from=str(out)).count() == 0


def test_blocks_are_rows_per_block_rows_however_many_rows_are_read(ray_cluster, tmp_path):
    # one row group per file, so one read task each: Ray Data joins what a task yields and splits it to
    # the block count it picks from the input's size, which makes blocks grow with the input
    for f, rows in enumerate((3000, 1000)):
        pq.write_table(pa.table({"v": list(range(rows))}), tmp_path / f"in-{f}.parquet")
    ds = read_parquet_indexed(str(tmp_path), rows_per_block=100)
    sizes = [entry.metadata.num_rows for bundle in ds.iter_internal_ref_bundles() for entry in bundle.blocks]
    assert sum(sizes) == 4000 and max(sizes) <= 100 and len(sizes) <= 60
