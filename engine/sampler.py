"""Batched sampling with per-row parameters.

Every row carries its own temperature / top-k / top-p / min-p, logit bias and penalties; each runs
once over the rows that use it. Logits are adjusted in vLLM's order, before greedy and sampled picks alike: a
structured-output row's grammar mask (every token its grammar forbids next is -inf; vLLM applies it before its
sampler, so a row's logprobs are over what its grammar allows), then logit bias, repetition penalty (prompt and
generated tokens), presence and frequency penalties (generated tokens), bad words and the min_tokens ban on stop
tokens; a sampled row's then temperature, min-p, top-k (every token tied with the k-th stays) and top-p over what
those kept, renormalised. Seeded rows draw their noise from a generator seeded per (seed, sample, step), so a
seeded sequence samples the same tokens whatever batch it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field

import torch

from batchgen.engine.grammar import mask_logits
from batchgen.engine.request import TokenLogprob
from batchgen.engine.sequence import Sequence
from batchgen.kernels import ops


def sample_next_tokens(logits: torch.Tensor, seqs: SequenceT[Sequence], generator: torch.Generator) -> list[int]:
    """Pick one token per row and record logprobs on sequences that asked for them."""
    logits = logits.float()
    rows = _RowKinds.of(seqs)
    if rows.structured:
        mask_logits(logits, [s.grammar for s in seqs])
    # logprobs are the model's own (vLLM's default, "raw"): before biases, penalties and bans (after the grammar's
    # mask, which vLLM applies before its sampler)
    raw = logits[rows.logprobs] if rows.logprobs else None
    if rows.adjusted:
        index = torch.tensor(rows.adjusted, dtype=torch.long, device=logits.device)
        logits[index] = adjust_logits(logits[index], [seqs[i] for i in rows.adjusted])
    _suppress_early_stop(logits, [(i, seqs[i]) for i in rows.early])
    tokens = ops.argmax(logits)
    if rows.sampled:
        index = torch.tensor(rows.sampled, dtype=torch.long, device=logits.device)
        probs = _filtered_probs(logits[index], [seqs[i] for i in rows.sampled])
        noise = _exponential_noise(probs.shape, [seqs[i] for i in rows.sampled], generator)
        tokens[index] = ops.argmax(probs / noise.to(probs.device))
    token_list = tokens.tolist()
    if rows.logprobs:
        _record_logprobs(raw, rows.logprobs, seqs, token_list)
    return token_list


@dataclass
class _RowKinds:
    """The rows each stage of sampling touches, from one pass over the step's sequences (thousands of them)."""

    adjusted: list[int] = field(default_factory=list)  # penalties, a logit bias or bad words
    early: list[int] = field(default_factory=list)  # under min_tokens: stop tokens banned
    structured: bool = False  # a grammar masks some row
    sampled: list[int] = field(default_factory=list)  # not greedy
    logprobs: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seqs: SequenceT[Sequence]) -> _RowKinds:
        kinds = cls()
        for i, s in enumerate(seqs):
            p = s.sampling
            if p.adjusts_logits:
                kinds.adjusted.append(i)
            if len(s.generated) < p.min_tokens:
                kinds.early.append(i)
            if s.grammar is not None:
                kinds.structured = True
            if not p.greedy:
                kinds.sampled.append(i)
            if p.logprobs is not None:
                kinds.logprobs.append(i)
        return kinds


def adjust_logits(logits: torch.Tensor, seqs: SequenceT[Sequence]) -> torch.Tensor:
    """Logit bias, then repetition, presence and frequency penalties, for every row at once (one scatter
    builds the rows' token counts, the rest are elementwise ops), then bad words: the token that would
    complete one of the row's bad-word token sequences after its generated tokens is banned."""
    rows, vocab, device = logits.shape[0], logits.shape[1], logits.device
    out = logits.clone()
    bias_rows = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.sampling.logit_bias]
    if bias_rows:
        index = torch.tensor([(i, t) for i, t, _ in bias_rows], dtype=torch.long, device=device)
        out.index_put_((index[:, 0], index[:, 1]),
                       torch.tensor([b for _, _, b in bias_rows], dtype=out.dtype, device=device), accumulate=True)
    generated = _token_counts([s.generated for s in seqs], rows, vocab, device)
    repetition = torch.tensor([s.sampling.repetition_penalty for s in seqs], device=device).unsqueeze(1)
    if bool((repetition != 1).any()):
        seen = (generated + _token_counts([s.prompt_ids for s in seqs], rows, vocab, device)) > 0
        penalised = torch.where(out > 0, out / repetition, out * repetition)
        out = torch.where(seen, penalised, out)
    presence = torch.tensor([s.sampling.presence_penalty for s in seqs], device=device).unsqueeze(1)
    frequency = torch.tensor([s.sampling.frequency_penalty for s in seqs], device=device).unsqueeze(1)
    out = out - presence * (generated > 0) - frequency * generated
    banned = [(i, ids[-1]) for i, s in enumerate(seqs) for ids in s.bad_word_ids
              if len(ids) == 1 or s.generated[-(len(ids) - 1):] == list(ids[:-1])]
    if banned:
        index = torch.tensor(banned, dtype=torch.long, device=device)
        out[index[:, 0], index[:, 1]] = float("-inf")
    return out


