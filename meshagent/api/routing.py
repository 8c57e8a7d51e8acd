"""Which replica of a model served whole takes a request: the one that served the same
conversation last, whose kept prefix (`serving/prefix_cache.py`) makes the new turn's prefill
short, unless it is much busier than another; a new conversation goes to the least busy.

Sans-IO: the agent that holds the client's connection keys each request by a hash chain over
its text (`prefix_keys`: the chat's messages one by one, or a completion prompt's blocks),
remembers which replica it sent each request to, and counts the requests it has in flight to each.
It needs no tokenizer (an agent that only routes may not have the model) and no gossip: a
conversation's turns come from one client, through one agent. What it cannot see is another
agent's traffic to the same replicas or a replica evicting an entry; the first costs balance,
the second one cold prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from meshagent.api.schemas import ChatCompletionRequest, CompletionRequest

LOCAL = ""  # the candidate that is this agent's own replica

BLOCK_CHARS = 256  # a text prompt is keyed in blocks of this many characters
BLOCK_TOKENS = 64  # a token-id prompt in blocks of this many ids
REMEMBERED_KEYS = 16384  # requests remembered, least recently routed forgotten first
RECENT = 256  # conversations started (or moved) that a new one's balance looks back on
# The holder keeps a conversation while its requests in flight from here are at most
# IMBALANCE x the least busy candidate's plus SLACK.
IMBALANCE = 2.0
SLACK = 4  # about the sequences one replica decodes together by default


def prefix_keys(req: ChatCompletionRequest | CompletionRequest) -> list[bytes]:
    """Keys of the request's growing prefixes, shortest first: key i stands for everything up
    to block i. Two requests share key i exactly when they share those blocks (and model)."""
    h = hashlib.blake2b(req.model.casefold().encode(), digest_size=16)
    keys: list[bytes] = []

    def add(block: bytes) -> None:
        h.update(len(block).to_bytes(8, "little"))
        h.update(block)
        keys.append(h.copy().digest())

    if isinstance(req, ChatCompletionRequest):
        for m in req.messages:
            add(json.dumps([m.role, m.text()], ensure_ascii=False).encode())
        return keys
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        data = prompt.encode()
        for i in range(BLOCK_CHARS, len(data) + 1, BLOCK_CHARS):
            add(data[i - BLOCK_CHARS : i])
    else:
        ids = [int(t) for t in prompt]
        for i in range(BLOCK_TOKENS, len(ids) + 1, BLOCK_TOKENS):
            add(b"".join(t.to_bytes(4, "little", signed=True) for t in ids[i - BLOCK_TOKENS : i]))
    return keys


@dataclass(frozen=True)
class Route:
    peer: str  # LOCAL or a replica's peer id
    matched: int  # keys of the request the chosen replica was sent before (0: none)
    why: str  # "prefix" (the holder), "balance" (the holder was too busy), "new"


@dataclass
class RouterStats:
    remembered: int
    prefix: int  # requests sent to the replica that held their conversation
    balance: int  # requests sent elsewhere because the holder was too busy
    new: int  # requests that matched no replica
    in_flight: dict[str, int]


class PrefixRouter:
    def __init__(
        self,
        *,
        remembered: int = REMEMBERED_KEYS,
        imbalance: float = IMBALANCE,
        slack: int = SLACK,
        recent: int = RECENT,
    ) -> None:
        self._holders: OrderedDict[bytes, str] = OrderedDict()
        self._remembered = remembered
        self._imbalance = imbalance
        self._slack = slack
        self._in_flight: Counter[str] = Counter()
        self._recent: deque[str] = deque(maxlen=recent)
        self._why: Counter[str] = Counter()

    def choose(self, keys: Sequence[bytes], candidates: Sequence[str]) -> Route:
        """The candidate (peer ids, LOCAL for this agent) that takes a request keyed `keys`."""
        if not candidates:
            raise ValueError("no candidate to route to")
        load = {c: self._in_flight[c] for c in candidates}
        least = min(load.values())
        for i in range(len(keys) - 1, -1, -1):
            holder = self._holders.get(keys[i])
            if holder is None or holder not in load:
                continue
            if self._admits(holder, least):
                return self._chose(Route(holder, i + 1, "prefix"))
            return self._chose(Route(self._least_busy(candidates), 0, "balance"))
        return self._chose(Route(self._least_busy(candidates), 0, "new"))

    def routed(self, peer: str, keys: Sequence[bytes]) -> _Routed:
        """While a request runs on `peer` (a context manager): counted as in flight there;
        and from now on a request that starts with all of this one (its conversation's next
        turn) is `peer`'s. Only the whole request is remembered, not its shorter prefixes:
        conversations that share a system prompt are different conversations, balanced as
        new ones."""
        if keys:  # the whole request: what a later turn of its conversation starts with
            self._holders[keys[-1]] = peer
            self._holders.move_to_end(keys[-1])
        while len(self._holders) > self._remembered:
            self._holders.popitem(last=False)
        return _Routed(self._in_flight, peer)

    def stats(self) -> RouterStats:
        return RouterStats(
            remembered=len(self._holders),
            prefix=self._why["prefix"],
            balance=self._why["balance"],
            new=self._why["new"],
            in_flight=dict(self._in_flight),
        )

    def _chose(self, route: Route) -> Route:
        self._why[route.why] += 1
        if route.why != "prefix":  # a conversation starts (or moves) there
            self._recent.append(route.peer)
        return route

    def _least_busy(self, candidates: Sequence[str]) -> str:
        """Of the candidates not much busier than the least busy, the one given the fewest
        conversations lately (then the fewest in flight, then this agent, then by id): so
        conversations spread evenly however their turns interleave, and with them the turns
        where conversations are alike."""
        least = min(self._in_flight[c] for c in candidates)
        fit = [c for c in candidates if self._admits(c, least)]
        recent = Counter(self._recent)
        return min(fit, key=lambda c: (recent[c], self._in_flight[c], c != LOCAL, c))

    def _admits(self, peer: str, least: int) -> bool:
        return self._in_flight[peer] <= self._imbalance * least + self._slack


class _Routed:
    """A request in flight on one peer. A plain class, not `contextlib.contextmanager`: that
    one sets `__traceback__` on what it re-raises, which frozen exceptions refuse."""

    def __init__(self, in_flight: Counter[str], peer: str) -> None:
        self._in_flight, self._peer = in_flight, peer

    def __enter__(self) -> None:
        self._in_flight[self._peer] += 1

    def __exit__(self, *exc: object) -> None:
        self._in_flight[self._peer] -= 1
        if self._in_flight[self._peer] <= 0:
            del self._in_flight[self._peer]
