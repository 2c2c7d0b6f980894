"""Load an HF-format checkpoint directory (config.json, *.safetensors, tokenizer files) from any fsspec URI.

Local shards are memory-mapped (safetensors.safe_open) and copied tensor by tensor into a model built
on the meta device, so no weight is held twice; remote shards (s3://, memory://, ...) are streamed
one file at a time. Every problem (missing file, corrupt shard, wrong shape, missing tensor,
unsupported model_type) raises before any generation, naming the file, tensor or type.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes

from batchgen.connectors.checkpoint_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CheckpointError,
    list_checkpoint_files,
    metadata_dir,
    read_tokenizer,
)
from batchgen.connectors.host_memory import SharedHostWeights, place_in_arena
from batchgen.connectors.io import filesystem
from batchgen.connectors.presets import default_cache_dir, resolve_preset
from batchgen.engine.host_arena import host_arena
from batchgen.engine.models.layers import FusedExperts
from batchgen.engine.models.loaded_model import LoadedModel
from batchgen.engine.models.registry import ModelFamily, model_family
from batchgen.engine.models.tensor_parallel import TensorSlice, keep_tensor_shard, read_slice
from batchgen.engine.models.weight_names import WeightTarget, checkpoint_name, checkpoint_target

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# quantization settings some tools keep beside config.json instead of in its quantization_config
QUANTIZATION_FILES = ("quantize_config.json", "quant_config.json", "quantization_config.json")
QUANTIZATION_TENSORS = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_shape",
                                  "weight_scale", "weight_scale_inv", "weight_zero_point", "input_scale", "SCB",
                                  "absmax", "quant_map", "nested_absmax", "nested_quant_map"})
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def load_model(
    uri: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    storage_options: dict[str, Any] | None = None,
    weights: bool = True,
    expert_shard: tuple[int, int] | None = None,
    tensor_shard: tuple[int, int] | None = None,
    shared_host_weights: bool = False,
    experts_only: bool = False,
) -> LoadedModel:
    """Load the checkpoint at `uri` (local path, s3://, memory://, or a preset name such as "tiny-moe").
    `weights=False`: only its shape, on the "meta" device (config and tokenizer read, no weight file): what the
    planner needs of a model too large for this machine. `expert_shard=(rank, ranks)`: hold only that rank's
    contiguous share of every MoE layer's routed experts, reading no other expert's bytes (expert parallelism).
    `tensor_shard=(rank, ranks)`: hold only that rank's attention heads and MLP / expert columns
    (engine/models/tensor_parallel.py), reading only those slices of the checkpoint's tensors.
    `shared_host_weights` (host memory only): the weights live in a file mapping every process of the node shares
    (connectors/host_memory.py): the first load writes it, later ones, in any process, map it without reading the
    checkpoint's weights again. `experts_only`: only the routed experts' weights load (everything else stays on the
    meta device, uncut): with `tensor_shard`, a rank's 1/N of every expert's columns (engine/parallel/partition.py)."""
    torch_dtype = parse_dtype(dtype)
    uri = resolve_preset(str(uri)) or str(uri)
    fs, root = filesystem(uri, storage_options)
    files = list_checkpoint_files(fs, root, uri)
    sidecars = sorted(set(QUANTIZATION_FILES) & files)
    if sidecars:
        raise CheckpointError(f"checkpoint {uri!r} has {sidecars[0]}: quantized checkpoints are not supported; use a "
                              "float32, bfloat16 or float16 checkpoint")
    with metadata_dir(fs, root, files) as meta_dir:
        config, family = _read_config(meta_dir, uri)
        tokenizer = read_tokenizer(meta_dir, files, uri)
        eos_token_ids = _eos_token_ids(meta_dir, uri, files, config, tokenizer)
    shards, weight_map = _shard_paths(fs, root, files, uri)
    store = None
    if shared_host_weights and weights and torch.device(device).type == "cpu":
        identity = {"uri": uri, "files": _file_identities(fs, root, files), "dtype": str(torch_dtype),
                    "expert_shard": expert_shard, "tensor_shard": tensor_shard}
        store = SharedHostWeights(default_cache_dir().parent / "host-weights", identity)
    model, cuts = _build_empty(family, config, torch_dtype, torch.device(device if weights else "meta"),
                               expert_shard, tensor_shard, store.allocate if store else host_arena, experts_only)
    if weights and not (store and store.complete):
        try:
            _fill_weights(model, family, fs, shards, weight_map, uri, cuts)
        except BaseException:
            if store:
                store.abandon()
            raise
        if store:
            store.commit()
    return LoadedModel(model.eval(), config, tokenizer, eos_token_ids, int(config.max_position_embeddings),
                       torch_dtype, uri, host_weights_shared=store is not None)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def _read_config(meta_dir: str, uri: str) -> tuple[Any, ModelFamily]:
    """The transformers config and our model family; an unsupported model_type fails first, naming it."""
    from transformers import AutoConfig

    path = Path(meta_dir) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{uri}/{CONFIG_FILE} is not a JSON object: {exc}") from exc
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise CheckpointError(f"{uri}/{CONFIG_FILE} has a quantization_config (quant_method {method!r}): quantized "
                              "checkpoints are not supported; use a float32, bfloat16 or float16 checkpoint")
    family = model_family(model_type)
    heads = [a for a in raw.get("architectures") or () if isinstance(a, str) and "For" in a]
    if heads and not any(a.endswith("ForCausalLM") for a in heads):
        raise CheckpointError(f"{uri}/{CONFIG_FILE} names architecture {heads[0]!r}: its head is not a language "
                              "model's (only ...ForCausalLM checkpoints generate text)")
    try:
        return AutoConfig.from_pretrained(meta_dir), family
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{uri}/{CONFIG_FILE} is not a valid {model_type} config: {exc}") from exc


def _eos_token_ids(meta_dir: str, uri: str, files: set[str], config, tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos ids (what transformers' generate stops on), else config's, else the
    tokenizer's."""
    candidates = []
    if GENERATION_CONFIG_FILE in files:
        try:
            generation = json.loads((Path(meta_dir) / GENERATION_CONFIG_FILE).read_text())
            candidates.append(generation.get("eos_token_id"))
        except (ValueError, UnicodeDecodeError, AttributeError) as exc:  # JSONDecodeError; not an object
            raise CheckpointError(f"{uri}/{GENERATION_CONFIG_FILE} is not a JSON object: {exc}") from exc
    candidates.append(config.eos_token_id)
    candidates.append(tokenizer.eos_token_id if tokenizer is not None else None)
    for eos in candidates:
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def _shard_paths(fs, root: str, files: set[str], uri: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files: those the index names (each must exist), with the index's map of tensor -> file path
    (a tensor is read from the file it names, as transformers does); else every *.safetensors file, and None."""
    if INDEX_FILE in files:
        try:
            weight_map = json.loads(fs.cat_file(posixpath.join(root, INDEX_FILE)))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("its weight_map is not an object of tensor name -> file name")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{uri}/{INDEX_FILE} is not a valid safetensors index: {exc}") from exc
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if name not in files]
        if missing:
            raise CheckpointError(f"shard {missing[0]!r} named in {uri}/{INDEX_FILE} is missing")
    else:
        weight_map = None
        names = sorted(name for name in files if name.endswith(".safetensors"))
        if not names:
            raise CheckpointError(f"checkpoint {uri!r} has no *.safetensors weights")
    paths = {name: posixpath.join(root, name) for name in names}
    return list(paths.values()), None if weight_map is None else {t: paths[f] for t, f in weight_map.items()}


def _build_empty(family: ModelFamily, config, dtype: torch.dtype, device: torch.device,
                 expert_shard: tuple[int, int] | None, tensor_shard: tuple[int, int] | None,
                 allocate_host: Callable[[int], torch.Tensor], experts_only: bool = False,
                 ) -> tuple[torch.nn.Module, dict[str, TensorSlice]]:
    """The model with uninitialised weights in `dtype` on `device` (nothing is computed or allocated twice; on
    the host in one region from `allocate_host`; `experts_only`: only the routed experts' leave the meta device),
    cut to a rank's share when asked, and how each cut parameter reads its checkpoint tensors."""
    cuts = {}
    with torch.device("meta"), _no_weight_init():
        model = family.build(config)
        for module in model.modules():
            if expert_shard is not None and isinstance(module, FusedExperts):
                module.keep_shard(*expert_shard)
        if tensor_shard is not None:
            cuts = keep_tensor_shard(model, *tensor_shard, dense=not experts_only)
    if experts_only:
        experts = torch.nn.ModuleList(m for m in model.modules() if isinstance(m, FusedExperts)).to(dtype=dtype)
        if device.type == "cpu":
            place_in_arena(experts, allocate_host)
        else:
            experts.to_empty(device=device)
        return model.requires_grad_(False), cuts
    if device.type == "cpu":  # one huge-page arena for every weight (connectors/host_memory.py)
        place_in_arena(model.to(dtype=dtype), allocate_host)
        return model.requires_grad_(False), cuts
    tied = _tied_parameters(model)
    model = model.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
    for alias, source in tied:  # leaving the meta device gives every module its own Parameter: re-tie
        module, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(source))
    return model, cuts


def _file_identities(fs, root: str, files: set[str]) -> list[tuple[str, object, object]]:
    """(name, size, modification mark) of every checkpoint file: a rewritten checkpoint is another identity."""
    out = []
    for name in sorted(files):
        info = fs.info(posixpath.join(root, name))
        mark = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("created")
        out.append((name, info.get("size"), str(mark)))
    return out


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Skip torch.nn.init while building: the checkpoint overwrites every weight, and on the meta device
    the init ops would pull in torch's decomposition machinery (seconds of imports per process)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) of every parameter registered under more than one name (tied embeddings)."""
    first: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.append((name, first[id(param)]))
        else:
            first[id(param)] = name
    return tied


def _check_tied(first: str, name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    """A tied parameter filled by a second checkpoint tensor (both the embeddings and an lm_head.weight saved)
    must get the same values: a checkpoint whose head was trained apart from the embeddings while its config still
    ties them would otherwise load whichever tensor came last into both."""
    if name != first and not torch.equal(dest, tensor.to(dest.device, dest.dtype)):  # (read to the host: a CUDA
        # parameter compared with it raised torch's "two tensors on different devices")
        raise CheckpointError(f"the config ties the LM head to the embeddings (tie_word_embeddings), but the "
                              f"checkpoint's {first!r} and {name!r} differ: set tie_word_embeddings to false in "
                              f"config.json")


_Getter = Callable[[str, Any], torch.Tensor]  # (tensor name, index) -> that part of the tensor
_Shape = Callable[[str], tuple[int, ...]]


def _open_shard(fs, path: str) -> tuple[list[str], _Getter, _Shape]:
    """(tensor names, indexed getter, shapes); local files are memory-mapped (only the part asked for is read),
    remote ones read whole."""
    try:
        if isinstance(fs, LocalFileSystem):
            handle = safe_open(path, framework="pt", device="cpu")
            return (list(handle.keys()), lambda name, index: handle.get_slice(name)[index],
                    lambda name: tuple(handle.get_slice(name).get_shape()))
        tensors = load_safetensors_bytes(fs.cat_file(path))
        return list(tensors), lambda name, index: tensors[name][index], lambda name: tuple(tensors[name].shape)
    except Exception as exc:  # safetensors raises its own SafetensorError; fsspec backends their own types
        raise CheckpointError(f"cannot read safetensors file {path!r}: {exc}") from exc


@torch.no_grad()
def _fill_weights(model: torch.nn.Module, family: ModelFamily, fs, shards: list[str],
                  weight_map: dict[str, str] | None, uri: str, cuts: dict[str, TensorSlice]) -> None:
    every = dict(model.named_parameters())
    params = {name: p for name, p in every.items() if not p.is_meta}  # all of them, unless experts_only
    aliases = dict(_tied_parameters(model))  # a tied lm_head.weight fills embed_tokens.weight
    experts = {f"{name}.{param}": module for name, module in model.named_modules()
               if isinstance(module, FusedExperts) for param in ("gate_up_proj", "down_proj")}
    filled: dict[str, dict[tuple, int]] = {name: {} for name in params}  # param -> {(expert, half): numel}
    tied_from: dict[str, str] = {}  # a tied parameter -> the checkpoint tensor that filled it
    ignored = []
    for path in shards:
        names, get_part, shape_of = _open_shard(fs, path)
        for name in names:
            if weight_map is not None and weight_map.get(name) != path:
                continue  # the index reads this tensor from another file (or not at all)
            _check_not_quantized(name, path)
            target = checkpoint_target(name, family.checkpoint_renames)
            param_name = aliases.get(target.param, target.param)
            if param_name not in params:
                if param_name not in every:
                    ignored.append(name)
                continue
            shard = experts.get(param_name)
            rows = slice(None)
            if shard is not None:
                if target.expert is None:  # a fused [E, ...] tensor: this rank's experts' rows
                    rows = slice(shard.first_expert, shard.first_expert + shard.num_local_experts)
                else:
                    _check_expert(target.expert, shard.num_experts, name, path)
                    target = dataclasses.replace(target, expert=target.expert - shard.first_expert)
                    if not 0 <= target.expert < shard.num_local_experts:
                        continue  # another rank's expert
            dest = _destination(params[param_name], target, name, path)
            piece = cuts.get(param_name)
            if piece is not None and target.half is not None:  # one half of a fused gate_up: one block to cut
                piece = dataclasses.replace(piece, parts=1)
            tensor = _read_tensor(get_part, shape_of, name, path, rows, piece, target.expert is not None)
            if not tensor.dtype.is_floating_point or tensor.element_size() < 2:
                raise CheckpointError(f"tensor {name!r} in {path} is {tensor.dtype}: quantized weights are not "
                                      "supported; use a float32, bfloat16 or float16 checkpoint")
            if tuple(tensor.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"tensor {name!r} in {path}: expected shape {list(dest.shape)}, got {list(tensor.shape)}"
                )
            if param_name in aliases.values():
                _check_tied(tied_from.setdefault(param_name, name), name, dest, tensor)
            elif (target.expert, target.half) in filled[param_name]:
                raise CheckpointError(f"tensor {name!r} in {path} is in the checkpoint twice (an earlier file holds "
                                      "it too): which copy transformers would load is not defined without an index")
            dest.copy_(tensor)
            filled[param_name][(target.expert, target.half)] = dest.numel()
    _check_complete(params, filled, uri, {name: shard.first_expert for name, shard in experts.items()})
    if ignored:
        logger.warning("%s: ignored %d checkpoint tensors the model does not use, e.g. %s",
                       uri, len(ignored), ignored[:3])


def _check_not_quantized(name: str, path: str) -> None:
    """A quantization method's own tensors (GPTQ / AWQ packed weights and their scales, compressed-tensors, FP8
    scales, bitsandbytes state), which a checkpoint may carry without a quantization_config."""
    parts = name.split(".")
    if parts[-1] in QUANTIZATION_TENSORS or "quant_state" in parts:
        raise CheckpointError(f"tensor {name!r} in {path} belongs to a quantized checkpoint ({parts[-1]!r}): "
                              "quantized checkpoints are not supported; use a float32, bfloat16 or float16 checkpoint")


def _destination(param: torch.Tensor, target: WeightTarget, name: str, path: str) -> torch.Tensor:
    """The view of `param` a checkpoint tensor fills: all of it, or one expert's (gate or up) rows."""
    if target.expert is None:
        return param
    rows = param[target.expert]
    return rows if target.half is None else rows.chunk(2, dim=0)[target.half]


def _check_expert(expert: int, num_experts: int, name: str, path: str) -> None:
    if expert >= num_experts:
        raise CheckpointError(
            f"tensor {name!r} in {path}: expert {expert} is out of range (the config has {num_experts} experts)"
        )


def _read_tensor(get_part: _Getter, shape_of: _Shape, name: str, path: str, rows: slice, piece: TensorSlice | None,
                 per_expert: bool) -> torch.Tensor:
    """Tensor `name`'s `rows` (expert parallel), or the rank's slice `piece` of it (tensor parallel; a per-expert
    tensor lacks the fused parameter's expert dim)."""
    try:
        if piece is None:
            return get_part(name, rows)
        return read_slice(get_part, name, piece, int(per_expert), shape_of(name))
    except Exception as exc:  # a truncated or corrupt shard fails here for mmapped files
        raise CheckpointError(f"cannot read tensor {name!r} from {path}: {exc}") from exc


def _check_complete(params: dict[str, torch.nn.Parameter], filled: dict[str, dict[tuple, int]],
                    uri: str, first_expert: dict[str, int]) -> None:
    """`first_expert`: the global id of each expert parameter's first local expert (a rank's share)."""
    missing = []
    for name, param in params.items():
        parts = filled[name]
        if (None, None) in parts or sum(parts.values()) == param.numel():
            continue
        per_expert = Counter()
        for (expert, _), numel in parts.items():
            if expert is not None:
                per_expert[expert] += numel
        if per_expert:
            first = first_expert.get(name, 0)
            absent = [first + e for e in range(param.shape[0]) if per_expert[e] < param[0].numel()]
            missing.append(f"{checkpoint_name(name)} (experts {absent})")
        else:
            missing.append(checkpoint_name(name))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {uri!r} is missing tensor(s) {', '.join(missing[:5])}{more}")
