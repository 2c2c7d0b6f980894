"""The state of one sequence coroutine: everything needed to resume it anywhere.

Between decode steps a coroutine's program point is "next token" and its checkpoint is its last
token id plus its KV (wherever `kv_location` says). Inside a forward pass the program point and
the hidden-state checkpoint live in the coroutine's row of a `CoroutineGroup` (engine/coroutine.py),
so thousands of suspended coroutines cost one tensor, not thousands of objects.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.request import TokenLogprob
from batchgen.engine.sampling_params import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"  # prompt not prefilled yet, or its KV dropped by a recompute preemption
    PREFILL = "prefill"
    DECODE = "decode"  # KV resident in device pages
    SUSPENDED = "suspended"  # yielded: KV checkpointed in the host store
    FINISHED = "finished"


class KVLocation(enum.Enum):
    NONE = "none"
    DEVICE = "device"
    HOST = "host"

    # members are singletons: identity hashing, in C (Enum's own hashes the name in Python, and the scheduler keys
    # a dict by (sequence, location) for every prompt it plans)
    __hash__ = object.__hash__


@dataclass(eq=False)
class Sequence:
    """One sample of one request. n > 1 requests fork into several sequences after prefill.
    Compared by identity: the scheduler's queues look sequences up, never compare their fields."""

    seq_id: int
    request_id: str
    sample_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    arrival: int  # FIFO order of submission
    phase: Phase = Phase.WAITING
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    kv_location: KVLocation = KVLocation.NONE
    device_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are stored
    finish_reason: str | None = None
    stop_text_end: int | None = None  # character offset where a stop string cut the text
    context_text: str | None = None  # the prompt's last tokens decoded, the output's text read after (stop_checker)
    grammar: Any = None  # structured outputs: the xgrammar matcher over `generated` (engine/grammar.py)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # token sequences of sampling.bad_words, never completed
    submitted_at: float = field(default_factory=time.perf_counter)
    first_scheduled_at: float | None = None
    finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def recomputing(self) -> bool:
        """Whether a prefill of this sequence recomputes KV it had (recompute preemption dropped it): it has
        generated tokens, so the prefill covers them too and draws its next token, no first one."""
        return bool(self.generated)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens a prefill of this sequence computes KV for: its prompt, and its generated tokens when
        `recomputing`."""
        return self.prompt_ids + self.generated if self.generated else self.prompt_ids

    @property
    def prefill_samples(self) -> int:
        """Sequences its prefill yields: the request's n for a prompt (forked after), one for a recompute."""
        return 1 if self.generated else self.sampling.n

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt_ids[-1]

    def rng_seed(self, step: int) -> int | None:
        """Counter-based seed: a seeded sample draws the same numbers whatever batch it runs in. Seed, sample and
        step are mixed (splitmix64), not summed: a sum gave sample i at step s + 7919 the numbers of sample i + 1 at
        step s."""
        if self.sampling.seed is None:
            return None
        return _mix(_mix(_mix(self.sampling.seed) ^ self.sample_index) ^ step) % (2**63 - 1)


def _mix(value: int) -> int:
    """splitmix64's finaliser: a 64-bit value whose every bit depends on every bit of `value`."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)
