"""Chat messages to prompt token ids through the model's chat template (shared by every front end)."""

from __future__ import annotations

from typing import Any

from batchgen.engine.sampling_params import InvalidRequestError


def render_chat(tokenizer: Any, turns: list[dict[str, str]], chat_template: str | None = None) -> list[int]:
    """Apply the chat template (or an override) with a generation prompt, then tokenize the text. A tokenizer
    with several named templates (a dict) picks its "default" itself, as transformers does."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError("messages: the model's tokenizer has no chat template; give prompt text instead")
    try:
        text = tokenizer.apply_chat_template(turns, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # a template's raise_exception() names what it rejects
        raise InvalidRequestError(f"messages: the chat template rejected them: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