def _token_counts(token_lists: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each row's tokens."""
    counts = torch.zeros(rows, vocab, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths):
        row_ids = torch.repeat_interleave(torch.arange(rows, device=device), torch.tensor(lengths, device=device))
        ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long, device=device)
        counts.index_put_((row_ids, ids), torch.ones(len(ids), device=device), accumulate=True)
    return counts


def _suppress_early_stop(logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
    """Rows (index, sequence) still under their min_tokens: their stop tokens (and EOS) are banned."""
    for i, s in rows:
        banned = set(s.sampling.stop_token_ids)
        if not s.sampling.ignore_eos:
            banned |= s.eos_token_ids
        if banned:
            logits[i, list(banned)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, seqs: SequenceT[Sequence]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([s.sampling.temperature for s in seqs], device=device).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    top_k = torch.tensor([s.sampling.top_k for s in seqs], device=device)
    top_p = torch.tensor([s.sampling.top_p for s in seqs], device=device)
    min_p = torch.tensor([s.sampling.min_p for s in seqs], device=device)
    if bool((min_p > 0).any()):  # first, as vLLM's sampler runs it: top-p's mass is then over what it kept
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=device).unsqueeze(0)
        # below the k-th probability (vLLM's and transformers' rule: a token tied with the k-th stays)
        kth = sorted_probs.gather(1, (top_k.clamp(min=1) - 1).clamp(max=probs.shape[-1] - 1).unsqueeze(1))
        drop = (top_k.unsqueeze(1) > 0) & (sorted_probs < kth)
        kept = sorted_probs.masked_fill(drop, 0.0)
        # top-p over what min-p and top-k kept, renormalised (vLLM's order); only rows that set top_p:
        # cumsum rounds to 1.0 before the tail, which a row without it would lose
        # the most likely token always stays: a top_p that rounds to 0 in float32 (1e-300) dropped every token
        mass_before = (kept.cumsum(dim=-1) - kept) / kept.sum(dim=-1, keepdim=True)
        drop |= (top_p.unsqueeze(1) < 1) & (mass_before >= top_p.unsqueeze(1)) & (rank > 0)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def _exponential_noise(shape: torch.Size, seqs: SequenceT[Sequence], generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty(shape).exponential_(generator=generator)
    for i, s in enumerate(seqs):
        seed = s.rng_seed(len(s.generated))
        if seed is not None:
            row_gen = torch.Generator().manual_seed(seed)
            noise[i] = torch.empty(shape[-1]).exponential_(generator=row_gen)
    return noise


def _record_logprobs(raw: torch.Tensor, rows: list[int], seqs: SequenceT[Sequence], tokens: list[int]) -> None:
    """`raw`: the logits of `rows`, as the model gave them (masked by a grammar)."""
    logprobs = torch.log_softmax(raw, dim=-1)
    top_n = max(seqs[i].sampling.logprobs for i in rows)
    top_vals, top_ids = logprobs.topk(max(top_n, 1), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=raw.device)).squeeze(1)
    for j, i in enumerate(rows):
        n = seqs[i].sampling.logprobs
        # a token the row's grammar forbids (-inf) is no alternative
        top = {t: v for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()) if v != float("-inf")}
        entry = TokenLogprob(token_id=tokens[i], logprob=float(chosen[j]), top=top)
        if seqs[i].logprobs is None:
            seqs[i].logprobs = []
        seqs[i].logprobs.append(entry)
