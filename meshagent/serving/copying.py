"""Where a sequence is copying from, and the edits it makes while it copies.

An answer that repeats its input (a renamed variable, a document with one field changed)
copies a stretch of earlier text token by token, leaves it where it edits, and comes back a
few tokens further on. `Copier` follows that: a `Cursor` points at the next token of the text
being copied; a token that differs starts a divergence, and when a written token matches the
source again within `MAX_SKIP` tokens of where the text left it, the cursor goes on from
there and the edit (the source tokens skipped, the tokens written instead) is learnt once the
next token confirms it. A learnt edit is applied wherever its source tokens come up again in
a draft, so the second and later uses of a renamed variable are drafted right instead of
breaking the draft: a plain n-gram drafter sees, after the new name, text that never occurred
before, and finds its way back only by chance.

A renamed variable is spelt by other tokens in other places (` total` after a space, `total`
after a brace or a quote), and a name may be renamed in code and kept in a string. With
`name` (a token's text as an identifier, or None), a draft therefore stops before a source
token that spells a renamed name where no learnt edit says what it becomes, or where the text
has also kept that token unchanged since: the model's own token there comes with the window,
where a draft on through it would most likely be wrong from there on.

A request that asks for a copy with changes usually names what changes
(`serving/mentions.py`): a draft also stops before a name the request `mentioned` (in
backticks), and at a `doubtful` position of the text (a number the request's words give),
until the text shows what becomes of it there: an edit (a name then is renamed, as above) or
the same token copied (then it is no longer in doubt). So even the first use of a renamed
name, or the changed number, ends a window with the model's own token instead of a miss.

No I/O, no model: plain objects, tested alone (`SuffixDrafter` uses them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

MAX_SKIP = 8  # the most source tokens an edit replaces
MAX_EDIT = 8  # the most tokens an edit writes instead
TRUST = 3  # source tokens followed in a row before the cursor drafts
COPYING = 4  # ... and before a divergence is taken for an edit of a copy
SHORT_EDIT = 3  # the most tokens written that a draft guesses an edit ends after


@dataclass(frozen=True)
class Cursor:
    at: int  # the index in the text of the next source token (after `pending`)
    pending: tuple[int, ...] = ()  # tokens of a learnt edit still to come before `at`
    left: int = -1  # where the text left the source (-1: following it)
    written: tuple[int, ...] = ()  # the tokens written since it left
    unconfirmed: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # an edit just seen
    run: int = 0  # source tokens followed in a row before now (kept across an edit)

    @property
    def following(self) -> bool:
        return self.left < 0

    @property
    def trusted(self) -> bool:
        """Whether to draft from it: a cursor that has followed its source for a while (a
        suffix that occurred before is often a coincidence in prose), and one that left a
        long copy a token or two ago (an edit under way)."""
        if self.following:
            return self.run >= TRUST
        return self.run >= COPYING and 2 <= len(self.written) <= SHORT_EDIT


class Copier:
    """The edits learnt for one sequence, and the steps of its cursor. `name`: the identifier
    a token spells (its text without the spaces around it), or None (see the module's
    docstring)."""

    def __init__(self, name: Callable[[int], str | None] | None = None) -> None:
        self.edits: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._longest = 0  # the longest source side of an edit learnt
        self._name = name
        self.mentioned: set[str] = set()  # names the request gave, not yet seen edited or kept
        self.doubtful: set[int] = set()  # positions of the text likewise (numbers named)
        self.renamed: set[str] = set()  # names a one-token edit replaced
        self.kept: set[int] = set()  # tokens of those names the text copied unchanged since
        self.learnt = 0  # edits learnt (and learnt anew, where the text edits a source otherwise)

    def unsure(self, token: int) -> bool:
        """Whether a draft should stop before `token` of the source: it spells a renamed
        name, and no edit learnt for it says what it becomes, or the text also kept it; or
        it spells a name the request mentioned that the text has neither edited nor kept."""
        if not (self.renamed or self.mentioned) or self._name is None:
            return False
        name = self._name(token)
        if name in self.mentioned:
            return True
        if name not in self.renamed:
            return False
        return (token,) not in self.edits or token in self.kept

    def stops_at(self, text: Sequence[int], i: int) -> bool:
        """Whether a draft should stop before `text[i]`: `unsure` of its token, or a
        `doubtful` position."""
        return i in self.doubtful or self.unsure(text[i])

    def edit_at(self, text: Sequence[int], i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The learnt edit whose source tokens start at `text[i]` (the longest), or ((), ())."""
        for n in range(min(self._longest, len(text) - i), 0, -1):
            source = tuple(text[i : i + n])
            wrote = self.edits.get(source)
            if wrote is not None:
                return source, wrote
        return (), ()

    def step(self, text: Sequence[int], cur: Cursor, token: int, *, learn: bool) -> Cursor | None:
        """The cursor after `token` follows `text`; None once the text has gone elsewhere
        (more than MAX_EDIT tokens written without coming back). With `learn`, an edit
        confirmed here is kept."""
        if cur.following:
            return self._follow(text, cur, token, learn)
        written = (*cur.written, token)
        for j in range(cur.left, min(cur.left + MAX_SKIP + 1, len(text))):
            if text[j] == token:  # back on the source: text[left:j] was replaced
                source = tuple(text[cur.left : j])
                edit = (source, written[:-1]) if source and written[:-1] else None
                # A short edit of a copy keeps its trust, and so does one that wrote as many
                # tokens as it replaced (a number or a date changed digit for digit); coming
                # back after a long detour may be a coincidence and has to earn it again.
                short = (j - cur.left <= 2 and len(written) <= SHORT_EDIT + 1) or (
                    j - cur.left == len(written) - 1 <= SHORT_EDIT
                )
                return Cursor(j + 1, unconfirmed=edit, run=cur.run if short else 0)
        if len(written) > MAX_EDIT:
            return None
        return replace(cur, written=written)

    def _follow(self, text: Sequence[int], cur: Cursor, token: int, learn: bool) -> Cursor:
        if cur.pending:
            if token == cur.pending[0]:
                return replace(cur, pending=cur.pending[1:], run=cur.run + 1)
            return Cursor(cur.at, left=cur.at, written=(token,), run=cur.run)
        if cur.at < len(text):
            source, wrote = self.edit_at(text, cur.at)
            edited = bool(wrote) and token == wrote[0]
            if learn and cur.unconfirmed is not None and (edited or token == text[cur.at]):
                self._learn(*cur.unconfirmed)  # back on the source (or an edit of it)
            if edited:
                return Cursor(cur.at + len(source), pending=wrote[1:], run=cur.run + 1)
            if token == text[cur.at]:
                if learn:
                    self._copied(cur.at, token)
                return Cursor(cur.at + 1, run=cur.run + 1)
        return Cursor(cur.at, left=cur.at, written=(token,), run=cur.run)

    def _copied(self, at: int, token: int) -> None:
        """The text copied `token` from its source at `at` unchanged: not in doubt there, nor
        as a name the request gave; a renamed name kept here."""
        self.doubtful.discard(at)
        if (self.renamed or self.mentioned) and self._name:
            name = self._name(token)
            self.mentioned.discard(name)
            if name in self.renamed:
                self.kept.add(token)

    def _learn(self, source: tuple[int, ...], wrote: tuple[int, ...]) -> None:
        if len(wrote) <= MAX_EDIT and source != wrote:
            self.learnt += self.edits.get(source) != wrote
            self.edits[source] = wrote
            self._longest = max(self._longest, len(source))
            name = self._name(source[0]) if self._name is not None and len(source) == 1 else None
            if name:
                self.renamed.add(name)
                self.mentioned.discard(name)

    def draft(self, text: Sequence[int], cur: Cursor, k: int) -> tuple[tuple[int, ...], bool]:
        """Up to `k` tokens: what the source holds from the cursor on, with the learnt edits
        made; and whether it stopped short before an `unsure` token. A cursor that has left
        the source guesses that the text comes back right after the one token it left at (a
        one-token source replaced, as a rename is)."""
        out = list(cur.pending[:k])
        i = cur.at if cur.following else cur.left + 1
        while len(out) < k and i < len(text):
            if self.stops_at(text, i):
                return tuple(out), True
            source, wrote = self.edit_at(text, i)
            if wrote:
                out += wrote
                i += len(source)
            else:
                out.append(text[i])
                i += 1
        return tuple(out[:k]), False


class TokenNames:
    """The identifier each token spells (its text without the spaces around it, where that is
    a name of two characters or more), from the vocabulary's `token_bytes`; remembered. And
    its text (`text`)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._names: dict[int, str | None] = {}
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if token not in self._names:
            text = self.text(token).strip()
            self._names[token] = text if len(text) >= 2 and text.isidentifier() else None
        return self._names[token]

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self._bytes(token).decode("utf-8", "replace")
        return self._texts[token]


class Joined(Sequence[int]):
    """`head` then the first `taken` tokens of `tail` as one sequence, without copying either
    (a sequence's text and the drafts in flight after it). `taken` may be moved on, so that
    one view serves every step through the drafts."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head, self.tail = head, tail
        self.taken = len(tail)

    def __len__(self) -> int:
        return len(self.head) + self.taken

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self.head)
        if i < 0:
            i += len(self)
        if not 0 <= i < n + self.taken:
            raise IndexError(i)
        return self.head[i] if i < n else self.tail[i - n]
