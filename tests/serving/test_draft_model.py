"""A draft model (`serving/draft_model.py`) proposing a target's next tokens: its cache follows
the target's sequence, token for token where they share a vocabulary and by text where they
do not, and what it drafted and the target confirmed is not computed again. On the fake
engine (whose cache checks every position it is given) and on SmolLM2 drafting for itself."""

from __future__ import annotations

import threading
import time

import numpy as np

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.serving.draft_model import DraftModel
from meshagent.testing.fake_engine import EOS, FakeEngine, FakeVocab


def greedy(engine, tokens: list[int], n: int, slot: int = 0) -> list[int]:
    """`engine`'s own greedy continuation of `tokens` (its slot cleared first)."""
    engine.clear_sequence(slot)
    (logits,) = engine.forward([ForwardItem(slot, 0, tokens, True)])
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        if engine.is_end_of_generation(t):
            break
        (logits,) = engine.forward([ForwardItem(slot, len(tokens) + len(out) - 1, [t], True)])
    engine.clear_sequence(slot)
    return out


def opened(text: str, seq: int, n: int, slots: int = 1):
    """A fake target, a draft model of the same arithmetic drafting for its sequence `seq`
    of `text`, that prompt, and the target's first `n` greedy tokens after it."""
    target, draft = FakeEngine(slots=slots), FakeEngine(slots=slots)
    prompt = target.tokenize(text, add_bos=True)
    truth = greedy(target, prompt, n)
    d = DraftModel(draft, target, same_vocab=True)
    d.open(seq, prompt)
    return target, draft, d, prompt, truth


def test_a_draft_of_the_same_vocabulary_proposes_its_greedy_text_and_keeps_its_cache():
    target, draft, d, prompt, truth = opened("the draft", 7, 12, slots=2)
    first = d.propose(7, 5)
    assert first == truth[:5]  # the same model: its own text
    fed = d.forwards
    d.extend(7, first)  # the target kept all five
    assert d.propose(7, 4) == truth[5:9]
    # Nothing it drafted was fed again: its last token ran once more for its logits, then
    # one pass per proposed token after the first.
    assert d.forwards - fed == 4
    # The target went elsewhere after two of them: the cache keeps what it shares.
    d.extend(7, [truth[5], truth[6], 30])
    got = d.propose(7, 3)
    assert got == greedy(target, [*prompt, *truth[:7], 30], 3)
    assert draft.caches.held[0][: len(prompt) + 8] == [*prompt, *truth[:7], 30]


def test_slots_are_the_draft_engines_and_a_closed_sequence_gets_none():
    d = DraftModel(FakeEngine(slots=1), FakeVocab(), same_vocab=True)
    d.open(1, [1, 2, 3])
    d.open(2, [1, 2])
    assert d.holds(1) and not d.holds(2)  # every slot taken
    assert d.propose(1, 3) and d.propose(2, 3) == []
    d.close(1)
    d.open(3, [1, 2])
    assert d.propose(1, 3) == [] and d.holds(3) and d.propose(3, 3)


def test_a_proposal_stops_at_an_end_of_generation():
    engine = FakeEngine(slots=1, eos_every=6)
    d = DraftModel(engine, engine, same_vocab=True)
    d.open(1, [1, 2, 3])
    got = d.propose(1, 10)
    assert got[-1] == EOS and len(got) == 4  # after the 6th position: the end


class Words:
    """A target tokenizer of whole words (and single letters and spaces)."""

    words = ("the ", "cat ", "sat ")

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        out, i = [], 0
        while i < len(text):
            w = next((k for k, w in enumerate(self.words) if text.startswith(w, i)), None)
            if w is not None:
                out.append(1000 + w)
                i += len(self.words[w])
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def token_bytes(self, token: int) -> bytes:
        return self.words[token - 1000].encode() if token >= 1000 else bytes([token])

    def is_end_of_generation(self, token: int) -> bool:
        return False


def test_a_draft_of_another_vocabulary_proposes_by_text_cut_where_both_end_a_token():
    draft, target, ref = FakeEngine(slots=1), Words(), FakeEngine(slots=1)
    d = DraftModel(draft, target, same_vocab=False)
    prompt = target.tokenize("the cat sat ", add_bos=False)
    d.open(3, prompt)
    got = d.propose(3, 8)
    # The draft's greedy letters after "the cat sat " (its BOS first), read as target tokens
    # and cut before the draft's last token: one target token per letter here.
    letters = greedy(ref, [1, *ref.tokenize("the cat sat ", add_bos=False)], 9)
    text = b"".join(draft.token_bytes(t) for t in letters[:-1])
    assert b"".join(target.token_bytes(t) for t in got) == text[: len(got)]
    assert got and len(got) <= 8
    # The target keeps three of them: the draft's cache still spells the text, and the
    # next proposal follows on from it.
    d.extend(3, got[:3])
    more = d.propose(3, 4)
    after = greedy(ref, [1, *ref.tokenize("the cat sat ", add_bos=False), *letters[:3]], 5)
    assert (
        b"".join(target.token_bytes(t) for t in more)
        == b"".join(draft.token_bytes(t) for t in after[:4])[: len(more)]
    )


