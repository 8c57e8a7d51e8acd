"""JSON schemas to grammars: integer bounds are enforced digit by digit, and keywords that
would be ignored are refused by name."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.api.json_schema import SchemaError, integer_range, to_gbnf


def as_regex(gbnf: str) -> re.Pattern[str]:
    """The alternatives `integer_range` writes (literals, classes, bounded repeats) as a
    regular expression."""
    alts = []
    for alt in gbnf.split(" | "):
        rx = ""
        for tok in re.findall(r'"[^"]*"|\[[^\]]*\](?:\{\d+,\d+\})?', alt):
            rx += re.escape(tok[1:-1]) if tok.startswith('"') else tok
        alts.append(rx)
    return re.compile("^(?:" + "|".join(alts) + ")$")


bound = st.one_of(st.none(), st.integers(-(10**7), 10**7))


@given(bound, bound, st.lists(st.integers(-(10**8), 10**8), min_size=20, max_size=60))
def test_an_integer_range_admits_exactly_the_numbers_in_it(lo, hi, probes):
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    rx = as_regex(integer_range(lo, hi))
    near = [x + d for x in (lo, hi, 0) if x is not None for d in (-11, -10, -1, 0, 1, 9, 10)]
    for n in probes + near:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(rx.match(str(n))) == inside, (lo, hi, n)
    assert not rx.match("-0") and not rx.match("007")


def test_bounds_reach_the_grammar():
    g = to_gbnf({"type": "integer", "minimum": 1, "exclusiveMaximum": 8})
    assert "[1-7]" in g


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "number", "minimum": 0}, "minimum"),
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        (
            {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
            "properties.a.uniqueItems",
        ),
        ({"type": "string", "pattern": "^a+$", "minLength": 2}, "minLength"),
        ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "anyOf.1.not"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "minimum"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(schema, path):
    with pytest.raises(SchemaError) as exc:
        to_gbnf(schema)
    assert exc.value.path == path


def test_strings_exclude_control_characters():
    g = to_gbnf({"type": "string"})
    assert "\\x00-\\x1F" in g
