"""`POST /v1/embeddings`: the request, validated at the edge, and the reply in OpenAI's shape
(vectors as floats, or base64 of little-endian float32, which the official client asks for)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from meshagent.api.errors import bad_request
from meshagent.api.schemas import parse_body
from meshagent.errors import ContextOverflow
from meshagent.serving.local_model import LocalModel

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_INPUTS = 256


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused: the model's vectors have one size
    user: str | None = None

    def texts(self) -> list[str]:
        """The inputs as text; token ids are refused (they would be another tokenizer's)."""
        given = [self.input] if isinstance(self.input, str) else list(self.input)
        if not given:
            raise bad_request("'input' must not be empty.", param="input")
        if not all(isinstance(x, str) for x in given):
            raise bad_request(
                "'input' as token ids is not supported here (they would be read with this "
                "model's tokenizer, not the one that made them): send the text.",
                param="input",
                code="unsupported_parameter",
            )
        if len(given) > MAX_INPUTS:
            raise bad_request(f"At most {MAX_INPUTS} inputs per request.", param="input")
        if any(not x for x in given):
            raise bad_request("An input must not be an empty string.", param="input")
        return [str(x) for x in given]


def parse_embedding(body: object) -> EmbeddingRequest:
    req = parse_body(EmbeddingRequest, body)
    if req.dimensions is not None:
        raise bad_request(
            "'dimensions' is not supported: this model's embeddings have one size.",
            param="dimensions",
            code="unsupported_parameter",
        )
    return req


async def embed_here(model: LocalModel, texts: list[str]) -> tuple[list[list[float]], int]:
    """The vectors of `texts` by this agent's `model`, and the tokens read; a 400 if it
    cannot embed (a split) or an input is too long."""
    if model.embedder is None:
        raise bad_request(
            f"The model '{model.info.id}' is split across agents on this mesh, and "
            "embeddings need every layer on one agent. Give one agent the memory to "
            "serve it whole.",
            param="model",
            code="model_split",
        )
    try:
        return await model.embedder.embed(texts)
    except ContextOverflow as e:
        raise bad_request(str(e), param="input", code="context_length_exceeded") from e


def embedding_reply(
    model: str, vectors: list[list[float]], tokens: int, encoding: str
) -> dict[str, Any]:
    def encoded(v: list[float]) -> list[float] | str:
        if encoding == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
        return v

    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
