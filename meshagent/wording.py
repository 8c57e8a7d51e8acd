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
    name = names.get(peer_id, "")
    return f"{name} ({peer_id[:12]})" if name else peer_id[:12]
