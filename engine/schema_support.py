"""JSON-schema constraints the grammar backend (xgrammar 0.2.9) compiles but does not enforce.

xgrammar turns a schema into a grammar of the JSON it admits; a few keywords constrain JSON in ways a grammar of that
kind does not express, and it drops them (`not`, `if`/`then`/`else`, `uniqueItems`, `contains`, the dependency
keywords), takes only the first of several `allOf` subschemas, and generates no property that `required` names
outside `properties`. Each was checked against the installed backend: a matcher accepted an output breaking it. A
schema using one is refused by name, as vLLM refuses what its xgrammar backend cannot honour, instead of giving
outputs that break their row's spec without an error. `oneOf` is compiled as `anyOf` (an output may match more than
one of its subschemas): left alone, as the discriminated unions it is written for do not overlap.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
              "dependentRequired", "dependentSchemas", "dependencies")
# keywords whose value is a subschema, a list of them, or a map of names to them (where the walk goes on)
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_constraint(schema: Any) -> str | None:
    """What in `schema` (parsed JSON) the grammar would not enforce, with where it is (a JSON pointer), or None."""
    for path, node in _subschemas(schema, ""):
        used = [k for k in UNENFORCED if k in node]
        if used:
            return f"'{used[0]}' (at {path or '/'})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} subschemas (at {path or '/'}; only the first is compiled)"
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list):
            missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
            if missing:
                return f"'required' naming {missing[0]!r} outside 'properties' (at {path or '/'})"
    return None


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in `node`, depth first, with its JSON pointer."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{path}/{key}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{_escaped(name)}")


def _escaped(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
