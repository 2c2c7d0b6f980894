"""What a row's output must look like: a JSON schema, any JSON, a regex, one of a list, or a grammar.

Field names follow vLLM's `StructuredOutputsParams`, so a row written for Ray Data LLM carries over.
Frozen and hashable: the grammar backend compiles each distinct spec once and every row that names
the same spec shares the compiled token masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.schema_support import unenforced_constraint

KINDS = ("json", "regex", "choice", "grammar", "json_object")
FLAGS = ("json_object", "disable_any_whitespace")  # the boolean fields: false is as good as unset


def is_unset(value: Any) -> bool:
    """Whether a structured_outputs value asks for nothing: null, or a struct whose every field is null (or a false
    flag), as a Parquet struct column holds the fields other rows set. A `json` of false is a schema (one that
    accepts nothing), not an unset field."""
    return value is None or (isinstance(value, dict) and bool(value) and all(
        v is None or (v is False and k in FLAGS) for k, v in value.items()))


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema, as JSON text (a dict or bool is accepted and serialised, keys in order)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF dialect), start rule `root`
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON without optional whitespace (no runaway blanks; the separators
    # keep their one space, ", " and ": ", as vLLM's do)

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):  # true and false are schemas too
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        def bad(why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter 'structured_outputs': {why}")

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise bad(f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise bad(f"'json' must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, an integer too long, nesting
                raise bad(f"'json' is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad(f"'json' must be a JSON schema object, got {type(schema).__name__}")
            unenforced = unenforced_constraint(schema)
            if unenforced is not None:
                raise bad(f"the schema uses {unenforced}, which the grammar backend does not enforce: outputs would "
                          "not follow it")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"'{name}' must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise bad("'choice' must be a non-empty list of non-empty strings")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"'{name}' must be a boolean")

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputs | None:
        """A StructuredOutputs from itself or a mapping (a Parquet struct, a JSON body); None stays None and
        null fields are unset (all of them: no structured outputs, `is_unset`); unknown keys are an error."""
        if is_unset(value):
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"invalid sampling parameter 'structured_outputs': expected an object, got "
                                      f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        value = {k: v for k, v in value.items() if v is not None}  # a struct's fields that other rows set
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"invalid sampling parameter 'structured_outputs': unknown field "
                                      f"'{unknown[0]}' (known: {', '.join(sorted(known))})")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}
