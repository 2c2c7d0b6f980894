"""Tiny random checkpoints of every supported architecture, built with transformers (no download).

Shared by the model, checkpoint and engine tests. Each config also exercises a family switch: rope
scaling (llama3, yarn), tied embeddings, explicit head_dim, a dense layer inside a MoE model. The
raised initializer_range makes greedy tokens vary instead of repeating one token. No eos token by
default, so greedy runs always produce max_new_tokens tokens (pass eos_token_id=... to add one).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import fsspec
import torch
from transformers import AutoConfig, AutoModelForCausalLM

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
ALL_ARCHITECTURES = (*ARCHITECTURES, "deepseek_v3")  # DeepSeek-V3's own tests cover more of its variants

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
EXTRA = {
    "llama": dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=64)),
    "qwen2": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=128)),
    "qwen3": dict(head_dim=24, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1]),
    "deepseek_v3": dict(moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_shared_experts=1,
                        routed_scaling_factor=2.5, rope_interleave=True),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=32),
}


TOKENIZER_VOCAB = 512  # a byte-level BPE needs its 256 byte tokens and the specials: pair it with vocab_size=512


def tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """The presets' byte-level BPE (specials <|pad|> <|bos|> <|eos|> <|unk|> are ids 0..3): it spells any
    text, JSON and punctuation included, so structured outputs run for real on the tiny models."""
    from batchgen.connectors.presets import build_tokenizer

    return build_tokenizer(vocab_size, seed=0, max_length=COMMON["max_position_embeddings"])


def tiny_config(arch: str, **overrides):
    """A transformers config of `arch` (a model_type in ARCHITECTURES), with overrides applied."""
    return AutoConfig.for_model(arch, **{**COMMON, **EXTRA[arch], **overrides})


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """The transformers model of a tiny config, float32, eval mode, weights seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    return model.eval()


def save_tiny_checkpoint(arch: str, directory: str | Path, seed: int = 0, **overrides):
    """save_pretrained (safetensors) a tiny model into `directory`; returns the transformers model."""
    model = tiny_hf_model(arch, seed, **overrides)
    model.save_pretrained(directory)
    return model


def copy_to_memory(directory: str | Path, name: str) -> str:
    """Copy a checkpoint directory into fsspec's in-memory filesystem; returns its memory:// URI."""
    fs = fsspec.filesystem("memory")
    target = f"/{name}"
    if fs.exists(target):
        fs.rm(target, recursive=True)
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        fs.pipe_file(f"{target}/{path.relative_to(directory).as_posix()}", path.read_bytes())
    return f"memory://{target}"


def prompts(vocab_size: int = COMMON["vocab_size"], lengths=(3, 9, 17), seed: int = 0) -> list[list[int]]:
    """Seeded random prompts of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt (the tokens after the prompt)."""
    return hf_greedy_batch(model, [prompt], max_new_tokens)[0]


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate over one left-padded batch; the tokens after each prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return out[:, width:].tolist()


def kv_bytes_per_token(loaded) -> int:
    """fp32 K and V bytes one token takes over all layers (to size KV budgets in pages)."""
    spec = loaded.model.kv_spec()
    return spec.num_layers * spec.num_kv_heads * (spec.k_dim + spec.v_dim) * 4


def scheduler_config(**fields):
    """An EngineConfig as an engine hands its scheduler one: every planned field set (here to fixed values)."""
    from batchgen.engine import EngineConfig

    return EngineConfig(**{"max_num_seqs": 256, "refill_threshold": 0.5, "b_attn": 256, "b_moe": 8192, **fields})


def engine_greedy_tokens(directory: str | Path, backends: dict[str, str]) -> list[list[int]]:
    """Greedy tokens (6 each) of three seeded prompts through our engine on the checkpoint in `directory`, with
    the kernel backends `backends` (op -> backend name) forced for the run: how a C kernel's test checks that a
    model's tokens do not depend on which backend ran."""
    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import Engine, Request, SamplingParams
    from batchgen.kernels import registry

    loaded = load_model(str(directory))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [Request(f"r{i}", prompt_token_ids=p, sampling=greedy)
                for i, p in enumerate(prompts(vocab_size=loaded.model.vocab_size, lengths=(3, 9, 17)))]
    with contextlib.ExitStack() as forced:
        for op, backend in backends.items():
            forced.enter_context(registry.use_backend(op, backend))
        return [r.outputs[0].token_ids for r in Engine(loaded, page_size=4).generate(requests)]
