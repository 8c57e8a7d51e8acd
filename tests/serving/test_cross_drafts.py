"""Drafts across tokenizers (`serving/cross_drafts.py`): the draft model's tokens kept in step
with the target's text, and its proposals turned into the target's tokens at a boundary both
tokenizers agree on. Two greedy longest-match tokenizers over different vocabularies stand in
for two models' (a property test over any steps), and SmolLM2's real vocabulary goes
through llama.cpp's tokenizer on both sides."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving.cross_drafts import CrossDrafts


class Greedy:
    """Longest match first over `pieces`; every single byte is a token too (ids from 1000)."""

    def __init__(self, pieces: list[str], bos: int | None = None, end: int | None = None):
        self.by_id = {i: p.encode() for i, p in enumerate(pieces)}
        self.by_piece = {p: i for i, p in self.by_id.items()}
        self.bos, self.end = bos, end
        self.longest = max(len(p) for p in self.by_id.values())

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        data, out, i = text.encode(), [], 0
        if add_bos and self.bos is not None:
            out.append(self.bos)
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                t = self.by_piece.get(data[i : i + n])
                if t is not None:
                    break
            else:
                n, t = 1, 1000 + data[i]
            out.append(t)
            i += n
        return out

    def token_bytes(self, token: int) -> bytes:
        if token in (self.bos, self.end):
            return b""
        return bytes([token - 1000]) if token >= 1000 else self.by_id[token]

    def is_end_of_generation(self, token: int) -> bool:
        return token == self.end


TARGET = Greedy([" the", " cat", " sat", " on", " mat", "ca", "t", " th", "é", "hello", " "])
DRAFT = Greedy(["the", " c", "at", " sat on", " m", "hel", "lo", " "], bos=999, end=998)


def spelled(tok: Greedy, tokens) -> bytes:
    return b"".join(tok.token_bytes(t) for t in tokens)


def test_the_draft_cache_follows_the_targets_text_and_keeps_what_still_spells_it():
    x = CrossDrafts(TARGET, DRAFT, draft_bos=True)
    x.extend(TARGET.tokenize(" the cat", add_bos=False))
    keep, feed = x.resync()
    assert keep == 0 and feed[0] == 999  # the draft model reads its BOS first
    assert spelled(DRAFT, x.fed) == b" the cat"
    cache = list(feed)
    # The draft proposes " sat on"; the target takes " sat" and then " mat".
    x.drafted(DRAFT.tokenize(" sat on", add_bos=False))
    x.extend(TARGET.tokenize(" sat mat", add_bos=False))
    keep, feed = x.resync()
    cache = cache[:keep] + feed
    assert cache == x.fed and spelled(DRAFT, cache) == b" the cat sat mat"
    assert keep >= 2  # the BOS and what still spells the text stay: no full refeed


def test_a_proposal_becomes_target_tokens_cut_where_both_end_a_token():
    x = CrossDrafts(TARGET, DRAFT, draft_bos=False)
    x.extend(TARGET.tokenize(" the", add_bos=False))
    x.resync()
    # " c" "at" " sat on" " m": the target reads " cat sat on m" as " cat", " sat", " on",
    # " ", "m"...; " m" ends only a draft token, so the draft stops after " on".
    proposal = DRAFT.tokenize(" cat sat on m", add_bos=False)
    got = x.to_target(proposal)
    assert spelled(TARGET, got) == b" cat sat on"
    # An end of generation ends the draft.
    assert spelled(TARGET, x.to_target([*DRAFT.tokenize(" cat", add_bos=False), 998])) == b" cat"


def test_text_that_ends_inside_a_character_waits_for_the_rest():
    x = CrossDrafts(TARGET, DRAFT, draft_bos=False)
    e_acute = "é".encode()
    x.extend([1000 + e_acute[0]])  # the first byte of é alone
    keep, feed = x.resync()
    assert (keep, feed) == (0, []) and x.to_target(DRAFT.tokenize(" cat", add_bos=False)) == []
    x.extend([1000 + e_acute[1]])
    keep, feed = x.resync()
    assert spelled(DRAFT, feed) == e_acute


words = st.sampled_from(["the", " the", " cat", "cat", " sat", " on", " mat", "hello", "é", " "])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(words, max_size=4), max_size=8), st.lists(words, max_size=6))
def test_any_sequence_of_steps_keeps_the_cache_spelling_the_text(steps, proposal_words):
    x = CrossDrafts(TARGET, DRAFT, draft_bos=True)
    cache: list[int] = []
    for step in steps:
        x.drafted(DRAFT.tokenize("".join(proposal_words), add_bos=False))
        cache += DRAFT.tokenize("".join(proposal_words), add_bos=False)
        x.extend(TARGET.tokenize("".join(step), add_bos=False))
        keep, feed = x.resync()
        cache = cache[:keep] + feed
        assert cache == x.fed
        assert spelled(DRAFT, cache) == bytes(x.text)  # (whole characters only here)
        proposal = DRAFT.tokenize("".join(proposal_words), add_bos=False)
        got = x.to_target(proposal)
        drafted = spelled(DRAFT, proposal)
        assert drafted.startswith(spelled(TARGET, got))
        assert (
            not got
            or any(  # cut where a draft token ends too
                spelled(DRAFT, proposal[:i]) == spelled(TARGET, got)
                for i in range(len(proposal) + 1)
            )
        )


def test_a_real_vocabulary_through_its_own_tokenizer(vocab):
    # SmolLM2's BPE vocabulary on both sides: llama.cpp's tokenizer and pieces, leading
    # spaces and all, round-trip through text.
    x = CrossDrafts(vocab, vocab, draft_bos=False)
    prompt = "Here is a sentence in English, "
    x.extend(vocab.tokenize(prompt, add_bos=False, special=False))
    keep, feed = x.resync()
    assert keep == 0 and b"".join(vocab.token_bytes(t) for t in feed) == prompt.encode()
    proposal = vocab.tokenize("and here is the rest of it", add_bos=False, special=False)
    assert x.to_target(proposal) == proposal[:-1]  # cut before its last token only
    assert x.to_target([*proposal, vocab.tokenize("<|endoftext|>", add_bos=False)[0]]) == proposal
    # The target takes part of it, then goes its own way: the draft cache keeps what still
    # spells the text, and takes the rest afresh.
    x.drafted(proposal)
    x.extend(proposal[:2])
    x.extend(vocab.tokenize(" was", add_bos=False, special=False))
    keep, feed = x.resync()
    assert keep >= len(vocab.tokenize(prompt, add_bos=False, special=False))
    assert b"".join(vocab.token_bytes(t) for t in x.fed) == bytes(x.text)
    assert bytes(x.text).decode() == prompt + "and here was"
