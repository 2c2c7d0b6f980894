"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from batchgen.connectors.io import parse_storage_options


def json_object(text: str) -> dict[str, Any]:
    """A JSON object on the command line (sampling defaults, engine options, storage options)."""
    try:
        return parse_storage_options(text, "the value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
