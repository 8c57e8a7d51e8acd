"""The embeddings request and reply without a model: what is refused, and base64 that the
official client decodes back to the same floats."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from meshagent.api.embeddings import MAX_INPUTS, embedding_reply, parse_embedding
from meshagent.api.errors import ApiError


def test_inputs_become_texts_and_what_cannot_be_honoured_is_refused():
    assert parse_embedding({"model": "m", "input": "a"}).texts() == ["a"]
    assert parse_embedding({"model": "m", "input": ["a", "b"]}).texts() == ["a", "b"]
    for body, param in (
        ({"model": "m", "input": [1, 2]}, "input"),
        ({"model": "m", "input": [[1, 2]]}, "input"),
        ({"model": "m", "input": ""}, "input"),
        ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input"),
        ({"model": "m", "input": "a", "dimensions": 4}, "dimensions"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m"}, "input"),
    ):
        with pytest.raises(ApiError) as e:
            parse_embedding(body).texts()
        assert e.value.status == 400 and e.value.param == param, body


def test_base64_is_little_endian_float32_of_the_same_vector():
    v = [0.5, -0.25, 1e-3]
    reply = embedding_reply("m", [v], 3, "base64")
    raw = base64.b64decode(reply["data"][0]["embedding"])
    assert np.allclose(np.frombuffer(raw, dtype="<f4"), v)
    assert embedding_reply("m", [v], 3, "float")["data"][0]["embedding"] == v
    assert reply["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
