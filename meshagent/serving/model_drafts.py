"""One speculating sequence's drafts from a draft model and from its own text together, as the
drafting policy (`serving/draft_policy.py`) reads a drafter.

While the sequence copies the text it follows (`SuffixDrafter.copying`: an edited document,
quoted output) and the copy's drafts pay, the text's draft goes: it is right more often than
any model. Otherwise the
draft model's proposal goes, and the text's n-gram draft where the model has none. The model
computes outside the scheduler's lock (`ModelRunner` asks for what the policy will want,
`DraftPolicy.wanted`, and offers it back): a proposal is used only while the sequence stands
where it was computed (its verified tokens and those in flight), so a stale one never goes.

No I/O: the draft model's calls that block run where the runner computes the offers.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshagent.serving.draft_model import DraftModel
from meshagent.serving.drafting import Acceptance, SuffixDrafter

# Where a proposal was computed: the sequence's verified tokens, and the tokens in flight.
Key = tuple[int, tuple[int, ...]]


class ModelDrafts:
    """The drafter of sequence `seq`: `text` (its own text) with `model` beside it."""

    def __init__(self, model: DraftModel, seq: int, text: SuffixDrafter) -> None:
        self.model = model
        self.seq = seq
        self.text = text
        self.offer: tuple[Key, tuple[int, ...]] | None = None
        self.from_model = False  # the last proposal was the model's
        self.asking = False  # the policy asks the model for its proposals now (they pay)
        # "auto": how often the model's drafts are right, and the text's n-gram drafts (the
        # policy's, `DraftPolicy.start`); with both proposing, the likelier goes
        self.accepts: Acceptance | None = None
        self.text_accepts: Acceptance | None = None
        # "auto": whether a window of the text's copy pays now (the policy's): where it does
        # not (a copy that keeps going off its source), the model is asked while it copies.
        self.copy_pays = True
        # How many of its tokens the model may hold already (a slot a sequence with the
        # same start left: a conversation's next turn)
        self.held = model.open(seq, text.tokens)

    @property
    def follow(self) -> Acceptance:
        return self.text.follow

    @property
    def copying(self) -> bool:
        return self.text.copying

    @property
    def copy_goes(self) -> bool:
        """Whether the text's copy drafts, not the model: it copies, and its drafts pay."""
        return self.text.copying and self.copy_pays

    @property
    def block(self) -> object:
        return self.text.block

    def key(self, after: Sequence[int] = ()) -> Key:
        return (len(self.text.tokens), tuple(after))

    def extend(self, tokens: Sequence[int]) -> None:
        self.text.extend(tokens)
        self.model.extend(self.seq, tokens)

    def offered(self, after: Sequence[int] = ()) -> tuple[int, ...]:
        """What the model's offer proposes at this point (the sequence's tokens, then
        `after` in flight): the offer went on from where it was computed, and where the
        tokens taken since are the ones it drafted, the rest of it is what the model would
        propose now (its greedy continuation of the same text); () where they differ."""
        if self.offer is None:
            return ()
        (n, before), proposal = self.offer
        tokens = self.text.tokens
        if n > len(tokens):
            return ()
        went = (*tokens[n:], *after)
        stream = (*before, *proposal)
        if len(went) >= len(stream) or tuple(stream[: len(went)]) != went:
            return ()
        return stream[len(went) :]

    def awaits(self, after: Sequence[int]) -> bool:
        """Whether a proposal of the model for this point is to come: it is asked for them
        and none offered goes on from here (a window that would follow those in flight
        waits for it rather than go with the text's n-gram guess)."""
        return self.asking and not self.copy_goes and not self.offered(after)

    def propose(self, k: int, after: Sequence[int] = ()) -> tuple[int, ...]:
        """Up to `k` tokens: the text's while its copy goes (`copy_goes`); else the model's
        offer for this point or the text's draft (its copy's or its n-gram's), whichever is
        expected to yield more (by each one's acceptance, with "auto"; the model's with
        "on"), or the one there is."""
        self.from_model = False
        got = () if self.copy_goes else self.offered(after)[:k]
        if not got:
            return self.text.propose(k, after)
        if self.accepts is not None and self.text_accepts is not None:  # "auto": weigh both
            text = self.text.propose(k, after)
            expect = self.text_accepts.expected(len(text), copying=self.copying)
            if text and expect > self.accepts.expected(len(got)):
                return text
        self.from_model = True
        return got

    def close(self) -> None:
        self.model.close(self.seq)