def test_smollm2_drafting_for_itself_proposes_its_greedy_text(model_path):
    engine = LlamaEngine(model_path, slots=2, slot_ctx=256, threads=1)
    try:
        prompt = engine.tokenize("The capital of France is", add_bos=True)
        truth = greedy(engine, prompt, 8, slot=1)
        d = DraftModel(engine, engine, same_vocab=True)
        d.open(0, prompt)
        assert d.propose(0, 4) == truth[:4]
        d.extend(0, truth[:4])
        assert d.propose(0, 4) == truth[4:8]
    finally:
        engine.close()


def test_a_proposal_beyond_the_windows_in_flight_continues_the_draft_unverified():
    # A split's entry sends the next window before the verdict on the last: the draft goes
    # on from its own tokens in flight, and nothing of them is agreed until the target says.
    target, _, d, prompt, truth = opened("in flight", 1, 12)
    first = d.propose(1, 4)
    fed = d.forwards
    assert d.propose(1, 4, after=first) == truth[4:8]
    assert d.forwards - fed == 4  # on from its cache: nothing fed again
    # The target rejects the second token: the next proposal follows what it verified.
    d.extend(1, [truth[0], 30])
    assert d.propose(1, 3) == greedy(target, [*prompt, truth[0], 30], 3)


def test_across_tokenizers_a_proposal_beyond_the_windows_in_flight():
    draft, target, ref = FakeEngine(slots=1), Words(), FakeEngine(slots=1)
    d = DraftModel(draft, target, same_vocab=False)
    d.open(2, target.tokenize("the cat ", add_bos=False))
    first = d.propose(2, 3)
    more = d.propose(2, 3, after=first)
    text = b"".join(target.token_bytes(t) for t in (*first, *more))
    letters = greedy(ref, [1, *ref.tokenize("the cat ", add_bos=False)], 8)
    assert more and text == b"".join(ref.token_bytes(t) for t in letters)[: len(text)]


def test_what_other_threads_tell_it_is_applied_by_the_proposing_thread():
    # The event loop tells it of verified tokens while a worker thread proposes: the
    # engine is only called from the proposing thread, and the drafts follow the tokens.
    _, draft, d, _, truth = opened("threads", 1, 40)
    calls: set[int] = set()
    forward = draft.forward

    def recorded(items):
        calls.add(threading.get_ident())
        return forward(items)

    draft.forward = recorded

    def tell() -> None:
        for t in truth[:30]:
            d.extend(1, [t])
            time.sleep(0.0005)

    teller = threading.Thread(target=tell)
    teller.start()
    while teller.is_alive():
        got = d.propose(1, 3)
        assert got and len(got) <= 3
    teller.join()
    assert d.propose(1, 5) == truth[30:35]
    assert calls == {threading.get_ident()}


async def test_smollm2_served_with_a_draft_model_gives_plain_decodings_text(model_path, nursery):
    # Real llama.cpp on both sides: the draft model (SmolLM2 itself, so it knows the text)
    # drafts novel text, the target verifies it in windows, and the text is plain decoding's.
    from meshagent.serving.local_model import LocalModel
    from tests.serving.test_runner import complete

    engine = LlamaEngine(model_path, slots=2, slot_ctx=512, threads=1)
    drafts = LlamaEngine(model_path, slots=2, slot_ctx=512, threads=1)
    try:
        model = LocalModel.whole(
            engine, max_queue=2, draft=DraftModel(drafts, engine, same_vocab=True)
        )
        await nursery.start(model.run)
        prompt = "Once upon a time, in a small village by the sea,"
        plain, _ = await complete(model, prompt, 40, speculation="off")
        spec, fin = await complete(model, prompt, 40, speculation="on")
        assert spec == plain and len(plain) > 60  # (a story goes on: no early end)
        s = fin.speculation
        assert s is not None and s.accepted > 0.8 * s.drafted and s.accepted >= 20
    finally:
        nursery.cancel_scope.cancel()


def test_a_proposal_times_its_feed_apart_from_its_forward_passes_of_one_token():
    # A proposal that first reads 40 tokens of text (a probe after a while) still tells what
    # one forward pass costs: its feed is timed apart from the passes after it. (The fake's
    # sleeps are lower bounds of each pass's time.)
    _, draft, d, prompt, _ = opened("a prompt of some length " * 4, 1, 1)
    draft.delay, draft.token_delay = 0.004, 0.001
    assert len(d.propose(1, 4)) == 4
    assert d.last_fed == len(prompt) and d.last_steps == 3
    assert d.last_feed_seconds >= 0.004 + 0.001 * len(prompt)
    assert d.last_steps_seconds >= 3 * 0.005


