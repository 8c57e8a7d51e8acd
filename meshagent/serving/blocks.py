"""Where a copied block of an answer ends, so that a draft stops there.

An answer that repeats a document from its prompt usually is that document: a JSON value
that opens the answer, or a fenced code block. Its copy ends where the block closes, and
there the text it copies from goes on with the request's own words ("Repeat the whole
document..."), which the answer does not repeat: a draft on past the close is wrong from its
first token after it, and every token of it is paid for. `BlockEnd` follows the answer's
text and tells how much of a draft to keep: up to the token that closes the JSON value the
answer opened with (its brackets counted outside strings), or the fenced block the answer is
in (its fences counted). The window's own token after the draft is the model's, and says
whether the answer ends there (as it mostly does) or goes on.

No I/O, no model: plain objects, tested alone (`SuffixDrafter` uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

FENCE = "```"


@dataclass(frozen=True)
class _State:
    started: bool = False  # the answer has written more than white space
    json: bool = False  # it opened with a JSON object or array, not closed yet
    depth: int = 0  # brackets open in that value
    string: bool = False  # inside a JSON string
    escape: bool = False  # after a backslash in one
    fences: int = 0  # fences seen (odd: inside a fenced block)
    ticks: int = 0  # backticks in a row at the end (a fence may span tokens)

    def feed(self, text: str) -> tuple[_State, bool]:
        """The state after `text`, and whether a block closed in it."""
        s, closed = self, False
        if not s.started and text.strip():
            text = text.lstrip()
            s = replace(s, started=True, json=text[0] in "{[")
        if s.json:
            s, closed = s._json(text)
        fences, ticks = s.fences, s.ticks
        for ch in text:
            ticks = ticks + 1 if ch == "`" else 0
            if ticks == len(FENCE):
                fences, ticks = fences + 1, 0
                closed = closed or fences % 2 == 0
        return replace(s, fences=fences, ticks=ticks), closed

    def _json(self, text: str) -> tuple[_State, bool]:
        depth, string, escape, end = scan_json(text, self.depth, self.string, self.escape)
        if end is not None:
            return replace(self, json=False, depth=0, string=False, escape=False), True
        return replace(self, depth=depth, string=string, escape=escape), False


def scan_json(
    text: str, depth: int = 0, string: bool = False, escape: bool = False, start: int = 0
) -> tuple[int, bool, bool, int | None]:
    """JSON's brackets and strings through `text` from `start`, from `depth` brackets open
    (`string`: inside a string; `escape`: after a backslash in one): the same after it, and
    the index after the bracket that closes the last one open, where one does (None if not)."""
    for i in range(start, len(text)):
        ch = text[i]
        if string:
            escape, string = (False, True) if escape else (ch == "\\", ch != '"')
        elif ch == '"':
            string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return 0, False, False, i + 1
    return depth, string, escape, None


class BlockEnd:
    """The answer's open block, followed through its tokens (`text`: a token's text)."""

    def __init__(self, text: Callable[[int], str], tokens: Iterable[int] = ()) -> None:
        self._text = text
        self._state = _State()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._state, _ = self._state.feed(self._text(token))

    def keep(self, draft: Sequence[int], after: Sequence[int] = ()) -> int:
        """How many of `draft`'s tokens to keep: up to the one that closes the answer's
        block, where the answer goes on with `after` (drafts in flight) and then `draft`."""
        s = self._state
        for token in after:
            s, _ = s.feed(self._text(token))
        for i, token in enumerate(draft):
            s, closed = s.feed(self._text(token))
            if closed:
                return i + 1
        return len(draft)
