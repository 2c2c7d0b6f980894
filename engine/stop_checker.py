"""Decides when a sequence is done, and what its text is."""

from __future__ import annotations

import weakref

from batchgen.engine.sequence import Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, whose text is what they add


def detokenize(tokenizer, token_ids: list[int]) -> str:
    """decode(token_ids, skip_special_tokens=True). A list of Python ints needs none of decode's input conversion
    (transformers' to_py_obj walks every id: half the time of a short decode), so it goes straight to the
    tokenizer's own _decode where it has one, as decode would."""
    if tokenizer is None:
        return ""
    decode = getattr(tokenizer, "_decode", None) or tokenizer.decode
    return decode(token_ids, skip_special_tokens=True)


def generated_text(tokenizer, seq: Sequence, tokens: list[int]) -> str:
    """The text `tokens` (the sequence's output, or its start) add after the prompt, as vLLM's detokenizer gives
    it: decoded behind the prompt's last CONTEXT_TOKENS tokens, so a SentencePiece decoder keeps the first output
    token's leading space (" Paris", not "Paris"); where the two decodes do not line up (a character split over the
    boundary), the tokens alone. A tokenizer whose pieces decode alone as they do in a sequence (byte-level BPE)
    decodes the tokens alone: the same text, one decode."""
    context = seq.prompt_ids[-CONTEXT_TOKENS:]
    if tokenizer is None or not context or _decodes_alone(tokenizer):
        return detokenize(tokenizer, tokens)
    if seq.context_text is None:  # once a sequence: a stop string's check reads the text every step
        seq.context_text = detokenize(tokenizer, context)
    prefix = seq.context_text
    text = detokenize(tokenizer, context + tokens)
    return text[len(prefix):] if text.startswith(prefix) else detokenize(tokenizer, tokens)


_DECODES_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decodes_alone(tokenizer) -> bool:
    """Whether two words' tokens decode apart to the text they decode to together (asked once a tokenizer)."""
    known = _DECODES_ALONE.get(tokenizer)
    if known is None:
        encode = getattr(tokenizer, "encode", None)
        ids = list(encode(" one two", add_special_tokens=False)) if encode is not None else []
        known = len(ids) < 2 or all(detokenize(tokenizer, ids[:i]) + detokenize(tokenizer, ids[i:])
                                    == detokenize(tokenizer, ids) for i in range(1, len(ids)))
        _DECODES_ALONE[tokenizer] = known
    return known


def finish_reason(seq: Sequence, tokenizer, max_model_len: int) -> str | None:
    """Check the newest token; returns "stop", "length" or None to keep going. A stop_token_ids token's own text is
    left out of the output (vLLM's default), as a stop string is."""
    params = seq.sampling
    token = seq.generated[-1]
    if seq.grammar is not None and seq.grammar.is_terminated():  # the grammar took its end token
        return "stop"
    if len(seq.generated) >= params.min_tokens:
        if not params.ignore_eos and token in seq.eos_token_ids:  # (a special token: no text to leave out)
            return "stop"
        if token in params.stop_token_ids:
            seq.stop_text_end = len(generated_text(tokenizer, seq, seq.generated[:-1]))
            return "stop"
        if params.stop:
            text = generated_text(tokenizer, seq, seq.generated)
            # a character whose bytes are split over tokens decodes as U+FFFD until its last byte comes, and the
            # text may then grow by nothing: the newest token's text starts where the previous text is whole
            before = generated_text(tokenizer, seq, seq.generated[:-1]).rstrip(REPLACEMENT)
            cut = _first_stop(text, params.stop, len(before))
            if cut is not None:
                seq.stop_text_end = cut
                return "stop"
    if len(seq.generated) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _first_stop(text: str, stops: tuple[str, ...], previous_len: int) -> int | None:
    """Earliest stop string that ends inside the newest token's text."""
    hits = []
    for stop in stops:
        pos = text.find(stop, max(0, previous_len - len(stop) + 1))
        if pos != -1:
            hits.append(pos)
    return min(hits) if hits else None


def output_text(seq: Sequence, tokenizer) -> str:
    """The output's text up to its stop, without the U+FFFD of a character whose last bytes never came (an output cut
    by max_tokens mid-character): vLLM holds such bytes back."""
    text = generated_text(tokenizer, seq, seq.generated)
    return (text if seq.stop_text_end is None else text[: seq.stop_text_end]).rstrip(REPLACEMENT)
