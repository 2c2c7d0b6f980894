"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse
import json
import math
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


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (0 admitted nothing, and every batch waited for good)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (nan and inf reached int() past the checks: a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port (0-65535; past it the server loaded the model, then failed to bind)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {value}")
    return value


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
