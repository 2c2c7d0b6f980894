"""Embedded demo presets: deterministic builds, safe concurrent first use, loading through the
checkpoint loader, and a tokenizer whose text round-trips."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralForCausalLM

from batchgen.connectors.checkpoint import load_model
from batchgen.connectors.demo_data import demo_prompts
from batchgen.connectors.presets import (
    BOS,
    CACHE_ENV,
    EOS,
    PRESETS,
    PresetError,
    build_preset,
    preset_config,
    resolve_preset,
)
from batchgen.engine.reference import ReferenceRunner


def tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def assert_same_checkpoint(a: str | Path, b: str | Path) -> None:
    left, right = tensors(a), tensors(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name
    for file in ("config.json", "tokenizer.json"):
        assert json.loads((Path(a) / file).read_text()) == json.loads((Path(b) / file).read_text()), file


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    """A cache directory already holding tiny-moe, shared by the tests that only read it."""
    root = tmp_path_factory.mktemp("cache") / "presets"  # the layout of $BATCHGEN_CACHE
    build_preset("tiny-moe", cache_dir=root)
    return root


@pytest.fixture
def cache_env(cache_root, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(cache_root.parent))
    return cache_root


def test_cache_dir_follows_env_and_names_the_version(cache_env):
    directory = resolve_preset("tiny-moe")
    assert directory == str(cache_env / f"tiny-moe-v{PRESETS['tiny-moe'].version}")
    assert resolve_preset("preset://tiny-moe") == directory
    assert resolve_preset("tiny-moe?experts=8") == directory  # an override equal to the default: same build
    assert Path(directory).stat().st_mode & 0o777 == 0o755  # readable by every user of a shared cache
    names = {p.name for p in Path(directory).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_build_is_deterministic(cache_root, tmp_path):
    again = build_preset("tiny-moe", cache_dir=tmp_path)
    assert Path(again).parent == tmp_path
    assert_same_checkpoint(build_preset("tiny-moe", cache_dir=cache_root), again)


def _build_after_barrier(barrier, cache_dir: str, results) -> None:
    barrier.wait()
    try:
        results.put(build_preset("tiny-moe", cache_dir=cache_dir))
    except Exception as exc:  # reported to the parent, so a failure shows at once with its cause
        results.put(f"failed: {exc!r}")


def test_concurrent_first_use_is_safe(cache_root, tmp_path):
    """Processes racing to build the same preset all get one complete directory, and no debris."""
    context = multiprocessing.get_context("spawn")
    workers = 2
    barrier, results = context.Barrier(workers), context.Queue()
    processes = [context.Process(target=_build_after_barrier, args=(barrier, str(tmp_path), results))
                 for _ in range(workers)]
    for process in processes:
        process.start()
    paths = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert len(set(paths)) == 1, paths
    assert all(process.exitcode == 0 for process in processes)
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]  # staging copies removed
    assert_same_checkpoint(paths[0], build_preset("tiny-moe", cache_dir=cache_root))


def test_preset_loads_through_the_checkpoint_loader_and_generates(cache_env):
    loaded = load_model("tiny-moe")
    directory = resolve_preset("tiny-moe")
    assert loaded.uri == directory
    assert loaded.config.model_type == "mixtral"
    assert loaded.tokenizer is not None
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids(EOS),)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    batch = sorted((loaded.tokenizer.encode(p) for p in demo_prompts(16, seed=1)), key=len)[:3]
    ours = ReferenceRunner(loaded.model).generate(batch, 12)
    for prompt, tokens in zip(batch, ours):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False, eos_token_id=list(loaded.eos_token_ids), pad_token_id=0)
        expected = expected[0, len(prompt):]
        assert tokens == expected.tolist()
        assert len(set(tokens)) > 1


def test_tokenizer_round_trips_the_demo_prompts(cache_env):
    directory = resolve_preset("tiny-moe")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == PRESETS["tiny-moe"].config["vocab_size"]
    assert len({BOS, EOS, tokenizer.unk_token, tokenizer.pad_token}) == 4
    for prompt in demo_prompts(64):
        ids = tokenizer.encode(prompt)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.unk_token_id not in ids, prompt
        assert tokenizer.decode(ids, skip_special_tokens=True) == prompt


@pytest.mark.parametrize("text", [
    '{"name": "Ann", "tags": ["a", "b"], "n": -12.5e3, "ok": true, "x": null}',
    "regex: ^[A-Z]{2,3}-\\d+$ | <tag attr='1'>", "caf\u00e9 \u00fcber \u65e5\u672c \U0001f600", "tab\tnew\nline",
])
def test_tokenizer_spells_any_text(cache_env, text):
    """Byte-level: JSON, punctuation, digits and any Unicode round-trip, with no unknown token."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_preset("tiny-moe"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges learnt, not bytes alone


def test_chat_template(cache_env):
    tokenizer = AutoTokenizer.from_pretrained(resolve_preset("tiny-moe"))
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{BOS}<|system|>Be kind.{EOS}<|user|>Tell me a story.{EOS}<|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert [t for t in tokens if t in tokenizer.all_special_tokens] == [
        BOS, "<|system|>", EOS, "<|user|>", EOS, "<|assistant|>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Be kind.Tell me a story."
    assert "\u0120story" in tokens  # byte-level BPE: a word and its leading space are one token
    with pytest.raises(Exception, match="unknown chat role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_overrides_get_their_own_directory(cache_env):
    directory = resolve_preset("preset://tiny-moe?experts=4&top_k=1")
    assert Path(directory).name == f"tiny-moe-v{PRESETS['tiny-moe'].version}-experts4-top_k1"
    config = json.loads((Path(directory) / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 1)
    assert load_model(directory).model.layers[0].ffn.mlp.num_experts == 4


def test_bench_preset_geometry():
    config = preset_config("bench-moe")
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (4096, 512, 6)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (16, 2, 1024)
    with torch.device("meta"):
        params = sum(p.numel() for p in MixtralForCausalLM(config).parameters())
    assert 158e6 < params < 160e6
    wide = preset_config("bench-moe", experts=32, top_k=4)
    assert (wide.num_local_experts, wide.num_experts_per_tok) == (32, 4)


def test_demo_prompts_are_seeded_and_varied():
    assert demo_prompts(64) == demo_prompts(64, seed=0)
    assert demo_prompts(8, seed=1) != demo_prompts(8, seed=0)
    prompts = demo_prompts(64)
    assert len(prompts) == 64
    words = sorted(len(p.split()) for p in prompts)
    assert words[0] < 15 and words[-1] > 100


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("preset://no-such-model", "unknown preset 'no-such-model'.*tiny-moe"),
        ("tiny-moe?colour=3", "unknown override 'colour'"),
        ("tiny-moe?experts=many", "override 'experts' must be an integer"),
        ("tiny-moe?experts=0", "override 'experts' must be an integer >= 1"),
        ("tiny-moe?experts=2&top_k=3", "top_k=3 exceeds experts=2"),
        ("tiny-moe?experts", "malformed overrides"),
    ],
)
def test_bad_preset_names_fail_clearly(uri, message):
    with pytest.raises(PresetError, match=message):
        resolve_preset(uri)


def test_paths_and_remote_uris_are_not_presets(tmp_path, monkeypatch):
    assert resolve_preset("s3://bucket/tiny-moe") is None
    assert resolve_preset(str(tmp_path / "checkpoint")) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-moe").mkdir()
    assert resolve_preset("tiny-moe") is None  # an existing directory of that name wins
    with pytest.raises(PresetError, match="unknown preset"):
        load_model("preset://tiny-moes")
