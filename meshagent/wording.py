"""Words said in more than one place (the `up` line, `status`, `peers`, the API's errors, the
logs), made in one: the same thing reads the same wherever the user meets it
(tests/test_wording.py holds the code to it)."""

from __future__ import annotations

# The troubleshooting guide's section for it (docs/troubleshooting.md, which `doctor` names).
NOT_SERVED_SECTION = "The model is not served"


def not_served(model: str, why: str) -> str:
    """Why the mesh serves `model` nowhere now: `MODEL is not served: WHY`."""
    return f"{model} is not served: {why}"


def layer_range(start: int, end: int) -> str:
    """Layers [start, end) as every message writes them: `A-B`, B exclusive."""
    return f"{start}-{end}"


def peer_label(peer_id: str, names: dict[str, str]) -> str:
    """A peer as the user named it, its id after: `laptop (3f2a9c01b7d4)`; the id alone
    (its first 12 characters) for a peer whose name is not known."""
    return peer(peer_id, names.get(peer_id, ""))


def peer(peer_id: str, name: str = "") -> str:
    """One peer, by the name it goes by and its id: `laptop (3f2a9c01b7d4)`."""
    return f"{name} ({peer_id[:12]})" if name else peer_id[:12]


def size(n: float) -> str:
    """Bytes as every message writes them, in decimal units (kB, MB, GB, TB: 1 GB is 10^9
    bytes, as the hub and disk makers write them): `98.4 MB`, `8.99 GB`, `152 MB`.
    Sizes given to the agent are read in the same units (`300M`, `1.5G`; `512MiB` too)."""
    n = float(n)
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 999.5 or unit == "TB":
            digits = 0 if abs(n) >= 99.95 else 1 if abs(n) >= 9.995 else 2
            return f"{n:.{digits}f} {unit}"
    raise AssertionError("unreachable")
