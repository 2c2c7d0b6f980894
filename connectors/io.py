"""fsspec helpers: one filesystem per URI, and the fail-fast checks a job runs before any inference."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.core import url_to_fs


class StorageError(RuntimeError):
    """A path that cannot be read or written; the message names the URI and the reason."""


def filesystem(uri: str, storage_options: dict[str, Any] | None = None
               ) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path inside it (no scheme).

    S3 storage options use s3fs names (`key`, `secret`, `endpoint_url`, `client_kwargs`, ...).
    """
    return url_to_fs(uri, **(storage_options or {}))


# options every fsspec filesystem takes through its base class's **kwargs (its listings cache, its instance cache)
GENERIC_STORAGE_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"})


def check_storage_options(uris: list[str], storage_options: dict[str, Any] | None) -> None:
    """ValueError naming a storage option that no filesystem of `uris` takes by name but that is close to one they
    do: fsspec hands options on and the filesystems drop what they do not use, so a mistyped `endpoint_ur` sent an
    S3 job to AWS itself. Names close to none pass (s3fs's `profile`, HTTP's `headers` reach their sessions through
    **kwargs). One set of options serves every URI of a job, so an S3 key beside a local output is fine."""
    if not storage_options:
        return
    taken = set(GENERIC_STORAGE_OPTIONS)
    for uri in uris:
        protocol = fsspec.core.split_protocol(str(uri))[0] or "file"
        try:
            taken |= _init_parameters(fsspec.get_filesystem_class(protocol))
        except (ImportError, ValueError):  # no implementation installed: its own error comes when it is opened
            continue
    for name in sorted(set(storage_options) - taken):
        near = difflib.get_close_matches(name, taken, n=1, cutoff=0.8)
        if near:
            raise ValueError(f"unknown storage option {name!r} (did you mean {near[0]!r}?) for "
                             f"{', '.join(sorted(set(map(str, uris))))}")


def _init_parameters(kind: type) -> set[str]:
    """The keyword parameters a filesystem class's constructors (its own and its bases') name."""
    names = set()
    for cls in kind.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            names |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names


# data files a job reads only in Parquet: met beside Parquet files, they are an error, not rows left out silently
OTHER_DATA_SUFFIXES = (".jsonl", ".json.gz", ".jsonl.gz", ".csv", ".csv.gz", ".tsv", ".orc", ".avro", ".feather",
                       ".arrow")


# what a storage listing tells of a file's contents changing: an object store's ETag (S3: the content's MD5 for a
# single-part upload) or generation, else the modification time (a local file rewritten in place)
VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "created")


@dataclass(frozen=True)
class ListedFile:
    size: int  # bytes
    version: str  # the first of VERSION_KEYS the listing gives, as text; "" where it gives none


def listed_file(info: dict[str, Any]) -> ListedFile:
    version = next((info[key] for key in VERSION_KEYS if info.get(key) is not None), "")
    return ListedFile(int(info.get("size") or 0), str(version))


def list_files(uri: str, suffix: str, storage_options: dict[str, Any] | None = None) -> tuple[
        fsspec.AbstractFileSystem, dict[str, ListedFile]]:
    """{path: size and version} of `uri` itself when it is a file, else of every file under it (or matching it, a glob
    pattern such as s3://bucket/prompts/*.parquet) whose name ends in `suffix` (any case), sorted by path."""
    fs, path = filesystem(uri, storage_options)
    fs.invalidate_cache(path)  # object-store listings are cached per filesystem instance
    try:
        if fsspec.core.has_magic(path):
            visible = {}
            root, chosen = _glob_root(path), _names_hidden(path)
            for match, info in fs.glob(path, detail=True).items():  # files, and folders read whole
                if _hidden(posixpath.relpath(match, root)) and not chosen:
                    continue  # a wildcard's match inside a Spark _temporary/ or a .hidden folder
                if info.get("type") == "directory":
                    visible.update(_visible_files(fs, match))
                else:
                    visible[match] = info
        elif fs.isfile(path):
            return fs, {path: listed_file(fs.info(path))}
        elif not fs.isdir(path):
            raise StorageError(f"input {uri!r} does not exist")
        else:
            visible = _visible_files(fs, path)
    except (OSError, PermissionError) as exc:
        raise StorageError(f"cannot read input {uri!r}: {exc}") from exc
    files = {p: listed_file(info) for p, info in sorted(visible.items()) if p.lower().endswith(suffix)}
    if not files:
        raise StorageError(f"input {uri!r} holds no '*{suffix}' files")
    others = [p for p in visible if p.lower().endswith(OTHER_DATA_SUFFIXES)]
    if others:
        raise StorageError(f"input {uri!r} holds other data files beside its '*{suffix}' files, which the job would "
                           f"leave out: {', '.join(sorted(others)[:3])}{' ...' if len(others) > 3 else ''}; "
                           f"convert them or move them elsewhere")
    return fs, files


def check_writable(uri: str, storage_options: dict[str, Any] | None = None) -> None:
    """Create the output folder and write and delete a probe file, so a bad output fails before inference."""
    fs, path = filesystem(uri, storage_options)
    probe = posixpath.join(path, f"_probe-{uuid.uuid4().hex}")
    try:
        if fs.isfile(path):
            raise StorageError(f"output {uri!r} is a file; it must be a folder")
        fs.makedirs(path, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        fs.rm(probe)
    except StorageError:
        raise
    except Exception as exc:  # botocore and friends raise their own types
        raise StorageError(f"output {uri!r} is not writable: {exc}") from exc


def write_atomically(fs, path: str, data: bytes) -> None:
    """`data` at `path`, written under a temporary name beside it, then moved over it: a reader sees the old file or
    the new one, never a part (a local rename replaces at once; an object store's copy appears whole). Several
    writers of one path each use a temporary name of their own."""
    folder = posixpath.dirname(path)
    temporary = posixpath.join(folder, f".{posixpath.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    fs.makedirs(folder, exist_ok=True)
    try:
        with fs.open(temporary, "wb") as f:
            f.write(data)
        fs.mv(temporary, path)
    except BaseException:
        with contextlib.suppress(Exception):  # the write's own error is the one to report
            fs.rm(temporary)
        raise


def _visible_files(fs, folder: str) -> dict[str, dict]:
    """{path: info} of the files under `folder`, hidden ones left out."""
    return {p: info for p, info in fs.find(folder, detail=True).items()
            if not _hidden(posixpath.relpath(p, folder))}


def _glob_root(pattern: str) -> str:
    """The folder a glob pattern's wildcards start below: its components up to the first with one."""
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if fsspec.core.has_magic(part))
    return "/".join(parts[:fixed]) or "/"


def _names_hidden(pattern: str) -> bool:
    """Whether a glob pattern's wildcard part names hidden components itself (`*/_*`, `*/.cache/*`): then it
    chooses them."""
    return _hidden(posixpath.relpath(pattern, _glob_root(pattern)))


def _hidden(relative: str) -> bool:
    """Files Hive/Spark writers leave beside data (_SUCCESS, .crc, _metadata)."""
    return any(part.startswith(("_", ".")) for part in relative.split("/"))
