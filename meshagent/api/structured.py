"""Structured output: `response_format` (and a tool's parameters) as a grammar the sampler
enforces (`engine/grammar.py`), so the reply is JSON of the asked shape by construction
rather than by hope. JSON schemas become GBNF in `api/json_schema.py`."""

from __future__ import annotations

from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF

from meshagent.api import errors
from meshagent.api.json_schema import SchemaError, to_gbnf

# A grammar travels to the last stage of a split in one message header (64 KiB at most).
MAX_GRAMMAR = 48 * 1024


def json_grammar() -> str:
    """Any JSON object."""
    return JSON_GBNF


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
