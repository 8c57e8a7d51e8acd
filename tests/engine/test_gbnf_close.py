"""The shortest text that completes a prefix of a grammar's language, for the grammars the
API enforces: from every prefix of random texts of the grammar, the closing makes JSON that
validates against the schema the grammar came from."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from meshagent.api.structured import schema_grammar
from meshagent.engine.gbnf_close import Chars, GbnfCloser, Grammar
from tests.engine.test_grammar import OPEN_SCHEMA, SCHEMA

SCHEMAS = {
    "open": OPEN_SCHEMA,
    "bounded": SCHEMA,
    "union": {
        "type": "object",
        "properties": {
            "x": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}}]},
            "y": {"enum": ["long-word", "b", 3]},
            "z": {"type": "string", "minLength": 3, "maxLength": 5},
        },
        "required": ["x", "y", "z"],
    },
}


def random_text(grammar: Grammar, rng: np.random.Generator, budget: int = 400) -> str:
    """A random text of the grammar: alternatives drawn at random, the shortest once the
    text passes `budget` characters (so it ends)."""
    out: list[int] = []

    def expand(name: str) -> None:
        alts = grammar.rules[name]
        alt = alts[rng.integers(len(alts))] if len(out) < budget else grammar.shortest_alt(name)
        for el in alt:
            if isinstance(el, Chars):
                out.append(_random_char(el, rng))
            else:
                expand(el)

    expand("root")
    return "".join(map(chr, out))


def _random_char(el: Chars, rng: np.random.Generator) -> int:
    for _ in range(100):
        c = int(rng.choice([rng.integers(0x20, 0x7F), rng.integers(0xA0, 0x3000)]))
        if el.matches(c):
            return c
    return el.first()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_prefix_of_random_texts_closes_into_a_valid_reply(name):
    schema = SCHEMAS[name]
    grammar = Grammar(schema_grammar(schema, param="x"))
    rng = np.random.default_rng(len(name))
    for _ in range(20):
        text = random_text(grammar, rng)
        jsonschema.validate(json.loads(text), schema)  # the walk itself is of the language
        closer = GbnfCloser(grammar)
        data = text.encode()
        for i in range(len(data) + 1):
            c = closer.copy()
            c.feed(data[:i])
            assert not c.lost
            whole = data[:i].decode(errors="ignore") + c.closing()
            jsonschema.validate(json.loads(whole), schema)
        closer.feed(data)
        assert closer.done and closer.closing() == ""


def test_the_closing_is_the_shortest():
    closer = GbnfCloser(schema_grammar(SCHEMAS["union"], param="x"))
    assert closer.closing() == '{"x":[],"y":3,"z":"aaa"}'
    closer.feed(b'{"x": [12')
    assert closer.closing() == '],"y":3,"z":"aaa"}'


def test_text_outside_the_grammar_is_lost_not_an_error():
    closer = GbnfCloser(schema_grammar(SCHEMA, param="x"))
    closer.feed(b"[not an object")
    assert closer.lost and closer.closing() == ""


def test_a_grammar_the_reader_does_not_know_is_refused():
    with pytest.raises(ValueError):
        Grammar("root ::= undefined-rule")
    with pytest.raises(ValueError):
        Grammar('root ::= "a" @')
