"""Structured output: `response_format` (and a tool's parameters) as a grammar the sampler
enforces (`engine/grammar.py`), so the reply is JSON of the asked shape by construction
rather than by hope. JSON schemas become GBNF in `api/json_schema.py`."""

from __future__ import annotations

from typing import Any

from meshagent.api import errors
from meshagent.api.json_schema import SchemaError, to_gbnf

# A grammar travels to the last stage of a split in one message header (64 KiB at most).
MAX_GRAMMAR = 48 * 1024


# `json_object`'s bounds: a model that repeats itself (nesting ever deeper, or the same item
# again) has to close the object within them, rather than run to its token limit and end
# with JSON cut short.
JSON_DEPTH = 5  # levels of objects and arrays, the outer object included
JSON_MEMBERS = 16  # members of an object, items of an array
JSON_STRING = 256  # characters of a string


def json_grammar() -> str:
    """A JSON object, within the bounds above."""
    rules = [
        "root ::= object-1",
        'ws ::= | " " | "\\n" [ \\t]{0,20}',
        'char ::= [^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})',
        f'string ::= "\\"" char{{0,{JSON_STRING}}} "\\"" ws',
        'number ::= "-"? ([0-9] | [1-9] [0-9]{1,15}) ("." [0-9]{1,16})? '
        "([eE] [-+]? [0-9]{1,3})? ws",
        'scalar ::= string | number | ("true" | "false" | "null") ws',
    ]
    more = JSON_MEMBERS - 1
    for d in range(1, JSON_DEPTH + 1):
        value = f"value-{d}"
        inner = "scalar" if d == JSON_DEPTH else f"object-{d + 1} | array-{d + 1} | scalar"
        rules.append(f"{value} ::= {inner}")  # what a level-d object or array holds
        member = f'string ":" ws {value}'
        rules.append(f'object-{d} ::= "{{" ws ({member} ("," ws {member}){{0,{more}}})? "}}" ws')
        if d > 1:  # the outer level is an object
            rules.append(f'array-{d} ::= "[" ws ({value} ("," ws {value}){{0,{more}}})? "]" ws')
    return "\n".join(rules)


def schema_grammar(schema: Any, *, param: str) -> str:
    """JSON that validates against `schema`; a 400 naming `param` if it cannot be
    converted."""
    if not isinstance(schema, dict):
        raise errors.bad_request("A JSON schema must be an object.", param=param)
    try:
        grammar = to_gbnf(schema)
    except SchemaError as e:
        where = f"{param}.{e.path}" if e.path else param
        raise errors.bad_request(f"This JSON schema cannot be enforced: {e}.", param=where) from e
    if len(grammar) > MAX_GRAMMAR:
        raise errors.bad_request(
            f"This JSON schema is too large to enforce ({len(grammar)} bytes of grammar, "
            f"at most {MAX_GRAMMAR}).",
            param=param,
        )
    return grammar


def response_format_grammar(fmt: dict[str, Any] | None) -> str | None:
    """The grammar `response_format` asks for (None: free text)."""
    kind = "text" if fmt is None else fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar()
    if kind == "json_schema":
        spec = fmt.get("json_schema") if fmt is not None else None
        if not isinstance(spec, dict) or "schema" not in spec:
            raise errors.bad_request(
                "response_format json_schema needs a 'json_schema' object with a 'schema'.",
                param="response_format.json_schema",
            )
        return schema_grammar(spec["schema"], param="response_format.json_schema.schema")
    raise errors.bad_request(
        f"Unknown response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'.",
        param="response_format.type",
    )
