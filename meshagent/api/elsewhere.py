"""A request served by another agent of the mesh: every inference request this agent's API takes
for a model a peer serves goes there over `gen/1` (docs/protocol.md 11.1), and comes back as
serving it here would give it. A completion comes back as events (`serve`), each of its n
choices on a stream of its own (`api/carried.py`: it goes on at another entry when its entry is
lost); embeddings come back as vectors (`embed`). This agent formats the client's reply itself,
so it knows what its client has; of an entry's receipt it passes on only `RECEIPT`, and names
the peer it asked in `x-meshagent-served-by`."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace

import structlog
import trio

from meshagent.api import errors
from meshagent.api.carried import Carried, Emit
from meshagent.api.completion_events import Choice, Events, Failed, Opened
from meshagent.api.errors import ApiError
from meshagent.api.exchange import ClientGone, Exchange
from meshagent.api.gen_messages import Ask, Embedded, Fail, Head, Vector, encode
from meshagent.api.gen_stream import Broken, frames, read_message
from meshagent.api.here import Continuation
from meshagent.api.prepare import Asked, Prepared
from meshagent.api.schemas import ChatCompletionRequest
from meshagent.api.tools import SYNTAXES
from meshagent.errors import MeshError
from meshagent.serving.directory import GENERATE_LABEL, Headers, ModelDirectory, RemoteModel
from meshagent.serving.generation import Delta, Finished
from meshagent.serving.sampling import SamplingParams

log = structlog.get_logger(__name__)

# The receipt headers of an entry that reach the client (docs/api.md, "Receipts").
RECEIPT = frozenset({b"x-meshagent-stages", b"x-meshagent-wire-dtype", b"x-meshagent-wire-exact"})
_MAX_HEADER_VALUE = 8192
# Seconds an embeddings request carried to the peer serving its model may take, answer and
# all (this agent's own take at most 256 inputs of 2048 tokens).
EMBEDDINGS_DEADLINE = 300.0


async def serve(
    directory: ModelDirectory,
    asked: Asked,
    out: Events,
    *,
    remote: RemoteModel | None = None,
    moved: Continuation | None = None,
    here: Callable[[], Prepared | None] = lambda: None,
) -> None:
    """`asked` served at `remote`, the peer serving its model, its events to `out` as serving
    it here gives them: `Opened`, then each choice's Delta and Finished (as `Choice` when
    n > 1), or `Failed`. With `moved`, the one generation this agent began goes on at the entry
    that serves the model now (what the client has was sent already). `here` prepares the
    request on this agent, for when the mesh moves the model to it mid-request."""
    name = asked.req.model
    deadline = directory.unserved_for_now(name)
    ask = Ask("POST", asked.path, asked.body)
    if moved is not None:
        carried = Carried.continuing(directory, ask, name, deadline, moved)
        try:
            await carried.hand_on(moved.why, out.send_nowait)
        except ApiError as e:
            out.send_nowait(Failed(e))
        finally:
            await carried.aclose()
        return
    assert remote is not None
    n = asked.req.n
    choices = [Carried(directory, a, name, deadline, here) for a in _asks(asked, ask)]
    try:
        heads = await _start(choices, remote)
        out.send_nowait(_opened(asked, heads[0], choices[0].entry))
        async with trio.open_nursery() as nursery:
            for i, carried in enumerate(choices):
                emit = out.send_nowait if n == 1 else _tagged(out, i)
                nursery.start_soon(_run, carried, emit, out)
    except ApiError as e:
        out.send_nowait(Failed(e))
    finally:
        for carried in choices:
            await carried.aclose()


def _asks(asked: Asked, ask: Ask) -> list[Ask]:
    """The ask of each choice. Choice i of n > 1 samples with the seed + i, as here
    (`api/here.py`): this agent draws the seed where the client gave none, and the entry
    prefills the prompt once for them all (`share`)."""
    req = asked.req
    if req.n == 1:
        return [ask]
    seed = SamplingParams(temperature=req.temperature, seed=req.seed).seeded().seed
    share = secrets.token_hex(8)
    return [
        replace(ask, seed=None if seed is None else seed + i, share=share) for i in range(req.n)
    ]


async def _start(choices: list[Carried], remote: RemoteModel) -> list[Head]:
    """Each choice asked of `remote` at once: their heads, or the first refusal."""
    heads: list[Head | None] = [None] * len(choices)
    refused: list[ApiError] = []

    async def start(i: int, nursery: trio.Nursery) -> None:
        try:
            heads[i] = await choices[i].start(remote)
        except ApiError as e:
            refused.append(e)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(choices)):
            nursery.start_soon(start, i, nursery)
    if refused:
        raise refused[0]
    return [h for h in heads if h is not None]


async def _run(carried: Carried, emit: Emit, out: Events) -> None:
    try:
        await carried.run(emit)
    except ApiError as e:
        out.send_nowait(Failed(e))


def _tagged(out: Events, index: int) -> Emit:
    def emit(ev: Delta | Finished) -> None:
        out.send_nowait(Choice(index, ev))

    return emit


def _opened(asked: Asked, head: Head, entry: str) -> Opened:
    req = asked.req
    return Opened(
        chat=isinstance(req, ChatCompletionRequest),
        model=head.model,
        n=req.n,
        stream=req.stream,
        include_usage=req.include_usage(),
        logprobs=req.top_count() is not None,
        echo=head.echo,
        tools=None if head.tools is None else SYNTAXES[head.tools],
        receipt=[*receipt(head.headers), (b"x-meshagent-served-by", entry.encode())],
    )


def receipt(headers: Headers) -> Headers:
    """The entry's receipt headers that may reach the client (`RECEIPT`)."""
    return [(k, v) for k, v in headers if k in RECEIPT and len(v) <= _MAX_HEADER_VALUE]


