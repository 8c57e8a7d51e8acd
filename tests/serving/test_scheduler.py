"""The scheduler on its own: plain calls, no engine, no trio."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.errors import ContextOverflow, EngineError, QueueFull, ShuttingDown
from meshagent.serving.prefix_cache import PrefixIndex
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.scheduler import Scheduler
from meshagent.serving.steps import Failed, Token

GREEDY = SamplingParams(temperature=0.0)
END = 0


def make(slots: int = 2, *, queue: int = 4, budget: int = 16, depth: int = 1) -> Scheduler:
    return Scheduler(
        n_slots=slots,
        slot_ctx=64,
        max_queue=queue,
        is_end=lambda t: t == END,
        max_batch_tokens=budget,
        depth=depth,
    )


def test_slots_go_in_arrival_order_and_the_queue_is_bounded():
    s = make(slots=2, queue=2)
    for seq in range(4):
        s.submit(seq, (5, 6), 3, GREEDY)
    with pytest.raises(QueueFull):
        s.submit(9, (5,), 1, GREEDY)
    assert s.stats().active == 2 and s.stats().queued == 2
    step = s.next_step()
    assert [it.seq for it in step.items] == [0, 1]
    assert [op.seq for op in step.opened] == [0, 1]
    s.cancel(2)  # a queued request that leaves frees its place in the queue
    s.fail([0], EngineError("x"))
    assert s.slot_of(3) is not None  # the freed slot went to the next in line
    assert s.stats().queued == 0


def test_prompts_are_chunked_within_the_budget_and_decode_goes_first():
    s = make(slots=3, budget=8)
    s.submit(0, (5,), 4, GREEDY)
    step = s.next_step()
    s.token(step.items[0].slot, 7)  # seq 0 now decodes
    s.submit(1, tuple(range(2, 14)), 2, GREEDY)  # a 12-token prompt
    step = s.next_step()
    by_seq = {it.seq: it for it in step.items}
    assert by_seq[0].tokens == (7,) and by_seq[0].last
    assert len(by_seq[1].tokens) == 7 and not by_seq[1].last
    step = s.next_step()  # seq 0 is busy; the rest of the prompt runs
    assert [(it.seq, it.pos, len(it.tokens), it.last) for it in step.items] == [(1, 7, 5, True)]


def test_tokens_end_a_sequence_at_its_limit_or_at_the_end_token():
    s = make()
    s.submit(0, (5,), 2, GREEDY)
    s.submit(1, (5,), 9, GREEDY)
    step = s.next_step()
    slots = {it.seq: it.slot for it in step.items}
    assert s.token(slots[0], 7) == [Token(0, 7)]
    assert s.token(slots[1], END) == [Token(1, END, "stop")]
    # Each slot is forgotten (its cache cleared) before the next step runs.
    assert s.next_step().released == (slots[1],)
    assert s.token(slots[0], 8) == [Token(0, 8, "length")]
    assert s.stats().active == 0
    assert s.next_step().released == (slots[0],)


def test_a_cancelled_sequence_frees_its_slot_at_once_unless_its_token_is_due():
    s = make(slots=1)
    s.submit(0, (5, 6), 4, GREEDY)
    s.submit(1, (5,), 4, GREEDY)
    step = s.next_step()
    slot = step.items[0].slot
    s.cancel(0)  # busy: its token is due, and the slot must not take another's yet
    assert s.stats().active == 1 and s.stats().queued == 1
    assert s.token(slot, 9) == []  # the late token is dropped and the slot passes on
    assert s.stats().active == 1 and s.slot_of(1) == slot
    step = s.next_step()
    assert step.released == (slot,) and [op.seq for op in step.opened] == [1]
    s.token(slot, 9)
    s.cancel(1)  # not busy: freed at once
    assert s.stats().active == 0


def test_refusals():
    s = make()
    with pytest.raises(ContextOverflow):
        s.submit(0, tuple(range(60)), 5, GREEDY)
    s.close()
    with pytest.raises(ShuttingDown):
        s.submit(1, (5,), 1, GREEDY)


def test_abort_fails_every_request_and_a_pipeline_share_is_one_over_depth():
    s = make(slots=4, depth=3)
    for seq in range(4):
        s.submit(seq, (5,), 4, GREEDY)
    assert len(s.next_step().items) == 1  # 4 // 3
    events = s.abort(EngineError("gone"))
    assert sorted(e.seq for e in events) == [0, 1, 2, 3]
    assert all(isinstance(e, Failed) for e in events)


# ----- properties -----

ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 20), st.integers(1, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("tokens"), st.integers(0, 5)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4), st.integers(1, 3), st.integers(0, 3))
def test_bounds_hold_and_positions_follow_each_other(program, slots, depth, queue):
    s = make(slots=slots, queue=queue, budget=slots + 8, depth=depth)
    next_id = 0
    live: set[int] = set()
    pos: dict[int, int] = {}  # seq -> next position it must be fed at
    due: dict[int, int] = {}  # busy slot -> seq
    for op in program:
        if op[0] == "submit":
            try:
                s.submit(next_id, tuple(range(2, 2 + op[1])), op[2], GREEDY)
                live.add(next_id)
                pos[next_id] = 0
            except QueueFull:
                assert s.stats().queued == queue
            next_id += 1
        elif op[0] == "step":
            step = s.next_step()
            if step is None:
                continue
            assert sum(len(it.tokens) for it in step.items) <= s.max_batch_tokens
            assert len({it.slot for it in step.items}) == len(step.items)
            for it in step.items:
                assert it.pos == pos[it.seq]
                pos[it.seq] += len(it.tokens)
                if it.last:
                    due[it.slot] = it.seq
        elif op[0] == "tokens":
            for slot in list(due)[: op[1] + 1]:
                due.pop(slot)
                for ev in s.token(slot, 3 + slot):
                    if ev.finish:
                        live.discard(ev.seq)
        else:
            if op[1] in live:
                s.cancel(op[1])
                live.discard(op[1])
        st_ = s.stats()
        assert st_.active <= slots and st_.queued <= queue


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(1, 3), st.integers(1, 4))
def test_no_sequence_starves(prompts, depth, slots):
    """Run everything to the end, answering every token at once: each request finishes, and
    every sequence with input runs within a bounded number of steps."""
    s = make(slots=slots, queue=len(prompts), budget=slots + 4, depth=depth)
    for i, n in enumerate(prompts):
        s.submit(i, tuple(range(2, 2 + n)), 3, GREEDY)
    finished: set[int] = set()
    waited: dict[int, int] = {}
    for _ in range(2000):
        step = s.next_step()
        if step is None:
            break
        ran = {it.seq for it in step.items}
        for seq in list(waited):
            if seq in ran:
                waited.pop(seq)
        for it in step.items:
            if it.last:
                for ev in s.token(it.slot, 9):
                    if ev.finish:
                        finished.add(ev.seq)
        for seq in range(len(prompts)):
            if seq not in finished and s.slot_of(seq) is not None and seq not in ran:
                waited[seq] = waited.get(seq, 0) + 1
                assert waited[seq] <= slots * depth + 1, f"sequence {seq} starves"
    assert finished == set(range(len(prompts)))


# ----- windows in flight (a split's entry) -----


def _next_token(held: list[int]) -> int:
    """A copy-shaped fake model: mostly the token five back, now and then another, and an
    end of generation now and then."""
    h = sum((i + 1) * t for i, t in enumerate(held[-7:])) % 97
    if h == 0 and len(held) > 12:
        return END
    if len(held) >= 5 and h % 12:
        return held[-5]
    return 2 + h % 11


class _Chain:
    """The stages of a split, simulated: each slot's cache (cut back where a step starts
    before its end, as every stage does) and a last stage that verifies windows as
    `StageServer` does, voiding a window that follows one whose last token it did not guess."""

    def __init__(self) -> None:
        self.cache: dict[int, list[int]] = {}
        self.carry: dict[int, int] = {}
        self.sent: list = []  # steps in flight, oldest first

    def run(self, step) -> list[tuple[int, int]]:
        self.keep(step)
        for slot in step.released:
            self.cache.pop(slot, None)
            self.carry.pop(slot, None)
        self.restore(step)
        out = []
        for it in step.items:
            cache = self.cache.setdefault(it.slot, [])
            assert it.pos <= len(cache), "a step skipped positions"
            del cache[it.pos :]
            cache.extend(it.tokens)
            if not it.last:
                continue
            n_draft = it.draft + it.follows
            draft = list(it.tokens[len(it.tokens) - n_draft :])
            before = len(cache) - n_draft - 1  # the index of the token before the draft
            if it.follows:
                if self.carry.pop(it.slot, None) != draft[0]:
                    continue  # void
                draft, before = draft[1:], before + 1
            kept = []
            for i in range(len(draft) + 1):
                kept.append(_next_token(cache[: before + 1 + i]))
                if i == len(draft) or kept[-1] != draft[i]:
                    break
            if len(kept) == len(draft) + 1:
                self.carry[it.slot] = kept[-1]
            else:
                self.carry.pop(it.slot, None)
            out += [(it.slot, t) for t in kept]
        return out

    def keep(self, step) -> None:
        """The step's saves, before its slots are released (none kept here)."""

    def restore(self, step) -> None:
        """The step's restores, after its slots are released (none kept here)."""


