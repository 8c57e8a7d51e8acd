"""Drafts across tokenizers: a draft model whose vocabulary is not the target's drafts text,
and the text is what the two agree on.

The target's tokens are the truth: the text they spell (`extend`) is the *agreed* text. The
draft model's cache holds draft tokens that spell a prefix of it; after the target moves on,
`resync` says how many of them to keep and which to feed next (the agreed text after the
kept ones, tokenized the draft's way). The last kept token is given up too once text follows
it, so that a word the target finished is tokenized whole, as the draft model saw words in
training. Text that ends inside a UTF-8 character waits until the character is whole.

A proposal of the draft model (tokens after those fed) is turned into the target's tokens by
its text (`to_target`): the target's tokenizer reads the drafted string, and the draft is cut
at the last point where both tokenizations end a token before the proposal's end (unless
it ended the generation), so that the target's last drafted token is not the first half of
a word the draft would go on with. Verification makes the text
exact whatever the draft says (`serving/drafting.py`); a draft that does not tokenize as the
target would only costs acceptance.

No I/O, no model: the tokenizers are passed in (any `TokenModel`: an engine, a split's
entry), tested alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...


class CrossDrafts:
    """One sequence's draft tokens kept in step with the target's text."""

    def __init__(self, target: Tokenizer, draft: Tokenizer, *, draft_bos: bool) -> None:
        self.target = target
        self.draft = draft
        self.text = bytearray()  # the agreed text: what the target's tokens spell
        self.fed: list[int] = []  # the draft tokens its cache holds (as `resync` said)
        self._ends: list[int] = []  # where each fed token ends in the agreed text
        # What the draft model reads first and always keeps (its BOS, spelling nothing).
        self._lead = draft.tokenize("", add_bos=True) if draft_bos else []
        self._started = False  # the lead was fed
        self._whole = True  # the text the last `resync` followed ends on a whole character

    def extend(self, target_tokens: Sequence[int]) -> None:
        """The target's sequence went on with `target_tokens`."""
        for t in target_tokens:
            self.text += self.target.token_bytes(t)

    def resync(self, after: Sequence[int] = ()) -> tuple[int, list[int]]:
        """What the draft model's cache must hold now: its first `keep` tokens, then `feed`
        (after them). The caller applies both before the next proposal. `after`: target
        tokens not verified yet (windows in flight) that the proposal is to follow, as if
        the target had gone on with them (they are not agreed: the next `resync` without
        them keeps what still spells the agreed text)."""
        text = self.text + b"".join(self.target.token_bytes(t) for t in after)
        done = _whole_chars(text)
        self._whole = done == len(text)
        lead = len(self._lead) if self._started else 0
        keep = lead
        for i in range(lead, len(self.fed)):
            start, end = (self._ends[i - 1] if i else 0), self._ends[i]
            if end > done or bytes(text[start:end]) != self.draft.token_bytes(self.fed[i]):
                break
            keep = i + 1
        if keep > lead and self._ends[keep - 1] < done:
            keep -= 1  # text follows its last token: tokenized with it
        while keep > lead and _whole_chars(text[: self._ends[keep - 1]]) < self._ends[keep - 1]:
            keep -= 1  # (and from a character's start: a byte token may end inside one)
        start = self._ends[keep - 1] if keep else 0
        new = bytes(text[start:done]).decode(errors="replace")
        feed = [] if self._started else list(self._lead)
        self._started = True
        if new:
            feed += self.draft.tokenize(new, add_bos=False)
        self.fed = self.fed[:keep] + feed
        ends, at = self._ends[:keep], start
        for t in feed:
            at += len(self.draft.token_bytes(t))
            ends.append(at)
        self._ends = ends
        return keep, feed

    def unfed(self, n: int) -> None:
        """The last `n` tokens of the last `resync`'s feed were not fed after all (a catch-up
        fed only the start of it): the next `resync` feeds them."""
        if n > 0:
            del self.fed[-n:]
            del self._ends[-n:]

    def held_text(self) -> bytes:
        """What the draft tokens its cache holds spell."""
        return b"".join(self.draft.token_bytes(t) for t in self.fed)

    def reopened(self) -> CrossDrafts:
        """The same cache for another sequence of the target, whose text is yet to come
        (`extend`): the next `resync` keeps the draft tokens that spell its start."""
        again = CrossDrafts(self.target, self.draft, draft_bos=False)
        again._lead, again._started = self._lead, self._started
        again.fed, again._ends = list(self.fed), list(self._ends)
        return again

    def drafted(self, tokens: Sequence[int]) -> None:
        """The draft model decoded `tokens` of its own after those fed (its proposal): its
        cache holds them, and `resync` keeps those the target's text turns out to spell."""
        at = self._ends[-1] if self._ends else 0
        for t in tokens:
            at += len(self.draft.token_bytes(t))
            self.fed.append(t)
            self._ends.append(at)

    def to_target(self, proposal: Sequence[int]) -> list[int]:
        """The draft model's `proposal` (after the fed tokens) as the target's tokens: the
        drafted text up to the last point where both tokenizations end a token, before any
        end of generation; [] where they share none, or while the text the last `resync`
        followed ends inside a character (the draft model has not read it all)."""
        if not self._whole:
            return []
        drafted, draft_ends, ended = b"", set(), False
        for t in proposal:
            if self.draft.is_end_of_generation(t):
                ended = True
                break
            drafted += self.draft.token_bytes(t)
            draft_ends.add(len(drafted))
        if not ended:
            # Where the proposal stops, the draft's next token may yet join the target's
            # last: a word the target reads whole (" m" then "at": " mat").
            draft_ends.discard(len(drafted))
        text = drafted[: _whole_chars(drafted)]
        if not text:
            return []
        tokens = self.target.tokenize(text.decode(), add_bos=False)
        out, cut, at = [], 0, 0
        for i, t in enumerate(tokens):
            piece = self.target.token_bytes(t)
            if text[at : at + len(piece)] != piece:
                break  # (a tokenizer that adds a leading space: the text differs here)
            at += len(piece)
            if at in draft_ends:
                cut = i + 1
            out.append(t)
        return out[:cut]


def _whole_chars(data: bytes | bytearray) -> int:
    """The length of `data`'s prefix that ends on a UTF-8 character boundary."""
    n = len(data)
    for back in itertools.islice(range(n - 1, -1, -1), 4):
        b = data[back]
        if b < 0x80:
            return n  # ASCII: every character before it ended
        if b >= 0xC0:  # a lead byte: is its character whole?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if n - back >= need else back
    return n
