"""Words said in more than one place (the `up` line, `status`, `peers`, the API's errors, the
logs), made in one: the same thing reads the same wherever the user meets it
(tests/test_wording.py holds the code to it)."""

from __future__ import annotations


def not_served(model: str, why: str) -> str:
    """Why the mesh serves `model` nowhere now: `MODEL is not served: WHY`."""
    return f"{model} is not served: {why}"


def layer_range(start: int, end: int) -> str:
    """Layers [start, end) as every message writes them: `A-B`, B exclusive."""
    return f"{start}-{end}"