def test_catching_up_reads_the_text_in_parts_and_the_proposal_is_the_same():
    # Same vocabulary: two catch-ups of 5 and of the rest, then a proposal that feeds
    # nothing new, give what a proposal from nothing gives.
    _, draft, d, prompt, truth = opened("the draft reads ahead", 2, 6)
    assert d.catch_up(2, 5) == 5 and draft.caches.held[0][:5] == prompt[:5]
    assert d.catch_up(2, 100) == len(prompt) - 5
    assert d.catch_up(2, 100) == 0
    fed = d.forwards
    assert d.propose(2, 6) == truth
    assert d.forwards - fed == 6  # its last token again for its logits, then one a token
    # Across tokenizers: the cache spells the text after a partial catch-up, and the
    # proposal is the one made without it.
    words = Words()
    prompt = words.tokenize("the cat sat on ", add_bos=False)
    plain = DraftModel(FakeEngine(slots=1), words, same_vocab=False)
    plain.open(0, prompt)
    caught = DraftModel(FakeEngine(slots=1), words, same_vocab=False)
    caught.open(0, prompt)
    assert 0 < caught.catch_up(0, 4) <= 4
    assert caught.propose(0, 6) == plain.propose(0, 6)


def test_a_sequence_that_starts_as_an_ended_one_did_keeps_what_its_slot_holds():
    # A conversation's next turn: its text starts with the last turn's whole text. The slot
    # that turn left keeps it, so the draft model reads only what is new, and proposes what
    # it would have proposed after reading it all.
    target, _, d, prompt, truth = opened("the first turn", 1, 6, slots=2)
    d.extend(1, truth)
    d.propose(1, 3)
    d.close(1)
    d.holds(1)  # (what it was told is applied)
    turn = [*prompt, *truth, *target.tokenize(" and the next", add_bos=False)]
    assert d.open(2, turn) == len(prompt) + len(truth)  # (the estimate the policy reads)
    before = d.forwards
    got = d.propose(2, 4)
    assert got == greedy(target, turn, 4)
    assert d.last_fed == len(turn) - len(prompt) - len(truth)  # only the new text read
    assert d.forwards - before == 4
    # Another start takes a slot of its own, emptied: nothing of the first is kept for it.
    other = target.tokenize("unrelated", add_bos=True)
    assert d.open(3, other) == 0
    assert d.propose(3, 2) == greedy(target, other, 2)


def test_across_tokenizers_a_next_turn_keeps_the_draft_tokens_that_spell_its_start():
    draft, target, ref = FakeEngine(slots=1), Words(), FakeEngine(slots=1)
    d = DraftModel(draft, target, same_vocab=False)
    first = target.tokenize("the cat sat ", add_bos=False)
    d.open(1, first)
    d.propose(1, 4)
    d.close(1)
    d.holds(1)
    turn = target.tokenize("the cat sat the cat ", add_bos=False)
    assert d.open(2, turn) == len(first)
    got = d.propose(2, 6)
    # Its cache kept the BOS and the letters of "the cat sat" (the last is read again with
    # what follows it), and read the rest: as if it had read the whole turn.
    assert d.last_fed < len("the cat ") + 2
    letters = greedy(ref, [1, *ref.tokenize("the cat sat the cat ", add_bos=False)], 7)
    text = b"".join(draft.token_bytes(t) for t in letters[:-1])
    assert got and b"".join(target.token_bytes(t) for t in got) == text[: len(got)]


async def test_a_conversations_next_turn_is_not_read_again_by_the_draft_model(nursery):
    # One agent, "auto": the second turn's prompt is the first turn's text and a little
    # more. The draft model's slot still holds the first turn, so "auto" knows it need not
    # read it again, asks for drafts from the turn's first tokens, and each proposal reads
    # only what is new. (A vocabulary of 29 spells each text one way: the turn's text reads
    # back as the tokens the first turn made.)
    from meshagent.serving.local_model import LocalModel
    from tests.serving.test_runner import complete

    engine = FakeEngine(29, slots=2, slot_ctx=512, delay=0.004)  # (a step costs a window's
    drafter = FakeEngine(29, slots=2, slot_ctx=512, delay=0.0002)  # time; a draft, little)
    draft = DraftModel(drafter, engine, same_vocab=True)
    model = LocalModel.whole(engine, max_queue=2, draft=draft)
    await nursery.start(model.run)
    prompt = "the lighthouse keeper found a map under the floor of the boathouse"
    first, _ = await complete(model, prompt, 60, speculation="on")
    read = draft.read_when_asked.tokens
    turn = f"{prompt}{first} and then"
    assert len(model.text_tokens(turn)) > 120
    text, fin = await complete(model, turn, 60, speculation="auto")
    assert draft.read_when_asked.tokens - read < 30  # not the turn's 120 tokens again
    s = fin.speculation
    assert s is not None and s.model_windows > 0 and s.model_accepted > 40
    plain, _ = await complete(model, turn, 60, speculation="off")
    assert text == plain
