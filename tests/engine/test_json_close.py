"""The text that closes a JSON value, from any prefix of one."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.engine.json_close import JsonCloser

DOCS = [
    '{"a": [1, -2.5e+3, true, null, {"b": "x\\"y\\u00e9z"}], "c": {"d": []}, "e": false}',
    '{ "k" : "v" , "l":[ [ ], {} ,"s" ] }',
    "{}",
    '{"u":"\\u12ab", "n": -0.5}',
    '{"é": "ü", "deep": [[[{"x": [0]}]]]}',
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


def closes(prefix: bytes) -> None:
    c = JsonCloser()
    c.feed(prefix)
    text = prefix.decode(errors="ignore") + c.closing()
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("doc", DOCS)
def test_every_prefix_closes_into_an_object(doc):
    data = doc.encode()
    for i in range(len(data) + 1):
        closes(data[:i])


@given(st.dictionaries(st.text(max_size=5), json_values, max_size=5), st.booleans())
def test_every_prefix_of_any_object_closes(obj, indent):
    data = json.dumps(obj, indent=2 if indent else None, ensure_ascii=False).encode()
    for i in range(0, len(data) + 1, max(1, len(data) // 40)):
        closes(data[:i])


def test_a_whole_object_needs_nothing():
    c = JsonCloser()
    c.feed(b'{"a": 1}')
    assert c.closing() == ""
