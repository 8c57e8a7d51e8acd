"""The entry's side of a completion that follows its asker (`api/gen_moves.py`), on its own:
a bug while answering ends that completion's stream and never the service (nor the agent
whose nursery runs it); a rejoin is found only by the peer that asked, with its ticket."""

from __future__ import annotations

import trio

from meshagent.api.gen_moves import Answering, Rejoins


class Resettable:
    """A stream that only records its reset."""

    reason = ""

    def reset(self, reason: str) -> None:
        self.reason = reason


async def test_a_bug_while_answering_ends_its_stream_and_the_service_serves_on(nursery):
    rejoins = Rejoins()
    await nursery.start(rejoins.run)
    broken = Answering(Resettable())

    async def bug() -> None:
        raise RuntimeError("a bug")

    with trio.fail_after(5):
        await rejoins.answer(bug, broken)
    assert broken.done.is_set() and "a bug" in broken.stream.reason
    fine, ran = Answering(Resettable()), []

    async def work() -> None:
        ran.append(True)
        fine.done.set()

    with trio.fail_after(5):
        await rejoins.answer(work, fine)
    assert ran and not fine.stream.reason


def test_a_rejoin_is_found_only_by_its_asker_and_ticket():
    rejoins, answering = Rejoins(), Answering(Resettable())
    with rejoins.holding("asker", 7, answering):
        assert rejoins.find("asker", 7) is answering
        assert rejoins.find("other", 7) is None and rejoins.find("asker", 8) is None
    assert rejoins.find("asker", 7) is None
    with rejoins.holding("asker", None, answering):  # no ticket: nothing to find
        assert rejoins.find("asker", 0) is None
