"""What the structured-output and logprob tests and `bench/agent_api.py` share: a schema with
nested objects, arrays, enums and integers, prompts for it, tools, and log-probabilities
computed by llama.cpp directly.

The schema bounds its strings and arrays, so that every text it admits fits in `MAX_TOKENS`
(a character may take three byte tokens): a model that repeats itself inside a string
(SmolLM2 does) still closes the JSON, where an unbounded schema would run to the token limit
and end with finish_reason "length"."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["pilot", "teacher", "cook", "other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "floor": {"type": "integer"},
            },
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "hobbies", "home"],
    "additionalProperties": False,
}

MAX_TOKENS = 400
PEOPLE = ["Ann, a pilot", "my grandmother", "a chess champion", "Bob the cook", "a new teacher"]


def person_format() -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }


def reference_logprobs(model_path: Path, prompt: str, n: int) -> list[tuple[bytes, float]]:
    """The greedy continuation of `prompt` (with BOS), token by token, with each token's
    log-softmax, straight from llama.cpp."""
    engine = LlamaEngine(model_path, slots=1, slot_ctx=512, threads=1)
    try:
        tokens = engine.tokenize(prompt, add_bos=True)
        [logits] = engine.forward([ForwardItem(0, 0, tokens, True)])
        out = []
        for i in range(n):
            x = logits.astype(np.float64)
            lse = x.max() + np.log(np.exp(x - x.max()).sum())
            token = int(np.argmax(x))
            if engine.is_end_of_generation(token):
                break
            out.append((engine.token_bytes(token), float(x[token] - lse)))
            [logits] = engine.forward([ForwardItem(0, len(tokens) + i, [token], True)])
        return out
    finally:
        engine.close()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's forecast",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOL_PROMPTS = ["What is the weather in Paris?", "Add 2 and 40.", "Will it rain in Oslo this week?"]


# A strict schema whose reply has no natural end (an unbounded array of strings): a model may
# run on inside it until max_tokens (tests/e2e/test_openai_api.py, bench/agent_api.py).
TAGS = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}
