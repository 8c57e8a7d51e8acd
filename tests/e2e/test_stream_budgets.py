"""A member of the mesh that opens more streams of one service than its budget: past the
budget the agent refuses each new stream (REFUSED_STREAM, logged), and serves the member's
streams within it, and everyone else, as before."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio

from meshagent.discovery import probe
from meshagent.launch import AgentProcess, start_agent
from meshagent.net.errors import StreamResetError
from meshagent.services import STREAM_BUDGETS
from meshagent.testing.member import AgentAddress, Member
from meshagent.wire.errors import ErrorCode

SMALL = ("--slots", "1", "--ctx-size", "512", "--threads", "1", "--no-mdns")


@pytest.fixture
def agent(tmp_path: Path):
    proc = start_agent(tmp_path / "agent", *SMALL, wait_model=False)
    yield proc
    proc.stop()


async def probe_once(stream, data: bytes, *, sent: bytes = b"") -> None:
    """Send `data` (after what was `sent` before), end, and check the agent's reply."""
    await stream.send_all(data)
    await stream.send_eof()
    reply = b""
    while chunk := await stream.receive_some():
        reply += chunk
    whole = sent + data
    assert reply == probe._REPLY.pack(hashlib.sha256(whole).digest(), len(whole))


async def test_streams_past_a_labels_budget_are_refused_and_the_rest_served(
    agent: AgentProcess,
):
    budget = STREAM_BUDGETS[probe.LABEL]
    address = AgentAddress.of(agent.data_dir)
    with trio.fail_after(60):
        async with Member.join(address) as hostile, Member.join(address) as honest:
            held = [await hostile.open(probe.LABEL) for _ in range(budget)]
            for stream in held:  # the agent serves them: they hold its probe service open
                await stream.send_all(b"x")
            for _ in range(3):
                over = await hostile.open(probe.LABEL)
                with pytest.raises(StreamResetError) as refused:
                    await over.receive_some()
                assert refused.value.code is ErrorCode.REFUSED_STREAM
                assert "over budget" in refused.value.reason
            await probe_once(await honest.open(probe.LABEL), b"honest" * 100)
            await probe_once(held[0], b"", sent=b"x")
            await probe_once(await hostile.open(probe.LABEL), b"within the budget again")
    log = agent.log_text()
    assert log.count("stream.refused") == 3 and "over budget" in log
