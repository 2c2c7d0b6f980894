"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.engine.chat import check_chat_template


def parse_json_object(value: str | dict[str, Any] | None, what: str) -> dict[str, Any]:
    """An option that is a JSON object on a command line or a mapping in a config file; None is {}."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__} {value!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} must be a JSON object, got {value!r}: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _argument_type(parse: Callable[[str], Any], accepts: Callable[[Any], bool], expected: str):
    """An argparse type: parse(text) where accepts() it, else a bad command line saying `expected`."""
    def argument(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return argument


# 0 admitted nothing, and every batch waited for good
positive_int = _argument_type(int, lambda value: value >= 1, "an integer >= 1")
# nan and inf reached int() past the checks: a traceback
positive_number = _argument_type(float, lambda value: 0 < value < math.inf, "a finite number > 0")
# past it the server loaded the model, then failed to bind
port_number = _argument_type(int, lambda value: 0 <= value <= 65535, "a port number in [0, 65535]")


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object on the command line (sampling defaults, engine options, storage options)."""
    try:
        return parse_json_object(text, "the value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def chat_template_text(value: str) -> str:
    """--chat-template: the template itself where it holds "{", "}" or a line break (vLLM's rule), else the path of
    a file holding it, which must exist (a mistyped path was taken for the template, and every chat prompt became
    its text; a long inline template was tested as a path and failed the server); either way a template that
    compiles (engine/chat.check_chat_template's ValueError)."""
    if any(mark in value for mark in "{}\n"):
        text = value
    elif Path(value).is_file():
        text = Path(value).read_text()
    else:
        raise ValueError(f"--chat-template {value!r} is no template (it holds no '{{', '}}' or line break) and no "
                         "file")
    check_chat_template(text)
    return text
