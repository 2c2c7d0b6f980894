"""The small files of a checkpoint (config, tokenizer, chat template), without torch or weights.

The CPU-only tokenize stage and the job's up-front model check need only these, so
this module imports neither torch nor the model code; connectors/checkpoint.py builds on it.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from batchgen.connectors.io import filesystem
from batchgen.connectors.presets import resolve_preset

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Small files copied next to config.json for transformers (tokenizers, chat templates, generation config).
METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
TEMPLATES_DIR = "additional_chat_templates"  # a tokenizer's named chat templates, one .jinja file each
GENERATION_CONFIG_FILE = "generation_config.json"
# what a checkpoint's generation config may recommend as sampling defaults, as vLLM's server takes them (transformers'
# max_new_tokens is max_tokens)
GENERATION_DEFAULTS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


def load_tokenizer(uri: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """The checkpoint's tokenizer alone (None when it ships none), reading no weights: for CPU-only
    tokenize stages, and to check a model URI before a job starts."""
    with _small_files(uri, storage_options) as (meta_dir, files, uri):
        return read_tokenizer(meta_dir, files, uri)


def load_config(uri: str | os.PathLike, storage_options: dict[str, Any] | None = None):
    """The checkpoint's transformers config, reading no weights: the model's limits (vocabulary, context
    length) for a process that checks requests but runs no engine."""
    from transformers import AutoConfig

    with _small_files(uri, storage_options) as (meta_dir, _, uri):
        try:
            return AutoConfig.from_pretrained(meta_dir)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{uri}/{CONFIG_FILE} is not a valid config: {exc}") from exc


def load_generation_defaults(uri: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults the checkpoint's generation_config.json recommends, as vLLM's OpenAI server applies them
    (its `--generation-config auto`): those of GENERATION_DEFAULTS set apart from transformers' own defaults, as
    SamplingParams fields. {} without the file."""
    from transformers import GenerationConfig

    with _small_files(uri, storage_options) as (meta_dir, files, uri):
        if GENERATION_CONFIG_FILE not in files:
            return {}
        try:
            given = GenerationConfig.from_pretrained(meta_dir).to_diff_dict()
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{uri}/{GENERATION_CONFIG_FILE} is not a valid generation config: {exc}") from exc
    defaults = {key: given[key] for key in GENERATION_DEFAULTS if given.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


@contextmanager
def _small_files(uri: str | os.PathLike, storage_options: dict[str, Any] | None) -> Iterator[tuple[str, set[str], str]]:
    """(local directory of the small files, the checkpoint's file names, the resolved URI)."""
    uri = resolve_preset(str(uri)) or str(uri)
    fs, root = filesystem(uri, storage_options)
    files = list_checkpoint_files(fs, root, uri)
    with metadata_dir(fs, root, files) as meta_dir:
        yield meta_dir, files, uri


def list_checkpoint_files(fs, root: str, uri: str) -> set[str]:
    """Names of the files directly inside the checkpoint directory."""
    try:
        if not fs.isdir(root):
            kind = "is a file, not a directory" if fs.isfile(root) else "does not exist"
            raise CheckpointError(f"checkpoint directory {uri!r} {kind}")
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {uri!r}: {exc}") from exc
    if CONFIG_FILE not in names:
        raise CheckpointError(f"checkpoint {uri!r} has no {CONFIG_FILE}")
    return names


@contextmanager
def metadata_dir(fs, root: str, files: set[str]) -> Iterator[str]:
    """A local directory holding config.json and the tokenizer files, as transformers wants a path:
    the checkpoint itself when local, else a temporary copy of its small files."""
    if isinstance(fs, LocalFileSystem):
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="batchgen-ckpt-") as tmp:
        for name in files:
            if name.endswith(METADATA_SUFFIXES):
                fs.get_file(posixpath.join(root, name), str(Path(tmp) / name))
        if TEMPLATES_DIR in files:
            (Path(tmp) / TEMPLATES_DIR).mkdir()
            for path in fs.ls(posixpath.join(root, TEMPLATES_DIR), detail=False):
                name = posixpath.basename(path.rstrip("/"))
                if name.endswith(".jinja"):
                    fs.get_file(path, str(Path(tmp) / TEMPLATES_DIR / name))
        yield tmp


def read_tokenizer(meta_dir: str, files: set[str], uri: str):
    if not files.intersection(TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(meta_dir)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"cannot load the tokenizer of {uri!r}: {exc}") from exc
