"""Structured outputs through xgrammar: compile a spec's token masks once, match each sequence's tokens.

Why xgrammar: it precompiles a grammar's context-independent token masks (the bulk of the vocabulary)
once per spec, so a step costs a few microseconds per row on CPU; it runs on CPU and CUDA alike, takes
JSON schemas, regexes and EBNF, and is what vLLM and SGLang use by default. (llguidance computes masks
lazily with no per-spec compile and reads Lark; outlines-core builds a full regex index per spec, slow
for large schemas.)

A `GrammarMatcher` is a sequence's parser state. It lives on the `Sequence`, starts fresh with the
sequence (a fork, a decode stage adopting a prefilled prompt) and takes every token the sequence
takes, the first one included, so nothing about it travels between stages.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence as SequenceT
from typing import Any

import torch

from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.structured_outputs import StructuredOutputs

# Whitespace characters allowed between two JSON tokens: room for deep indentation, not for a weak
# model's runaway blank lines eating max_tokens.
MAX_JSON_WHITESPACE = 20
# compiled grammars kept, the least recently used dropped past it: a batch whose every line has its own
# json_schema would otherwise hold one per line for the engine's life
KEPT_GRAMMARS = 512


class GrammarBackend:
    """One model's vocabulary as xgrammar sees it, and the compiled grammars of the specs seen so far."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: SequenceT[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._unusable = ("no tokenizer" if tokenizer is None else
                          "no end-of-sequence token" if not self.stop_token_ids else None)
        if self._unusable is None:
            base = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            vocab = list(base.decoded_vocab)
            # special tokens decode to nothing in the output text: the grammar must never take them as text
            for token in tokenizer.all_special_ids:
                if token < len(vocab):  # (a special token added past the model's vocabulary is never sampled)
                    vocab[token] = b""
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                          stop_token_ids=list(self.stop_token_ids))
            # its own cache off: this one is bounded (xgrammar's grows without limit by default)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        else:
            self._compiler = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self.compilations = 0

    def compile(self, spec: StructuredOutputs) -> Any:
        """The spec's compiled grammar (compiled on first use, KEPT_GRAMMARS kept); InvalidRequestError if it cannot
        compile."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self._compile(spec)
            self.compilations += 1
            if len(self._compiled) > KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return compiled

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh parser state for `spec`: the engine feeds it each token the sequence takes."""
        return self._xgr.GrammarMatcher(self.compile(spec))

    def _compile(self, spec: StructuredOutputs) -> Any:
        if self._compiler is None:
            raise InvalidRequestError(f"structured_outputs needs the model's tokenizer and an end-of-sequence "
                                      f"token; this model has {self._unusable}")
        compiler = self._compiler
        json_options = dict(any_whitespace=not spec.disable_any_whitespace, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(spec.json, **json_options)
            if spec.json_object:
                return compiler.compile_json_schema('{"type": "object"}', **json_options)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                # each choice a string literal of its own characters: escaped to ASCII, a character past U+FFFF
                # became two surrogate escapes the grammar read as two characters, and the choice never matched
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                          for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(f"structured_outputs: the {spec.kind} does not compile: "
                                      f"{_compile_error(exc)}") from None


def _compile_error(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[time] file.cc:line: ") and assertion text."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    text = re.sub(r"^\S+\.(cc|h|cpp):\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)


def mask_logits(logits: torch.Tensor, matchers: SequenceT[Any | None]) -> None:
    """Set to -inf, in place, every token the row's matcher forbids next (rows with None are left alone)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar  # only once a structured row exists: free-text jobs never load it

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
