"""llama.cpp's grammar sampler as a `Constraint` over the embedded model's vocabulary: it
keeps a walk through random logits inside a JSON schema, refuses tokens it does not allow
with an error rather than llama.cpp's abort, and allows the end only once the text is whole."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from meshagent.api.structured import json_grammar, schema_grammar
from meshagent.errors import EngineError
from meshagent.serving.sampling import Sampler, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"x": {"type": "number"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}


def walk(vocab, grammar, seed, limit=400):
    """Sample through random logits under the grammar until the end of generation."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), (), vocab.constraint(grammar))
    out = b""
    for _ in range(limit):
        token = sampler.sample(rng.normal(size=vocab.n_vocab).astype(np.float32) * 3)
        if vocab.is_end_of_generation(token):
            return out.decode()
        out += vocab.token_bytes(token)
    raise AssertionError(f"no end within {limit} tokens: {out!r}")


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_a_schema_grammar_give_json_that_validates(vocab, seed):
    text = walk(vocab, schema_grammar(SCHEMA, param="schema"), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_strings_admit_no_raw_control_characters(vocab):
    c = vocab.constraint(schema_grammar({"type": "string"}, param="schema"))
    quote, newline = vocab.tokenize('"', add_bos=False)[0], vocab.tokenize("\n", add_bos=False)[0]
    c.accept(quote)
    assert c.allows(vocab.tokenize("a", add_bos=False)[0])
    assert not c.allows(newline)  # JSON has no raw newline inside a string


def test_the_end_is_allowed_only_once_the_text_is_whole(vocab):
    c = vocab.constraint(json_grammar())
    eos = next(t for t in range(vocab.n_vocab) if vocab.is_end_of_generation(t))
    assert not c.allows(eos)
    with pytest.raises(EngineError):
        c.accept(eos)  # an error, not llama.cpp's abort of the process
    with pytest.raises(EngineError):
        c.accept(vocab.tokenize("hello", add_bos=False)[0])
    for t in vocab.tokenize("{}", add_bos=False):
        c.accept(t)
    assert c.allows(eos)


def test_a_mask_leaves_only_the_allowed_tokens(vocab):
    c = vocab.constraint(schema_grammar({"type": "boolean"}, param="schema"))
    masked = c.mask(np.zeros(vocab.n_vocab, dtype=np.float32))
    allowed = {vocab.token_bytes(int(t)).decode() for t in np.flatnonzero(np.isfinite(masked))}
    assert allowed and all("true".startswith(a) or "false".startswith(a) for a in allowed)


def test_a_grammar_that_does_not_parse_is_refused(vocab):
    vocab.check_grammar(json_grammar())
    with pytest.raises(EngineError, match="does not parse"):
        vocab.check_grammar("root ::= (")


def test_json_object_bounds_its_nesting_so_a_looping_model_must_close_it(vocab):
    from meshagent.api.structured import JSON_DEPTH

    c = vocab.constraint(json_grammar())
    for t in vocab.tokenize('{"a":' * (JSON_DEPTH - 1) + '{"z":', add_bos=False):
        c.accept(t)
    brace, quote = vocab.tokenize("{", add_bos=False)[0], vocab.tokenize('"', add_bos=False)[0]
    assert not c.allows(brace) and c.allows(quote)  # no level deeper; a value closes it


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_the_json_object_grammar_give_an_object(vocab, seed):
    assert isinstance(json.loads(walk(vocab, json_grammar(), seed, limit=3000)), dict)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [12, 40])
def test_a_json_object_that_must_close_within_a_budget_does(vocab, seed, budget):
    # Random logits write deep, long JSON; the closer makes it whole before the budget, with
    # the end of generation at the last token at the latest.
    assert isinstance(json.loads(walk_within(vocab, json_grammar(), seed, budget)), dict)


def walk_within(vocab, grammar: str, seed: int, budget: int) -> str:
    """Sample through random logits under `grammar`, which must close within `budget`
    tokens, the end of generation included."""
    rng = np.random.default_rng(seed)
    constraint = vocab.constraint(grammar, None, budget)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), (), constraint)
    out = b""
    for _ in range(budget):
        token = sampler.sample(rng.normal(size=vocab.n_vocab).astype(np.float32) * 3)
        if vocab.is_end_of_generation(token):
            return out.decode()
        out += vocab.token_bytes(token)
    raise AssertionError(f"no end within {budget} tokens: {out!r}")


# Unbounded arrays and strings, required and optional properties, nested objects: a random
# walk runs on, and must still validate when the budget ends it.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "n": {"type": "integer", "minimum": 1, "maximum": 99},
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"k": {"type": "string"}, "v": {"type": "number"}},
                "required": ["k", "v"],
            },
        },
        "note": {"type": "string"},
    },
    "required": ["title", "tags", "n", "rows"],
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [24, 48, 96])
def test_a_schema_that_must_close_within_a_budget_validates(vocab, seed, budget):
    text = walk_within(vocab, schema_grammar(OPEN_SCHEMA, param="x"), seed, budget)
    jsonschema.validate(json.loads(text), OPEN_SCHEMA)


def test_the_any_json_grammar_gets_the_json_closer_and_a_schema_its_own():
    # The engine tells the API's json_object grammar by its first line (JSON_GRAMMAR_MARK).
    from meshagent.engine.gbnf_close import GbnfCloser
    from meshagent.engine.grammar import closer_for
    from meshagent.engine.json_close import JsonCloser

    assert isinstance(closer_for(json_grammar()), JsonCloser)
    assert isinstance(closer_for(schema_grammar(SCHEMA, param="x")), GbnfCloser)
