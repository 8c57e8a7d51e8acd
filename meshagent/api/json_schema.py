"""JSON schemas as GBNF grammars, enforcing every keyword they keep and refusing the rest.

llama-cpp-python's converter does the structure (types, properties, items, enums, patterns,
lengths, references, unions). Two gaps are closed here: integer bounds (`minimum`,
`maximum` and their exclusive forms), which it ignores, become digit-range rules; and any
keyword that would constrain the value but that neither enforces is refused by name,
rather than ignored into output that does not validate. Strings admit no raw control
characters, which JSON forbids.
"""

from __future__ import annotations

import math
from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

# Keywords that say nothing about which values validate, or that the converter enforces.
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "enum", "const", "anyOf",
    "oneOf", "allOf", "$ref", "$defs", "definitions", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",  # integers: see below
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
    "readOnly", "writeOnly", "deprecated",
}  # fmt: skip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_DIGITS = 16  # the converter's integers have at most this many digits; so do ours
_LOOSE_CHAR = '[^"\\\\] |'
_STRICT_CHAR = '[^"\\\\\\x7F\\x00-\\x1F] |'


class SchemaError(ValueError):
    """A schema that cannot be enforced; `path` names where."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def check_keywords(schema: Any, path: str = "") -> None:
    """Raise SchemaError at the first keyword that would be ignored."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_keywords(item, f"{path}.{i}" if path else str(i))
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key not in ENFORCED:
            raise SchemaError(f"the keyword '{key}' cannot be enforced", where)
        if key in _BOUNDS and schema.get("type") != "integer":
            raise SchemaError(f"'{key}' can be enforced on integers only", where)
        if key in _BOUNDS and not (isinstance(value, int | float) and not isinstance(value, bool)):
            raise SchemaError(f"'{key}' must be a number", where)
        if key in ("minLength", "maxLength") and "pattern" in schema:
            raise SchemaError(f"'{key}' cannot be enforced together with 'pattern'", where)
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                check_keywords(sub, f"{where}.{name}")
        elif key in ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf"):
            check_keywords(value, where)


class _Converter(SchemaConverter):
    def visit(self, schema: Any, name: str) -> str:
        if _bounded_integer(schema):
            rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
            self._add_rule("space", '" "?')
            return self._add_rule(rule_name, f"({integer_range(*_bounds(schema))}) space")
        return super().visit(schema, name)


def _bounded_integer(schema: Any) -> bool:
    return (
        isinstance(schema, dict)
        and schema.get("type") == "integer"
        and any(k in schema for k in _BOUNDS)
    )


def _bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    lo: int | None = None
    hi: int | None = None
    if "minimum" in schema:
        lo = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        v = math.floor(schema["exclusiveMinimum"]) + 1
        lo = v if lo is None else max(lo, v)
    if "maximum" in schema:
        hi = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        v = math.ceil(schema["exclusiveMaximum"]) - 1
        hi = v if hi is None else min(hi, v)
    return lo, hi


def to_gbnf(schema: dict[str, Any]) -> str:
    """The grammar of the JSON texts `schema` admits; SchemaError if it cannot be."""
    check_keywords(schema)
    for lo, hi in _integer_bounds(schema):
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"no integer lies between {lo} and {hi}", "minimum")
    converter = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        resolved = converter.resolve_refs(schema, "stdin")
        converter.visit(resolved, "")
    except SchemaError:
        raise
    except Exception as e:  # the converter raises assertions, KeyErrors, ValueErrors, ...
        raise SchemaError(str(e) or type(e).__name__, "") from e
    lines = converter.format_grammar().splitlines()
    strict = (
        r.replace(_LOOSE_CHAR, _STRICT_CHAR, 1) if r.startswith("char ::=") else r for r in lines
    )
    return "\n".join(strict)


def _integer_bounds(schema: Any) -> list[tuple[int | None, int | None]]:
    out = []
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and any(k in schema for k in _BOUNDS):
            out.append(_bounds(schema))
        for value in schema.values():
            out += _integer_bounds(value)
    elif isinstance(schema, list):
        for value in schema:
            out += _integer_bounds(value)
    return out


# ----- integer ranges as GBNF -----


def integer_range(lo: int | None, hi: int | None) -> str:
    """GBNF alternatives for the decimal integers from lo to hi (None: unbounded on that side,
    up to 16 digits), without leading zeros or a minus zero."""
    alts: list[str] = []
    if lo is None or lo < 0:  # the negative part: "-" and the magnitudes it spans
        top = None if lo is None else -lo  # largest magnitude
        bottom = 1 if hi is None or hi >= 0 else -hi
        alts += ['"-" ' + a for a in _magnitudes(bottom, top)]
    if hi is None or hi >= 0:
        alts += _magnitudes(max(lo or 0, 0), hi)
    return " | ".join(alts)


def _magnitudes(a: int, b: int | None) -> list[str]:
    """Alternatives for a..b (b None: every number of at most 16 digits from a on)."""
    if b is None:
        digits = len(str(a))
        alts = _range(a, 10**digits - 1)
        if digits < _DIGITS:
            alts.append(f"[1-9] [0-9]{{{digits},{_DIGITS - 1}}}")
        return alts
    return _range(a, b)


def _range(a: int, b: int) -> list[str]:
    """Alternatives, one per run of numbers that share their leading digits, for a..b."""
    out = []
    for start, stop in _runs(a, b):
        s, e = str(start), str(stop)
        parts = []
        for x, y in zip(s, e, strict=True):
            parts.append(f'"{x}"' if x == y else f"[{x}-{y}]")
        out.append(" ".join(parts))
    return out


def _runs(a: int, b: int) -> list[tuple[int, int]]:
    """a..b cut where the digits' pattern changes: each run is [start, stop] of one length,
    equal leading digits, then one digit ranging, then digits that run over 0-9."""
    stops = {b}
    k = 1
    while a <= (stop := _nines(a, k)) < b:
        stops.add(stop)
        k += 1
    k = 1
    while a < (stop := (b + 1) - (b + 1) % 10**k - 1) <= b:
        stops.add(stop)
        k += 1
    runs, start = [], a
    for stop in sorted(stops):
        runs.append((start, stop))
        start = stop + 1
    return runs


def _nines(n: int, k: int) -> int:
    """n with its last k digits made 9."""
    s = str(n)
    return int(s[:-k] + "9" * k) if k < len(s) else int("9" * k)
