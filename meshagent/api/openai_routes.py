"""OpenAI's endpoints: `GET /v1/models` (and `/v1/models/{id}`), `POST /v1/chat/completions`,
`/v1/completions` (through `Completions`, answered by `delivery.py`) and `/v1/embeddings` (here,
or by the peer that serves the model: `elsewhere.embed`)."""

from __future__ import annotations

from meshagent.api import elsewhere
from meshagent.api.catalog import Catalog
from meshagent.api.completions import Completions
from meshagent.api.delivery import deliver
from meshagent.api.embeddings import (
    EMBEDDINGS_PATH,
    EmbeddingRequest,
    embed_here,
    embedding_reply,
    parse_embedding,
)
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.prepare import KINDS

MODELS = "/v1/models"
MODEL_PREFIX = MODELS + "/"  # `/v1/models/{id}`


class OpenAIRoutes:
    def __init__(self, catalog: Catalog, completions: Completions) -> None:
        self.catalog = catalog
        self.completions = completions
        self.routes: Routes = {
            ("GET", MODELS): self._models,
            **{("POST", path): self._complete for path in KINDS},
            ("POST", EMBEDDINGS_PATH): self._embeddings,
        }

    async def model(self, ex: Exchange, name: str) -> None:
        """`GET /v1/models/{name}`."""
        await ex.send_json(200, self.catalog.card(name))

    async def _models(self, ex: Exchange) -> None:
        await ex.send_json(200, {"object": "list", "data": self.catalog.cards()})

    async def _complete(self, ex: Exchange) -> None:
        async def body() -> tuple[object, bytes]:
            return await ex.json_body(), ex.raw_body

        await self.completions.complete(ex, ex.path, body, deliver, sse=True)

    async def _embeddings(self, ex: Exchange) -> None:
        req = parse_embedding(await ex.json_body())
        name, vectors, tokens, served_by = await self.embed(ex, req, ex.raw_body)
        reply = embedding_reply(name, vectors, tokens, req.encoding_format)
        await ex.send_json(200, reply, served_by)

    async def embed(
        self, ex: Exchange, req: EmbeddingRequest, raw: bytes
    ) -> tuple[str, list[list[float]], int, list[tuple[bytes, bytes]]]:
        """The request's vectors (here, or by the agent that serves the model: `raw` is the
        request as it goes there), their token count, and the model's name and receipt."""
        texts = req.texts()
        await self.catalog.await_served(req.model)
        model = self.catalog.local(req.model)
        if model is None and (remote := self.catalog.remote(req.model)) is not None:
            # The agent serving it answers (or says why not).
            directory = self.catalog.directory
            vectors, tokens, name = await elsewhere.embed(ex, directory, remote, raw, len(texts))
            return name, vectors, tokens, [(b"x-meshagent-served-by", remote.peer_id.encode())]
        model = self.catalog.model(req.model)
        vectors, tokens = await embed_here(model, texts)
        return model.info.id, vectors, tokens, []
