"""A member of the mesh that sends what it should not, to a real agent process: each bad
message gets an error on its own stream, and the agent lives on and serves its HTTP clients
the same text as before.

One agent serves the whole module (`agent`, tests/e2e/conftest.py); `as_member` is how a test
speaks to it as a member (a fresh identity with the mesh's secret), on any label.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import cbor2
import pytest
import trio
from openai import OpenAI

from meshagent.api.gen_messages import FRAMING, Fail, Head, Message, decode
from meshagent.launch import AgentProcess, start_agent
from meshagent.net.frame_reader import receive_frame
from meshagent.net.stream import MeshStream
from meshagent.serving.directory import GENERATE_LABEL
from meshagent.serving.generation import Delta, Finished
from meshagent.testing.member import AgentAddress, Member
from meshagent.wire.framing import LengthPrefixDecoder

T = TypeVar("T")

SMOLLM_VOCAB = 49152  # the embedded default model's (SmolLM2-135M)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One agent process for the module, with default settings (as tests/e2e/conftest.py's,
    given longer to load and check its model on a busy machine)."""
    proc = start_agent(Path(tmp_path_factory.mktemp("agent")), timeout=240)
    yield proc
    proc.stop()


def as_member(
    agent: AgentProcess,
    label: str,
    talk: Callable[[MeshStream], Awaitable[T]],
    *,
    timeout: float = 60.0,
) -> T:
    """Join `agent`'s mesh as a new member, open a stream labelled `label` to it and return
    what `talk` makes of that stream (the stream is closed after)."""

    async def main() -> T:
        async with Member.join(AgentAddress.of(agent.data_dir)) as member:
            stream = await member.open(label)
            try:
                with trio.fail_after(timeout):
                    return await talk(stream)
            finally:
                await stream.aclose()

    return trio.run(main)


def raw_ask(model: str, history: list[int], *, path: str = "/v1/chat/completions") -> bytes:
    """A `gen/1` ask framed as any member could, whatever its values (no encoder checks)."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    ).encode()
    ask = {0: 1, 1: "ask", 2: "POST", 3: path, 4: body, 5: history, 6: 0, 7: None}
    return FRAMING.encode(cbor2.dumps(ask))


def gen_replies(payload: bytes) -> Callable[[MeshStream], Awaitable[list[Message | str]]]:
    """Send `payload` on a `gen/1` stream and read, as a member that stays, every message of
    the reply up to its `done` or `fail`; a reply cut short ends with why (a string)."""

    async def talk(stream: MeshStream) -> list[Message | str]:
        await stream.send_all(payload)
        frames = LengthPrefixDecoder(FRAMING)
        replies: list[Message | str] = []
        while not replies or not isinstance(replies[-1], Fail | Finished):
            try:
                body = await receive_frame(stream, frames, on_eof=lambda: EOFError("EOF"))
            except (trio.BrokenResourceError, EOFError) as e:
                return [*replies, f"the stream broke: {e}"]
            replies.append(decode(body))
        return replies

    return talk


def assert_alive(agent: AgentProcess) -> None:
    """The agent process still runs (given a second to show it does not)."""
    try:
        code = agent.proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    raise AssertionError(f"the agent died ({how}):\n{agent.log_text()[-2000:]}")


def chat(client: OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def model(agent: AgentProcess) -> str:
    client = OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def undisturbed(agent: AgentProcess, model: str) -> str:
    """The greedy reply before any member misbehaved."""
    client = OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return chat(client, model)


@pytest.mark.parametrize(
    "history,code",
    [
        ([-1, 2**31], "invalid_gen_message"),
        ([2**31], "invalid_gen_message"),
        ([42, SMOLLM_VOCAB], "invalid_continuation"),
    ],
    ids=["negative-and-2**31", "2**31", "vocabulary-size"],
)
def test_an_ask_with_token_ids_outside_the_vocabulary_is_refused_and_the_agent_serves_on(
    agent, client, model, undisturbed, history, code
):
    replies = as_member(agent, GENERATE_LABEL, gen_replies(raw_ask(model, history)))
    assert_alive(agent)
    [reply] = replies
    assert isinstance(reply, Fail) and not reply.resumable, reply
    assert reply.error.status == 400 and reply.error.code == code
    assert "outside" in reply.error.message
    assert chat(client, model) == undisturbed
    assert "gen.ask_refused" in agent.log_text()


def test_a_continuation_within_the_vocabulary_is_served(agent, model):
    replies = as_member(agent, GENERATE_LABEL, gen_replies(raw_ask(model, [42, SMOLLM_VOCAB - 1])))
    head, *deltas, done = replies
    assert isinstance(head, Head) and head.model == model, replies
    assert isinstance(done, Finished) and done.completion_tokens <= 4, replies
    assert all(isinstance(d, Delta) for d in deltas)
