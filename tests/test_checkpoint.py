"""The checkpoint loader: sharded checkpoints, tokenizer / eos / context metadata, and every bad input
failing at load time with an error naming the file, tensor or type."""

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    ALL_ARCHITECTURES,
    TOKENIZER_VOCAB,
    copy_to_memory,
    prompts,
    save_tiny_checkpoint,
    tiny_config,
    tiny_tokenizer,
)

from batchgen.connectors import checkpoint as checkpoint_module
from batchgen.connectors.checkpoint import CheckpointError, load_model
from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.connectors.host_memory import SharedHostWeights, mapped_file
from batchgen.engine.models.registry import UnsupportedModelError, supported_model_types
from batchgen.engine.reference import ReferenceRunner

SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A tiny Mixtral with eos id 2, a generation config and a tokenizer; shared read-only."""
    directory = tmp_path_factory.mktemp("mixtral")
    save_tiny_checkpoint("mixtral", directory, eos_token_id=2, bos_token_id=1, vocab_size=TOKENIZER_VOCAB)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def _copy(src, dst):
    dst.mkdir(exist_ok=True)
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


def _rewrite_shard(directory, edit) -> None:
    tensors = load_file(str(directory / SHARD))
    edit(tensors)
    save_file(tensors, str(directory / SHARD))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_metadata_and_tokenizer(mixtral_dir, where):
    uri = mixtral_dir if where == "local" else copy_to_memory(mixtral_dir, "test-checkpoint-meta")
    loaded = load_model(uri)
    assert loaded.eos_token_ids == (2,)
    assert loaded.max_model_len == 512
    assert loaded.dtype == torch.float32
    assert loaded.config.model_type == "mixtral"
    text = 'the cat: {"n": [1, 2.5], "ok": true}'
    ids = loaded.tokenizer.encode(text)
    assert ids[0] == 1 and loaded.tokenizer.decode(ids, skip_special_tokens=True) == text
    assert load_tokenizer(uri).encode(text) == ids


@pytest.mark.parametrize("where", ["local", "memory"])
def test_named_chat_templates_come_with_the_tokenizer(tmp_path, where):
    """transformers saves a tokenizer's named templates as additional_chat_templates/<name>.jinja: a remote
    checkpoint's copy of its small files left that folder out, and the named templates were lost."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = {"default": "{{ 'D' }}", "tool_use": "{{ 'T' }}"}
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama").to_dict()))
    uri = tmp_path if where == "local" else copy_to_memory(tmp_path, "test-named-templates")
    assert load_tokenizer(uri).chat_template == {"default": "{{ 'D' }}", "tool_use": "{{ 'T' }}"}