def _plain(prompt: tuple[int, ...], limit: int) -> list[int]:
    held, out = list(prompt), []
    while len(out) < limit:
        t = _next_token(held)
        if t == END:
            break
        out.append(t)
        held.append(t)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(3, 30), st.integers(1, 40)), min_size=1, max_size=5),
    st.lists(st.sampled_from(["step", "step", "deliver", "cancel"]), max_size=400),
    st.integers(1, 4),
    st.sampled_from(["on", "auto"]),
)
def test_windows_sent_before_the_verdict_change_no_token(requests, program, windows, mode):
    """A split's entry sends a sequence's next window before the verdict on the last one
    comes back, guessing how it ends; a window after a wrong guess or a rejected draft is
    void at both ends. Whatever the order of steps and verdicts, each sequence gets the
    tokens of plain greedy decoding, every step starts where the stages' caches allow, and
    no token comes for a slot after its sequence ended."""
    s = _split_scheduler(windows)
    prompts = {
        i: (tuple(2 + (j * 7 + i) % 5 for j in range(n)), limit)
        for i, (n, limit) in enumerate(requests)
    }
    _run_program(s, _Chain(), prompts, program, speculation=mode)


def _split_scheduler(windows: int) -> Scheduler:
    """A split's entry: two slots, a pipeline two deep, `windows` in flight per sequence."""
    s = Scheduler(
        n_slots=2,
        slot_ctx=256,
        max_queue=8,
        is_end=lambda t: t == END,
        max_batch_tokens=64,
        depth=2,
        max_windows=windows,
    )
    s.window_cost.slope, s.window_cost.weight = 0.05, 0.0  # cheap windows: auto drafts too
    return s


