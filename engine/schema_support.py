"""JSON-schema constraints the grammar backend (xgrammar 0.2.9) compiles but does not enforce.

xgrammar turns a schema into a grammar of the JSON it admits; a few keywords constrain JSON in ways a grammar of that
kind does not express, and it drops them (`not`, `if`/`then`/`else`, `uniqueItems`, `contains`, the dependency
keywords, `multipleOf` on numbers, the formats `regex`, `iri`, `iri-reference`, `idn-email` and `idn-hostname`), takes
only the first of several `allOf` subschemas, and generates no property that `required` names outside `properties`.
Where a schema object combines keywords it compiles one and drops the rest: beside `anyOf`, `oneOf`, `allOf` or
`$ref`, every other constraint; beside `enum` or `const`, every other constraint (a `type` that every listed value has
changes nothing); beside `format`, a `pattern`; `patternProperties` beside an `additionalProperties` schema. Lengths
beside `format` or `pattern` are dropped too, but pass: pydantic writes them for every URL field (`HttpUrl`: format
uri, lengths 1-2083) and constrained string, and refusing those models would refuse most schemas with a URL (the
README names the gap). Each was checked against the installed backend: a matcher accepted an output
breaking it. A schema using one is refused by name, as vLLM refuses what its xgrammar backend cannot honour, instead of
giving outputs that break their row's spec without an error. `oneOf` is compiled as `anyOf` (an output may match more
than one of its subschemas): left alone, as the discriminated unions it is written for do not overlap. Keywords that
only annotate (`title`, `description`, `default`, ...) and format names JSON Schema does not define (annotations
there too) pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

UNENFORCED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
              "dependentRequired", "dependentSchemas", "dependencies")
UNENFORCED_FORMATS = ("regex", "iri", "iri-reference", "idn-email", "idn-hostname")
# JSON Schema's validation keywords (the rest annotate, or are unknown and ignored by any validator)
CONSTRAINTS = ("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "maxLength", "minLength", "pattern", "format", "items", "prefixItems", "additionalItems", "maxItems",
               "minItems", "properties", "patternProperties", "additionalProperties", "required", "propertyNames",
               "maxProperties", "minProperties", "unevaluatedProperties", "unevaluatedItems", "anyOf", "oneOf",
               "allOf", "$ref", *UNENFORCED)
COMPOSITIONS = ("anyOf", "oneOf", "allOf", "$ref")  # beside one of these the backend compiles nothing else
_JSON_TYPES = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}  # and the numbers
# keywords whose value is a subschema, a list of them, or a map of names to them (where the walk goes on)
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_constraint(schema: Any) -> str | None:
    """What in `schema` (parsed JSON) the grammar would not enforce, with where it is (a JSON pointer), or None."""
    for path, node in _subschemas(schema, ""):
        found = _unenforced_here(node)
        if found is not None:
            what, why = found
            return f"{what} (at {path or '/'}{'; ' + why if why else ''})"
    return None


def _unenforced_here(node: dict) -> tuple[str, str] | None:
    """What in this schema object alone the backend drops, and why if the name does not say, or None."""
    used = [k for k in UNENFORCED if k in node]
    if used:
        return f"'{used[0]}'", ""
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return f"'allOf' of {len(node['allOf'])} subschemas", "only the first is compiled"
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        missing = [name for name in required if not isinstance(properties, dict) or name not in properties]
        if missing:
            return f"'required' naming {missing[0]!r} outside 'properties'", ""
    for first in (*COMPOSITIONS, "enum", "const"):
        if first in node:
            beside = [k for k in CONSTRAINTS if k in node and k != first and not _agrees(node, first, k)]
            if beside:
                return f"'{beside[0]}' beside '{first}'", f"only the '{first}' is compiled"
    types = node.get("type")
    if "multipleOf" in node and types != "integer" and (not isinstance(types, list) or set(types) != {"integer"}):
        return "'multipleOf' on a number", "the backend compiles it for integers only"
    if node.get("format") in UNENFORCED_FORMATS:
        return f"format '{node['format']}'", ""
    if "format" in node and "pattern" in node:
        return "'pattern' beside 'format'", "only the 'format' is compiled"
    if "patternProperties" in node and isinstance(node.get("additionalProperties"), dict):
        return "'patternProperties' beside an 'additionalProperties' schema", "the latter takes every other name"
    return None


def _agrees(node: dict, first: str, key: str) -> bool:
    """Whether `key` beside `first` changes nothing the backend drops: a `type` that every value `enum` or `const`
    lists has."""
    if key != "type" or first not in ("enum", "const"):
        return False
    values = node[first] if first == "enum" else [node[first]]
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    return isinstance(values, list) and all(any(_has_type(v, name) for name in types) for v in values)


def _has_type(value: Any, name: Any) -> bool:
    """Whether a JSON value is of JSON Schema type `name` (1.0 is an integer, true is not a number)."""
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float))
    return isinstance(value, _JSON_TYPES.get(name, ()))


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
