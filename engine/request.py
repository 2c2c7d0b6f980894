"""What goes into the engine and what comes out of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.chat import DEFAULT_CHAT, ChatOptions
from batchgen.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One prompt, as token ids, chat turns (rendered as `chat_options` say) or text (the first given wins; see
    RequestNormalizer)."""

    request_id: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict] | None = None
    chat_options: ChatOptions = DEFAULT_CHAT


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class Completion:
    """One sample of a request (n > 1 gives several)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Result:
    """The outcome of one request: completions, or an error naming what was wrong with it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    error: str | None = None
    submitted_at: float = 0.0
    first_scheduled_at: float | None = None
    finished_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def completion_time(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at
