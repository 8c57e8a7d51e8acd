"""Routing by prefix between replicas (sans-IO): a conversation's turns go where it was
served before, new conversations to the least busy, and no replica gets far more than another."""

from __future__ import annotations

from contextlib import ExitStack

from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.api.routing import BLOCK_CHARS, LOCAL, PrefixRouter, prefix_keys
from meshagent.api.schemas import ChatCompletionRequest, CompletionRequest


def chat(*texts: str, model: str = "m") -> ChatCompletionRequest:
    roles = ["system"] + ["user", "assistant"] * len(texts)
    msgs = [{"role": r, "content": t} for r, t in zip(roles, texts, strict=False)]
    return ChatCompletionRequest.model_validate({"model": model, "messages": msgs})


def completion(prompt, model: str = "m") -> CompletionRequest:
    return CompletionRequest.model_validate({"model": model, "prompt": prompt})


def test_keys_grow_with_the_conversation_and_depend_on_every_earlier_block():
    one = prefix_keys(chat("sys", "hi"))
    two = prefix_keys(chat("sys", "hi", "hello", "more"))
    assert len(one) == 2 and len(two) == 4
    assert two[:2] == one
    assert prefix_keys(chat("sys", "hi", model="other"))[1] != one[1]
    assert prefix_keys(chat("other sys", "hi"))[1] != one[1]
    # A role is part of a message: the same text from another role is another prompt.
    swapped = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "sys"}]}
    )
    assert prefix_keys(swapped)[0] != one[0]
    # Message boundaries count: "ab" + "c" is not "a" + "bc".
    assert prefix_keys(chat("ab", "c"))[1] != prefix_keys(chat("a", "bc"))[1]


def test_a_completion_prompt_is_keyed_in_whole_blocks():
    text = "x" * (BLOCK_CHARS * 2 + 10)
    keys = prefix_keys(completion(text))
    assert len(keys) == 2  # the partial last block is not a key
    assert prefix_keys(completion(text + "y" * BLOCK_CHARS))[:2] == keys
    assert prefix_keys(completion("short")) == []
    assert prefix_keys(completion([text])) == keys
    assert len(prefix_keys(completion(list(range(130))))) == 2


def test_a_conversation_returns_to_its_replica_and_new_ones_alternate():
    router = PrefixRouter()
    replicas = [LOCAL, "b"]
    served: dict[int, list[str]] = {}
    for turn in range(3):
        for conv in range(6):
            texts = ["system prompt", f"conversation {conv}"]
            for t in range(turn):
                texts += [f"answer {t}", f"question {t}"]
            keys = prefix_keys(chat(*texts))
            route = router.choose(keys, replicas)
            with router.routed(route.peer, keys):
                served.setdefault(conv, []).append(route.peer)
            assert route.why == ("new" if turn == 0 else "prefix")
    # Each conversation stays where it began; the shared system prompt does not pull new
    # conversations to one replica.
    assert all(len(set(peers)) == 1 for peers in served.values())
    assert sorted(p[0] for p in served.values()) == [LOCAL] * 3 + ["b"] * 3
    assert router.stats().prefix == 12 and router.stats().new == 6


def test_a_busy_holder_gives_way_and_its_conversation_moves():
    router = PrefixRouter(imbalance=2.0, slack=1)
    first = prefix_keys(chat("s", "q"))
    route = router.choose(first, ["a", "b"])
    with router.routed(route.peer, first):
        pass
    holder, other = route.peer, ("b" if route.peer == "a" else "a")
    nxt = prefix_keys(chat("s", "q", "r", "q2"))
    with ExitStack() as busy:
        for i in range(2):  # the holder runs two other requests: 2 <= 2 x 0 + 1 is false
            busy.enter_context(router.routed(holder, prefix_keys(chat(f"other {i}"))))
        route = router.choose(nxt, ["a", "b"])
        assert (route.peer, route.why) == (other, "balance")
        with router.routed(route.peer, nxt):
            pass
    # The conversation now lives on the other replica.
    later = prefix_keys(chat("s", "q", "r", "q2", "r2", "q3"))
    assert router.choose(later, ["a", "b"]).peer == other
    assert router.stats().in_flight == {}


def test_a_holder_no_longer_serving_is_passed_over():
    router = PrefixRouter()
    keys = prefix_keys(chat("s", "q"))
    with router.routed("gone", keys):
        pass
    route = router.choose(prefix_keys(chat("s", "q", "a", "q2")), ["b", "c"])
    assert route.why == "new" and route.peer == "b"


def test_memory_is_bounded():
    router = PrefixRouter(remembered=10)
    for i in range(100):
        keys = prefix_keys(chat(f"conversation {i}"))
        with router.routed("a", keys):
            pass
    assert router.stats().remembered == 10


@settings(max_examples=100, deadline=None)
@given(
    order=st.integers(2, 5).flatmap(
        lambda k: st.permutations([c for c in range(10) for _ in range(k)])
    ),
    running=st.lists(st.integers(1, 8), min_size=50, max_size=50),
)
def test_ten_conversations_stay_on_their_holder_within_bounded_imbalance(order, running):
    """10 conversations of as many turns each, in any order (a conversation's next turn once
    its last is answered), with up to 8 requests at a time:
    at least 90% of later turns land on the replica that served the conversation's last
    turn, a replica takes a request only while it runs at most 2x + 4 of the other's, and
    neither gets more than twice the other's requests."""
    router = PrefixRouter()
    depth = dict.fromkeys(range(10), 0)
    last: dict[int, str] = {}
    on_holder = later = 0
    counts = {"a": 0, "b": 0}
    window: dict[int, ExitStack] = {}  # requests in flight, oldest first, by conversation
    for conv, hold in zip(order, running * 2, strict=False):
        if conv in window:  # a client asks its next turn once the last one is answered
            window.pop(conv).close()
        texts = ["shared system prompt", f"conversation {conv}"]
        for t in range(depth[conv]):
            texts += [f"answer {t}", f"question {t}"]
        depth[conv] += 1
        keys = prefix_keys(chat(*texts))
        before = router.stats().in_flight
        route = router.choose(keys, ["a", "b"])
        assert before.get(route.peer, 0) <= 2 * min(before.get(p, 0) for p in "ab") + 4
        if conv in last:
            later += 1
            on_holder += route.peer == last[conv]
        last[conv] = route.peer
        counts[route.peer] += 1
        request = ExitStack()
        request.enter_context(router.routed(route.peer, keys))
        window[conv] = request
        while len(window) > hold:  # the oldest requests end
            window.pop(next(iter(window))).close()
    for request in window.values():
        request.close()
    assert router.stats().in_flight == {}
    assert on_holder >= 0.9 * later, (on_holder, later)
    assert max(counts.values()) <= 2 * min(counts.values()), counts
