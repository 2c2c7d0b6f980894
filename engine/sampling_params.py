"""Per-request sampling parameters, validated up front so a bad request fails alone."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.structured_outputs import StructuredOutputs, is_unset

GREEDY_BELOW = 1e-5  # temperatures under this are greedy
INT64 = range(-2**63, 2**63)
FLOAT32_MAX = 3.4028234663852886e38  # the sampler's tensors are float32: a larger temperature would be inf there
# the sampler divides positive logits by the penalty and multiplies negative ones: past these, float32 overflows to
# inf (and NaN probabilities) or a penalty rounds to 0 or inf
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate for one prompt. Defaults follow vLLM / OpenAI (temperature 1, 16 tokens)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None
    max_prompt_tokens: int | None = None
    presence_penalty: float = 0.0  # minus this from a token's logit once it has been generated (OpenAI)
    frequency_penalty: float = 0.0  # minus this per time a token has been generated (OpenAI)
    repetition_penalty: float = 1.0  # a token in the prompt or output: positive logit / p, negative * p (vLLM)
    # added to a token's logit; given as {token id: bias} (OpenAI: string ids, biases in [-100, 100])
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the output follows a JSON schema, a regex, a choice list or a grammar (vLLM's field and names)
    structured_outputs: StructuredOutputs | None = None
    # words never generated: the token that would complete one (as a word, or after a space) is banned (vLLM)
    bad_words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        if self.top_k == -1:  # vLLM's (and its clients') "disabled"
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "structured_outputs", StructuredOutputs.from_value(self.structured_outputs))
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise InvalidRequestError(f"invalid sampling parameter '{name}': must be a list, got "
                                          f"{type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures under GREEDY_BELOW pick the most likely token, as vLLM does: logits divided by them
        overflow to inf, and the softmax of infs is NaN."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Whether penalties, a logit bias or bad words change this row's logits before sampling (asked of every
        decoding sequence at every step: computed once)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.bad_words)

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter '{name}': {why}")

        # the split pipeline carries the params in 64-bit Arrow columns: a larger integer failed its whole batch
        for name in ("max_tokens", "min_tokens", "top_k", "n", "seed", "logprobs", "max_prompt_tokens"):
            value = getattr(self, name)
            if _is_int(value) and value not in INT64:
                raise bad(name, f"{value} does not fit a 64-bit integer")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise bad("temperature", f"must be a finite number >= 0 (at most float32's {FLOAT32_MAX:.4g}), got "
                      f"{self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        if not all(isinstance(s, str) and s.strip() for s in self.bad_words):
            raise bad("bad_words", "must be a string or a list of non-blank strings")
        if not all(map(_is_token_id, self.stop_token_ids)):
            raise bad("stop_token_ids", "must be a list of non-negative 64-bit integers")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be a number in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise bad("repetition_penalty", f"must be a number in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        if not isinstance(self.ignore_eos, bool):  # a "false" string counted as true: every row ran to max_tokens
            raise bad("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if self.structured_outputs is not None and self.min_tokens:
            raise bad("min_tokens", "cannot be combined with structured_outputs: the grammar decides where the "
                      "output ends")
        if self.max_prompt_tokens is not None and (
            not _is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1
        ):
            raise bad("max_prompt_tokens", f"must be an integer >= 1, got {self.max_prompt_tokens!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, defaults: SamplingParams | None = None) -> SamplingParams:
        """Build from a user dict (a Parquet struct, a JSON body) over `defaults`; None values are unset,
        unknown keys are an error. Nothing set over `defaults` returns `defaults` itself (frozen): a job
        calls this once per row, and most rows override nothing."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        changes = {}
        for key, value in (values or {}).items():
            if value is None:  # before the name check: a Parquet struct has every field any row sets, null elsewhere
                continue
            if key == "structured_outputs" and is_unset(value):  # a struct of nulls: as unset as a null struct
                continue
            if key not in fields:
                raise InvalidRequestError(f"unknown sampling parameter '{key}'")
            if isinstance(value, float) and value.is_integer() and fields[key] in ("int", "int | None"):
                value = int(value)  # 3.0: Ray's numpy batches make floats of an int field with a null in the batch
            changes[key] = value
        if defaults is not None and not changes:
            return defaults
        if defaults is not None and "structured_outputs" in changes and "min_tokens" not in changes:
            changes["min_tokens"] = 0  # a default min_tokens is not this row's: its grammar decides where it ends
        try:
            return dataclasses.replace(defaults, **changes) if defaults is not None else cls(**changes)
        except TypeError as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["bad_words"] = list(self.bad_words)
        out["logit_bias"] = dict(self.logit_bias)
        out["structured_outputs"] = None if self.structured_outputs is None else self.structured_outputs.to_dict()
        return out


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or digit strings, as OpenAI sends them) or (id, bias) pairs, as
    sorted (int, float) pairs; InvalidRequestError naming the bad entry."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple, type({}.items()))):
        raise InvalidRequestError(f"invalid sampling parameter 'logit_bias': must map token ids to biases, got "
                                  f"{type(value).__name__}")
    pairs = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidRequestError(f"invalid sampling parameter 'logit_bias': bad entry {item!r}")
        token, bias = item
        if isinstance(token, str) and token.isascii() and token.isdigit():  # ("²" is a digit int() refuses)
            token = int(token)
        if not _is_token_id(token):
            raise InvalidRequestError(f"invalid sampling parameter 'logit_bias': token id {token!r} is not a "
                                      "64-bit integer >= 0")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequestError(f"invalid sampling parameter 'logit_bias': bias {bias!r} for token {token} "
                                      "is not a number in [-100, 100]")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    """A non-negative integer a 64-bit column holds."""
    return _is_int(value) and 0 <= value < INT64.stop


def _is_number(value: Any) -> bool:
    """A finite int or float (an int a float can hold): NaN would sample token 0 forever, inf uniformly."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range (a JSON line may hold 1 and 400 zeros)
        return False
