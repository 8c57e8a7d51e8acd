"""The peers and relays an agent has known, kept in its data dir (`known.json`), so that an
agent restarted with a plain `meshagent up` dials its mesh again without mDNS or a new invite.

- **Peers**: each live member's peer id, addresses and relays, as gossip last showed them,
  with when it was last seen; at most `MAX_PEERS` (the most recently seen), none unseen for
  `FORGET_AFTER`.
- **Bootstrap addresses**: where this agent was told its mesh is (an invite, `--peer`), peer
  id unknown; at most `MAX_ADDRESSES`.
- **Relays**: the relays this agent was told to register with (an invite, `--relay`): it
  registers with them again after a restart. Relays merely seen in peers' records are not
  registered with; they stay with the peer that named them.

The file belongs to one mesh: its fingerprint is kept in it and a file of another mesh (after
`--join` replaced the secret) is read as empty. A file that fails to parse is set aside with a
warning, never fatal: it is a cache.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from meshagent.errors import MeshError
from meshagent.net.address import Address

log = structlog.get_logger(__name__)

FILE = "known.json"
VERSION = 1
MAX_PEERS = 64
MAX_ADDRESSES = 16  # bootstrap addresses, and addresses per peer
MAX_RELAYS = 8
SAVE_EVERY = 30.0  # seconds between looks at the live peers
FORGET_AFTER = 30 * 24 * 3600.0  # seconds unseen before a peer is forgotten
_SEEN_GRAIN = 3600.0  # seconds: when a peer was last seen is kept to about this
_MAX_ID = 128  # characters of a peer id


@dataclass(frozen=True)
class KnownPeer:
    peer_id: str
    addresses: tuple[str, ...]
    relays: tuple[str, ...]
    seen: float  # unix time gossip last showed it alive


class Known:
    def __init__(
        self, path: Path | None, mesh: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = path  # None: kept in memory only
        self.mesh = mesh  # the mesh's fingerprint
        self._clock = clock
        self._peers: dict[str, KnownPeer] = {}
        self._bootstrap: list[str] = []
        self._relays: list[str] = []
        self._dirty = False

    @classmethod
    def load(cls, path: Path, mesh: str, *, clock: Callable[[], float] = time.time) -> Known:
        known = cls(path, mesh, clock=clock)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return known
        except (OSError, ValueError) as e:
            log.warning("known.unreadable", path=str(path), error=str(e))
            return known
        try:
            known._read(data)
        except (MeshError, TypeError, ValueError, KeyError, AttributeError) as e:
            log.warning("known.unreadable", path=str(path), error=f"{type(e).__name__}: {e}")
            return cls(path, mesh, clock=clock)
        return known

    def _read(self, data: dict) -> None:
        if data.get("version") != VERSION or data.get("mesh") != self.mesh:
            return  # another mesh's (or an unknown format's): nothing known of this one
        for address in data.get("bootstrap", []):
            self.note_bootstrap([_address(address)])
        for address in data.get("relays", []):
            self.note_relays([_address(address)])
        for p in data.get("peers", []):
            peer_id = p["peer_id"]
            if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_ID:
                raise ValueError(f"bad peer id {peer_id!r}")
            self._peers[peer_id] = KnownPeer(
                peer_id,
                tuple(_address(a) for a in p.get("addresses", []))[:MAX_ADDRESSES],
                tuple(_address(a) for a in p.get("relays", []))[:MAX_RELAYS],
                float(p["seen"]),
            )
        self._forget()
        self._dirty = False

    # ----- what is known -----

    @property
    def peers(self) -> list[KnownPeer]:
        """Most recently seen first."""
        return sorted(self._peers.values(), key=lambda p: -p.seen)

    @property
    def bootstrap(self) -> tuple[str, ...]:
        return tuple(self._bootstrap)

    @property
    def relays(self) -> tuple[str, ...]:
        return tuple(self._relays)

    def __bool__(self) -> bool:
        return bool(self._peers or self._bootstrap or self._relays)

    def addresses(self) -> list[str]:
        """Every address a restarted agent may try: bootstrap ones first."""
        out = list(self._bootstrap)
        for p in self.peers:
            out += p.addresses
        return list(dict.fromkeys(out))

    # ----- learning -----

    def note_bootstrap(self, addresses: Iterable[str]) -> None:
        self._note(self._bootstrap, addresses, MAX_ADDRESSES)

    def note_relays(self, relays: Iterable[str]) -> None:
        self._note(self._relays, relays, MAX_RELAYS)

    def _note(self, known: list[str], new: Iterable[str], most: int) -> None:
        for a in new:
            if a not in known and len(known) < most:
                known.append(a)
                self._dirty = True

    def note_peer(self, peer_id: str, addresses: Iterable[str], relays: Iterable[str] = ()) -> None:
        """Gossip shows `peer_id` alive with these addresses and relays now."""
        now = self._clock()
        old = self._peers.get(peer_id)
        new = KnownPeer(peer_id, tuple(addresses)[:MAX_ADDRESSES], tuple(relays)[:MAX_RELAYS], now)
        same = old is not None and (old.addresses, old.relays) == (new.addresses, new.relays)
        if same and now - old.seen < _SEEN_GRAIN:
            return  # seen again with nothing new: not worth a write
        self._dirty = True
        self._peers[peer_id] = new
        self._forget()

    def _forget(self) -> None:
        now = self._clock()
        kept = [p for p in self.peers if now - p.seen < FORGET_AFTER][:MAX_PEERS]
        if len(kept) != len(self._peers):
            self._dirty = True
        self._peers = {p.peer_id: p for p in kept}

    # ----- the file -----

    def save(self) -> bool:
        """Write the file if anything changed; says whether it wrote. A failed write is
        logged and tried again at the next save."""
        if not self._dirty or self.path is None:
            return False
        data = {
            "version": VERSION,
            "mesh": self.mesh,
            "bootstrap": self._bootstrap,
            "relays": self._relays,
            "peers": [
                {"peer_id": p.peer_id, "addresses": p.addresses, "relays": p.relays, "seen": p.seen}
                for p in self.peers
            ],
        }
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("known.unwritable", path=str(self.path), error=str(e))
            return False
        self._dirty = False
        return True


def _address(text: object) -> str:
    if not isinstance(text, str):
        raise ValueError(f"an address must be a string, not {text!r}")
    return str(Address.parse(text))


async def keep(
    known: Known,
    alive: Callable[[], Iterable[tuple[str, Iterable[str], Iterable[str]]]],
    every: float = SAVE_EVERY,
) -> None:
    """Note the live peers (`alive()`: peer id, addresses, relays of each) every `every`
    seconds and write the file when it changed; once more when cancelled (the agent stops)."""
    try:
        while True:
            await trio.sleep(every)
            for peer_id, addresses, relays in alive():
                known.note_peer(peer_id, addresses, relays)
            known.save()
    finally:
        for peer_id, addresses, relays in alive():
            known.note_peer(peer_id, addresses, relays)
        known.save()
