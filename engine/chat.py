"""Chat messages to prompt token ids through the model's chat template (shared by every front end), and the
per-request options of that rendering that vLLM's chat API takes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.sampling_params import InvalidRequestError

# apply_chat_template's own arguments (`self` too): a template variable of one of these names would never reach the
# template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


# the request fields (Batch API body fields, Parquet columns) that make a ChatOptions, in from_values' order
CHAT_OPTION_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


@dataclass(frozen=True)
class ChatOptions:
    """How a request's turns become its prompt: with the template's generation prompt after the last turn (the
    default), or with the last turn left open for the model to continue (a prefilled answer); and extra
    variables the template reads, such as Qwen3's `enable_thinking`. Checked when made: InvalidRequestError
    names the field."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name}: expected true or false, got {type(value).__name__} {value!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true: one "
                                      "opens a new assistant turn, the other continues the last message")
        if not isinstance(self.template_kwargs, Mapping):
            raise InvalidRequestError(f"chat_template_kwargs: expected an object of template variables, got "
                                      f"{type(self.template_kwargs).__name__}")
        for key in self.template_kwargs:
            _check_variable(key)

    @classmethod
    def from_values(cls, add_generation_prompt: Any = None, continue_final_message: Any = None,
                    template_kwargs: Any = None) -> ChatOptions:
        """The options as a request gives them, None (and a null template variable) counting as unset: the
        generation prompt then defaults to the opposite of continue_final_message (both true is refused, as
        vLLM and transformers refuse it); template_kwargs may be a JSON object's text."""
        if add_generation_prompt is None and continue_final_message is None and template_kwargs is None:
            return DEFAULT_CHAT  # a row or line that sets none of them: the common case
        continuing = False if continue_final_message is None else continue_final_message
        generation = continuing is not True if add_generation_prompt is None else add_generation_prompt
        return cls(generation, continuing, _template_kwargs(template_kwargs))

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_CHAT


DEFAULT_CHAT = ChatOptions()


def check_chat_template(template: Any) -> None:
    """A chat template given as its text, checked before any model loads instead of failing every row: ValueError
    when it is not text, holds no Jinja tag (a file's path taken for the template renders every conversation to
    that path), or does not compile as transformers compiles it to render (a syntax error, an unknown filter)."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat_template must be the template's text, got {template!r}")
    if "{{" not in template and "{%" not in template:
        raise ValueError(f"chat_template {template[:80]!r} holds no Jinja tag ('{{{{' or '{{%'): every conversation "
                         "would render to this same text (a file's path? give the file's text)")
    from jinja2 import TemplateError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateError as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, TemplateSyntaxError) else ""
        raise ValueError(f"chat_template does not compile: {exc}{where}") from None


def render_chat(tokenizer: Any, turns: list[dict[str, str]], chat_template: str | None = None,
                options: ChatOptions = DEFAULT_CHAT) -> list[int]:
    """Apply the chat template (or an override) as `options` say, then tokenize the text. A tokenizer with
    several named templates (a dict) picks its "default" itself, as transformers does."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError("messages: the model's tokenizer has no chat template; give prompt text instead")
    try:
        text = tokenizer.apply_chat_template(turns, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message,
                                             **options.template_kwargs)
    except Exception as exc:  # a template's raise_exception() names what it rejects
        raise InvalidRequestError(f"messages: the chat template rejected them: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_kwargs(value: Any) -> dict[str, Any]:
    """A mapping (or a JSON object's text) of template variables, without its null entries (a struct column's
    missing fields arrive as nulls)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"chat_template_kwargs: not a JSON object: {exc}") from None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs: expected an object of template variables, got "
                                  f"{type(value).__name__}")
    return {key: item for key, item in value.items() if item is not None}


def _check_variable(key: Any) -> None:
    if not isinstance(key, str) or not key.isidentifier():
        raise InvalidRequestError(f"chat_template_kwargs: {key!r} is not a template variable name")
    if key in RESERVED_TEMPLATE_KWARGS:
        where = f"; set '{key}' on the request" if key in ("add_generation_prompt", "continue_final_message") else ""
        raise InvalidRequestError(f"chat_template_kwargs: {key!r} is an argument of the rendering itself, not a "
                                  f"template variable{where}")
