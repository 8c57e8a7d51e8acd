"""SWIM membership (`meshagent/gossip/swim.py`) on the simulated bus: a full view, a cost per
member that does not grow with the mesh, crashes found within seconds, suspicions refuted,
records spread, and no false death under loss."""

from __future__ import annotations

from meshagent.discovery.keep import KeepConfig
from meshagent.gossip.swim import Message, State, Swim, Update
from meshagent.testing.swim_bus import SwimBus


def _mesh(n: int, seed: int = 1, loss: float = 0.0) -> tuple[SwimBus, list[str]]:
    bus = SwimBus(seed=seed, loss=loss)
    names = bus.grow(n)
    everyone = set(names)
    start = bus.now
    while not bus.views_complete(everyone):
        assert bus.now < start + 10, "no full view within 10 s"
        bus.run_until(bus.now + 0.1)
    return bus, names


def _run_until(bus: SwimBus, done, limit: float, step: float = 0.25) -> bool:
    start = bus.now
    while not done() and bus.now < start + limit:
        bus.run_until(bus.now + step)
    return done()


def _steady_bytes(bus: SwimBus, names: list[str], window: float = 30.0) -> float:
    bus.run_until(bus.now + 15)
    before = {k: bus.members[k].bytes_sent for k in names}
    bus.run_until(bus.now + window)
    return sum(bus.members[k].bytes_sent - before[k] for k in names) / len(names) / window


def test_what_a_member_sends_does_not_grow_with_the_mesh():
    small, few = _mesh(10)
    big, many = _mesh(80)
    a, b = _steady_bytes(small, few), _steady_bytes(big, many)
    assert a > 0 and b < 1.5 * a, (a, b)


def test_a_crash_is_dead_everywhere_within_five_seconds():
    bus, names = _mesh(60)
    bus.run_until(bus.now + 5)
    victim = names[17]
    bus.crash(victim)
    crashed = bus.now
    rest = set(names) - {victim}
    while any(victim in bus.members[k].alive() for k in rest):
        assert bus.now < crashed + 5, "not dead everywhere within 5 s"
        bus.run_until(bus.now + 0.05)
    assert all(bus.members[k].members[victim].state == State.DEAD for k in rest)


def test_on_a_bounded_set_of_connections_each_probes_its_neighbours_and_finds_a_crash():
    """Members connected as agents are with a bounded set (`discovery/keep.py`: 4 random,
    4 nearest, a connection where either keeps the other) probe only their neighbours, and a
    crash is still dead everywhere within 5 s; no member is declared dead at 1% loss."""
    bus = SwimBus(seed=4, keep=KeepConfig())
    names = bus.grow(60)
    everyone = set(names)
    assert _run_until(bus, lambda: bus.views_complete(everyone), 30)
    bus.run_until(bus.now + 10)
    neighbours = [sum(bus.connected(a, b) for b in names if b != a) for a in names]
    assert max(neighbours) < 30 and min(neighbours) >= 4, neighbours
    bus.loss = 0.01
    bus.run_until(bus.now + 60)
    assert bus.deaths == []
    victim = names[29]
    bus.crash(victim)
    crashed = bus.now
    assert _run_until(bus, lambda: bus.dead_everywhere(victim), 5, step=0.05), bus.now - crashed


def test_a_live_member_refutes_a_suspicion_of_itself():
    bus, names = _mesh(20)
    subject, liar = names[3], names[4]
    inc = bus.members[subject].incarnation
    rumour = Update(subject, inc, State.SUSPECT, liar)
    bus._deliver(liar, [(names[5], Message("gossip", updates=(rumour,)))])
    bus.run_until(bus.now + 10)
    assert bus.members[subject].incarnation == inc + 1
    for k in names:
        if k != subject:
            x = bus.members[k].members[subject]
            assert x.state == State.ALIVE and x.incarnation == inc + 1
    assert not [d for d in bus.deaths if d[2] == subject]


def test_a_new_record_reaches_every_member():
    bus, names = _mesh(40)
    bus.members[names[9]].publish(b"x" * 1500, bus.now)
    published = bus.now
    while any(
        bus.members[k].members[names[9]].record != b"x" * 1500 for k in names if k != names[9]
    ):
        assert bus.now < published + 5
        bus.run_until(bus.now + 0.05)


def test_no_false_death_at_one_percent_loss():
    bus, names = _mesh(40, seed=3)
    bus.loss = 0.01
    bus.run_until(bus.now + 180)
    assert bus.deaths == []
    assert bus.views_complete(set(names))