def test_no_tokenizer_gives_none(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.tokenizer is None and loaded.eos_token_ids == ()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_sharded_checkpoint_with_index(tmp_path, where):
    hf = save_tiny_checkpoint("qwen2_moe", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    uri = tmp_path / "sharded" if where == "local" else copy_to_memory(tmp_path / "sharded", "test-sharded")
    sharded, single = load_model(uri).model, load_model(tmp_path / "one").model
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_tensor_in_two_shards_is_read_from_the_file_the_index_names(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    names = list(load_file(str(directory / SHARD)))
    stale = {"model.norm.weight": torch.zeros(64)}  # a stale copy in another file, which the index does not name
    save_file(stale, str(directory / "extra.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: SHARD for name in names}}))
    loaded, original = load_model(directory).model, load_model(mixtral_dir).model
    for (name, a), (_, b) in zip(loaded.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name
    (directory / "model.safetensors.index.json").unlink()  # no index: two copies, neither of them the one to use
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' in .*model\.safetensors is in the "
                                              r"checkpoint twice"):
        load_model(directory)


def test_an_index_whose_weight_map_is_not_an_object_is_a_checkpoint_error(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [SHARD]}))
    with pytest.raises(CheckpointError, match="is not a valid safetensors index: its weight_map is not an object"):
        load_model(directory)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere.* does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"memory://absent-ckpt.* does not exist"):
        load_model("memory://absent-ckpt")


def test_missing_config(mixtral_dir, tmp_path):
    (_copy(mixtral_dir, tmp_path / "ckpt") / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        load_model(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_corrupt_config(mixtral_dir, tmp_path, name):
    (_copy(mixtral_dir, tmp_path / "ckpt") / name).write_text('{"model_type": "mixtral", ')
    with pytest.raises(CheckpointError, match=rf"ckpt/{name.replace('.', '[.]')} is not a JSON object"):
        load_model(tmp_path / "ckpt")


def test_no_weights(mixtral_dir, tmp_path):
    (_copy(mixtral_dir, tmp_path / "ckpt") / SHARD).unlink()
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors weights"):
        load_model(tmp_path / "ckpt")


def test_shard_named_in_index_is_missing(tmp_path):
    hf = save_tiny_checkpoint("llama", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{shard.name}' named in .*model\.safetensors\.index\.json"):
        load_model(tmp_path / "sharded")


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(mixtral_dir, tmp_path, where, damage):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    data = (directory / SHARD).read_bytes()
    (directory / SHARD).write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a tensor file" * 9)
    uri = directory if where == "local" else copy_to_memory(directory, f"test-corrupt-{damage}")
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_model(uri)


def test_wrong_shape(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_shard(directory, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*: expected shape \[32, 64\], got \[16, 64\]"):
        load_model(directory)


def test_wrong_expert_shape(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    _rewrite_shard(directory, lambda t: t.__setitem__(name, torch.zeros(96, 32)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' .*expected shape \[96, 64\], got \[96, 32\]"):
        load_model(directory)


def test_missing_tensor(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    _rewrite_shard(directory, lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.0\.post_attention_layernorm"):
        load_model(directory)


def test_missing_expert(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    _rewrite_shard(directory, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w1.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(experts \[3\]\)"):
        load_model(directory)
    # a rank holding experts 2-3 of 4 names the expert by its id in the checkpoint, not its index on the rank (1)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(experts \[3\]\)"):
        load_model(directory, expert_shard=(1, 2))


def test_expert_beyond_config(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    name = "model.layers.0.block_sparse_moe.experts.4.w2.weight"
    _rewrite_shard(directory, lambda t: t.__setitem__(name, torch.zeros(64, 96)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' .*expert 4 is out of range .*4 experts"):
        load_model(directory)


@pytest.mark.parametrize("model_type", ["gpt2", "not_a_model"])
def test_unsupported_model_type(mixtral_dir, tmp_path, model_type):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(UnsupportedModelError, match=rf"unsupported model_type '{model_type}'; supported: .*mixtral"):
        load_model(directory)
    assert {"llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"} <= set(
        supported_model_types())


FULL, SLIDING = ["full_attention"] * 2, ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("arch,fields", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    # Mixtral and Qwen3-MoE window every layer whatever layer_types says: transformers never reads it there
    ("mixtral", dict(sliding_window=16, layer_types=FULL)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16, layer_types=FULL)),
])
def test_a_sliding_window_transformers_applies_is_refused(tmp_path, arch, fields):
    tiny_config(arch, **fields).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / SHARD))
    with pytest.raises(UnsupportedModelError, match=rf"{arch}: sliding-window attention \(sliding_window=16\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch,fields", [
    ("llama", dict(sliding_window=16, layer_types=SLIDING)),  # transformers' Llama has no window at all
    ("mixtral", dict(sliding_window=512)),  # as long as the context: every key is in the window
    ("qwen2", dict(sliding_window=16, layer_types=FULL)),  # layer_types rules the Qwen2 / Qwen3 families
    # the families' default RoPE rotates the whole head whatever partial_rotary_factor says
    ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
])
def test_config_fields_transformers_ignores_load_and_match_it(tmp_path, arch, fields):
    hf = save_tiny_checkpoint(arch, tmp_path, **fields)
    prompt = list(range(3, 40))  # longer than a 16-token window
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ReferenceRunner(load_model(tmp_path).model).prefill_logits(prompt), expected,
                               atol=1e-4, rtol=0)


def test_a_checkpoint_with_another_head_than_a_language_models_is_refused(tmp_path):
    """A sequence classifier of a supported family whose tied embeddings would stand in for the missing lm_head."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("qwen3", num_labels=3)  # qwen3's tiny config ties its embeddings
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"names architecture 'Qwen3ForSequenceClassification': its head is "
                                              r"not a language model's"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch,fields,message", [
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
     r"rope_type 'dynamic' is not supported"),
    ("qwen2", dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                        long_factor=[2.0] * 8, original_max_position_embeddings=128)),
     r"rope_type 'longrope' is not supported"),
    ("mixtral", dict(hidden_act="gelu"), r"mixtral: activation 'gelu' unsupported \(only silu\)"),
])
def test_rope_types_and_activations_we_cannot_run_fail_at_load(tmp_path, arch, fields, message):
    tiny_config(arch, **fields).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / SHARD))
    with pytest.raises((UnsupportedModelError, ValueError), match=message):
        load_model(tmp_path)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    hf = save_tiny_checkpoint("llama", tmp_path, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                      factor=4.0))
    prompt = list(range(3, 60))
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ReferenceRunner(load_model(tmp_path).model).prefill_logits(prompt), expected,
                               atol=1e-4, rtol=0)


def test_bad_dtype(mixtral_dir):
    with pytest.raises(ValueError, match=r"unsupported dtype 'int8'; use one of float32"):
        load_model(mixtral_dir, dtype="int8")


def test_checkpoint_in_bf16_loads_into_fp32(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    _rewrite_shard(directory, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    from_bf16 = ReferenceRunner(load_model(directory).model).prefill_logits(prompts()[0])
    rounded = ReferenceRunner(load_model(mixtral_dir, dtype="float32").model)
    for param in rounded.model.parameters():
        param.copy_(param.to(torch.bfloat16))
    assert from_bf16.dtype == torch.float32
    torch.testing.assert_close(from_bf16, rounded.prefill_logits(prompts()[0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_quantized_checkpoint_of_any_family_fails_at_load_naming_its_quantization(arch, tmp_path):
    save_tiny_checkpoint(arch, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config \\(quant_method 'fp8'\\)"):
        load_model(str(tmp_path))


def test_float8_weights_without_a_quantization_config_fail_naming_the_tensor(mixtral_dir, tmp_path):
    directory = _copy(mixtral_dir, tmp_path / "fp8")
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_shard(directory, lambda tensors: tensors.__setitem__(name, tensors[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' .* is torch.float8_e4m3fn"):
        load_model(str(directory))


@pytest.mark.parametrize("sidecar", ["quantize_config.json", "quant_config.json"])  # AutoGPTQ's, AWQ's
def test_quantization_settings_beside_the_config_fail_at_load_naming_the_file(mixtral_dir, tmp_path, sidecar):
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    (directory / sidecar).write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(CheckpointError, match=rf"has {sidecar}: quantized checkpoints are not supported"):
        load_model(str(directory))


@pytest.mark.parametrize("suffix", ["qweight", "weight_packed", "weight_scale_inv", "absmax"])
def test_quantized_tensors_without_any_quantization_settings_fail_naming_the_tensor(mixtral_dir, tmp_path, suffix):
    """GPTQ / AWQ (qweight), compressed-tensors (weight_packed), FP8 scales, bitsandbytes state: their layers
    have no `.weight`, and the load would otherwise fail on a missing tensor that says nothing of quantization."""
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    name = f"model.layers.0.self_attn.q_proj.{suffix}"
    _rewrite_shard(directory, lambda tensors: tensors.update(
        {name: torch.zeros(8, 8, dtype=torch.int32 if suffix == "qweight" else torch.float32)}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' .* belongs to a quantized checkpoint"):
        load_model(str(directory))


def test_host_weights_live_in_one_arena(mixtral_dir):
    """Every weight of a model loaded into host memory is a 64-byte aligned view of one private anonymous mapping
    (engine/host_arena.py), no two overlapping."""
    model = load_model(mixtral_dir).model
    params = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert all(p.data_ptr() % 64 == 0 for p in params)
    assert mapped_file(params[0]) is None
    ends = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in params)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # no two weights overlap


def test_shared_host_weights_are_written_once_and_mapped_by_every_later_load(mixtral_dir, tmp_path, monkeypatch):
    """The node-shared host store: the first load writes the weights to one file under $BATCHGEN_CACHE, later
    loads map it without reading the checkpoint's tensors; a rewritten checkpoint gets a file of its own."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    directory = _copy(mixtral_dir, tmp_path / "ckpt")
    expected = ReferenceRunner(load_model(directory).model).generate(prompts(), max_new_tokens=4)
    first = load_model(directory, shared_host_weights=True).model
    stores = sorted((tmp_path / "cache" / "host-weights").glob("*.bin"))
    assert len(stores) == 1 and not list((tmp_path / "cache" / "host-weights").glob("*.tmp"))
    written = stores[0].stat().st_mtime_ns
    reads = []
    monkeypatch.setattr("batchgen.connectors.checkpoint._open_shard", lambda *a: reads.append(a) or 1 / 0)
    second = load_model(directory, shared_host_weights=True).model
    assert reads == [] and stores[0].stat().st_mtime_ns == written
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    assert mapped_file(next(second.parameters())) == str(stores[0])
    assert ReferenceRunner(second).generate(prompts(), max_new_tokens=4) == expected
    monkeypatch.undo()
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    _rewrite_shard(directory, lambda tensors: None)  # same tensors, a new file: another identity
    load_model(directory, shared_host_weights=True)
    assert len(list((tmp_path / "cache" / "host-weights").glob("*.bin"))) == 2


def test_a_killed_writers_temporary_file_is_removed_and_a_live_writers_kept(tmp_path):
    """A writer killed mid-load (an actor SIGKILLed, an OOM kill) runs no cleanup: its temporary file, up to a
    model's size, stayed forever, since the next writer names its own by its own pid."""
    folder = tmp_path / "host-weights"
    folder.mkdir()
    (folder / "deadkey.123.tmp").write_bytes(b"half a model")
    (folder / "livekey.456.tmp").write_bytes(b"being written")
    with open(folder / "livekey.lock", "w") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # a writer of this key at work (another open file: another holder)
        store = SharedHostWeights(folder, {"checkpoint": "any"})
        store.allocate(64)
        store.abandon()
    assert sorted(f.name for f in folder.glob("*.tmp")) == ["livekey.456.tmp"]


def test_a_load_waits_while_another_process_writes_the_shared_file(mixtral_dir, tmp_path, monkeypatch):
    """Engine actors of a node start together: while one writes the shared file, another load of the same
    checkpoint waits for it and then maps the published file (it neither writes a second copy nor reads a half
    written one)."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    script = ("import sys\n"
              "from batchgen.connectors.checkpoint import load_model\n"
              "from batchgen.connectors.host_memory import mapped_file\n"
              "model = load_model(sys.argv[1], shared_host_weights=True).model\n"
              "print(mapped_file(next(model.parameters())))\n")
    fill, other = checkpoint_module._fill_weights, {}

    def fill_while_another_loads(*args):
        other["process"] = subprocess.Popen([sys.executable, "-c", script, str(mixtral_dir)], env=dict(os.environ),
                                            stdout=subprocess.PIPE, text=True)
        time.sleep(6)  # the other process is past its imports by now, at the file lock
        other["waited"] = other["process"].poll() is None
        fill(*args)

    monkeypatch.setattr(checkpoint_module, "_fill_weights", fill_while_another_loads)
    load_model(mixtral_dir, shared_host_weights=True)
    printed = other["process"].communicate(timeout=120)[0].strip()
    assert other["process"].returncode == 0 and other["waited"]
    published = [str(f) for f in (tmp_path / "cache" / "host-weights").glob("*.bin")]
    assert [printed] == published


def test_a_tied_head_saved_apart_must_equal_the_embeddings(tmp_path):
    """transformers unties a head that differs from the embeddings; loading it into the one tied tensor took
    whichever came last. Equal copies (some savers write both) load; different ones are refused, naming both."""
    save_tiny_checkpoint("mixtral", tmp_path, tie_word_embeddings=True)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    assert "lm_head.weight" not in tensors  # tied: transformers saves the embeddings only
    embeddings = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embeddings.clone()}, path, metadata={"format": "pt"})
    loaded = load_model(str(tmp_path))
    assert torch.equal(loaded.model.lm_head.weight, embeddings)
    save_file({**tensors, "lm_head.weight": embeddings + 1}, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the config ties the LM head to the embeddings \(tie_word_embeddings\), "
                                              r"but the checkpoint's 'lm_head.weight' and 'model.embed_tokens.weight' "
                                              r"differ: set tie_word_embeddings to false"):
        load_model(str(tmp_path))