def _run_program(s, chain, prompts, program, **submit) -> None:
    """Submit `prompts` (seq -> (prompt, limit)), play `program` (steps taken, steps
    delivered by `chain`, the first half of the sequences cancelled in turn), then run to
    the end: no token after a sequence ended, and each not cancelled got plain decoding's."""
    got: dict[int, list[int]] = {}
    done: set[int] = set()
    cancelled: set[int] = set()
    for i, (prompt, limit) in prompts.items():
        s.submit(i, prompt, limit, GREEDY, **submit)
        got[i] = []
    for op in [*program, *["step", "deliver"] * 600]:
        if op == "step":
            step = s.next_step()
            if step is not None:
                chain.sent.append(step)
        elif op == "deliver" and chain.sent:
            for slot, token in chain.run(chain.sent.pop(0)):
                for ev in s.token(slot, token):
                    assert ev.seq not in done, "a token after the end"
                    if ev.finish != "stop":
                        got[ev.seq].append(ev.token)
                    if ev.finish:
                        done.add(ev.seq)
        elif op == "cancel" and len(cancelled) < len(prompts) // 2:
            seq = len(cancelled)
            cancelled.add(seq)
            s.cancel(seq)
            done.add(seq)
    assert not chain.sent and s.stats().active == 0
    for i, (prompt, limit) in prompts.items():
        if i not in cancelled:
            assert got[i] == _plain(prompt, limit), i


class _KeepingChain(_Chain):
    """`_Chain` that also keeps prefixes as an executor does: a save copies the positions its
    slot's cache holds, which must be the tokens the index keeps under that entry, and a
    restore puts them back in a slot."""

    def __init__(self, entries: dict[int, tuple[int, ...]]) -> None:
        super().__init__()
        self.entries = entries  # entry -> the tokens the scheduler's index keeps
        self.saved: dict[int, list[int]] = {}

    def keep(self, step) -> None:
        for save in step.saves:
            held = self.cache.get(save.slot, [])[: save.tokens]
            assert held == list(self.entries[save.entry]), "a save of positions not yet right"
            self.saved[save.entry] = held

    def restore(self, step) -> None:
        for op in step.opened:
            if op.restore is not None:
                entry, keep = op.restore
                self.cache[op.slot] = list(self.saved[entry][:keep])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.integers(1, 30)), min_size=2, max_size=6),
    st.lists(st.sampled_from(["step", "step", "deliver", "cancel"]), max_size=400),
    st.integers(1, 3),
    st.sampled_from(["off", "on", "auto"]),
)
def test_kept_prefixes_hold_only_right_positions_whenever_a_sequence_is_cut(
    requests, program, windows, mode
):
    """Sequences sharing a long prefix keep and restore it while windows are in flight and
    some are cancelled mid-step (as a stop string does): every save holds exactly the tokens
    the index keeps for it (no rejected draft, no position not yet computed), and the
    sequences that start from a kept prefix decode as plain greedy decoding does."""
    s = _split_scheduler(windows)
    s.prefix = index = PrefixIndex(1 << 30, lambda n: n)
    entries: dict[int, tuple[int, ...]] = {}
    insert = index.insert

    def recorded(tokens):
        stored = insert(tokens)
        if stored.entry is not None:
            entries[stored.entry] = tuple(tokens)
        return stored

    index.insert = recorded
    chain = _KeepingChain(entries)
    common = tuple(2 + (j * 3) % 7 for j in range(24))
    prompts = {
        i: ((*common, *(2 + (j * 5 + i) % 9 for j in range(tail))), limit)
        for i, (tail, limit) in enumerate(requests)
    }
    _run_program(s, chain, prompts, program, speculation=mode, cache=True)
    assert chain.saved  # prefixes were kept