def test_a_lost_ping_or_ack_is_not_a_suspicion():
    """Members in three cities, up to 200 ms apart: a probe whose PING or ACK is lost (one in
    fifty at 1% loss) goes on through PING-REQs, whose answers cross two links each way and
    come after the next probe has started. Almost no suspicion, so almost no refutation."""
    bus, names = _mesh(40, seed=3)
    bus.run_until(bus.now + 5)
    before = {k: bus.members[k].incarnation for k in names}
    bus.loss = 0.01
    bus.run_until(bus.now + 120)
    refuted = sum(bus.members[k].incarnation - before[k] for k in names)
    assert refuted <= 2, refuted  # ~240 expected were a lost message a suspicion
    assert bus.deaths == []


def test_a_crash_is_confirmed_by_others_and_dead_soon_after_its_first_suspicion():
    """Others' failed probes confirm a suspicion (spread beside it), which brings every
    member's timeout toward `suspicion_min` instead of `suspicion_max`."""
    bus, names = _mesh(60)
    bus.run_until(bus.now + 5)
    victim = names[23]
    bus.crash(victim)
    first, confirmed = None, 0  # when first suspected; the most suspectors one member heard
    while not bus.dead_everywhere(victim):
        assert bus.now < 60
        bus.run_until(bus.now + 0.05)
        rows = [bus.members[k].members[victim] for k in names if k != victim]
        suspected = [x for x in rows if x.state == State.SUSPECT]
        if suspected:
            first = first or bus.now
            confirmed = max(confirmed, *(len(x.suspectors) for x in suspected))
    died = min(when for when, _, m in bus.deaths if m == victim)
    c = bus.config
    assert died - first < (c.suspicion_min + c.suspicion_max) / 2, (first, died)
    assert confirmed > c.confirmations, confirmed


def test_a_member_that_declares_others_dead_makes_them_suspect_no_more():
    bus, names = _mesh(30)
    hostile, victim = names[3], names[11]
    bus.run_until(bus.now + 5)
    end = bus.now + 30
    while bus.now < end:  # every 0.5 s a death of the victim, at its latest incarnation
        inc = bus.members[victim].incarnation
        death = Update(victim, inc, State.DEAD, hostile)
        for k in bus.rng.sample(names, 5):
            if k not in (hostile, victim):
                bus._deliver(hostile, [(k, Message("gossip", updates=(death,)))])
        bus.run_until(bus.now + 0.5)
    assert not [d for d in bus.deaths if d[2] == victim]
    assert all(victim in bus.members[k].alive() for k in names)
    # The real thing is still found: the victim crashes, and it is dead everywhere.
    bus.crash(victim)
    start = bus.now
    while not bus.dead_everywhere(victim):
        assert bus.now < start + 5, "a crash not dead everywhere within 5 s"
        bus.run_until(bus.now + 0.05)


def test_the_two_sides_of_a_healed_partition_are_one_mesh_again():
    # Each side declares the other dead; once messages cross again, each member syncs with
    # one member of the other side (its connections coming back): each learns from the
    # other's table that it is held dead there, refutes it, and the refutations spread.
    bus = SwimBus(seed=3, signed=True)
    names = bus.grow(40)
    everyone = set(names)
    assert _run_until(bus, lambda: bus.views_complete(everyone), 30)
    away = set(names[:10])
    bus.partition(away)

    def split() -> bool:
        return all(bus.members[a].alive() == away for a in away) and all(
            bus.members[b].alive() == everyone - away for b in everyone - away
        )

    assert _run_until(bus, split, 30)
    bus.run_until(bus.now + 10)
    bus.heal()
    assert _run_until(bus, lambda: bus.views_complete(everyone), 10)


def test_a_member_answering_for_a_silent_one_does_not_keep_it_alive():
    # A hostile member sends an ACK with every sequence number a probe of a silent member
    # may carry (they are easy to guess): only its target's, or a helper's asked for it,
    # counts, so the silent member is still suspected and buried. (A hostile helper asked
    # for it can still vouch for it in that one probe: SWIM trusts its helpers.)
    a = Swim("a", seed=1)
    others = [f"o{i}" for i in range(8)]  # (the helpers a may ask besides h)
    known = tuple(Update(m, 0, State.ALIVE, m) for m in ("t", "h", *others))
    a.receive(0.0, "t", Message("gossip", updates=known))
    now, forged = 0.0, 0
    while now < 20 and a.state_of("t") != State.DEAD:
        now += 0.05
        a.tick(now)
        for seq in range(1, int(now / 0.2) + 3):  # (a probe every 0.4 s at most)
            a.receive(now, "h", Message("ack", seq))
            a.receive(now, "h", Message("ack", seq, "t"))  # as if relayed
            forged += 1
    assert forged and a.state_of("t") == State.DEAD, now
