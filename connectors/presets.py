"""Embedded demo models, so `make run` and the tests need no download.

A preset is built deterministically from a seed with transformers (random weights: its text is
random words), saved in HF format (config, safetensors, tokenizer files) into a cache directory on
first use and then loaded by the same loader as any checkpoint. The tokenizer is built locally too:
a byte-level BPE trained on a seeded corpus (the demo prompts, JSON, code-like text, pseudo-words),
sized to the model, so it spells any text: structured outputs (JSON, regexes) run for real.

Names: "tiny-moe", "preset://tiny-moe", "bench-moe?experts=32&top_k=4" (overrides change the
expert count / top-k and get their own cache directory).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

from batchgen.connectors.demo_data import WORDS, demo_prompts

CACHE_ENV = "BATCHGEN_CACHE"
SCHEME = "preset://"

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # the first vocabulary ids, in this order
ROLES = ("system", "user", "assistant")
_CONSONANTS = tuple("bcdfghjklmnprstvz")
_VOWELS = tuple("aeiou")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class PresetError(ValueError):
    """An unknown preset name or a bad override; the message names it and what is allowed."""


@dataclass(frozen=True)
class Preset:
    """A Mixtral-style model recipe. Bump `version` whenever the built files would change."""

    name: str
    version: int
    seed: int
    description: str
    config: dict = field(repr=False)  # MixtralConfig arguments
    # override key in a preset URI -> MixtralConfig field
    overrides: dict = field(
        default_factory=lambda: {"experts": "num_local_experts", "top_k": "num_experts_per_tok"}
    )


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="tiny-moe",
            version=3,
            seed=1234,
            description="demo model: 4 layers, 8 experts top-2, hidden 128 (~4M params), runs fast on CPU",
            config=dict(
                vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                max_position_embeddings=4096, initializer_range=0.1,
            ),
        ),
        Preset(
            name="bench-moe",
            version=3,
            seed=4321,
            description="benchmark workload: 6 layers, 16 experts top-2, hidden 512, fp32 (~159M params)",
            config=dict(
                vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2,
                max_position_embeddings=8192, initializer_range=0.05,
            ),
        ),
        Preset(
            name="large-moe",
            version=1,
            seed=2468,
            description="memory-constrained benchmark: 10 layers, 16 experts top-2, hidden 1024, fp32 (~1.04B params, "
                        "4.2 GB)",
            config=dict(
                vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=10,
                num_attention_heads=8, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2,
                max_position_embeddings=8192, initializer_range=0.03,
            ),
        ),
    )
}


def resolve_preset(uri: str) -> str | None:
    """The local directory of the preset `uri` names (built on first use), or None if it names none.

    A bare name that is also an existing path is a path; "preset://" forces the preset reading and
    makes an unknown name an error.
    """
    parsed = parse_preset_uri(uri)
    if parsed is None:
        return None
    name, overrides = parsed
    return build_preset(name, **overrides)


def parse_preset_uri(uri: str) -> tuple[str, dict[str, int]] | None:
    """(name, overrides) for a preset URI, None for anything else (a path, s3://...)."""
    forced = uri.startswith(SCHEME)
    body = uri[len(SCHEME):] if forced else uri
    name, _, query = body.partition("?")
    if name not in PRESETS:
        if forced:
            raise PresetError(f"unknown preset {name!r} in {uri!r}; known presets: {', '.join(PRESETS)}")
        return None
    if not forced and os.path.exists(uri):
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise PresetError(f"preset {uri!r}: malformed overrides {query!r} (expected key=value&...)") from exc
    overrides = {}
    for key, value in pairs:
        try:
            overrides[key] = int(value)
        except ValueError:
            raise PresetError(f"preset {uri!r}: override {key!r} must be an integer, got {value!r}") from None
    return name, overrides


def preset_config(name: str, **overrides: int):
    """The transformers MixtralConfig of a preset, with validated overrides applied."""
    from transformers import MixtralConfig

    preset = _lookup(name)
    values = dict(preset.config)
    for key, value in overrides.items():
        if key not in preset.overrides:
            allowed = ", ".join(preset.overrides)
            raise PresetError(f"preset {name!r}: unknown override {key!r} (allowed: {allowed})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PresetError(f"preset {name!r}: override {key!r} must be an integer >= 1, got {value!r}")
        values[preset.overrides[key]] = value
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        top_k, experts = values["num_experts_per_tok"], values["num_local_experts"]
        raise PresetError(f"preset {name!r}: top_k={top_k} exceeds experts={experts}")
    return MixtralConfig(
        **values, pad_token_id=SPECIAL_TOKENS.index(PAD), bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build_preset(name: str, cache_dir: str | os.PathLike | None = None, **overrides: int) -> str:
    """The directory holding preset `name` in HF format; the first caller builds it.

    Built in a private temporary directory and renamed into place, so concurrent first uses
    (several Ray actors on one node) never see a half-written checkpoint: one rename wins, the
    others discard their copy.
    """
    preset = _lookup(name)
    config = preset_config(name, **overrides)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / _directory_name(preset, config)
    if final.is_dir():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _write(preset, config, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        try:
            staging.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(final)


def default_cache_dir() -> Path:
    """$BATCHGEN_CACHE/presets, else ~/.cache/batchgen/presets."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "batchgen")
    return Path(base) / "presets"


def build_tokenizer(vocab_size: int, seed: int, max_length: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (specials first) with a chat template.

    Byte-level: every string encodes without unknown tokens and decodes back to itself. Trained on
    `_training_corpus(seed)`, so the same arguments build the same tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, *(_role_token(role) for role in ROLES)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_training_corpus(seed), trainer)
    if backend.get_vocab_size() != vocab_size:
        raise PresetError(f"vocab_size {vocab_size}: the training corpus yields {backend.get_vocab_size()} tokens")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        additional_special_tokens=[_role_token(role) for role in ROLES],
        chat_template=CHAT_TEMPLATE, model_max_length=max_length,
    )


def _training_corpus(seed: int) -> list[str]:
    """Demo prompts, JSON records, code-like lines and seeded pseudo-words: enough distinct pairs for
    a few thousand merges, with the demo words and JSON punctuation among the first."""
    rng = random.Random(seed)
    corpus = demo_prompts(400, seed=seed)
    for _ in range(300):
        record = {rng.choice(WORDS): rng.choice([rng.randint(-999, 9999), rng.random() < 0.5, None,
                                                 rng.choice(WORDS), round(rng.uniform(-50, 50), 2)])
                  for _ in range(rng.randint(1, 5))}
        corpus.append(json.dumps(record) if rng.random() < 0.5 else json.dumps(record, indent=2))
        corpus.append(f"{rng.choice(WORDS)}_{rng.choice(WORDS)}({rng.randint(0, 99)}) = [{rng.choice(WORDS)}];")
    seen: set[str] = set()
    while len(seen) < 6000:
        syllables = (rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 4)))
        seen.add("".join(syllables))
    words = sorted(seen)
    rng.shuffle(words)
    corpus += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return corpus


def _role_token(role: str) -> str:
    return f"<|{role}|>"


def _write(preset: Preset, config, directory: Path) -> None:
    import torch  # only to build a preset: finding an already built one needs no torch
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model = model.to(torch.float32).to_empty(device="cpu")
    _init_weights(model, preset.seed, config.initializer_range)
    tokenizer = build_tokenizer(config.vocab_size, preset.seed, config.max_position_embeddings)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(directory)


def _init_weights(model, seed: int, std: float) -> None:
    """Norm scales 1, every matrix N(0, std), drawn from a private generator in parameter order:
    the weights depend on the seed and config alone (not on the global RNG, other threads, or
    transformers' own init code)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)


def _directory_name(preset: Preset, config) -> str:
    changed = [
        f"{key}{getattr(config, field_name)}"
        for key, field_name in sorted(preset.overrides.items())
        if getattr(config, field_name) != preset.config[field_name]
    ]
    return "-".join([preset.name, f"v{preset.version}", *changed])


def _lookup(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