async def embed(
    ex: Exchange,
    directory: ModelDirectory,
    remote: RemoteModel,
    body: bytes,
    inputs: int,
    deadline: float = EMBEDDINGS_DEADLINE,
) -> tuple[list[list[float]], int, str]:
    """The vectors of an embeddings request (`body`, of `inputs` texts) that `remote` serves,
    the tokens read and the model's name; stopped when the client leaves (`ClientGone`) and
    given up after `deadline` seconds (504)."""
    failure: ApiError | None = None  # raised out of the nursery, not in a group
    answer: tuple[list[list[float]], int, str] | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
        with trio.move_on_after(deadline) as timer:
            try:
                answer = await _vectors(directory, remote, body, inputs)
            except ApiError as e:
                failure = e
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if answer is not None:
        return answer
    if not timer.cancelled_caught:
        raise ClientGone
    log.warning("embed.timeout", peer=remote.peer_id, seconds=deadline)
    raise ApiError(
        504,
        f"The peer serving '{remote.id}', {remote.label}, did not answer within "
        f"{deadline:g} s; retry, or send fewer inputs per request.",
        type="server_error",
        code="peer_timeout",
    )


async def _vectors(
    directory: ModelDirectory, remote: RemoteModel, body: bytes, inputs: int
) -> tuple[list[list[float]], int, str]:
    try:
        stream = await directory.open_stream(remote.peer_id, GENERATE_LABEL)
    except MeshError as e:
        raise errors.unavailable(
            f"The peer serving '{remote.id}', {remote.label}, is unreachable: {e}",
            code="peer_unavailable",
        ) from e
    vectors: list[list[float]] = []
    async with stream:
        reader = frames()
        try:
            try:
                await stream.send_all(encode(Ask("POST", "/v1/embeddings", body)))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise Broken(str(e)) from e
            while True:
                msg = await read_message(stream, reader)
                if isinstance(msg, Fail):
                    raise msg.error
                if isinstance(msg, Vector) and len(vectors) < inputs:
                    if vectors and len(msg.values) != len(vectors[0]):
                        raise Broken("vectors of different lengths")
                    vectors.append(list(msg.values))
                elif isinstance(msg, Embedded) and len(vectors) == inputs:
                    return vectors, msg.tokens, msg.model
                else:
                    raise Broken(f"an unexpected {type(msg).__name__} after {len(vectors)} vectors")
        except Broken as e:
            raise ApiError(
                502,
                f"The peer serving '{remote.id}' failed before answering: {e}",
                type="server_error",
                code="peer_failed",
            ) from e
